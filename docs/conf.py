"""Sphinx configuration of the celery-steplock documentation (``make docs``).

The pages are Markdown (MyST). The settings and signals references are generated from the
library by ``_ext/steplock_reference.py``; the API reference is autodoc over the modules
listed in ``reference/api.md``, whose Google-style docstrings napoleon renders.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE / "_ext")]

# autodoc imports contrib.django (models, admin): the example project's settings, on a
# throwaway SQLite file (nothing is written to it).
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_app.settings")
os.environ.setdefault("STEPLOCK_VAR_DIR", str(HERE / "_build" / "var"))
import django  # noqa: E402

django.setup()

from celery_steplock import __version__ as release  # noqa: E402

project = "celery-steplock"
author = "the celery-steplock authors"
copyright = "2026, the celery-steplock authors"
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "steplock_reference",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "performance-profiles", "_ext"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 4

html_theme = "furo"
html_title = f"celery-steplock {release}"

autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_preserve_defaults = True
# Celery's own docstrings (Task.ignore_result, ...) use roles of Celery's documentation.
autodoc_inherit_docstrings = False

# The library's docstrings are Google style (Args:, Returns:, Raises:, Attributes:). Not
# NumPy style: a docstring's underlined table must not be read as a section. Attributes
# render as fields of their class, so an attribute that also has a ``#:`` comment is not
# described twice.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True

# No network at build time: cross-references to other projects stay plain text.
intersphinx_mapping: dict[str, tuple[str, str | None]] = {}
nitpicky = False

# napoleon reads the first line of an attribute's docstring as "type: description", so a
# ``#:`` comment such as "Outcomes of a force release, as recorded: before the delete, ..."
# would render its first half as a type. Attributes, data and properties without sections
# (a property may have Returns: and Raises:) keep their docstring as written.
_UNSECTIONED = {"attribute", "data", "property"}
_SECTION = re.compile(r"\s*(Args|Returns|Raises|Yields|Attributes|Example|Examples|Note):\s*")
_as_written: dict[str, list[str]] = {}


def _keep(app: object, what: str, name: str, obj: object, options: object, lines: list[str]):
    if what in _UNSECTIONED and not any(_SECTION.fullmatch(line) for line in lines):
        _as_written[name] = list(lines)


def _restore(app: object, what: str, name: str, obj: object, options: object, lines: list[str]):
    if what in _UNSECTIONED and name in _as_written:
        lines[:] = _as_written.pop(name)


def setup(app):  # napoleon's handler runs at the default priority, 500: between these two
    app.connect("autodoc-process-docstring", _keep, priority=400)
    app.connect("autodoc-process-docstring", _restore, priority=600)
