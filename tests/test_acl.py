"""The lease store and StepLockedTask as a least-privilege Redis ACL user (tests/support/acl.py),
and as users that lack a permission or log in wrongly: those are configuration errors
(LockStoreMisconfigured), never outages, and no script leaves half of its writes behind."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis
from django.contrib.admin.models import DELETION, LogEntry
from django.test import Client
from django.urls import reverse

from celery_steplock._redis import wire as _wire
from celery_steplock import signals
from celery_steplock.patterns.concurrency import ConcurrencyLimit
from celery_steplock.contrib.django.leases import lease_page
from celery_steplock.exceptions import (
    LockContended,
    LockError,
    LockStoreMisconfigured,
    LockStoreUnavailable,
)
from celery_steplock.heartbeat import get_heartbeat
from celery_steplock.lock import (
    RedisLeaseStore,
    get_lease_store,
    holder_metadata,
    make_client,
    store_error,
)
from celery_steplock.ops import force_release
from celery_steplock.reaper import reap
from celery_steplock.task import StepLockedTask
from django_app.celery import app as celery_app
from django_app.workflows.models import Step
from tests.support import acl, servers

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis_shape]

ROOT = Path(__file__).resolve().parent.parent
BODY_RUNS: list = []
GHOST = "ghost@nowhere.invalid"


@celery_app.task(
    bind=True,
    base=StepLockedTask,
    name="tests.acl_finish",
    lock_key="acl:{step_id}",
    step_model="workflows.Step",
    step_id_arg="step_id",
    transition=("pending", "done"),
    on_contended="raise",
)
def acl_finish(self, step_id, hold=0.0):
    BODY_RUNS.append(step_id)
    if hold:
        time.sleep(hold)
    return {
        "owner": self.lease.owner if self.lease else None,
        "fence": self.lease.fence if self.lease else None,
    }


@pytest.fixture
def admin(acl_server):
    """The default (all-powerful) user of the module's server, on a flushed database."""
    client = make_client(acl_server.url)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def user_url(acl_server, admin):
    """URL of the least-privilege user (prefix ``steplock``)."""
    return acl.create_user(acl_server)


@pytest.fixture
def store(user_url):
    client = make_client(user_url)
    yield RedisLeaseStore(client)
    client.close()


@pytest.fixture
def as_user(app, user_url):
    """The app's steplock settings pointed at the least-privilege user."""
    BODY_RUNS.clear()
    app.conf.steplock_redis_url = user_url
    app.conf.steplock_retry_backoff = 0.01
    return app


def names(events):
    return [name for name, _ in events]


# -- the documented ACL ------------------------------------------------------------------------


def test_the_docs_give_the_acl_the_tests_use():
    line = acl.acl_setuser_line()
    assert line in (ROOT / "docs" / "acl.md").read_text()
    assert "resetchannels" in line and "~steplock:*" in line and "-@all" in line


def test_the_user_has_no_channel_and_no_other_key(user_url, admin):
    fields = admin.acl_getuser("steplock")
    assert not fields["channels"]  # "" or [] depending on the server's version
    user = make_client(user_url)
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.publish("steplock:released:{x}", "1")
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.set("other:key", "1")
    finally:
        user.close()


# -- the lock store as that user -----------------------------------------------------------


def test_lock_cycle_as_the_user(store, admin, events):
    lease = store.acquire("a", ttl=30.0, metadata={"task_name": "tests.fake"})
    assert lease is not None and lease.fence > 0
    refused, holder, ttl = store.try_acquire("a", "other", 30.0)
    assert refused is None and holder == lease.owner and 0 < ttl <= 30.0
    assert store.extend("a", lease.owner, 40.0) is True
    assert store.extend_many([("a", lease.owner, 50.0), ("gone", "x", 5.0)]) == [True, False]
    assert 40.0 < store.owned("a", lease.owner) <= 50.0
    assert store.inspect("a")["owner"] == lease.owner
    assert [info["name"] for info in store.iter_leases()] == ["a"]
    assert store.release("a", lease.owner) is True
    assert store.inspect("a") is None
    assert admin.keys("steplock:lease:*") == []


def test_a_waiter_is_woken_by_a_release_as_the_user(store, admin):
    holder = store.acquire("w", ttl=60.0)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(store.acquire("w", "waiter", 60.0, wait=20.0))
    )
    waiter.start()
    servers.wait_until(
        lambda: admin.zscore("steplock:waiters:{w}", "waiter") is not None,
        timeout=10,
        interval=0.005,
        what="the waiter to register",
    )
    released_at = time.monotonic()
    assert store.release("w", holder.owner) is True
    waiter.join(30)
    assert got and got[0] is not None and got[0].owner == "waiter"
    assert got[0].fence > holder.fence
    # Woken by the wake-up list, long before the holder's TTL (60 s) or its own deadline.
    assert time.monotonic() - released_at < 10.0


