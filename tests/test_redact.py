"""No password in any output (celery_steplock.redact): the masking function on every URL
shape, then each output path with a URL or options holding a password, against the real
Redis, database, worker processes and admin: a worker's CRITICAL log and exit message,
``manage.py check``, the ``celery steplock`` commands' errors, the admin page, the errors
of the lease store, ``scripts/demo.py``."""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.urls import reverse

from celery_steplock import validate
from celery_steplock.clients import check_transport_options, check_url, client_for_settings
from celery_steplock.conf import Settings
from celery_steplock.contrib.django import checks
from celery_steplock.exceptions import ImproperlyConfigured, LockStoreMisconfigured
from celery_steplock.lock import RedisLeaseStore, make_client
from celery_steplock.redact import MASK, printable, redact, redact_options, secrets_of, url_secrets
from tests.helpers import free_port, set_settings

ROOT = Path(__file__).resolve().parent.parent
PW = "s3cr3t-Pw7f"  # never in any output
#: Shapes of a steplock_redis_url the library refuses, each holding PW: (url, what must
#: still be shown).
REFUSED_URLS = [
    (f"sentinels://:{PW}@sentinel-a:26379", ("sentinels://", "sentinel-a:26379")),
    (
        f"redis+sentinel://:{PW}@sa:26379;redis+sentinel://:{PW}@sb:26380",
        ("redis+sentinel://", "sa:26379", "sb:26380"),
    ),
    (f"rediss//:{PW}@cache-1:6380/0", ("rediss//", "cache-1:6380")),
    (f"http://alice:{PW}@cache-1:6379", ("http://alice:", "cache-1:6379")),
    (f"redis://:{PW[:4]}/{PW[4:]}@cache-1:6379/0", ("redis://", "cache-1:6379")),
    (f"redis://:{PW}@cache-1:6379/zero", ("redis://", "cache-1:6379", "'zero'")),
    (f"unix:///run/redis.sock?password={PW}&db=x", ("unix:///run/redis.sock", "db")),
    (f"sentinel://:{PW}@sa:26379/x;sentinel://:{PW}@sb:26379", ("sentinel://", "sa:26379")),
    (f"sentinel://:{PW[:5]};{PW[5:]}@sa:26379", ("sentinel://", "sa:26379")),
]
ALL_SHAPES = pytest.mark.parametrize(
    "url,shown",
    REFUSED_URLS,
    ids=[u.split(":", 1)[0] + str(i) for i, (u, _) in enumerate(REFUSED_URLS)],
)


def assert_masked(text, *shown):
    """``text`` holds no piece of PW longer than 2 characters, and each of ``shown``."""
    assert PW not in text
    for start in range(len(PW) - 2):
        assert PW[start : start + 3] not in text, (PW[start : start + 3], text)
    for part in shown:
        assert part in text, (part, text)


# -- the masking function --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("sentinel://:pw@h;sentinel://:pw@h2", "sentinel://:***@h;sentinel://:***@h2"),
        ("redis://user:pw@h:6379/1", "redis://user:***@h:6379/1"),
        (
            "rediss://:pw@h:6380/0?ssl_cert_reqs=required",
            "rediss://:***@h:6380/0?ssl_cert_reqs=required",
        ),
        ("unix://:pw@/run/redis.sock", "unix://:***@/run/redis.sock"),
        ("unix:///run/redis.sock?db=1&password=pw", "unix:///run/redis.sock?db=1&password=***"),
        ("redis://h/0?password=pw&db=2", "redis://h/0?password=***&db=2"),
        ("redis://word@h", "redis://***@h"),
        ("rediss//:pw@h", "rediss//:***@h"),
        ("redis://:a/b?c#d@h:1/0", "redis://:***@h:1/0"),
        ("got 'redis://:pw@h', then", "got 'redis://:***@h', then"),
        ('got "redis://:a\'b@h"', 'got "redis://:***@h"'),
        (
            "{'master_name': 'm', 'sentinel_kwargs': {'password': 'pw'}}",
            "{'master_name': 'm', 'sentinel_kwargs': {'password': '***'}}",
        ),
        ("[('password', 'pw')]", "[('password', '***')]"),
        ("Redis(password='pw', ssl_password=b'pw')", "Redis(password='***', ssl_password=b'***')"),
        ("sentinel_password=pw db=1", "sentinel_password=*** db=1"),
        ("redis://h:6379/0 is unreachable", "redis://h:6379/0 is unreachable"),
        (
            "fix the credentials (user name, password) in steplock_redis_url",
            "fix the credentials (user name, password) in steplock_redis_url",
        ),
    ],
)
def test_redact_masks_every_shape_and_keeps_the_rest(text, expected):
    assert redact(text) == expected


