#!/usr/bin/env python3
"""`make matrix`: every tox env of tox.ini, with the interpreters found on this machine.

pyenv's shims only run the versions pyenv has selected, so each Python 3.10-3.14 found (on
PATH or among pyenv's versions, as scripts/corners.py looks) gets its directory put first on
PATH for tox. Arguments go to ``tox run`` (default: the whole envlist); an interpreter that is
missing makes its envs skip (tox.ini's skip_missing_interpreters), and the list of what was
found is printed first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from corners import ROOT, MissingInterpreter, find_python  # noqa: E402

VERSIONS = ("3.10", "3.11", "3.12", "3.13", "3.14")


def main(args: list[str]) -> int:
    dirs: list[str] = []
    for version in VERSIONS:
        try:
            path = find_python(version)
        except MissingInterpreter:
            print(f"matrix: Python {version}: not found, its envs are skipped", flush=True)
            continue
        print(f"matrix: Python {version}: {path}", flush=True)
        parent = str(Path(path).parent)
        if parent not in dirs:
            dirs.append(parent)
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([*dirs, env.get("PATH", "")])
    cmd = [sys.executable, "-m", "tox", "run", *args]
    print(f"matrix: {' '.join(cmd[2:])}", flush=True)
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
