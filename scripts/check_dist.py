"""Check the built sdist and wheel in dist/ (`make dist`): what must travel and what must not.

The wheel holds LICENSE, py.typed, the admin templates and the migrations, and no tests; the
sdist holds LICENSE and the library and no tests either. Exits non-zero with the reasons.
"""

from __future__ import annotations

import sys
import tarfile
import zipfile
from pathlib import Path


def check_wheel(path: Path) -> list[str]:
    names = zipfile.ZipFile(path).namelist()
    problems = []
    if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
        problems.append("no LICENSE under .dist-info/licenses/")
    wanted = [
        "celery_steplock/py.typed",
        "celery_steplock/_scm_version.txt",  # __version__ reads it (setuptools-scm writes it)
        "celery_steplock/contrib/django/migrations/__init__.py",
        "celery_steplock/contrib/django/migrations/0001_initial.py",
    ]
    problems += [f"missing {n}" for n in wanted if n not in names]
    if not any(
        n.startswith("celery_steplock/contrib/django/templates/") and n.endswith(".html")
        for n in names
    ):
        problems.append("no admin templates")
    problems += [f"test file {n}" for n in names if n.startswith(("tests/", "django_app/"))]
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(path).read(metadata).decode()
    for field in ("License-Expression: BSD-3-Clause", "License-File: LICENSE", "Project-URL: "):
        if field not in text:
            problems.append(f"METADATA lacks {field!r}")
    return problems


def check_sdist(path: Path) -> list[str]:
    with tarfile.open(path) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    problems = [f"missing {n}" for n in ("LICENSE", "celery_steplock/py.typed") if n not in names]
    problems += [f"test file {n}" for n in names if n.startswith(("tests/", "django_app/"))]
    return problems


def main() -> int:
    dist = Path(sys.argv[1] if len(sys.argv) > 1 else "dist")
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"check_dist: want one wheel and one sdist in {dist}, found {wheels + sdists}")
        return 1
    problems = [f"{wheels[0].name}: {p}" for p in check_wheel(wheels[0])]
    problems += [f"{sdists[0].name}: {p}" for p in check_sdist(sdists[0])]
    for problem in problems:
        print(f"check_dist: {problem}")
    if not problems:
        print(f"check_dist: {wheels[0].name} and {sdists[0].name} OK")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