def test_redact_masks_known_secrets_in_any_form():
    secrets = url_secrets(f"sentinel://:{PW}@h;sentinel://:{PW}@h2") + ["p@ss/w%rd"]
    assert secrets == [PW, "p@ss/w%rd"]
    text = redact(
        f"as is {PW}, encoded p%40ss%2Fw%25rd, in a repr {PW!r}, decoded p@ss/w%rd", secrets
    )
    assert text == "as is ***, encoded ***, in a repr '***', decoded ***"
    assert redact("a pw of two", ["pw"]) == "a pw of two"  # shorter than MIN_SECRET
    assert redact(ValueError(f"redis://:{PW}@h")) == "redis://:***@h"
    assert redact({"password": PW}) == "{'password': '***'}"
    assert redact_options(
        {"master_name": "m", "sentinel_kwargs": {"password": PW}, "ssl_password": None}
    ) == {"master_name": "m", "sentinel_kwargs": {"password": MASK}, "ssl_password": None}


def test_secrets_of_an_app_are_every_password_of_its_settings(app):
    set_settings(
        app,
        steplock_redis_url=f"redis://u:{PW}1@h/0",
        steplock_redis_transport_options={"sentinel_kwargs": {"password": f"{PW}2"}},
        steplock_redis_use_ssl={"ssl_password": f"{PW}3"},
    )
    found = secrets_of(app)
    assert {f"{PW}1", f"{PW}2", f"{PW}3"} <= set(found)


# -- validation (clients.py) -------------------------------------------------------------------


@ALL_SHAPES
def test_a_refused_url_is_named_without_its_password(url, shown):
    with pytest.raises(ImproperlyConfigured) as raised:
        check_url(url)
    assert_masked(str(raised.value), *shown)
    assert raised.value.setting == "steplock_redis_url"


def test_refused_transport_options_are_shown_without_their_password():
    for value in (
        [("password", PW)],
        {"master_name": "m", "sentinel_kwargs": {"password": PW, 1: 2}},
    ):
        with pytest.raises(ImproperlyConfigured) as raised:
            check_transport_options(value, "sentinel://h:26379")
        assert_masked(str(raised.value), "steplock_redis_transport_options")


def test_a_client_factory_error_quoting_the_url_is_masked(app):
    def factory(settings):
        raise RuntimeError(f"no route to redis://app:{PW}@cache-1:6379/0")

    set_settings(app, steplock_redis_client_factory=factory)
    with pytest.raises(ImproperlyConfigured) as raised:
        client_for_settings(Settings(app))
    assert_masked(str(raised.value), "redis://app:", "cache-1:6379", "RuntimeError")


# -- the lease store's errors (real Redis) --------------------------------------------------------


def test_lock_store_misconfigured_names_no_password(private_redis):
    admin = make_client(private_redis.url)
    admin.execute_command("ACL", "SETUSER", "steplock", "on", f">{PW}", "~*", "+@all")
    admin.close()
    wrong = f"redis://steplock:{PW}-wrong@127.0.0.1:{private_redis.port}/0"
    store = RedisLeaseStore(make_client(wrong), prefix="t")
    with pytest.raises(LockStoreMisconfigured) as raised:
        store.acquire("order:1", ttl=5.0)
    assert_masked(str(raised.value), "authentication failed", "steplock_redis_url")
    right = make_client(f"redis://steplock:{PW}@127.0.0.1:{private_redis.port}/0")
    assert RedisLeaseStore(right, prefix="t").acquire("order:1", ttl=5.0) is not None


# -- worker start and manage.py check (validate.py, checks.py) -----------------------------------