def test_renewal_by_the_heartbeat_as_the_user(store):
    lease = store.acquire("hb", ttl=0.6)
    hb = get_heartbeat()
    hb.register(lease, store, ratio=1 / 3)
    try:
        time.sleep(1.5)  # 2.5 TTLs: held only if renewed
        assert not lease.lost
        assert store.owned("hb", lease.owner) is not None
    finally:
        hb.unregister(lease)
    assert store.release("hb", lease.owner) is True


def test_reap_scan_and_admin_page_as_the_user(app, user_url, store, admin, events):
    app.conf.steplock_redis_url = user_url
    lease = store.acquire(
        "ghostly",
        ttl=60.0,
        metadata={
            "task_id": "t-1",
            "task_name": "tests.fake",
            "worker": GHOST,
            "hostname": "elsewhere.invalid",
            "pid": "4242",
        },
    )
    keep = store.acquire("kept", ttl=60.0, metadata={"task_name": "tests.fake"})
    page = lease_page(store, 0, 50)
    assert sorted(info["name"] for info in page.leases) == ["ghostly", "kept"]
    assert page.db_keys == admin.dbsize()
    now_s, now_us = admin.time()
    admin.hset(store.key("ghostly"), "renewed_ms", now_s * 1000 + now_us // 1000 - 60000)
    got = []
    waiter = threading.Thread(
        target=lambda: got.append(store.acquire("ghostly", "waiter", 60.0, wait=20.0))
    )
    waiter.start()
    servers.wait_until(
        lambda: admin.zscore("steplock:waiters:{ghostly}", "waiter") is not None,
        timeout=10,
        interval=0.005,
        what="the waiter to register",
    )
    reaped_at = time.monotonic()
    report = reap(app, ping_timeout=0.3, lock=store)
    assert report.ok, report.errors
    assert [r["name"] for r in report.leases_reaped] == ["ghostly"]
    waiter.join(30)
    # The reap woke the waiter (the dead holder's TTL had 60 s left).
    assert got and got[0] is not None and got[0].owner == "waiter"
    assert time.monotonic() - reaped_at < 10.0
    assert store.inspect("ghostly")["owner"] == "waiter"
    assert store.inspect("kept")["owner"] == keep.owner
    assert ("lock_expired", lease.owner) in [(n, kw.get("owner")) for n, kw in events]


def test_force_release_with_its_record_as_the_user(store, events):
    lease = store.acquire("f", ttl=60.0, metadata={"task_name": "tests.fake"})
    records = []
    released = force_release(store, "f", lease.owner, actor="ops", audit=records.append)
    assert [r.owner for r in records] == [lease.owner] and released.fence == lease.fence
    assert store.inspect("f") is None
    [(name, kw)] = [(n, kw) for n, kw in events if n == "lock_released"]
    assert kw["forced"] is True and kw["owner"] == lease.owner


def test_admin_force_release_writes_its_log_entry_as_the_user(as_user, django_user_model, events):
    from django.contrib.auth.models import Permission

    store = get_lease_store(as_user)
    lease = store.acquire(
        "step:9", ttl=60.0, metadata=holder_metadata("t-9", acl_finish.name, 0, worker="w1@box")
    )
    user = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    for codename in ("view_lease", "force_release_lease"):
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="celery_steplock", codename=codename)
        )
    client = Client()
    client.force_login(user)
    listing = client.get(reverse("admin:celery_steplock_lease_changelist"))
    assert listing.status_code == 200
    assert [r["lease"].name for r in listing.context["rows"]] == ["step:9"]
    response = client.post(
        reverse("admin:celery_steplock_lease_release"), {"name": "step:9", "owner": lease.owner}
    )
    assert response.status_code == 302
    assert store.inspect("step:9") is None
    [entry] = LogEntry.objects.filter(action_flag=DELETION)
    assert (
        lease.owner in entry.change_message
        or lease.owner in entry.object_repr
        or "step:9" in entry.object_repr
    )
    released = [kw for n, kw in events if n == "lock_released"]
    assert [(kw["owner"], kw["forced"]) for kw in released] == [(lease.owner, True)]


# -- StepLockedTask as that user --------------------------------------------------------------


