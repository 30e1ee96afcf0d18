"""The error tree drawn in ``celery_steplock.exceptions``' docstring is the real one.

The drawing is what the API reference shows: every subclass of ``StepLockError`` the package
defines appears exactly once, under its first base that is in the tree, with a one-line
description, and the branch glyphs are those of the tree as drawn. A failure prints the
drawing as it should be (descriptions kept, new classes marked TODO) to paste in.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import pytest

import celery_steplock
from celery_steplock import exceptions
from celery_steplock.exceptions import RETRYABLE_ERRORS, StepLockError

LINE = re.compile(r"(?P<prefix>(?:│   |    )*)(?:├── |└── )(?P<name>\w+)(?P<gap> *)(?P<text>.*)")


def drawn_lines() -> list[str]:
    """The literal block of the module docstring that starts with ``StepLockError``."""
    doc = exceptions.__doc__ or ""
    lines = doc.splitlines()
    start = lines.index("    StepLockError")
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line[4:])
    return block


def parse(lines: list[str]) -> list[tuple[int, str, str]]:
    """``(depth, class name, description)`` per drawn class, the root at depth 0."""
    assert lines[0] == "StepLockError", lines[0]
    entries = [(0, "StepLockError", "")]
    for line in lines[1:]:
        match = LINE.fullmatch(line)
        assert match, f"not a line of the tree: {line!r}"
        assert len(match["gap"]) >= 2 or not match["text"], f"description too close: {line!r}"
        entries.append((len(match["prefix"]) // 4 + 1, match["name"], match["text"]))
    return entries


def library_classes() -> dict[str, type]:
    """Every subclass of StepLockError defined in the package, by name (every module
    imported first; the deprecation shims alias modules imported anyway and are skipped)."""
    for info in pkgutil.walk_packages(celery_steplock.__path__, "celery_steplock."):
        spec = importlib.util.find_spec(info.name)
        origin = Path(spec.origin) if spec and spec.origin else None
        if origin and origin.suffix == ".py" and "._moved import alias" in origin.read_text():
            continue
        importlib.import_module(info.name)
    found: dict[str, type] = {}
    pending = [StepLockError]
    while pending:
        cls = pending.pop()
        if cls.__module__.startswith("celery_steplock") and cls.__name__ not in found:
            found[cls.__name__] = cls
            pending.extend(cls.__subclasses__())
    return found


def tree_parent(cls: type) -> type | None:
    """The class a drawing puts ``cls`` under: its first base in the tree."""
    for base in cls.__bases__:
        if issubclass(base, StepLockError):
            return base
    return None


def render(entries: list[tuple[int, str, str]], classes: dict[str, type]) -> list[str]:
    """The drawing of ``classes`` as the tree says: children in drawn order (classes not
    drawn yet last, in definition order), each class's drawn description (else TODO)."""
    order = {name: n for n, (_, name, _) in enumerate(entries)}
    text = {name: description for _, name, description in entries}
    children: dict[str, list[str]] = {}
    for name, cls in classes.items():
        parent = tree_parent(cls)
        if parent is not None:
            children.setdefault(parent.__name__, []).append(name)
    for names in children.values():
        names.sort(key=lambda n: order.get(n, len(order)))
    width = max(len(n) + 4 * depth for depth, n, _ in entries) + 2
    lines = ["StepLockError"]

    def draw(name: str, prefix: str) -> None:
        kids = children.get(name, [])
        for n, kid in enumerate(kids):
            last = n == len(kids) - 1
            head = f"{prefix}{'└── ' if last else '├── '}{kid}"
            lines.append(f"{head.ljust(width)}{text.get(kid) or 'TODO: describe'}".rstrip())
            draw(kid, prefix + ("    " if last else "│   "))

    draw("StepLockError", "")
    return lines


def test_the_drawn_error_tree_is_the_class_hierarchy():
    lines = drawn_lines()
    entries = parse(lines)
    classes = library_classes()
    names = [name for _, name, _ in entries]
    expected = "\n".join("    " + line for line in render(entries, classes))
    hint = f"the tree in celery_steplock/exceptions.py should read:\n{expected}"

    assert sorted(set(names)) == sorted(names), f"a class is drawn twice; {hint}"
    assert sorted(names) == sorted(classes), f"drawn and defined classes differ; {hint}"
    stack: list[str] = []
    for depth, name, description in entries:
        del stack[depth:]
        if stack:
            assert tree_parent(classes[name]).__name__ == stack[-1], f"{name}: {hint}"
            assert description, f"{name} has no description; {hint}"
        stack.append(name)
    # The glyphs: the drawing is the tree's own rendering (alignment aside).
    assert [" ".join(line.split()) for line in lines] == [
        " ".join(line.split()) for line in render(entries, classes)
    ], hint


def test_every_class_with_two_bases_in_the_tree_says_so():
    """A class drawn under one base of the tree names its other ones ("also an X")."""
    text = {name: description for _, name, description in parse(drawn_lines())}
    for name, cls in library_classes().items():
        others = [
            base.__name__
            for base in cls.__bases__[1:]
            if issubclass(base, StepLockError) and base is not tree_parent(cls)
        ]
        for other in others:
            assert f"also an {other}" in text[name], name


@pytest.mark.parametrize(
    "name,description", [(n, d) for _, n, d in parse(drawn_lines()) if "retryable" in d]
)
def test_what_the_drawing_calls_retryable_is_in_retryable_errors(name, description):
    retryable = issubclass(library_classes()[name], RETRYABLE_ERRORS)
    assert retryable == ("(retryable" in description), (name, description)


def test_the_tree_renders_as_a_literal_block():
    """The drawing follows ``::`` and a blank line, so Sphinx keeps its spacing."""
    doc = exceptions.__doc__ or ""
    assert "::\n\n    StepLockError\n" in doc