@ALL_SHAPES
def test_the_e003_problem_names_no_password(app, url, shown):
    set_settings(app, steplock_redis_url=url)
    found = [p for p in validate.problems(app) if p.obj == "steplock_redis_url"]
    assert [p.id for p in found] == ["celery_steplock.E003"]
    assert_masked(found[0].message, *shown)


def test_refuse_to_start_logs_and_exits_without_the_password(app, caplog):
    set_settings(
        app,
        steplock_redis_url=REFUSED_URLS[1][0],
        steplock_redis_transport_options=[("password", PW)],
    )
    with (
        caplog.at_level(logging.CRITICAL, logger="celery_steplock"),
        pytest.raises(SystemExit) as raised,
    ):
        validate.refuse_to_start(app)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert logged.count("event=improperly_configured") == 2
    assert_masked(
        logged, "redis+sentinel://", "sa:26379", "sb:26380", "steplock_redis_transport_options"
    )
    assert_masked(
        str(raised.value.code), "redis+sentinel://", "sa:26379", "steplock_redis_transport_options"
    )


def test_a_validator_that_breaks_names_no_known_secret(app, caplog, monkeypatch):
    """The fail-closed path: a validator's own error quoting a setting's password as a
    bare word (no URL around it) is masked by the app's known secrets."""
    set_settings(app, steplock_redis_transport_options={"sentinel_kwargs": {"password": PW}})

    def broken(app):
        raise RuntimeError(f"cannot judge sentinel_kwargs holding {PW}")

    monkeypatch.setattr(validate, "problems", broken)
    with (
        caplog.at_level(logging.CRITICAL, logger="celery_steplock"),
        pytest.raises(SystemExit) as raised,
    ):
        validate.refuse_to_start(app)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert_masked(logged, 'error="RuntimeError: cannot judge sentinel_kwargs')
    assert_masked(str(raised.value.code), "could not be validated: RuntimeError")
    assert raised.value.__cause__ is None