def test_task_commits_and_releases_as_the_user(as_user, admin, events):
    step = Step.objects.create(name="s")
    result = acl_finish.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    step.refresh_from_db()
    assert step.status == "done" and step.lock_fence == result.result["fence"]
    assert names(events) == ["lock_acquired", "transition_applied", "lock_released"]
    assert admin.exists(f"steplock:lease:{{acl:{step.pk}}}") == 0


def test_task_contended_and_waiting_as_the_user(as_user, events):
    store = get_lease_store(as_user)
    step = Step.objects.create(name="s")
    holder = store.acquire(f"acl:{step.pk}", ttl=60.0)
    result = acl_finish.apply(args=(step.pk,))
    assert isinstance(result.result, LockContended) and BODY_RUNS == []
    acl_finish.lock_wait = 20.0
    try:
        timer = threading.Timer(0.3, store.release, args=(f"acl:{step.pk}", holder.owner))
        timer.start()
        result = acl_finish.apply(args=(step.pk,))
        timer.join()
    finally:
        acl_finish.lock_wait = None
    assert result.successful(), result.traceback
    assert result.result["fence"] > holder.fence and BODY_RUNS == [step.pk]


def test_task_renewed_past_its_ttl_as_the_user(as_user, events):
    acl_finish.lock_ttl = 0.6
    try:
        step = Step.objects.create(name="s")
        result = acl_finish.apply(args=(step.pk,), kwargs={"hold": 1.5})
    finally:
        acl_finish.lock_ttl = None
    assert result.successful(), result.traceback
    assert "lock_extended" in names(events) and "lock_lost" not in names(events)
    assert Step.objects.get(pk=step.pk).status == "done"


# -- the patterns as that user: tests/patterns/test_topologies.py ([acl]) --------------------


def test_a_pattern_without_one_of_its_commands_is_refused_before_it_writes(acl_server, admin):
    client = make_client(acl.create_user(acl_server, without=["zrank"]))
    try:
        with pytest.raises(LockStoreMisconfigured) as caught:
            with ConcurrencyLimit(2, ttl=30.0).acquire("bh", client=client):
                pytest.fail("acquired without ZRANK")
    finally:
        client.close()
    exc = caught.value
    assert exc.setting == "steplock_redis_url"
    assert exc.permissions == ("zrank steplock:waiters:{steplock-acl-probe}",)
    assert "+zrank" in str(exc) and "docs/acl.md" in str(exc)
    assert admin.dbsize() == 0  # no slot, no queue entry, no probe key


# -- missing permissions: configuration errors, nothing half-done ----------------------------


def test_missing_command_is_named_before_anything_is_written(acl_server, admin):
    url = acl.create_user(acl_server, without=["hset"])
    store = RedisLeaseStore(make_client(url))
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("m", ttl=30.0)
    exc = caught.value
    assert exc.setting == "steplock_redis_url"
    assert "hset steplock:lease:{steplock-acl-probe}" in exc.permissions
    assert "+hset" in str(exc) and "docs/acl.md" in str(exc)
    assert not isinstance(exc, LockStoreUnavailable)
    assert admin.dbsize() == 0  # the probe's keys are gone; no fencing counter, no lease


def test_missing_key_pattern_is_refused_before_anything_is_written(acl_server, admin):
    url = acl.create_user(
        acl_server, keys=["steplock:lease:*", "steplock:waiters:*", "steplock:wake:*"]
    )
    store = RedisLeaseStore(make_client(url))
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("m", ttl=30.0)
    assert caught.value.setting == "steplock_redis_url"
    assert admin.dbsize() == 0


def test_missing_evalsha_names_it(acl_server, admin):
    url = acl.create_user(acl_server, without=["evalsha"])
    with pytest.raises(LockStoreMisconfigured) as caught:
        RedisLeaseStore(make_client(url)).acquire("m", ttl=30.0)
    assert caught.value.permissions == ("evalsha",)
    assert admin.dbsize() == 0


def test_missing_blpop_refuses_the_wait_and_leaves_no_waiter(acl_server, admin):
    url = acl.create_user(acl_server, without=["blpop"])
    store = RedisLeaseStore(make_client(url))
    holder = store.acquire("b", ttl=30.0)
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("b", "waiter", 30.0, wait=5.0)
    assert caught.value.permissions == ("blpop",)
    assert admin.exists("steplock:waiters:{b}") == 0
    assert store.inspect("b")["owner"] == holder.owner


