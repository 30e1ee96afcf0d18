"""``celery -A django_app steplock ...`` (celery_steplock.cli) run as real subprocesses through
Celery's ``celery.commands`` entry point, against the session's Redis and the test database."""

import json
import os
import subprocess
import sys

import pytest

from celery_steplock.lock import get_lease_store, make_client
from django_app.workflows.models import Step
from helpers import UNREADABLE_NAME, closed_port_url, free_port, write_hostile_leases

# The database holds at most audit rows here: one pass (db_incidental).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.db_incidental]

GHOST = "ghost@nowhere.invalid"


@pytest.fixture
def cli(worker_env, app):
    """``cli(*args, **env) -> CompletedProcess`` of ``celery -A django_app steplock *args``."""

    def run(*args, **env):
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "django_app", "steplock", *args],
            env={**worker_env, **env},
            cwd=worker_env["PYTHONPATH"],
            capture_output=True,
            text=True,
            timeout=120,
        )

    return run


@pytest.fixture
def lease_store(app, redis_client):
    return get_lease_store(app)


def take(lock, name, **meta):
    lease = lock.acquire(
        name,
        ttl=60.0,
        metadata={"task_name": "proj.tasks.charge", "task_id": "1234abcd-task", **meta},
    )
    assert lease is not None
    return lease


def test_ls_lists_held_leases(cli, lease_store):
    empty = cli("ls")
    assert empty.returncode == 0, empty.stderr
    assert "no lease held" in empty.stdout
    first = take(lease_store, "order:1", worker="w1@host", pid=11, step="shop.order:1")
    take(lease_store, "order:2", worker="w2@host", pid=22)
    take(lease_store, "other:9")

    table = cli("ls")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["NAME", "OWNER", "FENCE"]
    assert [line.split()[0] for line in lines[1:4]] == ["order:1", "order:2", "other:9"]
    row = lines[1]
    assert first.owner[:12] in row and str(first.fence) in row and "charge" in row
    assert "w1@host" in row and "shop.order:1" in row and "1234abcd" in row
    assert lines[-1] == "3 lease(s)"

    listed = json.loads(cli("ls", "--json", "--match", "order:*").stdout)
    assert [lease["name"] for lease in listed] == ["order:1", "order:2"]
    assert listed[0]["owner"] == first.owner and listed[0]["fence"] == first.fence
    assert 0 <= listed[0]["age"] < 60 and 0 < listed[0]["ttl"] <= 60

    limited = cli("ls", "--limit", "1")
    assert limited.returncode == 0
    assert len(limited.stdout.splitlines()) == 3  # header, one row, footer
    assert "more not shown (--limit 1)" in limited.stdout


def test_show_prints_one_lease(cli, lease_store):
    lease = take(lease_store, "order:1", worker="w1@host", pid=11)
    shown = cli("show", "order:1")
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert fields["owner"] == lease.owner and fields["fence"] == str(lease.fence)
    assert fields["worker"] == "w1@host" and fields["key"] == "steplock:lease:{order:1}"
    as_json = json.loads(cli("show", "order:1", "--json").stdout)
    assert as_json["owner"] == lease.owner and as_json["pid"] == 11
    missing = cli("show", "order:404")
    assert missing.returncode == 1 and "no lease named 'order:404'" in missing.stderr


def test_release_is_owner_checked(cli, lease_store):
    lease = take(lease_store, "order:1")
    refused = cli("release", "order:1", "--owner", "not-the-owner")
    assert refused.returncode == 1
    assert f"held by another owner ({lease.owner})" in refused.stderr
    assert lease_store.inspect("order:1")["owner"] == lease.owner  # untouched
    released = cli("release", "order:1", "--owner", lease.owner)
    assert released.returncode == 0, released.stderr
    assert f"released 'order:1' (owner {lease.owner}" in released.stdout
    assert lease_store.inspect("order:1") is None
    again = cli("release", "order:1", "--owner", lease.owner)
    assert again.returncode == 1 and "it is not held" in again.stderr
    assert cli("release", "order:1").returncode == 2  # --owner is required (usage error)