def test_a_worker_with_a_refused_url_exits_without_showing_the_password(worker_env):
    url = REFUSED_URLS[1][0]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "django_app",
            "worker",
            "-l",
            "INFO",
            "-P",
            "solo",
            "--without-mingle",
            "--without-gossip",
        ],
        env={**worker_env, "STEPLOCK_REDIS_URL": url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "event=improperly_configured id=celery_steplock.E003" in output
    assert_masked(output, "redis+sentinel://", "sa:26379", "sb:26380")


@pytest.mark.django_db
def test_manage_py_check_names_no_password(app):
    set_settings(app, steplock_redis_url=REFUSED_URLS[0][0])
    found = [m for m in run_checks(tags=[checks.TAG]) if m.id == "celery_steplock.E003"]
    assert len(found) == 1
    assert_masked(found[0].msg, "sentinels://", "sentinel-a:26379")
    with pytest.raises(SystemCheckError) as raised:
        call_command("check")
    assert_masked(str(raised.value), "celery_steplock.E003", "sentinels://", "sentinel-a:26379")


def test_the_unreachable_lock_store_check_names_no_password(app):
    """E001 (``check --deploy``) with a Sentinel URL of two sentinels that do not answer."""
    url = f"sentinel://:{PW}@127.0.0.1:{free_port()};sentinel://:{PW}@127.0.0.1:{free_port()}"
    set_settings(
        app,
        steplock_redis_url=url,
        steplock_socket_timeout=0.5,
        steplock_redis_transport_options={
            "master_name": "mymaster",
            "sentinel_kwargs": {"password": PW},
        },
    )
    found = checks.check_lock_store(app)
    assert [m.id for m in found] == ["celery_steplock.E001"]
    assert_masked(found[0].msg, "sentinel://:***@127.0.0.1:", "is unreachable")


# -- the admin page (view-only staff) -----------------------------------------------------------


@pytest.mark.django_db
def test_the_admin_page_shows_no_password(app, django_user_model, redis_client):
    from django.contrib.auth.models import Permission
    from django.test import Client

    viewer = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_lease"))
    client = Client()
    client.force_login(viewer)
    set_settings(app, steplock_redis_url=REFUSED_URLS[1][0])
    response = client.get(reverse("admin:celery_steplock_lease_changelist"))
    assert response.status_code == 200 and response.context["store_error"]
    shown = [str(m) for m in response.context["messages"]]
    assert len(shown) == 1 and "could not be read" in shown[0]
    assert_masked(shown[0], "redis+sentinel://", "sa:26379", "sb:26380")
    assert_masked(response.content.decode(), "redis+sentinel://")


@pytest.mark.django_db
def test_the_admin_release_pages_show_no_password(app, django_user_model, redis_client):
    from django.contrib.auth.models import Permission
    from django.test import Client

    releaser = django_user_model.objects.create_user("releaser", password="x", is_staff=True)
    for codename in ("view_lease", "force_release_lease"):
        releaser.user_permissions.add(Permission.objects.get(codename=codename))
    client = Client()
    client.force_login(releaser)
    set_settings(app, steplock_redis_url=REFUSED_URLS[1][0])
    release = reverse("admin:celery_steplock_lease_release")
    for response, expected in (
        (client.get(release, {"name": "order:1"}, follow=True), "could not be read"),
        (
            client.post(release, {"name": "order:1", "owner": "o"}, follow=True),
            "could not be reached: nothing released",
        ),
    ):
        assert response.status_code == 200
        # The release view's message, then the list's own (the redirect's page).
        shown = [str(m) for m in response.context["messages"]]
        assert len(shown) == 2 and expected in shown[0] and "could not be read" in shown[1]
        for message in shown:
            assert_masked(message, "redis+sentinel://", "sa:26379", "sb:26380")
        assert_masked(response.content.decode(), "redis+sentinel://")


@pytest.mark.django_db(transaction=True)
def test_the_admin_page_in_a_browser_shows_no_password(
    app, django_user_model, live_server, redis_client
):
    """What view-only staff see in headless Chromium: the error, no password."""
    from tests.contrib.test_browser import CHROMIUM_ARGS, chromium_path, unavailable

    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed (pip install -e '.[dev]')")
    if chromium_path() is None:
        unavailable(
            "chromium not found (Debian: apt-get install chromium, or set STEPLOCK_CHROMIUM)"
        )
    from django.contrib.auth.models import Permission

    viewer = django_user_model.objects.create_user(
        "viewer", password="pw-of-the-viewer", is_staff=True
    )
    viewer.user_permissions.add(Permission.objects.get(codename="view_lease"))
    set_settings(app, steplock_redis_url=REFUSED_URLS[1][0])
    list_path = "/admin/celery_steplock/lease/"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(f"{live_server.url}/admin/login/?next={list_path}")
            page.fill("#id_username", "viewer")
            page.fill("#id_password", "pw-of-the-viewer")
            page.click("input[type=submit]")
            page.wait_for_url(f"{live_server.url}{list_path}")
            text, html = page.inner_text("body"), page.content()
        finally:
            browser.close()
    assert "could not be read" in text
    assert_masked(text, "redis+sentinel://:***@sa:26379;redis+sentinel://:***@sb:26380")
    assert_masked(html, "redis+sentinel://")


# -- scripts/demo.py -----------------------------------------------------------------------------


def load_demo():
    spec = importlib.util.spec_from_file_location(
        "steplock_demo_script", ROOT / "scripts" / "demo.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_prints_redis_url_without_its_password(private_redis, monkeypatch, capsys):
    admin = make_client(private_redis.url)
    admin.config_set("requirepass", PW)
    admin.close()
    url = f"redis://:{PW}@127.0.0.1:{private_redis.port}/0"
    monkeypatch.setenv("REDIS_URL", url)
    demo_module = load_demo()
    demo = demo_module.Demo(demo_module.parse_args([]))
    demo.start_redis()
    try:
        assert demo.redis.ping() is True  # it did use the password
    finally:
        demo.redis.close()
    printed = capsys.readouterr().out
    assert_masked(printed, "using REDIS_URL=redis://:***@", f"127.0.0.1:{private_redis.port}")
    failure = demo_module.safe(f"demo: FAILED: ConnectionError: {url} and {PW}")
    assert_masked(failure, "demo: FAILED", f"127.0.0.1:{private_redis.port}")


# -- terminal output -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,shown",
    [
        ("order:1", "order:1"),
        ("a\x1b[2Jb", "a\\x1b[2Jb"),
        ("line\nforged", "line\\nforged"),
        ("back\rover", "back\\rover"),
        ("tab\there", "tab\\there"),
        ("bidi\u202eevil", "bidi\\u202eevil"),
        ("nel\x85c1", "nel\\x85c1"),
        ("sep\u2028para", "sep\\u2028para"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
        ("back\\slash", "back\\\\slash"),
        ("déjà vu 東京", "déjà vu 東京"),
        (17, "17"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(raw, shown):
    assert printable(raw) == shown
    assert printable(raw).isprintable()


# -- passwords of any shape (quotes, spaces, punctuation) -----------------------------------------

#: Passwords holding PW and a character that once ended or split the URL in the masking.
PASSWORD_SHAPES = {
    "quote-dot": f"{PW}'.x",
    "quote": f"{PW[:5]}'{PW[5:]}",
    "double-quote": f'{PW[:5]}"{PW[5:]}',
    "both-quotes": f"{PW[:4]}'\"{PW[4:]}",
    "quote-paren": f"{PW[:5]}'){PW[5:]}",
    "space": f"{PW[:5]} {PW[5:]}",
    "two-spaces": f"{PW[:3]} {PW[3:7]} {PW[7:]}",
    "backslash": f"{PW[:5]}\\{PW[5:]}",
    "at": f"{PW[:5]}@{PW[5:]}",
    "hash": f"{PW[:5]}#{PW[5:]}",
    "percent": f"{PW[:5]}%{PW[5:]}",
    "semicolon": f"{PW[:5]};{PW[5:]}",
    "comma": f"{PW[:5]},{PW[5:]}",
    "non-ascii": f"{PW[:5]}é€{PW[5:]}",
}
SHAPED = pytest.mark.parametrize(
    "password", list(PASSWORD_SHAPES.values()), ids=list(PASSWORD_SHAPES)
)
#: Refused URLs (scheme refused; port not a number), with what must still be shown.
SHAPED_URLS = [
    ("redis+sentinel://:{}@h:26379", ("redis+sentinel://", "@h:26379")),
    ("redis://:{}@h:bad/0", ("redis://", "@h:bad/0")),
]


@SHAPED
def test_redact_masks_a_password_of_any_shape_in_any_quoting(password):
    for template, shown in SHAPED_URLS:
        url = template.format(password)
        for text in (
            url,
            repr(url),
            f"got {url!r}: retry",
            f"url={url} failed",
            f'"{url}"',
            str([url]),
            f"({url!r}, 'x')",
        ):
            assert_masked(redact(text), *shown)
        assert url_secrets(url)[0] == password
        assert_masked(redact(f"bare {password} here", url_secrets(url)), "bare", "here")


@SHAPED
def test_the_e003_problem_and_exit_mask_a_password_of_any_shape(app, password, caplog):
    for template, shown in SHAPED_URLS:
        set_settings(app, steplock_redis_url=template.format(password))
        found = [p for p in validate.problems(app) if p.obj == "steplock_redis_url"]
        assert [p.id for p in found] == ["celery_steplock.E003"]
        assert_masked(found[0].message, *shown)
        caplog.clear()
        with (
            caplog.at_level(logging.CRITICAL, logger="celery_steplock"),
            pytest.raises(SystemExit) as raised,
        ):
            validate.refuse_to_start(app)
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "event=improperly_configured" in logged
        assert_masked(logged, *shown)
        assert_masked(str(raised.value.code), *shown)


@pytest.mark.django_db
@SHAPED
def test_manage_py_check_masks_a_password_of_any_shape(app, password):
    set_settings(app, steplock_redis_url=SHAPED_URLS[0][0].format(password))
    with pytest.raises(SystemCheckError) as raised:
        call_command("check")
    assert_masked(str(raised.value), "celery_steplock.E003", *SHAPED_URLS[0][1])


@pytest.mark.django_db
@pytest.mark.parametrize(
    "password", [PASSWORD_SHAPES[k] for k in ("quote-dot", "space")], ids=["quote-dot", "space"]
)
def test_the_admin_page_masks_a_password_with_a_quote_or_space(
    app, django_user_model, redis_client, password
):
    from django.contrib.auth.models import Permission
    from django.test import Client

    viewer = django_user_model.objects.create_user("viewer", password="x", is_staff=True)
    viewer.user_permissions.add(Permission.objects.get(codename="view_lease"))
    client = Client()
    client.force_login(viewer)
    set_settings(app, steplock_redis_url=SHAPED_URLS[1][0].format(password))
    response = client.get(reverse("admin:celery_steplock_lease_changelist"))
    assert response.status_code == 200 and response.context["store_error"]
    [shown] = [str(m) for m in response.context["messages"]]
    assert_masked(shown, "redis://")
    assert_masked(response.content.decode(), "redis://")


def test_a_worker_with_a_quote_in_its_password_exits_without_showing_it(worker_env):
    url = SHAPED_URLS[1][0].format(PASSWORD_SHAPES["quote-dot"])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "django_app",
            "worker",
            "-l",
            "INFO",
            "-P",
            "solo",
            "--without-mingle",
            "--without-gossip",
        ],
        env={**worker_env, "STEPLOCK_REDIS_URL": url},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "event=improperly_configured id=celery_steplock.E003" in output
    assert_masked(output, "redis://", "@h:bad/0")


@pytest.mark.parametrize(
    "password", [PASSWORD_SHAPES[k] for k in ("quote-dot", "space")], ids=["quote-dot", "space"]
)
def test_the_demo_masks_a_password_with_a_quote_or_space(
    private_redis, monkeypatch, capsys, password
):
    admin = make_client(private_redis.url)
    admin.config_set("requirepass", password)
    admin.close()
    url = f"redis://:{password}@127.0.0.1:{private_redis.port}/0"
    monkeypatch.setenv("REDIS_URL", url)
    demo_module = load_demo()
    demo = demo_module.Demo(demo_module.parse_args([]))
    demo.start_redis()
    try:
        assert demo.redis.ping() is True
    finally:
        demo.redis.close()
    assert_masked(
        capsys.readouterr().out, "using REDIS_URL=redis://:***@", f"127.0.0.1:{private_redis.port}"
    )
    for shape in PASSWORD_SHAPES.values():
        other = f"redis://:{shape}@127.0.0.1:{private_redis.port}/0"
        assert_masked(
            demo_module.safe(f"demo: FAILED: ConnectionError: {other!r}"),
            "demo: FAILED",
            f"127.0.0.1:{private_redis.port}",
        )


# -- a setting value quoted in an error raised where no worker start validates it ------------------


def _eager_task():
    from django_app.celery import app as celery_app

    from celery_steplock import StepLockedTask

    name = "tests.redact.eager"
    if name not in celery_app.tasks:

        @celery_app.task(bind=True, base=StepLockedTask, name=name)
        def eager(self):
            return "done"

    return celery_app.tasks[name]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "url",
    [f"redis:/:{PW}@h", f"redis:{PW}@h", f"redis:/{PW}@h:1/0", f"redis:/:{PW[:5]}'.{PW[5:]}@h"],
    ids=["one-slash", "no-slash", "user-no-slash", "quote"],
)
def test_an_eager_task_stores_no_password_of_a_malformed_url(app, redis_client, url):
    task = _eager_task()
    set_settings(app, steplock_redis_url=url)
    result = task.apply()
    assert result.failed()
    assert isinstance(result.result, ImproperlyConfigured)
    assert_masked(str(result.result), "steplock_redis_url", "@h")
    assert_masked(repr(result.result), "steplock_redis_url")
    assert_masked(result.traceback, "ImproperlyConfigured", "@h")


# -- masks values, never names --------------------------------------------------------------------


def test_a_setting_named_secret_keeps_its_name():
    text = (
        "Invalid celery-steplock setting steplock_name_secret: steplock_name_secret "
        "(CELERY_STEPLOCK_NAME_SECRET in Django settings) must be 32 to 4096 long"
    )
    assert redact(text) == text
    assert redact("steplock_name_secret=hunter22 db=1") == "steplock_name_secret=*** db=1"
    assert redact("password: password") == "password: password"