def test_a_permission_revoked_later_leaves_the_lease_as_it_was(acl_server, admin):
    url = acl.create_user(acl_server)
    store = RedisLeaseStore(make_client(url))
    holder = store.acquire("r", ttl=30.0)
    waiter = RedisLeaseStore(make_client(url))
    assert waiter.try_acquire("r", "waiter", 30.0, wait=10.0)[0] is None  # it waits
    acl.create_user(acl_server, without=["rpush"])  # revoked after the probe passed
    with pytest.raises(LockStoreMisconfigured):
        store.release("r", holder.owner)
    assert store.inspect("r")["owner"] == holder.owner  # the refused release deleted nothing
    acl.create_user(acl_server, without=["hset"])
    with pytest.raises(LockStoreMisconfigured):
        store.acquire("r2", ttl=30.0)
    assert admin.exists("steplock:lease:{r2}") == 0  # no lease without its fields and TTL


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_task_fails_with_a_missing_permission_whatever_the_policy(
    as_user, acl_server, policy, events
):
    as_user.conf.steplock_redis_url = acl.create_user(acl_server, without=["hset"])
    as_user.conf.steplock_on_store_error = policy
    step = Step.objects.create(name="s")
    result = acl_finish.apply(args=(step.pk,))
    assert result.failed()
    assert isinstance(result.result, LockStoreMisconfigured)
    assert result.result.setting == "steplock_redis_url"
    assert BODY_RUNS == []  # never run without its lease
    assert "lock_store_error" not in names(events)  # not an outage
    assert Step.objects.get(pk=step.pk).status == "pending"


# -- credentials -------------------------------------------------------------------------------


def _with_credentials(url, userinfo):
    return url.replace("redis://", f"redis://{userinfo}@", 1)


@pytest.mark.parametrize("userinfo", ["steplock:wrong-password", "nobody:secret"])
def test_wrong_password_or_unknown_user_is_a_configuration_error(acl_server, user_url, userinfo):
    store = RedisLeaseStore(make_client(_with_credentials(acl_server.url, userinfo)))
    with pytest.raises(LockStoreMisconfigured) as caught:
        store.acquire("c", ttl=30.0)
    assert caught.value.setting == "steplock_redis_url"
    assert "authentication failed" in str(caught.value)
    with pytest.raises(LockStoreMisconfigured):
        store.acquire("c", ttl=30.0, wait=1.0)


@pytest.fixture
def password_server(tmp_path):
    """A server whose default user needs the password ``s3cret`` (set once it answers: the
    readiness check logs in without one)."""
    server = servers.RedisServer(workdir=tmp_path / "redis").start()
    admin = redis.Redis.from_url(server.url)
    admin.config_set("requirepass", "s3cret")
    admin.close()
    yield server
    server.stop()


@pytest.mark.parametrize("policy", ["fail_closed", "fail_open"])
def test_task_without_the_required_password_fails_whatever_the_policy(
    app, password_server, policy, events
):
    BODY_RUNS.clear()
    app.conf.steplock_redis_url = password_server.url  # NOAUTH: no password given
    app.conf.steplock_on_store_error = policy
    step = Step.objects.create(name="s")
    result = acl_finish.apply(args=(step.pk,))
    assert result.failed() and isinstance(result.result, LockStoreMisconfigured)
    assert "authentication failed" in str(result.result)
    assert BODY_RUNS == [] and "lock_store_error" not in names(events)
    app.conf.steplock_redis_url = _with_credentials(password_server.url, ":wrong")
    result = acl_finish.apply(args=(step.pk,))
    assert result.failed() and isinstance(result.result, LockStoreMisconfigured)
    assert BODY_RUNS == []
    app.conf.steplock_redis_url = _with_credentials(password_server.url, ":s3cret")
    result = acl_finish.apply(args=(step.pk,))
    assert result.successful(), result.traceback
    assert BODY_RUNS == [step.pk]


def test_an_unreachable_server_stays_an_outage():
    from tests.helpers import closed_port_url

    store = RedisLeaseStore(make_client(closed_port_url(), socket_timeout=0.5))
    with pytest.raises(LockStoreUnavailable) as caught:
        store.acquire("u", ttl=5.0)
    assert not isinstance(caught.value, LockStoreMisconfigured)


