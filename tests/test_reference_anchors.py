"""The reference pages give every setting, task option and system check its own anchor.

Nothing is built: the lines docs/_ext/steplock_reference.py generates (the settings and the
task options) and the hand-written docs/reference/checks.md are read as the docs build would
read them, and every name of the library (:data:`celery_steplock.conf.SETTINGS`, the plan's
option names, each check id written in the library's source) must have its target there.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_database

DOCS = Path(__file__).resolve().parent.parent / "docs"


@pytest.fixture(scope="module")
def reference():
    path = DOCS / "_ext" / "steplock_reference.py"
    spec = importlib.util.spec_from_file_location("steplock_reference_anchors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def targets(lines: list[str], objtype: str) -> list[str]:
    """The names of the ``{objtype} name`` target directives among MyST lines."""
    prefix = f"```{{{objtype}}} "
    return [line[len(prefix) :].strip() for line in lines if line.startswith(prefix)]


def test_every_setting_has_an_anchor(reference):
    from celery_steplock.conf import RENAMED, SETTINGS, setting_name

    found = targets(reference.settings_lines(), "setting")
    assert found == [s.qualified for s in SETTINGS]
    assert len(set(found)) == len(found) == len(SETTINGS) > 40
    former = targets(reference.renamed_settings_lines(), "setting")
    assert former == [setting_name(old) for old in RENAMED]
    assert reference.setting_anchor("steplock_default_ttl") == "setting-steplock_default_ttl"
    page = (DOCS / "reference" / "settings.md").read_text()
    assert "```{steplock-settings}" in page and "```{steplock-renamed-settings}" in page


def test_every_task_option_has_an_anchor_and_a_description(reference):
    from celery_steplock.plan import OPTION_NAMES

    lines = reference.task_options_lines()
    found = targets(lines, "taskoption")
    # The keyword transition= is kept as step_transition: both names are anchored.
    assert sorted(found) == sorted(OPTION_NAMES | {"transition"})
    assert len(OPTION_NAMES) == 24
    assert reference.option_anchor("lock_ttl") == "option-lock_ttl"
    terms = {
        line.split("`")[1]: lines[i + 1]
        for i, line in enumerate(lines)
        if line.startswith("{taskoption}`")
    }
    assert terms["lock_ttl"] == ": lease TTL, seconds (``steplock_default_ttl``, 30)"
    assert terms["transition"] == ": ``(from_, to)`` applied by CAS after the body"
    # A row's reST role becomes a MyST role; a gate's option points at its gate.
    assert "{py:mod}`celery_steplock.patterns.breaker`" in terms["circuit_breaker"]
    assert terms["concurrency_limit"] == (
        ": Read by the ``concurrency`` admission gate: see "
        "{py:mod}`celery_steplock.patterns.concurrency`."
    )
    assert all(":mod:" not in text for text in terms.values())
    page = (DOCS / "reference" / "settings.md").read_text()
    assert "(task-options)=\n## Task options" in page and "```{steplock-task-options}" in page


def test_a_task_docstring_row_without_an_option_fails_the_build(reference, monkeypatch):
    from celery_steplock import task

    monkeypatch.setattr(task, "__doc__", task.__doc__ + "``lock_tll``  a misspelled row\n")
    with pytest.raises(ValueError, match=r"describes no option \['lock_tll'\]"):
        reference.task_options()


def test_every_check_id_has_an_anchor_on_the_checks_page(reference):
    ids = reference.check_ids()
    assert {"celery_steplock.E001", "celery_steplock.E004", "celery_steplock.W011"} <= ids
    assert len(ids) == 17  # W012: return_winner without result_extended
    page = (DOCS / "reference" / "checks.md").read_text()
    documented = targets(page.splitlines(), "check")
    assert sorted(documented) == sorted(ids)
    for check_id in ids:
        # The target, then the check's own heading, then what to do.
        section = page.split(f"```{{check}} {check_id}\n```\n\n### `{check_id}`: ", 1)
        assert len(section) == 2, check_id
        assert "\nWhat to do\n: " in section[1].split("```{check}", 1)[0], check_id
    assert reference.check_anchor("celery_steplock.E004") == "celery-steplock-e004"
    index = (DOCS / "index.md").read_text()
    assert "reference/settings\nreference/checks\n" in index


def test_check_ids_are_read_from_the_source(reference):
    """The ids the Django checks and the validator emit, as written in their modules."""
    from celery_steplock import validate
    from celery_steplock.contrib.django import checks

    written = set()
    for module in (validate, checks):
        written |= set(
            re.findall(r'"(celery_steplock\.[EW]\d{3})"', Path(module.__file__).read_text())
        )
    assert written <= reference.check_ids()
