"""Sphinx directives that generate the settings and signals references from the library.

``steplock-settings``: one entry per setting of :data:`celery_steplock.conf.SETTINGS` (the
Celery setting, the Django setting of ``namespace="CELERY"``, the default, the unit and the
description), each with its own anchor (``#setting-steplock_default_ttl``) that any page
links with ``{setting}`steplock_default_ttl```. ``steplock-renamed-settings``: the former
names of :data:`celery_steplock.conf.RENAMED`, anchored the same way. ``steplock-signals``:
one entry per signal of :data:`celery_steplock.signals.ALL_SIGNALS`, described by the ``#:``
comment above its declaration. ``steplock-task-options``: the task options of
:data:`celery_steplock.plan.OPTION_NAMES`, each anchored (``#option-lock_ttl``, linked with
``{taskoption}`lock_ttl```) and described by its row of the option table in
:mod:`celery_steplock.task`'s docstring, or, for a gate's option, by the gate that reads it
(:data:`celery_steplock.patterns.GATE_REGISTRY`). ``{check} celery_steplock.E004``: the
anchor ``#celery-steplock-e004`` of a system check on the hand-written checks page, linked
with ``{check}`celery_steplock.E004```. A setting without a description or a check, a core
task option without a row (or a row naming no option), a signal without a comment, or a
check id of the library's source without an entry on the checks page (or an entry naming
no id of the source) is a build error.

The line generators import no Sphinx (tests/test_conf.py and tests/test_reference_anchors.py
run them without the docs tools); Sphinx is imported by :func:`setup` and the signals'
comment reader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

#: The cross-reference type of a setting: the ``{setting}`` role and its anchors' prefix.
SETTING_TYPE = "setting"
#: The cross-reference type of a task option (the ``{taskoption}`` role; Sphinx's own
#: ``option`` type is a program's command-line option) and its anchors' prefix.
OPTION_TYPE = "taskoption"
OPTION_PREFIX = "option"
#: The cross-reference type of a system check id (``celery_steplock.E004``).
CHECK_TYPE = "check"
#: A check id as the library's source spells it.
CHECK_ID = re.compile(r"\bcelery_steplock\.[EW][0-9]{3}\b")
#: Task options written under another name than the attribute the plan reads: the keyword
#: ``transition=`` is kept as ``step_transition`` (it would shadow ``Task.transition()``).
OPTION_KEYWORDS = {"step_transition": "transition"}


def _literal(value: Any) -> str:
    return "``" + repr(value) + "``"


def _cell(text: str) -> str:
    return " ".join(text.split())


def setting_anchor(qualified: str) -> str:
    """The HTML anchor of a setting on the reference page (``"steplock_default_ttl"`` ->
    ``"setting-steplock_default_ttl"``): what Sphinx makes of the ``{setting}`` target."""
    return f"{SETTING_TYPE}-{qualified}"


def option_anchor(name: str) -> str:
    """The HTML anchor of a task option (``"lock_ttl"`` -> ``"option-lock_ttl"``)."""
    return f"{OPTION_PREFIX}-{name}"


def check_anchor(check_id: str) -> str:
    """The HTML anchor of a system check on the checks page (``"celery_steplock.E004"`` ->
    ``"celery-steplock-e004"``: the id lowercased, ``_`` and ``.`` as ``-``)."""
    return re.sub(r"[^a-z0-9]+", "-", check_id.lower()).strip("-")


def check_ids() -> set[str]:
    """Every check id (``celery_steplock.E004``) written in the library's source, the
    Django checks and the worker-start validator alike."""
    import celery_steplock

    root = Path(celery_steplock.__file__).resolve().parent
    found: set[str] = set()
    for path in root.rglob("*.py"):
        found.update(CHECK_ID.findall(path.read_text(encoding="utf-8")))
    return found


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
            f"unset (until the next release; {{{CHECK_TYPE}}}`celery_steplock.W006` warns).",
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


_OPTION_ROW = re.compile(r"``(\w+)``\s+(\S.*)")
_RST_ROLE = re.compile(r":(mod|class|data|func|meth|attr|exc|obj):`")


def _myst(text: str) -> str:
    """A docstring's reST roles (``:mod:`x```) as MyST roles (``{py:mod}`x```)."""
    return _RST_ROLE.sub(lambda m: "{py:" + m.group(1) + "}`", text)