def test_reap_dry_run_then_reap(cli, lease_store, redis_client):
    dead = take(lease_store, "step:dead", worker=GHOST, hostname="elsewhere.invalid", pid=1)
    now_s, now_us = redis_client.time()
    redis_client.hset(
        lease_store.key("step:dead"), "renewed_ms", now_s * 1000 + now_us // 1000 - 120_000
    )
    live = take(lease_store, "step:live", worker=GHOST, hostname="elsewhere.invalid", pid=1)
    orphan = Step.objects.create(name="orphan", status="running", lock_owner=dead.owner)
    held = Step.objects.create(name="held", status="running", lock_owner=live.owner)

    dry = cli("reap", "--dry-run", "--json", "--ping-timeout", "0.3")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] and report["ok"] and report["leases_scanned"] == 2
    assert [r["name"] for r in report["leases_reaped"]] == ["step:dead"]
    assert [r["pk"] for r in report["steps_recovered"]] == [orphan.pk]
    assert lease_store.inspect("step:dead") is not None
    orphan.refresh_from_db()
    assert orphan.status == "running"

    done = cli("reap", "--ping-timeout", "0.3")
    assert done.returncode == 0, done.stderr
    assert "reaped lease step:dead" in done.stdout
    assert f"recovered workflows.Step pk={orphan.pk}: running -> pending" in done.stdout
    for line in ("leases scanned: 2", "leases reaped: 1", "steps recovered: 1", "errors: 0"):
        assert line in done.stdout.splitlines()
    orphan.refresh_from_db()
    held.refresh_from_db()
    assert (orphan.status, orphan.lock_owner) == ("pending", "")
    assert (held.status, held.lock_owner) == ("running", live.owner)
    assert lease_store.inspect("step:live")["owner"] == live.owner

    again = cli("reap", "--json", "--ping-timeout", "0.3")
    assert again.returncode == 0
    report = json.loads(again.stdout)
    assert report["leases_reaped"] == [] and report["steps_recovered"] == []


def test_redis_down_exits_non_zero(cli):
    down = {"STEPLOCK_REDIS_URL": closed_port_url()}
    listing = cli("ls", **down)
    assert listing.returncode == 69 and "lock store unavailable" in listing.stderr
    reaping = cli("reap", "--json", **down)
    assert reaping.returncode == 1
    report = json.loads(reaping.stdout)
    assert not report["ok"] and "lease scan failed" in report["errors"][0]
    assert "error: lease scan failed" in reaping.stderr


# -- release is audited (issue 12, finding 3); corrupt leases (finding 5) -------------------


def test_release_is_audited_with_the_os_user_and_host(cli, lease_store):
    """With a Django project the record is a LeaseEvent row, committed before the delete,
    naming the OS user and this host; a refused release is recorded too."""
    import socket

    from celery_steplock.contrib.django.models import LeaseEvent

    lease = take(lease_store, "order:1")
    refused = cli("release", "order:1", "--owner", "not-the-owner")
    assert refused.returncode == 1
    released = cli("release", "order:1", "--owner", lease.owner)
    assert released.returncode == 0, released.stderr
    first, second = LeaseEvent.objects.filter(event="force_release").order_by("id")
    user, host = os_actor(), socket.gethostname()
    assert (first.outcome, first.owner, first.actor, first.actor_host, first.via) == (
        "held_by_another",
        "not-the-owner",
        user,
        host,
        "cli",
    )
    assert (
        second.outcome,
        second.owner,
        second.fence,
        second.actor,
        second.actor_host,
        second.via,
    ) == ("released", lease.owner, lease.fence, user, host, "cli")
    assert f"audit: LeaseEvent {second.pk}" in released.stdout
    assert f"force-released by {user}@{host} from the command line" in second.reason


