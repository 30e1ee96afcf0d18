"""Fixtures of the fault suite: a :class:`~tests.support.faults.lab.Lab` per module.

The lab's workers write to the test database, so the suite needs PostgreSQL (row locks, a
server to terminate connections on, a TCP path to put a proxy on); in the SQLite pass of
``make test`` its scenarios are deselected (not skipped) with a note, and run in the
PostgreSQL pass.
"""

from __future__ import annotations

import pytest

from tests.support.faults.lab import Lab

TTL = 2.0


def _on_postgresql() -> bool:
    from django.conf import settings

    return "postgresql" in settings.DATABASES["default"]["ENGINE"]


@pytest.hookimpl(trylast=True)  # after -k/-m, so the count is of what would have run
def pytest_collection_modifyitems(config, items):
    if _on_postgresql():
        return
    lab_items = [item for item in items if item.get_closest_marker("faults")]
    if lab_items:
        config.hook.pytest_deselected(items=lab_items)
        items[:] = [item for item in items if not item.get_closest_marker("faults")]
        from django.conf import settings

        vendor = (
            "MariaDB/MySQL" if "mysql" in settings.DATABASES["default"]["ENGINE"] else "SQLite"
        )
        print(
            f"\ntests/faults: {len(lab_items)} tests that need PostgreSQL deselected on "
            f"{vendor}; they run in the PostgreSQL pass"
        )


@pytest.fixture(scope="module")
def make_lab(django_db_setup, django_db_blocker, tmp_path_factory):
    """Factory: ``make_lab(**options)`` -> a started Lab on the test database, stopped with the
    module."""
    from django.db import connection

    labs = []

    def make(**options):
        with django_db_blocker.unblock():
            settings = dict(connection.settings_dict)
        lab = Lab(tmp_path_factory.mktemp("faults"), settings, ttl=TTL, **options)
        labs.append(lab)
        return lab.start()

    yield make
    for lab in labs:
        lab.stop()


@pytest.fixture(scope="module")
def lab(make_lab):
    return make_lab()