def task_option_docs() -> dict[str, str]:
    """``{option keyword: description}`` of the option table in :mod:`celery_steplock.task`'s
    docstring (a row: the ``name`` at column 0, its text beside it and on the indented lines
    below)."""
    from celery_steplock import task

    lines = (task.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Task options"))
    rows: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in lines[start + 1 :]:
        row = _OPTION_ROW.fullmatch(line)
        if row:
            current = rows[row.group(1)] = [row.group(2)]
        elif current is not None and line[:1].isspace() and line.strip():
            current.append(line.strip())
        else:
            current = None
    return {name: _myst(_cell(" ".join(text))) for name, text in rows.items()}


def task_options() -> list[tuple[str, str, str]]:
    """``(keyword, attribute, description)`` of every task option, by keyword: the plan's
    :data:`~celery_steplock.plan.OPTION_NAMES`, described by the task module's table or, for
    an option only a gate reads, by that gate.

    Raises:
        ValueError: an option the plan reads that is neither in the table nor a gate's, or a
            row of the table that names no option.
    """
    from celery_steplock import patterns
    from celery_steplock.plan import OPTION_NAMES

    rows = task_option_docs()
    gates = {
        option: (gate, module)
        for gate, (module, options) in patterns.GATE_REGISTRY.items()
        for option in options
    }
    found = []
    for attribute in OPTION_NAMES:
        keyword = OPTION_KEYWORDS.get(attribute, attribute)
        text = rows.pop(keyword, None)
        if text is None and attribute in gates:
            gate, module = gates[attribute]
            text = f"Read by the ``{gate}`` admission gate: see {{py:mod}}`{module}`."
        if text is None:
            raise ValueError(
                f"task option {keyword} has no row in celery_steplock.task's docstring"
            )
        found.append((keyword, attribute, text))
    if rows:
        raise ValueError(f"celery_steplock.task's docstring describes no option {sorted(rows)}")
    return sorted(found)


def task_options_lines() -> list[str]:
    """The task options, one anchored definition each, by keyword (MyST lines). An option
    kept under another attribute (``transition`` as ``step_transition``) is anchored by
    both names."""
    lines = []
    for keyword, attribute, text in task_options():
        names = [keyword] if attribute == keyword else [keyword, attribute]
        for name in names:
            lines += [f"```{{{OPTION_TYPE}}} {name}", "```", ""]
        kept = "" if attribute == keyword else f" (kept on the task as ``{attribute}``)"
        lines += [f"{{{OPTION_TYPE}}}`{keyword}`{kept}", f": {text}", ""]
    return lines


def setup(app: Any) -> dict[str, Any]:
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx import addnodes
    from sphinx.util import logging
    from sphinx.util.docutils import SphinxDirective

    logger = logging.getLogger(__name__)

    def target_directive(objtype: str, anchor: Any, what: str) -> type[SphinxDirective]:
        class Target(SphinxDirective):
            """``{objtype} name``: the anchor ``anchor(name)`` (Sphinx's own target of a
            cross-reference type would be ``std-objtype-name``) and its index entry."""

            required_arguments = 1

            def run(self) -> list[nodes.Node]:
                name = self.arguments[0].strip()
                node_id = anchor(name)
                target = nodes.target("", "", ids=[node_id])
                self.set_source_info(target)
                self.state.document.note_explicit_target(target)
                self.env.domains.standard_domain.note_object(
                    objtype, name, node_id, location=target
                )
                entries = [("pair", f"{name}; {what}", node_id, "", None)]
                return [addnodes.index(entries=entries), target]

        return Target

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

    def check_every_check_documented(app: Any, env: Any) -> None:
        """Every check id of the library's source has an entry on the checks page, and every
        entry names an id of the source (a warning: ``make docs`` builds with ``-W``)."""
        documented = {
            name for (kind, name) in env.domains.standard_domain.objects if kind == CHECK_TYPE
        }
        for missing in sorted(check_ids() - documented):
            logger.warning(f"system check {missing} has no {{check}} entry on reference/checks")
        for stale in sorted(documented - check_ids()):
            logger.warning(f"{{check}} {stale}: no such check id in celery_steplock")

    # Celery's documentation declares its settings the same way (a "setting" target type).
    for objtype in (SETTING_TYPE, OPTION_TYPE, CHECK_TYPE):
        app.add_crossref_type(objtype, objtype)
    targets = {
        SETTING_TYPE: (setting_anchor, "setting"),
        OPTION_TYPE: (option_anchor, "task option"),
        CHECK_TYPE: (check_anchor, "system check"),
    }
    for objtype, (anchor, what) in targets.items():
        app.add_directive_to_domain(
            "std", objtype, target_directive(objtype, anchor, what), override=True
        )
    app.add_directive("steplock-task-options", directive(task_options_lines))
    app.add_directive("steplock-settings", directive(settings_lines))
    app.add_directive("steplock-renamed-settings", directive(renamed_settings_lines))
    app.add_directive("steplock-signals", directive(signals_lines))
    app.connect("env-check-consistency", check_every_check_documented)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
