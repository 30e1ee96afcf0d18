"""The package version comes from the git tags (pyproject.toml's ``[tool.setuptools_scm]``).

``celery_steplock.__version__`` is a PEP 440 version, a development build whenever the
checkout's HEAD is not a release tag, and ``_version.FALLBACK`` (pyproject.toml's
``fallback_version``) when no build wrote ``_scm_version.txt``. The scheme itself is checked on
throwaway git repositories holding this project's pyproject.toml, with the setuptools-scm that
requirements/test.txt installs (the series pyproject.toml's build requires): untagged, shallow,
without git metadata, on a tag and after one. None of it touches the step database.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import celery_steplock
from celery_steplock import _version

pytestmark = pytest.mark.db_incidental

ROOT = Path(__file__).resolve().parent.parent
GIT = shutil.which("git")
needs_git = pytest.mark.skipif(GIT is None, reason="git is not on PATH")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        [
            "git",
            "-c",
            "user.name=test",
            "-c",
            "user.email=test@example.invalid",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "tag.gpgsign=false",
            *args,
        ],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def pyproject_fallback() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^fallback_version = "([^"]+)"$', text, re.MULTILINE)
    assert match, "pyproject.toml's [tool.setuptools_scm] has no fallback_version"
    return match.group(1)


def scm_version(cwd: Path) -> str:
    """What the build would call the version of the tree at ``cwd`` (setuptools-scm's CLI reads
    the pyproject.toml there)."""
    pytest.importorskip("setuptools_scm")
    result = subprocess.run(
        [sys.executable, "-m", "setuptools_scm"],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_version_is_pep440_in_its_normal_form():
    version = celery_steplock.__version__
    assert str(Version(version)) == version
    assert version == _version.__version__


def test_fallback_is_the_builds_and_a_dev_version():
    assert _version.FALLBACK == pyproject_fallback()
    fallback = Version(_version.FALLBACK)
    assert fallback.is_devrelease
    assert fallback.dev == 0
    assert fallback.local is None


def test_without_the_written_file_the_version_is_the_fallback(tmp_path):
    shutil.copy(Path(_version.__file__), tmp_path / "_version.py")

    def load() -> str:
        spec = importlib.util.spec_from_file_location("version_copy", tmp_path / "_version.py")
        assert spec and spec.loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.__version__

    assert load() == _version.FALLBACK
    (tmp_path / "_scm_version.txt").write_text("0.3.0.dev7+g1a2b3c4\n", encoding="utf-8")
    assert load() == "0.3.0.dev7+g1a2b3c4"
    (tmp_path / "_scm_version.txt").write_text("", encoding="utf-8")
    assert load() == _version.FALLBACK


@needs_git
def test_a_checkout_between_tags_is_a_dev_build():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an sdist): its version is PKG-INFO's")
    if not (Path(_version.__file__).with_name("_scm_version.txt")).exists():
        assert celery_steplock.__version__ == _version.FALLBACK
        return
    version = Version(celery_steplock.__version__)
    on_tag = subprocess.run(
        ["git", "describe", "--tags", "--exact-match", "--match", "v[0-9]*", "HEAD"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if on_tag.returncode != 0:
        assert version.is_devrelease, (
            f"HEAD is on no release tag, yet the version is {version} "
            "(a stale install? pip install -e . writes celery_steplock/_scm_version.txt anew)"
        )
    if version.is_devrelease and version.local:
        # The commit named in the local part (g<hash>) is one of this repository's.
        node = version.local.split(".")[0]
        assert node.startswith("g"), version
        git(ROOT, "cat-file", "-e", f"{node[1:]}^{{commit}}")


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository of two commits on main holding this project's pyproject.toml."""
    path = tmp_path / "repo"
    path.mkdir()
    shutil.copy(ROOT / "pyproject.toml", path / "pyproject.toml")
    git(path, "init", "-q")
    git(path, "add", "pyproject.toml")
    git(path, "commit", "-q", "-m", "first")
    git(path, "commit", "-q", "--allow-empty", "-m", "second")
    return path


def dev_build_of(version: str, base: str, distance: int, head: str) -> None:
    parsed = Version(version)
    assert str(parsed) == version
    assert parsed.is_devrelease, version
    assert parsed.base_version == base, version
    assert parsed.dev == distance, version
    assert parsed.local and parsed.local.startswith("g"), version
    assert head.startswith(parsed.local[1:]), (version, head)


@needs_git
def test_an_untagged_clone_is_a_dev_build_of_the_fallback(repo):
    base = Version(pyproject_fallback()).base_version
    dev_build_of(scm_version(repo), base, 2, git(repo, "rev-parse", "HEAD"))


@needs_git
def test_a_shallow_clone_without_tags_builds(repo, tmp_path):
    git(repo, "tag", "v0.1.0", "HEAD~1")
    shallow = tmp_path / "shallow"
    git(tmp_path, "clone", "-q", "--depth", "1", "--no-tags", repo.as_uri(), str(shallow))
    base = Version(pyproject_fallback()).base_version
    dev_build_of(scm_version(shallow), base, 1, git(shallow, "rev-parse", "HEAD"))


@needs_git
def test_a_tree_without_git_metadata_is_the_fallback(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert scm_version(tmp_path) == pyproject_fallback()


@needs_git
def test_a_release_tag_and_the_commits_after_it(repo):
    git(repo, "tag", "v0.1.0", "HEAD~1")
    # After 0.1.0, main builds the next minor's development version.
    dev_build_of(scm_version(repo), "0.2.0", 1, git(repo, "rev-parse", "HEAD"))
    git(repo, "tag", "v0.2.0")
    assert scm_version(repo) == "0.2.0"
