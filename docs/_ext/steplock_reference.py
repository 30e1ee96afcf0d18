"""Sphinx directives that generate the settings and signals references from the library.

``steplock-settings``: one entry per key of :data:`celery_steplock.conf.DEFAULTS`: the Celery
setting, the Django setting (``namespace="CELERY"``), the default and
:data:`celery_steplock.conf.DESCRIPTIONS`. ``steplock-signals``: one entry per signal of
:data:`celery_steplock.signals.ALL_SIGNALS`, described by the ``#:`` comment above its
declaration. ``steplock-task-options``: the task options of
:data:`celery_steplock.plan.OPTION_NAMES`. A setting without a description or a signal
without a comment is a build error.
"""

from __future__ import annotations

from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective


def _literal(value: Any) -> str:
    return "``" + repr(value) + "``"


def _cell(text: str) -> str:
    return " ".join(text.split())


def settings_lines() -> list[str]:
    """The settings as a definition list (MyST Markdown lines)."""
    from celery_steplock import conf

    missing = sorted(set(conf.DEFAULTS) - set(conf.DESCRIPTIONS))
    if missing:
        raise ValueError(f"celery_steplock.conf.DESCRIPTIONS lacks {', '.join(missing)}")
    lines = []
    for name, default in conf.DEFAULTS.items():
        lines += [
            f"``steplock_{name}`` (Django: ``CELERY_STEPLOCK_{name.upper()}``), "
            f"default {_literal(default)}",
            f": {_cell(conf.DESCRIPTIONS[name])}",
            "",
        ]
    return lines


def signal_docs() -> list[tuple[str, str]]:
    """``(name, description)`` of every signal, in the order of ``ALL_SIGNALS``."""
    from celery_steplock import signals

    attr_docs = ModuleAnalyzer.for_module("celery_steplock.signals").find_attr_docs()
    by_object = {id(getattr(signals, attr)): attr for _, attr in attr_docs}
    found = []
    for signal in signals.ALL_SIGNALS:
        attr = by_object.get(id(signal))
        if attr is None:
            raise ValueError(f"celery_steplock.signals.{signal.name} has no #: comment")
        found.append((attr, _cell(" ".join(attr_docs[("", attr)]))))
    return found


def signals_lines() -> list[str]:
    """One ``py:data`` entry per signal (MyST Markdown lines)."""
    lines = []
    for name, text in signal_docs():
        lines += [
            f"```{{py:data}} celery_steplock.signals.{name}",
            ":no-index:",
            "",
            text,
            "```",
            "",
        ]
    return lines


def task_options_lines() -> list[str]:
    """The task options (:data:`celery_steplock.plan.OPTION_NAMES`), one bullet each."""
    from celery_steplock.plan import OPTION_NAMES

    return [f"- ``{name}``" for name in sorted(OPTION_NAMES)]


class _Generated(SphinxDirective):
    has_content = False

    def lines(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        # Parsed by the page's own parser: the pages are MyST Markdown.
        container = nodes.container()
        self.state.nested_parse(
            StringList(self.lines(), source="steplock_reference"), self.content_offset, container
        )
        return container.children


class SettingsDirective(_Generated):
    def lines(self) -> list[str]:
        return settings_lines()


class SignalsDirective(_Generated):
    def lines(self) -> list[str]:
        return signals_lines()


class TaskOptionsDirective(_Generated):
    def lines(self) -> list[str]:
        return task_options_lines()


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("steplock-task-options", TaskOptionsDirective)
    app.add_directive("steplock-settings", SettingsDirective)
    app.add_directive("steplock-signals", SignalsDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