def os_actor(env=None):
    """The actor the CLI records for a run with ``env`` (default: this process's)."""
    import pwd

    env = os.environ if env is None else env
    account = pwd.getpwuid(os.getuid()).pw_name
    claims = [
        f"{var}={env[var]}"
        for var in ("USER", "LOGNAME", "SUDO_USER")
        if env.get(var) and env[var] != account
    ]
    return f"{account} ({', '.join(claims)})" if claims else account


PLAIN_APP = """
import os
from celery import Celery

app = Celery("plain", broker=os.environ["REDIS_URL"])
app.conf.steplock_redis_url = os.environ["REDIS_URL"]
"""


def test_release_on_a_plain_celery_app_logs_the_record(worker_env, lease_store, tmp_path):
    """Without Django the audit record is the WARNING line on the celery_steplock logger:
    requested before the delete, then released, with the OS user and host."""
    import shlex
    import socket

    (tmp_path / "plainapp.py").write_text(PLAIN_APP)
    env = {k: v for k, v in worker_env.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{worker_env['PYTHONPATH']}"
    lease = take(lease_store, "order:1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "plainapp",
            "steplock",
            "release",
            "order:1",
            "--owner",
            lease.owner,
        ],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "audit: log line event=force_release_audit" in done.stdout
    lines = [
        shlex.split(line)
        for line in done.stderr.splitlines()
        if "event=force_release_audit" in line
    ]
    fields = [dict(token.split("=", 1) for token in line if "=" in token) for line in lines]
    assert [f["outcome"] for f in fields] == ["requested", "released"]
    for f in fields:
        assert (f["actor"], f["actor_host"], f["via"], f["name"], f["owner"], f["fence"]) == (
            os_actor(env),
            socket.gethostname(),
            "cli",
            "order:1",
            lease.owner,
            str(lease.fence),
        )
    assert lease_store.inspect("order:1") is None


def test_ls_and_show_survive_malformed_leases(cli, lease_store, redis_client):
    import redis

    good = take(lease_store, "order:1", pid=11)
    take(lease_store, "order:2", pid="9" * 40)
    redis_client.hset(lease_store.key("order:2"), "acquired_ms", "noon")
    kwargs = redis_client.connection_pool.connection_kwargs
    raw = redis.Redis(host=kwargs["host"], port=kwargs["port"], db=kwargs.get("db", 0))
    raw.hset(lease_store.key("order:3"), mapping={"owner": b"\xff\xfe", "fence": b"x"})
    raw.pexpire(lease_store.key("order:3"), 60000)
    raw.close()
    table = cli("ls")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["order:1", "order:2", "order:3"]
    assert lines[-2] == "3 lease(s)"
    assert lines[-1].startswith("2 malformed lease(s)") and '"order:2"' in lines[-1]
    assert good.owner[:12] in lines[1]
    listed = {lease["name"]: lease for lease in json.loads(cli("ls", "--json").stdout)}
    assert "malformed" not in listed["order:1"]
    assert "acquired_ms: not an integer" in listed["order:2"]["malformed"]
    assert "pid" not in listed["order:2"] and listed["order:2"]["age"] is None
    shown = cli("show", "order:3")
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines())
    assert fields["malformed"] == "fence: not an integer ('x'); owner: not UTF-8"
    assert json.loads(cli("show", "order:2", "--json").stdout)["malformed"].startswith(
        "acquired_ms"
    )


# -- no secret, no raw control character on the terminal ------------------------------------------

PW = "s3cr3t-Pw7f"
HOSTILE = "\x1b[2J\x1b[31mred\nFORGED 0 lease(s)\rOVER\u202e"


def no_raw_controls(text):
    """Nothing but printable characters and the line breaks of the output itself."""
    return all(c.isprintable() or c == "\n" for c in text) and "\x1b" not in text


