"""Every ```python block of README.md and docs/**/*.md runs here, each as one test.

A block runs alone in a fresh interpreter (what a reader who pastes it gets; a task it
declares with ``shared_task`` stays out of this suite's apps). By default it is executed as
it stands. An HTML comment on the line before the fence declares what else it needs:

    <!-- example: setup=NAME -->

with NAME one of :data:`SETUPS` (their docstrings say what each provides and checks), e.g.
``settings`` for a fragment of a settings file: it is executed, then its
``CELERY_STEPLOCK_*`` (or ``steplock_*``) names are loaded into a Celery app and the
library's own validator must find no error and no unknown setting among them. A block that
names the Redis at ``redis://127.0.0.1:6379/0`` gets the tests' Redis server instead (setup
``lease-store``). ``<!-- example: setup=continue -->`` runs a block after the page's previous
block, in its namespace.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_database

ROOT = Path(__file__).resolve().parent.parent
USER_PROJECT = ROOT / "tests" / "userproject"
EXAMPLE_REDIS = "redis://127.0.0.1:6379/0"
# The broker of the project a settings example belongs to (never connected to).
PROJECT_BROKER = "redis://redis.internal:6379/0"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_DIRECTIVE = re.compile(r"<!--\s*example:\s*(.*?)\s*-->")


def blocks(path: Path) -> list[tuple[int, str, dict[str, str]]]:
    """``(line, code, options)`` of each ```python block of ``path``; ``options`` from an
    ``<!-- example: key=value ... -->`` comment on the line above the fence."""
    found = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            options: dict[str, str] = {}
            above = lines[start - 1] if start else ""
            match = _DIRECTIVE.search(above)
            if match:
                for item in match.group(1).split():
                    key, _, value = item.partition("=")
                    options[key] = value
            found.append((start + 1, textwrap.dedent("\n".join(body)) + "\n", options))
        i += 1
    return found


def _examples() -> list:
    params = []
    for page in PAGES:
        if "_build" in page.parts:
            continue
        chain: list[str] = []
        chain_setup = ""
        tutorial: list[dict] = []
        for line, code, options in blocks(page):
            setup = options.get("setup", "")
            if setup == "tutorial":
                # One test per tutorial: its files written into a fresh project, then its
                # shell steps run there (at the line of the tutorial's last block).
                tutorial.append({**options, "code": code, "line": line})
                continue
            if setup == "continue":
                chain.append(code)
                code = "\n".join(chain)
                setup = chain_setup
            else:
                chain = [code]
                chain_setup = setup
            rel = page.relative_to(ROOT)
            params.append(pytest.param(str(rel), line, code, setup, id=f"{rel}:{line}"))
        if tutorial:
            rel = page.relative_to(ROOT)
            line = tutorial[-1]["line"]
            params.append(
                pytest.param(
                    str(rel), line, json.dumps(tutorial), "tutorial", id=f"{rel}:tutorial"
                )
            )
    return params


# -- what runs in the child interpreter ------------------------------------------------------


def _problems_of(conf: dict) -> list[str]:
    """The library's validator on an app configured with ``conf``: its errors and its
    unknown-name warnings (W005: a misspelled setting)."""
    from celery import Celery

    from celery_steplock.validate import problems

    app = Celery("docs_example", set_as_current=False, broker=PROJECT_BROKER)
    app.conf.update(conf)
    return [f"{p.id}: {p.message}" for p in problems(app) if ".E" in p.id or p.id.endswith("W005")]


def _setup_settings(namespace: dict) -> None:
    """A settings-file fragment (Django's ``CELERY_STEPLOCK_*`` or Celery's ``steplock_*``
    names) of a project whose broker is a Redis: after it runs, the validator must accept
    every steplock setting it sets (a ``LOGGING`` it sets must load). Certificate paths under
    ``/etc/ssl/`` are empty stand-in files of the same names."""


def _check_settings(namespace: dict) -> None:
    conf = {}
    for name, value in namespace.items():
        if name.startswith("CELERY_STEPLOCK_"):
            conf[name[len("CELERY_") :].lower()] = value
        elif name.startswith("steplock_"):
            conf[name] = value
    assert conf or "LOGGING" in namespace, "a settings example that sets no steplock setting"
    found = _problems_of({name: _stand_in_files(value) for name, value in conf.items()})
    assert found == [], found
    if "LOGGING" in namespace:
        import logging.config

        logging.config.dictConfig(namespace["LOGGING"])


def _stand_in_files(value):
    """``value`` with each certificate path under ``/etc/ssl/`` (in TLS options) replaced by
    a readable file of that name in a directory of the child's own."""
    if isinstance(value, dict):
        return {k: _stand_in_files(v) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("/etc/ssl/"):
        path = Path(os.environ["STEPLOCK_VAR_DIR"]) / value.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return str(path)
    return value


def _setup_app(namespace: dict) -> None:
    """``app``: a Celery app of its own; after the block, the validator must find no error
    and no unknown setting in its configuration."""
    from celery import Celery

    namespace["app"] = Celery("docs_example", set_as_current=False, broker=PROJECT_BROKER)


def _check_app(namespace: dict) -> None:
    from celery_steplock.validate import problems

    found = [
        f"{p.id}: {p.message}"
        for p in problems(namespace["app"])
        if ".E" in p.id or p.id.endswith("W005")
    ]
    assert found == [], found


def _setup_tasks(namespace: dict) -> None:
    """A fragment of a tasks module: ``shared_task``, ``StepLockedTask`` and the example
    models' names (``Order``, ``Ledger``) are there; the tasks it declares must be
    StepLockedTasks."""
    from celery import shared_task

    from celery_steplock import StepLockedTask

    namespace.update(
        shared_task=shared_task, StepLockedTask=StepLockedTask, Order=object(), Ledger=object()
    )


def _check_tasks(namespace: dict) -> None:
    from celery_steplock import StepLockedTask

    tasks = [v for v in namespace.values() if isinstance(v, StepLockedTask)]
    assert tasks, "a tasks example that declares no StepLockedTask"


def _setup_models(namespace: dict) -> None:
    """A fragment of a model class body: ``models`` is ``django.db.models``."""
    import django
    from django.conf import settings

    settings.configure()
    django.setup()
    from django.db import models

    namespace["models"] = models


def _setup_factory(namespace: dict) -> None:
    """A client factory module: ``MyVaultCredentials`` is a redis-py credential provider;
    the factory the block defines must build a client (no connection is made)."""
    import redis

    class MyVaultCredentials(redis.CredentialProvider):
        def get_credentials(self):
            return ("steplock", "from-the-vault")

    namespace["MyVaultCredentials"] = MyVaultCredentials


def _check_factory(namespace: dict) -> None:
    import redis
    from celery import Celery

    from celery_steplock.conf import Settings

    factory = namespace["steplock_client"]
    client = factory(Settings(Celery("docs_example", set_as_current=False)))
    assert isinstance(client, redis.Redis)
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == 5.0 and kwargs["credential_provider"] is not None


def _setup_lease_store(namespace: dict) -> None:
    """The block's ``redis://127.0.0.1:6379/0`` is the tests' Redis; ``STEPLOCK_NAME_SECRET``
    is set."""
    os.environ.setdefault("STEPLOCK_NAME_SECRET", "docs-example-" + "s" * 32)


class _Dependency:
    """The reader's own client of a remote dependency (a payment provider, a mail API):
    every method returns a result with an ``id``."""

    def __getattr__(self, name: str):
        import types

        return lambda *args, **kwargs: types.SimpleNamespace(id=f"{name}-1")


def _setup_patterns(namespace: dict) -> None:
    """The distributed patterns' pages: ``app`` is a Celery app of its own whose lock store
    is the tests' Redis (a key prefix of its own, a name secret), ``StepLockedTask`` is
    imported, and the reader's own names are stand-ins: ``provider``, ``client`` and
    ``gateway`` (a dependency's client: every method returns an object with an ``id``),
    ``order_id`` (1), ``render()``, ``MyTransientError`` and ``MyPermanentError``. After the
    block, the validator must find no error in the app's configuration or its tasks."""
    from celery import Celery

    from celery_steplock import StepLockedTask

    app = Celery("docs_example", set_as_current=False, broker=PROJECT_BROKER)
    app.conf.steplock_redis_url = os.environ["STEPLOCK_DOCS_REDIS_URL"]
    app.conf.steplock_key_prefix = f"docs-example-{os.getpid()}"
    app.conf.steplock_name_secret = "docs-example-" + "s" * 32
    namespace.update(
        app=app,
        StepLockedTask=StepLockedTask,
        provider=_Dependency(),
        client=_Dependency(),
        gateway=_Dependency(),
        order_id=1,
        render=lambda: None,
        MyTransientError=type("MyTransientError", (ConnectionError,), {}),
        MyPermanentError=type("MyPermanentError", (ValueError,), {}),
    )


SETUPS = {
    "": (None, None),
    "settings": (_setup_settings, _check_settings),
    "app": (_setup_app, _check_app),
    "tasks": (_setup_tasks, _check_tasks),
    "models": (_setup_models, None),
    "factory": (_setup_factory, _check_factory),
    "lease-store": (_setup_lease_store, None),
    "userproject": (None, None),
    "tutorial": (None, None),
    "patterns": (_setup_patterns, _check_app),
}


def run_in_child(spec: dict) -> None:
    """The child's side: set up, run the block, check what the setup checks."""
    setup, check = SETUPS[spec["setup"]]
    namespace: dict = {"__name__": "docs_example"}
    if setup is not None:
        setup(namespace)
    exec(compile(spec["code"], spec["where"], "exec"), namespace)
    if check is not None:
        check(namespace)
    print("example ok")


# -- the tests -------------------------------------------------------------------------------


def _child_env(**extra: str) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DJANGO_SETTINGS_MODULE", "PYTEST_ADDOPTS", "STEPLOCK_NAME_SECRET")
    }
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def _run(args: list[str], cwd: Path, env: dict, where: str) -> str:
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{where}: {' '.join(args[1:])}\n{output}"
    return output


def _tutorial(steps: list[dict], redis_url: str, prefix: str, tmp_path: Path, where: str) -> None:
    """``django-admin startproject shop``, ``startapp orders``, each ``file=`` block written
    (``mode=append``: added to the file startproject made), migrations, ``manage.py check``,
    then each ``run=shell`` block in ``manage.py shell``. The lease keys go under ``prefix``."""
    env = _child_env()
    del env["PYTHONPATH"]  # the project alone, as a reader has it
    _run([sys.executable, "-m", "django", "startproject", "shop"], tmp_path, env, where)
    project = tmp_path / "shop"
    manage = [sys.executable, "manage.py"]
    _run([*manage, "startapp", "orders"], project, env, where)
    shells = []
    for step in steps:
        code = step["code"].replace(EXAMPLE_REDIS, redis_url)
        if step.get("run") == "shell":
            shells.append(code)
            continue
        path = project / step["file"]
        if step.get("mode") == "append":
            code = path.read_text(encoding="utf-8") + "\n" + code
        path.write_text(code, encoding="utf-8")
    settings = project / "shop" / "settings.py"
    settings.write_text(
        settings.read_text(encoding="utf-8") + f"\nCELERY_STEPLOCK_KEY_PREFIX = {prefix!r}\n",
        encoding="utf-8",
    )
    _run([*manage, "makemigrations", "orders"], project, env, where)
    _run([*manage, "migrate", "-v", "0"], project, env, where)
    checked = _run([*manage, "check"], project, env, where)
    assert "System check identified no issues" in checked, checked
    assert shells, f"{where}: a tutorial without a run=shell step"
    for code in shells:
        _run([*manage, "shell", "-c", code], project, env, where)


@pytest.fixture
def new_redis_keys(redis_server_url):
    """Deletes, after the test, every key the example left in the tests' Redis."""
    import redis

    client = redis.Redis.from_url(redis_server_url)
    before = set(client.scan_iter(count=1000))
    yield client
    left = set(client.scan_iter(count=1000)) - before
    if left:
        client.delete(*left)


@pytest.mark.parametrize(("page", "line", "code", "setup"), _examples())
def test_example_runs(page, line, code, setup, redis_server_url, new_redis_keys, tmp_path):
    assert setup in SETUPS, f"{page}:{line}: unknown setup {setup!r} (see {__name__})"
    where = f"{page}:{line}"
    if setup == "tutorial":
        prefix = f"docs-tutorial-{os.getpid()}"
        _tutorial(json.loads(code), redis_server_url, prefix, tmp_path, where)
        # The first order's five sends wait for a worker; the second order was charged by
        # apply() under a lease of the project's own prefix, then released (its fencing
        # counter and its history are left, and the per-minute activity counts).
        keys = sorted(k.decode() for k in new_redis_keys.scan_iter(f"{prefix}:*"))
        keys = [k for k in keys if not k.startswith(f"{prefix}:activity:")]
        assert keys == [f"{prefix}:fence:{{order:2}}", f"{prefix}:history:{{order:2}}"], keys
        return
    if setup == "userproject":
        test_file = tmp_path / "test_docs_example.py"
        test_file.write_text(code, encoding="utf-8")
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-p",
                "no:cacheprovider",
                "-q",
                "-c",
                str(USER_PROJECT / "pytest.ini"),
                "--rootdir",
                str(USER_PROJECT),
                str(test_file),
            ],
            cwd=USER_PROJECT,
            env=_child_env(STEPLOCK_TEST_REDIS_URL=redis_server_url),
            capture_output=True,
            text=True,
            timeout=120,
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{where}\n{output}"
        tests = len(re.findall(r"^def test_", code, flags=re.M))
        assert re.search(rf"\b{tests} passed\b", output), f"{where}\n{output}"
        return
    if EXAMPLE_REDIS in code:
        code = code.replace(EXAMPLE_REDIS, redis_server_url)
    spec = json.dumps({"code": code, "setup": setup, "where": where})
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; from tests.test_docs_examples import run_in_child; "
            "run_in_child(json.loads(sys.argv[1]))",
            spec,
        ],
        cwd=ROOT,
        env=_child_env(STEPLOCK_VAR_DIR=str(tmp_path), STEPLOCK_DOCS_REDIS_URL=redis_server_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and proc.stdout.strip().endswith("example ok"), (
        f"{where}\n{output}"
    )


def test_every_page_with_python_has_its_examples_collected():
    """The collector sees the blocks a reader sees: as many as the pages' ```python fences,
    each setup known."""
    found = [blocks(page) for page in PAGES if "_build" not in page.parts]
    fences = sum(
        page.read_text(encoding="utf-8").count("\n```python\n")
        for page in PAGES
        if "_build" not in page.parts
    )
    tutorial = sum(1 for page in found for _, _, o in page if o.get("setup") == "tutorial")
    pages_with_tutorial = sum(
        1 for page in found if any(o.get("setup") == "tutorial" for _, _, o in page)
    )
    examples = _examples()
    assert len(examples) == fences - tutorial + pages_with_tutorial and fences >= 10
    assert {p.values[3] for p in examples} <= set(SETUPS)


# -- the generated references' sources --------------------------------------------------------


def test_every_setting_has_a_description():
    """The settings reference (docs/reference/settings.md) is generated from conf.DEFAULTS
    and conf.DESCRIPTIONS: one non-empty sentence per setting, no description of a setting
    that does not exist."""
    from celery_steplock import conf

    assert list(conf.DESCRIPTIONS) == list(conf.DEFAULTS)
    assert all(text.strip().endswith(".") for text in conf.DESCRIPTIONS.values())


def test_every_signal_has_a_doc_comment():
    """The signals reference is generated from the ``#:`` comment above each declaration in
    signals.py: every signal of ALL_SIGNALS has one."""
    from celery_steplock import signals

    source = (ROOT / "celery_steplock" / "signals.py").read_text(encoding="utf-8").splitlines()
    documented = set()
    for i, line in enumerate(source):
        match = re.match(r"(\w+) = Signal\(", line)
        if match and i and source[i - 1].startswith("#:"):
            documented.add(match.group(1))
    names = [signal.name for signal in signals.ALL_SIGNALS]
    assert len(names) >= 10 and sorted(documented) == sorted(names)
