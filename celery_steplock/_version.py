"""The package version (one place; the facade and the tracer read it).

The version comes from the repository's git tags: setuptools-scm computes it when the package
is built or installed (pyproject.toml's ``[tool.setuptools_scm]``: ``0.1.0`` on the tag
``v0.1.0``, ``0.2.0.dev12+g1a2b3c4`` twelve commits after it) and writes it to
``_scm_version.txt`` beside this module, a generated file that git ignores and the wheel and
the sdist carry. A checkout that was never built nor installed (``pip install -e .`` writes the
file too) has no such file: its version is :data:`FALLBACK`, a development version, the one the
build gives a tree without git metadata.
"""

from __future__ import annotations

from pathlib import Path

#: The version of a tree without the generated file: pyproject.toml's fallback_version, which
#: tests/test_version.py holds equal to it (both move to the next minor's .dev0 after a release).
FALLBACK = "0.2.0.dev0"


def _read() -> str:
    try:
        text = Path(__file__).with_name("_scm_version.txt").read_text(encoding="utf-8")
    except OSError:
        return FALLBACK
    return text.strip() or FALLBACK


__version__ = _read()