def _self_signed(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=steplock-test",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.skipif(
    subprocess.run(["which", "openssl"], capture_output=True).returncode,
    reason="needs the openssl command",
)
def test_a_failed_tls_verification_is_a_configuration_error(tmp_path):
    """redis-py wraps the ``ssl.SSLCertVerificationError`` of a server whose certificate no
    trusted CA signed in a ConnectionError: classified by its cause, not as an outage."""
    cert, key = _self_signed(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        try:
            context.wrap_socket(conn, server_side=True)
        except (ssl.SSLError, OSError):
            pass  # the client refuses the certificate
        finally:
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    store = RedisLeaseStore(
        redis.Redis.from_url(f"rediss://127.0.0.1:{port}/0", socket_timeout=2, retry=None)
    )
    try:
        with pytest.raises(LockStoreMisconfigured) as caught:
            store.acquire("tls", ttl=5.0)
    finally:
        thread.join(5)
        listener.close()
    assert "TLS certificate verification failed" in str(caught.value)
    cause = caught.value.__cause__
    assert isinstance(cause, redis.exceptions.ConnectionError)
    assert _wire.misconfiguration(cause) == "TLS certificate verification failed"


def test_classification_of_redis_errors():
    e = redis.exceptions
    assert _wire.misconfiguration(e.NoPermissionError("no permissions")) == "permission refused"
    assert _wire.misconfiguration(e.AuthenticationError("invalid")) == "authentication failed"
    assert (
        _wire.misconfiguration(e.AuthenticationWrongNumberOfArgsError("wrong"))
        == "authentication failed"
    )
    assert (
        _wire.misconfiguration(
            e.ResponseError(
                "Error running script: The user executing the script can't run this command or "
                "subcommand"
            )
        )
        == "permission refused"
    )
    assert _wire.misconfiguration(e.ResponseError("WRONGTYPE Operation")) is None
    assert _wire.misconfiguration(e.ConnectionError("refused")) is None
    assert _wire.misconfiguration(e.TimeoutError("timed out")) is None
    assert type(store_error(e.ResponseError("WRONGTYPE x"), "acquire")) is LockError
    assert type(store_error(e.ConnectionError("x"), "acquire")) is LockStoreUnavailable
    assert (
        type(
            store_error(
                e.NoPermissionError("this user has no permissions to run the 'zrem' command"),
                "wait",
            )
        ).__name__
        == "LockStoreMisconfigured"
    )


def test_a_server_refusing_writes_for_another_reason_is_not_an_acl_error(
    acl_server, user_url, admin
):
    """The probe reports only what the ACL refuses: a server out of memory refuses the
    probe's writes as it would the lease scripts' (a LockError, not a permission)."""
    store = RedisLeaseStore(make_client(user_url))
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        with pytest.raises(LockError) as caught:
            store.acquire("oom", ttl=5.0)
    finally:
        admin.config_set("maxmemory", 0)
    assert not isinstance(caught.value, (LockStoreMisconfigured, LockStoreUnavailable))
    assert "OOM" in str(caught.value) or "maxmemory" in str(caught.value)
    assert store.acquire("oom", ttl=5.0) is not None  # the probe runs again, and passes


def test_a_renewal_refused_later_loses_the_lease_once(acl_server, admin, caplog):
    """A permission revoked while a lease is held: the heartbeat logs the refusal at ERROR and
    the lease is lost when its validity runs out (then no longer renewed), not retried on."""
    url = acl.create_user(acl_server)
    store = RedisLeaseStore(make_client(url))
    lease = store.acquire("rv", ttl=0.6)
    hb = get_heartbeat()
    lost = []
    signals.lock_lost.connect(
        lambda sender=None, **kw: lost.append(kw["owner"]),
        weak=False,
        dispatch_uid="test-acl-lost",
    )
    try:
        hb.register(lease, store, ratio=1 / 3)
        acl.create_user(acl_server, without=["hset"])
        servers.wait_until(
            lambda: lease.lost, timeout=10, interval=0.02, what="the lease to be lost"
        )
        servers.wait_until(lambda: lost, timeout=5, interval=0.02, what="lock_lost")
    finally:
        hb.unregister(lease)
        signals.lock_lost.disconnect(dispatch_uid="test-acl-lost")
    assert lost == [lease.owner]
    assert lease not in hb.leases
    assert any(
        r.levelname == "ERROR"
        and "event=renewal_failed" in r.getMessage()
        and "permission refused" in r.getMessage()
        for r in caplog.records
    )


def test_celery_steplock_ls_as_the_user(worker_env, store, user_url):
    import json
    import sys

    lease = store.acquire("order:1", ttl=60.0, metadata={"task_name": "proj.tasks.charge"})
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "django_app", "steplock", "ls", "--json"],
        env={**worker_env, "STEPLOCK_REDIS_URL": user_url},
        cwd=worker_env["PYTHONPATH"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    [row] = json.loads(proc.stdout)
    assert (row["name"], row["owner"]) == ("order:1", lease.owner)
    assert row["age"] is not None  # Redis server TIME as the user