@pytest.mark.parametrize(
    "command", [("ls",), ("show", "order:1"), ("release", "order:1", "--owner", "x")]
)
def test_errors_name_no_password(cli, command):
    url = f"redis+sentinel://:{PW}@sa:26379;redis+sentinel://:{PW}@sb:26380"
    refused = cli(*command, STEPLOCK_REDIS_URL=url)
    assert refused.returncode == 1, refused.stderr
    assert PW not in refused.stdout + refused.stderr and PW[:5] not in refused.stderr
    assert "redis+sentinel://:***@sa:26379;redis+sentinel://:***@sb:26380" in refused.stderr


def test_store_errors_name_no_password(cli, private_redis):
    admin = make_client(private_redis.url)
    admin.config_set("requirepass", PW)
    admin.close()
    wrong = f"redis://:{PW}-x@127.0.0.1:{private_redis.port}/0"
    refused = cli("ls", STEPLOCK_REDIS_URL=wrong)
    assert refused.returncode == 69, refused.stderr
    assert "authentication failed" in refused.stderr and PW not in refused.stderr


@pytest.mark.parametrize("shape", ["tcp", "unix"])
def test_unreachable_store_errors_name_no_password(cli, tmp_path, shape):
    url = (
        f"redis://app:{PW}@127.0.0.1:{free_port()}/0"
        if shape == "tcp"
        else f"unix://{tmp_path}/none.sock?password={PW}&db=0"
    )
    refused = cli("ls", STEPLOCK_REDIS_URL=url)
    assert refused.returncode == 69, refused.stderr
    assert "lock store unavailable" in refused.stderr and PW not in refused.stderr


def hostile_lease(lock, redis_client, name):
    """A lease acquired normally, then every field a reader prints overwritten by a real
    client with control characters, ANSI escapes and newlines."""
    lease = take(lock, name)
    redis_client.hset(
        lock.key(name),
        mapping={
            "owner": f"own{HOSTILE}",
            "task_name": f"proj.tasks.{HOSTILE}",
            "task_id": f"id{HOSTILE}",
            "worker": f"w{HOSTILE}",
            "pid": f"1{HOSTILE}",
            "step": f"st{HOSTILE}",
            f"evil{HOSTILE}": HOSTILE,
        },
    )
    return lease


