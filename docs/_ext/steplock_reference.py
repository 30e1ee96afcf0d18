"""Sphinx directives that generate the settings and signals references from the library.

``steplock-settings``: one entry per setting of :data:`celery_steplock.conf.SETTINGS` (the
Celery setting, the Django setting of ``namespace="CELERY"``, the default, the unit and the
description), each with its own anchor (``#setting-steplock_default_ttl``) that any page
links with ``{setting}`steplock_default_ttl```. ``steplock-renamed-settings``: the former
names of :data:`celery_steplock.conf.RENAMED`, anchored the same way. ``steplock-signals``:
one entry per signal of :data:`celery_steplock.signals.ALL_SIGNALS`, described by the ``#:``
comment above its declaration. ``steplock-task-options``: the task options of
:data:`celery_steplock.plan.OPTION_NAMES`. A setting without a description or a check, or a
signal without a comment, is a build error.

The line generators import no Sphinx (tests/test_conf.py runs them without the docs tools);
Sphinx is imported by :func:`setup` and the signals' comment reader.
"""

from __future__ import annotations

from typing import Any

#: The cross-reference type of a setting: the ``{setting}`` role and its anchors' prefix.
SETTING_TYPE = "setting"


def _literal(value: Any) -> str:
    return "``" + repr(value) + "``"


def _cell(text: str) -> str:
    return " ".join(text.split())


def setting_anchor(qualified: str) -> str:
    """The HTML anchor of a setting on the reference page (``"steplock_default_ttl"`` ->
    ``"setting-steplock_default_ttl"``): what Sphinx makes of the ``{setting}`` target."""
    return f"{SETTING_TYPE}-{qualified}"


def _entry(qualified: str, term: str, text: str) -> list[str]:
    """An anchor (a ``{setting}`` target) and a one-item definition list (MyST lines)."""
    return [
        f"```{{{SETTING_TYPE}}} {qualified}",
        "```",
        "",
        f"{{{SETTING_TYPE}}}`{qualified}` {term}",
        f": {_cell(text)}",
        "",
    ]


def settings_lines() -> list[str]:
    """The settings, one anchored definition each, in the table's order (MyST lines).

    Raises:
        ValueError: a setting without a description or without a check.
    """
    from celery_steplock import conf

    lines = []
    for setting in conf.SETTINGS:
        if not setting.description.strip() or not callable(setting.check):
            raise ValueError(
                f"celery_steplock.conf.SETTINGS: {setting.name} lacks a description or a check"
            )
        unit = f" ({setting.unit})" if setting.unit else ""
        lines += _entry(
            setting.qualified,
            f"(Django: ``CELERY_{setting.qualified.upper()}``), "
            f"default {_literal(setting.default)}{unit}",
            setting.description,
        )
    return lines


def renamed_settings_lines() -> list[str]:
    """The former setting names, one anchored definition each (MyST lines)."""
    from celery_steplock import conf

    lines = []
    for old, new in conf.RENAMED.items():
        old_name, new_name = conf.setting_name(old), conf.setting_name(new)
        lines += _entry(
            old_name,
            f"(Django: ``CELERY_{old_name.upper()}``), deprecated",
            f"The former name of {{{SETTING_TYPE}}}`{new_name}`, read while the new name is "
            f"unset (until the next release; ``celery_steplock.W006`` warns).",
        )
    return lines


def signal_docs() -> list[tuple[str, str]]:
    """``(name, description)`` of every signal, in the order of ``ALL_SIGNALS``."""
    from sphinx.pycode import ModuleAnalyzer

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


def setup(app: Any) -> dict[str, Any]:
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx import addnodes
    from sphinx.util.docutils import SphinxDirective

    class SettingTarget(SphinxDirective):
        """``{setting} steplock_x``: the anchor ``setting-steplock_x`` (Sphinx's own target
        of a cross-reference type would be ``std-setting-...``) and its index entry."""

        required_arguments = 1

        def run(self) -> list[nodes.Node]:
            name = self.arguments[0].strip()
            node_id = setting_anchor(name)
            target = nodes.target("", "", ids=[node_id])
            self.set_source_info(target)
            self.state.document.note_explicit_target(target)
            self.env.domains.standard_domain.note_object(
                SETTING_TYPE, name, node_id, location=target
            )
            index = addnodes.index(entries=[("pair", f"{name}; setting", node_id, "", None)])
            return [index, target]

    def directive(generate: Any) -> type[SphinxDirective]:
        class Generated(SphinxDirective):
            has_content = False

            def run(self) -> list[nodes.Node]:
                # Parsed by the page's own parser: the pages are MyST Markdown.
                container = nodes.container()
                self.state.nested_parse(
                    StringList(generate(), source="steplock_reference"),
                    self.content_offset,
                    container,
                )
                return container.children

        return Generated

    # Celery's documentation declares its settings the same way (a "setting" target type).
    app.add_crossref_type(SETTING_TYPE, SETTING_TYPE)
    app.add_directive_to_domain("std", SETTING_TYPE, SettingTarget, override=True)
    app.add_directive("steplock-task-options", directive(task_options_lines))
    app.add_directive("steplock-settings", directive(settings_lines))
    app.add_directive("steplock-renamed-settings", directive(renamed_settings_lines))
    app.add_directive("steplock-signals", directive(signals_lines))
    return {"parallel_read_safe": True, "parallel_write_safe": True}