def dead_hostile_lease(lock, redis_client, name):
    """:func:`hostile_lease` held by a worker nobody runs, last renewed two minutes ago: the
    reaper's to reap."""
    dead = hostile_lease(lock, redis_client, name)
    redis_client.hset(
        lock.key(name),
        mapping={"worker": GHOST, "hostname": "elsewhere.invalid", "pid": 1, "owner": dead.owner},
    )
    now_s, now_us = redis_client.time()
    redis_client.hset(lock.key(name), "renewed_ms", now_s * 1000 + now_us // 1000 - 120_000)
    return dead


def hostile_name(lock, redis_client, name):
    """The lease ``name`` moved to a key whose name holds control characters: the API refuses
    such names (LockNameError), so only a Redis user writing keys by hand can make one."""
    hostile = f"order:{HOSTILE}"
    redis_client.rename(lock.key(name), lock.key(hostile))
    return hostile


ESCAPED = "\\x1b[2J\\x1b[31mred\\nFORGED 0 lease(s)\\rOVER\\u202e"


def test_show_and_ls_escape_what_redis_holds(cli, lease_store, redis_client):
    hostile_lease(lease_store, redis_client, "order:1")
    fields = len(lease_store.inspect("order:1")) + 2  # + age and renewed_ago

    shown = cli("show", "order:1")
    assert shown.returncode == 0, shown.stderr
    assert no_raw_controls(shown.stdout)
    lines = shown.stdout.splitlines()
    assert len(lines) == fields  # one line per field, none forged
    assert not any(line.startswith(("FORGED", "OVER", "red")) for line in lines)
    by_key = dict(line.split(None, 1) for line in lines)
    assert by_key["worker"] == f"w{ESCAPED}" and by_key["owner"] == f"own{ESCAPED}"
    assert f"evil{ESCAPED}" in shown.stdout

    hostile_lease(lease_store, redis_client, "order:2")
    name = hostile_name(lease_store, redis_client, "order:2")
    listed = cli("ls")
    assert listed.returncode == 0, listed.stderr
    assert no_raw_controls(listed.stdout)
    lines = listed.stdout.splitlines()
    assert lines[0].startswith("NAME") and "2 lease(s)" in lines
    assert not any(line.startswith(("FORGED", "OVER", "red")) for line in lines)
    [row] = [line for line in lines if line.startswith(f"order:{ESCAPED}")]
    assert f"w{ESCAPED}" in row and f"st{ESCAPED}" in row

    as_json = cli("ls", "--json")  # JSON escapes them itself, and keeps the values exact
    assert no_raw_controls(as_json.stdout) and len(as_json.stdout.splitlines()) == 1
    assert {lease["name"] for lease in json.loads(as_json.stdout)} == {"order:1", name}

    refused = cli("show", name)  # a name the API refuses: an escaped error, nothing forged
    assert refused.returncode != 0 and no_raw_controls(refused.stderr)
    assert not any(line.startswith(("FORGED", "OVER")) for line in refused.stderr.splitlines())


def test_release_and_reap_escape_what_redis_holds(cli, lease_store, redis_client):
    name = "step:1"
    hostile_lease(lease_store, redis_client, name)
    refused = cli("release", name, "--owner", "not-the-owner")
    assert refused.returncode == 1
    assert no_raw_controls(refused.stderr)
    assert "held by another owner (own\\x1b[2J" in refused.stderr
    # An owner token the API refuses (unprintable): the release fails, escaped, and is audited.
    failed = cli("release", name, "--owner", f"own{HOSTILE}")
    assert failed.returncode != 0 and no_raw_controls(failed.stdout + failed.stderr)
    assert "owner must be a non-empty string" in failed.stderr
    assert not any(line.startswith(("FORGED", "OVER")) for line in failed.stderr.splitlines())
    assert lease_store.inspect(name) is not None
    redis_client.hset(lease_store.key(name), "owner", "plain-owner")
    released = cli("release", name, "--owner", "plain-owner")
    assert released.returncode == 0, released.stderr
    assert no_raw_controls(released.stdout) and len(released.stdout.splitlines()) == 1

    dead_hostile_lease(lease_store, redis_client, name)
    reaped = cli("reap", "--ping-timeout", "0.3")
    assert reaped.returncode == 0, reaped.stderr
    assert no_raw_controls(reaped.stdout)
    assert f"reaped lease {name} (owner " in reaped.stdout and "task \\x1b[2J" in reaped.stdout
    assert not any(line.startswith(("FORGED", "OVER")) for line in reaped.stdout.splitlines())
    assert lease_store.inspect(name) is None


def test_the_reap_command_escapes_what_redis_holds(lease_store, redis_client):
    """``manage.py reap_expired_leases`` prints the same report lines as ``steplock reap``."""
    import io

    from django.core.management import call_command

    name = "step:1"
    dead_hostile_lease(lease_store, redis_client, name)
    out = io.StringIO()
    call_command("reap_expired_leases", "--ping-timeout", "0.3", stdout=out)
    assert no_raw_controls(out.getvalue())
    lines = out.getvalue().splitlines()
    reaped = [line for line in lines if line.startswith("reaped lease ")]
    assert len(reaped) == 1
    assert reaped[0].startswith(f"reaped lease {name} (owner ")
    assert "task \\x1b[2J" in reaped[0]  # the task name's last dotted part, escaped
    assert not any(line.startswith(("FORGED", "OVER")) for line in lines)
    assert lease_store.inspect(name) is None


# -- the operator recorded, and no record no release ---------------------------------------------


def test_release_records_the_os_account_not_a_forged_user(cli, lease_store):
    """$USER / $LOGNAME / $SUDO_USER can be set by anyone: the actor is the passwd account of
    the process's uid, with those variables after it as claims."""
    import pwd

    from celery_steplock.contrib.django.models import LeaseEvent

    account = pwd.getpwuid(os.getuid()).pw_name
    lease = take(lease_store, "order:1")
    released = cli(
        "release",
        "order:1",
        "--owner",
        lease.owner,
        USER="ceo",
        LOGNAME=account,
        SUDO_USER="alice",
    )
    assert released.returncode == 0, released.stderr
    [event] = LeaseEvent.objects.filter(event="force_release")
    assert event.actor == f"{account} (USER=ceo, SUDO_USER=alice)"
    assert event.reason.startswith(f"force-released by {account} (USER=ceo, SUDO_USER=alice)@")
    second = take(lease_store, "order:2")
    plain = cli(
        "release", "order:2", "--owner", second.owner, USER=account, LOGNAME=account, SUDO_USER=""
    )
    assert plain.returncode == 0, plain.stderr
    assert LeaseEvent.objects.get(event="force_release", name="order:2").actor == account


QUIET_APP = (
    PLAIN_APP
    + """
import logging
logging.getLogger("celery_steplock").setLevel(logging.ERROR)
"""
)

FAILING_AUDIT_APP = (
    PLAIN_APP
    + f"""
from celery_steplock import ops


def requested(self, record):
    raise RuntimeError("audit store redis://:{PW}@audit-db:6379/0 said {HOSTILE!r}")


ops.LogAudit.requested = requested
"""
)


def run_plain(worker_env, tmp_path, source, *args, **extra):
    (tmp_path / "plainapp.py").write_text(source)
    env = {k: v for k, v in worker_env.items() if k != "DJANGO_SETTINGS_MODULE"}
    env["PYTHONPATH"] = f"{tmp_path}{os.pathsep}{worker_env['PYTHONPATH']}"
    env.update(extra)
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "plainapp", "steplock", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_release_on_a_quiet_plain_app_is_refused(worker_env, lease_store, tmp_path):
    """No record, no release: with the celery_steplock logger at ERROR the log line would
    not be written, so nothing is released and the message names the logger."""
    lease = take(lease_store, "order:1")
    done = run_plain(worker_env, tmp_path, QUIET_APP, "release", "order:1", "--owner", lease.owner)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not released: 'order:1': the audit record could not be written" in done.stderr
    assert "'celery_steplock' logger does not emit WARNING lines" in done.stderr
    assert "audit: log line" not in done.stdout
    assert lease_store.inspect("order:1")["owner"] == lease.owner


def test_a_failed_audit_write_is_shown_masked_and_escaped(worker_env, lease_store, tmp_path):
    lease = take(lease_store, "order:1")
    done = run_plain(
        worker_env, tmp_path, FAILING_AUDIT_APP, "release", "order:1", "--owner", lease.owner
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "the audit record could not be written (audit store redis://:***@audit-db:6379/0"
        in done.stderr
    )
    assert PW not in done.stdout + done.stderr
    assert no_raw_controls(done.stdout + done.stderr)
    assert lease_store.inspect("order:1")["owner"] == lease.owner


BROKEN_SETTINGS = f"""
raise RuntimeError("settings read redis://:{PW}@cache-1:6379/0 {HOSTILE!r}".encode().decode(
    "unicode_escape"))
"""


def test_a_django_load_failure_is_shown_masked_and_escaped(worker_env, lease_store, tmp_path):
    (tmp_path / "brokensettings.py").write_text(BROKEN_SETTINGS)
    lease = take(lease_store, "order:1")
    done = run_plain(
        worker_env,
        tmp_path,
        PLAIN_APP,
        "release",
        "order:1",
        "--owner",
        lease.owner,
        DJANGO_SETTINGS_MODULE="brokensettings",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not released: could not load the app's modules" in done.stderr
    assert "RuntimeError: settings read redis://:***@cache-1:6379/0" in done.stderr
    assert PW not in done.stdout + done.stderr
    assert no_raw_controls(done.stdout + done.stderr)
    assert lease_store.inspect("order:1")["owner"] == lease.owner


def test_ls_and_show_survive_a_deep_meta_and_a_key_that_is_not_utf8(
    cli, lease_store, redis_client
):
    take(lease_store, "order:1", pid=11)
    raw, _ = write_hostile_leases(redis_client, lease_store, "order:deep")
    raw.close()
    table = cli("ls")
    assert table.returncode == 0, table.stderr
    assert "\x1b" not in table.stdout and table.stdout.splitlines()[-2] == "3 lease(s)"
    listed = {lease["name"]: lease for lease in json.loads(cli("ls", "--json").stdout)}
    assert sorted(listed) == ["order:1", "order:deep", UNREADABLE_NAME]
    assert listed["order:deep"]["malformed"].startswith("meta: not a JSON object (")
    assert listed["order:deep"]["owner"] == "b" * 32
    assert listed[UNREADABLE_NAME]["malformed"] == "key: not UTF-8 (cannot be read back)"
    shown = cli("show", "order:deep", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["malformed"].startswith("meta: not a JSON object (")


# -- issue 29: typed JSON, breaker ls, one reap summary, --help lists every command ------------


def test_json_numbers_are_numbers(cli, lease_store, redis_client):
    """``ls --json`` and ``show --json``: the integer fields are JSON numbers, the seconds
    numbers (not strings), metadata entries strings as stored."""
    lease = take(lease_store, "order:1", worker="w1@host", pid=11, step="shop.order:1")
    stored = redis_client.hgetall(lease_store.key("order:1"))
    acquired, renewed = int(stored["acquired_ms"]), int(stored["renewed_ms"])
    [listed] = json.loads(cli("ls", "--json").stdout)
    shown = json.loads(cli("show", "order:1", "--json").stdout)
    for row in (listed, shown):
        assert (row["fence"], row["pid"], "retries" in row) == (lease.fence, 11, False)
        assert (row["acquired_ms"], row["renewed_ms"], row["ttl_ms"]) == (
            acquired,
            renewed,
            60_000,
        )
        for key in ("fence", "pid", "acquired_ms", "renewed_ms", "ttl_ms"):
            assert type(row[key]) is int, key
        for key in ("ttl", "age", "renewed_ago"):
            assert type(row[key]) is float, key
        assert 0 < row["ttl"] <= 60.0 and 0 <= row["age"] < 60.0
        assert (row["worker"], row["step"], row["task_id"]) == (
            "w1@host",
            "shop.order:1",
            "1234abcd-task",
        )


def test_a_slots_limit_is_a_number(cli, lease_store):
    take(lease_store, "slot:1", kind="slot", limit=3, limit_key="api")
    [row] = json.loads(cli("ls", "--json").stdout)
    assert (row["kind"], row["limit"], row["limit_key"]) == ("slot", 3, "api")


def test_help_lists_every_command_with_one_line(cli):
    """``celery steplock --help`` and ``breaker --help``: every command, each with its whole
    one-line summary (none cut with "...")."""
    from celery_steplock.cli import breaker_group, steplock

    def listed(*args):
        out = cli(*args, "--help")
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        commands = lines[lines.index("Commands:") + 1 :]
        return {line.split(None, 1)[0]: line.split(None, 1)[1] for line in commands}

    top = listed()
    assert top == {name: cmd.short_help for name, cmd in steplock.commands.items()}
    assert sorted(top) == ["breaker", "history", "ls", "reap", "release", "show"]
    assert top["breaker"] == "Circuit breakers: ls, show, open, close."
    inner = listed("breaker")
    assert inner == {name: cmd.short_help for name, cmd in breaker_group.commands.items()}
    assert sorted(inner) == ["close", "ls", "open", "show"]
    assert not any("..." in text for text in (*top.values(), *inner.values()))


def test_breaker_ls_lists_the_tasks_and_redis_breakers(cli, app, redis_client):
    """``breaker ls``: the breaker a task names (never used: closed, zero counts), those Redis
    holds, a forced one, and a key that names no possible breaker, below the table."""
    from celery_steplock.patterns.breaker import CircuitBreaker
    from django_app.faults.patterns import BREAKER_NAME

    payments = CircuitBreaker("payments", app=app, failure_threshold=2, window=4)
    for _ in range(2):
        with pytest.raises(RuntimeError):
            payments.call(_fail)
    CircuitBreaker("search", app=app).override("open")
    redis_client.hset("steplock:breaker:{bad{name}", "state", "closed")

    as_json = cli("breaker", "ls", "--json")
    assert as_json.returncode == 0, as_json.stderr
    rows = {row["name"]: row for row in json.loads(as_json.stdout)}
    assert sorted(rows) == sorted([BREAKER_NAME, "bad{name", "payments", "search"])
    assert rows[BREAKER_NAME] == {
        "name": BREAKER_NAME,
        "key": f"steplock:breaker:{{{BREAKER_NAME}}}",
        "state": "closed",
        "forced": False,
        "failures": 0,
        "calls": 0,
        "successes": 0,
        "probes": 0,
        "generation": 0,
        "opened_ago": None,
        "malformed": "",
    }
    pay = rows["payments"]
    # Opening empties the window: a new generation, its counts from zero.
    assert (pay["state"], pay["forced"], pay["failures"], pay["calls"], pay["generation"]) == (
        "open",
        False,
        0,
        0,
        1,
    )
    assert type(pay["opened_ago"]) is float and 0 <= pay["opened_ago"] < 60
    assert (rows["search"]["state"], rows["search"]["forced"]) == ("open", True)
    assert rows["bad{name"]["key"] == "steplock:breaker:{bad{name}"
    assert rows["bad{name"]["malformed"].startswith("name: ")
    assert set(rows["bad{name"]) == {"name", "key", "malformed"}

    table = cli("breaker", "ls")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "NAME",
        "STATE",
        "FORCED",
        "FAILURES",
        "CALLS",
        "PROBES",
        "OPENED",
        "AGO",
    ]
    by_name = {line.split()[0]: line.split() for line in lines[1:5]}
    assert by_name[BREAKER_NAME][1:] == ["closed", "no", "0", "0", "0", "-"]
    assert by_name["payments"][1:6] == ["open", "no", "0", "0", "0"]
    assert by_name["search"][1:3] == ["open", "yes"]
    assert lines[5] == "4 circuit breaker(s)"
    assert lines[6].startswith("malformed bad{name: name: ")

    limited = json.loads(cli("breaker", "ls", "--json", "--limit", "1").stdout)
    assert len(limited) == 1


def _fail():
    raise RuntimeError("dependency down")


def test_breaker_ls_with_redis_down_exits_69(cli):
    down = cli("breaker", "ls", STEPLOCK_REDIS_URL=closed_port_url())
    assert down.returncode == 69 and "unavailable" in down.stderr


def test_both_reap_commands_print_one_summary(cli):
    """``celery steplock reap`` and ``manage.py reap_expired_leases``: the same lines
    (ReapReport.human_lines), but the run's duration."""
    import io

    from django.core.management import call_command

    from_cli = cli("reap", "--ping-timeout", "0.3")
    assert from_cli.returncode == 0, from_cli.stderr
    out = io.StringIO()
    call_command("reap_expired_leases", "--ping-timeout", "0.3", stdout=out)
    cli_lines, command_lines = from_cli.stdout.splitlines(), out.getvalue().splitlines()
    assert cli_lines[:3] == ["leases scanned: 0", "leases reaped: 0", "steps recovered: 0"]
    assert cli_lines[:-1] == command_lines[:-1]
    assert cli_lines[-1].startswith("duration: ") and command_lines[-1].startswith("duration: ")
