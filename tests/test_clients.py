"""Settings -> the lease store's redis-py client (celery_steplock.clients): each URL form, the
transport and TLS options, the client factory, and errors that name the setting.

Building a client connects to nothing; the tests that talk to servers are in
test_topologies_sentinel_tls.py (and the factory test below, on the session's Redis).
"""

import ssl

import pytest
import redis
from celery import Celery
from redis.retry import Retry
from redis.sentinel import SentinelConnectionPool

from celery_steplock import clients, lock
from celery_steplock.clients import client_for_settings, client_identity, make_client
from celery_steplock.conf import Settings
from celery_steplock.exceptions import ImproperlyConfigured
from tests.helpers import set_settings

pytestmark = pytest.mark.redis_shape

FACTORY_CALLS = []


def make_app(**conf):
    app = Celery("clients-tests", set_as_current=False)
    app.conf.update(conf)
    return app


def client_of(**conf):
    return client_for_settings(Settings(make_app(**conf)))


def refused(setting, **conf):
    """The ImproperlyConfigured that building the client from ``conf`` raises, checked to
    name ``setting``."""
    with pytest.raises(ImproperlyConfigured) as info:
        client_of(**conf)
    assert info.value.setting == setting, info.value
    assert setting in str(info.value)
    return str(info.value)


@pytest.fixture
def pem(tmp_path):
    """Three files standing for a CA, a certificate and a key (paths are checked to exist;
    their content is read only when connecting)."""
    paths = {}
    for name in ("ca.crt", "client.crt", "client.key"):
        path = tmp_path / name
        path.write_text("placeholder\n")
        paths[name] = str(path)
    return paths


# -- URL forms ---------------------------------------------------------------------------


def test_make_client_is_still_importable_from_lock():
    assert lock.make_client is clients.make_client is make_client
    client = lock.make_client("redis://127.0.0.1:1/2", 1.5)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"]) == ("127.0.0.1", 1, 2)
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 1.5
    assert kwargs["decode_responses"] is True


def retries_of(retry: Retry) -> int:
    """The number of retries of a redis-py ``Retry`` (redis-py 5.0 has no ``get_retries``)."""
    get_retries = getattr(retry, "get_retries", None)
    return get_retries() if get_retries is not None else retry._retries


def test_redis_url_with_socket_timeout_setting():
    client = client_of(
        steplock_redis_url="redis://:secret@127.0.0.1:7001/4", steplock_socket_timeout=0.7
    )
    pool = client.connection_pool
    assert pool.connection_class is redis.Connection
    kwargs = pool.connection_kwargs
    assert (kwargs["port"], kwargs["db"], kwargs["password"]) == (7001, 4, "secret")
    assert kwargs["socket_timeout"] == 0.7
    assert retries_of(kwargs["retry"]) == 1


def test_unix_url():
    client = client_of(steplock_redis_url="unix:///run/redis/redis.sock?db=3")
    pool = client.connection_pool
    assert pool.connection_class is redis.UnixDomainSocketConnection
    assert pool.connection_kwargs["path"] == "/run/redis/redis.sock"
    assert pool.connection_kwargs["db"] == 3


def test_rediss_url_takes_the_tls_setting(pem):
    client = client_of(
        steplock_redis_url="rediss://127.0.0.1:6380/0",
        steplock_redis_use_ssl={
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
            "ssl_ca_certs": pem["ca.crt"],
            "ssl_certfile": pem["client.crt"],
            "ssl_keyfile": pem["client.key"],
        },
    )
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    kwargs = pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert (kwargs["ssl_ca_certs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
        pem["ca.crt"],
        pem["client.crt"],
        pem["client.key"],
    )


def test_rediss_query_parameters_win_over_the_tls_setting(pem, tmp_path):
    other = tmp_path / "other-ca.crt"
    other.write_text("placeholder\n")
    client = client_of(
        steplock_redis_url=f"rediss://127.0.0.1:6380/0?ssl_cert_reqs=none&ssl_ca_certs={other}",
        steplock_redis_use_ssl={"ssl_cert_reqs": "required", "ssl_ca_certs": pem["ca.crt"]},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["ssl_cert_reqs"], kwargs["ssl_ca_certs"]) == ("none", str(other))


def test_cert_reqs_strings_as_celery_takes_them(pem):
    for text, mode in (
        ("required", ssl.CERT_REQUIRED),
        ("CERT_OPTIONAL", ssl.CERT_OPTIONAL),
        ("none", ssl.CERT_NONE),
    ):
        client = client_of(
            steplock_redis_url="rediss://127.0.0.1:6380/0",
            steplock_redis_use_ssl={"ssl_cert_reqs": text},
        )
        assert client.connection_pool.connection_kwargs["ssl_cert_reqs"] == mode


def test_tls_options_with_a_redis_url_turn_tls_on(pem):
    client = client_of(
        steplock_redis_url="redis://127.0.0.1:6380/0",
        steplock_redis_use_ssl={"ssl_ca_certs": pem["ca.crt"]},
    )
    assert client.connection_pool.connection_class is redis.SSLConnection
    plain = client_of(steplock_redis_url="redis://127.0.0.1:6380/0", steplock_redis_use_ssl={})
    assert plain.connection_pool.connection_class is redis.Connection


def test_broker_use_ssl_is_the_default_only_with_the_broker_url(pem):
    conf = {
        "broker_url": "rediss://127.0.0.1:6380/0",
        "broker_use_ssl": {
            "ssl_cert_reqs": ssl.CERT_REQUIRED,
            "ssl_ca_certs": pem["ca.crt"],
            "ssl_unknown_to_redis": 1,
        },
    }
    kwargs = client_of(**conf).connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == pem["ca.crt"]
    own = client_of(**conf, steplock_redis_url="rediss://127.0.0.1:6390/0")
    assert own.connection_pool.connection_kwargs.get("ssl_ca_certs") is None


def test_sentinel_url_kombu_form():
    url = "sentinel://:pw@10.0.0.1:26379;sentinel://:pw@10.0.0.2:26380;sentinel://10.0.0.3/5"
    client = client_of(
        steplock_redis_url=url,
        steplock_socket_timeout=1.25,
        steplock_redis_transport_options={
            "master_name": "mymaster",
            "min_other_sentinels": 1,
            "sentinel_kwargs": {"password": "sentinel-secret"},
        },
    )
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "mymaster" and pool.is_master
    kwargs = pool.connection_kwargs
    assert (kwargs["password"], kwargs["db"], kwargs["socket_timeout"]) == ("pw", 5, 1.25)
    manager = pool.sentinel_manager
    assert manager.min_other_sentinels == 1
    found = [
        (
            s.connection_pool.connection_kwargs["host"],
            s.connection_pool.connection_kwargs["port"],
            s.connection_pool.connection_kwargs["password"],
        )
        for s in manager.sentinels
    ]
    assert found == [
        ("10.0.0.1", 26379, "sentinel-secret"),
        ("10.0.0.2", 26380, "sentinel-secret"),
        ("10.0.0.3", 26379, "sentinel-secret"),
    ]
    # The sentinels get the socket timeouts too (not the primary's password).
    assert manager.sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 1.25


def test_sentinel_without_sentinel_kwargs_sends_no_password_to_the_sentinels():
    client = client_of(
        steplock_redis_url="sentinel://:pw@10.0.0.1:26379",
        steplock_redis_transport_options={"master_name": "m"},
    )
    sentinel = client.connection_pool.sentinel_manager.sentinels[0]
    assert sentinel.connection_pool.connection_kwargs.get("password") is None
    assert client.connection_pool.connection_kwargs["password"] == "pw"


def test_sentinel_with_tls_options_uses_tls_to_the_primary(pem):
    client = client_of(
        steplock_redis_url="sentinel://10.0.0.1:26379",
        steplock_redis_transport_options={"master_name": "m"},
        steplock_redis_use_ssl={"ssl_ca_certs": pem["ca.crt"]},
    )
    pool = client.connection_pool
    assert issubclass(pool.connection_class, redis.SSLConnection)
    assert pool.connection_kwargs["ssl_ca_certs"] == pem["ca.crt"]


def test_sentinel_broker_url_and_broker_transport_options_are_the_default():
    app = make_app(
        broker_url="sentinel://10.0.0.1:26379;sentinel://10.0.0.2:26379",
        broker_transport_options={
            "master_name": "broker-primary",
            "visibility_timeout": 3600,
            "sentinel_kwargs": {"password": "s"},
        },
    )
    settings = Settings(app)
    assert settings.redis_transport_options == {
        "master_name": "broker-primary",
        "sentinel_kwargs": {"password": "s"},
    }
    client = client_for_settings(settings)
    assert client.connection_pool.service_name == "broker-primary"
    assert settings.problems() == []
    # An own lease-store URL does not inherit the broker's options.
    set_settings(app, steplock_redis_url="redis://127.0.0.1:1/0")
    assert Settings(app).redis_transport_options == {}


def test_transport_connection_options_reach_the_connections():
    client = client_of(
        steplock_redis_url="redis://127.0.0.1:1/0",
        steplock_redis_transport_options={"health_check_interval": 15, "client_name": "steplock"},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["health_check_interval"], kwargs["client_name"]) == (15, "steplock")


def test_identity_follows_the_settings():
    base = {
        "steplock_redis_url": "sentinel://10.0.0.1:26379",
        "steplock_redis_transport_options": {"master_name": "a"},
    }
    one = client_identity(Settings(make_app(**base)))
    assert one == client_identity(Settings(make_app(**base)))
    hash(one)
    other = client_identity(
        Settings(make_app(**{**base, "steplock_redis_transport_options": {"master_name": "b"}}))
    )
    assert other != one


# -- errors name the setting -------------------------------------------------------------


def test_sentinel_url_without_master_name():
    message = refused(
        "steplock_redis_transport_options", steplock_redis_url="sentinel://10.0.0.1:26379"
    )
    assert "master_name" in message
    message = refused(
        "broker_transport_options",
        broker_url="sentinel://10.0.0.1:26379",
        broker_transport_options={"visibility_timeout": 10},
    )
    assert "master_name" in message


@pytest.mark.parametrize(
    "url, why",
    [
        ("sentinel://", "no host"),
        ("sentinel://10.0.0.1:26379?ssl=true", "query parameters"),
        ("sentinel://:a@10.0.0.1:26379;sentinel://:b@10.0.0.2:26379", "disagree on the password"),
        ("sentinel://10.0.0.1:26379/x", "database must be a number"),
        ("sentinel://10.0.0.1:26379;redis://10.0.0.2:6379", "must start with sentinel://"),
        ("sentinel://10.0.0.1:notaport", "sentinel URL is"),
    ],
)
def test_malformed_sentinel_urls(url, why):
    message = refused(
        "steplock_redis_url",
        steplock_redis_url=url,
        steplock_redis_transport_options={"master_name": "m"},
    )
    assert why in message
    assert ":a@" not in message  # passwords are not echoed


def test_other_schemes_are_refused():
    message = refused("steplock_redis_url", steplock_redis_url="amqp://guest@localhost//")
    assert "sentinel://" in message


@pytest.mark.parametrize(
    "options, why",
    [
        ("master_name=m", "must be a dict"),
        ({"master_name": "m", "visibility_timeout": 1}, "unknown option(s) visibility_timeout"),
        ({"master_name": ""}, "master_name"),
        ({"master_name": "m", "sentinel_kwargs": "password"}, "sentinel_kwargs must be a dict"),
        ({"master_name": "m", "min_other_sentinels": -1}, "min_other_sentinels"),
        ({"master_name": "m", "health_check_interval": "often"}, "health_check_interval"),
    ],
)
def test_bad_transport_options(options, why):
    message = refused(
        "steplock_redis_transport_options",
        steplock_redis_url="sentinel://10.0.0.1:26379",
        steplock_redis_transport_options=options,
    )
    assert why in message


@pytest.mark.parametrize(
    "use_ssl, why",
    [
        ("yes", "must be a dict"),
        ({"ssl_cert_reqs": "sometimes"}, "ssl_cert_reqs"),
        ({"ssl_cert_reqs": 7}, "ssl_cert_reqs"),
        ({"ssl_ca_certs": "/nonexistent/ca.crt"}, "ssl_ca_certs must be the path"),
        ({"ssl_verify_everything": True}, "unknown option(s) ssl_verify_everything"),
    ],
)
def test_bad_tls_options(use_ssl, why):
    message = refused(
        "steplock_redis_use_ssl",
        steplock_redis_url="rediss://127.0.0.1:1/0",
        steplock_redis_use_ssl=use_ssl,
    )
    assert why in message


def refused_by_validation(setting, **conf):
    """As :func:`refused`, and checked to be what ``Settings.validate()`` raises and
    ``Settings.problems()`` lists (validation, not only the client's construction)."""
    message = refused(setting, **conf)
    settings = Settings(make_app(**conf))
    with pytest.raises(ImproperlyConfigured) as info:
        settings.validate()
    assert info.value.setting == setting and str(info.value) == message
    assert [(p.setting, str(p)) for p in settings.problems()] == [(setting, message)]
    return message


@pytest.mark.parametrize(
    "url, why",
    [
        ("redis://127.0.0.1:abc", "Port could not be cast to integer value as 'abc'"),
        ("redis://127.0.0.1:99999", "Port out of range"),
        # redis-py's own words (it quotes the name with ' or `, by version).
        ("redis://127.0.0.1:1?socket_timeout=abc", "socket_timeout"),
        ("redis://127.0.0.1:1?max_connections=many", "max_connections"),
        ("redis://127.0.0.1:1/abc", "the database (the URL's path) must be a number, not 'abc'"),
        (
            "rediss://127.0.0.1:1?ssl_cert_reqs=bogus",
            "ssl_cert_reqs must be none, optional or required, not 'bogus'",
        ),
    ],
)
def test_malformed_redis_urls(url, why):
    message = refused_by_validation("steplock_redis_url", steplock_redis_url=url)
    assert why in message
    if "?" in url and "ssl" not in url:
        assert "Invalid value for" in message


def test_a_malformed_broker_url_names_broker_url():
    message = refused_by_validation("broker_url", broker_url="redis://:secret@127.0.0.1:1/x")
    assert "must be a number, not 'x'" in message and "secret" not in message


def test_well_formed_redis_urls_keep_their_database_and_query():
    client = client_of(steplock_redis_url="redis://127.0.0.1:1/3?socket_timeout=1.5")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["db"], kwargs["socket_timeout"]) == (3, 1.5)
    # A db query parameter is the database: the path is not read then.
    client = client_of(steplock_redis_url="redis://127.0.0.1:1/x?db=4")
    assert client.connection_pool.connection_kwargs["db"] == 4


@pytest.mark.parametrize(
    "options, why",
    [
        (
            {"master_name": "m", "sentinel_kwargs": {"bogus": 1}},
            "sentinel_kwargs has unknown option(s) bogus",
        ),
        (
            {"master_name": "m", "sentinel_kwargs": {"socket_timeout": "x"}},
            "sentinel_kwargs['socket_timeout'] must be a number of seconds",
        ),
        ({"master_name": "m", "client_name": 5}, "client_name must be a non-empty string"),
        ({"master_name": "m", "client_name": "two words"}, "without spaces"),
        (
            {"master_name": "m", "socket_keepalive": "yes"},
            "socket_keepalive must be True or False",
        ),
        (
            {"master_name": "m", "socket_keepalive_options": "x"},
            "socket_keepalive_options must be a dict of socket option numbers",
        ),
        (
            {"master_name": "m", "socket_keepalive_options": {"TCP_KEEPIDLE": 60}},
            "socket_keepalive_options must be a dict of socket option numbers",
        ),
        (
            {"master_name": "m", "health_check_interval": "x"},
            "health_check_interval must be a number of seconds >= 0",
        ),
        (
            {"master_name": "m", "health_check_interval": -1},
            "health_check_interval must be a number of seconds >= 0",
        ),
    ],
)
def test_bad_transport_option_values_are_refused_by_validation(options, why):
    message = refused_by_validation(
        "steplock_redis_transport_options",
        steplock_redis_url="sentinel://10.0.0.1:26379",
        steplock_redis_transport_options=options,
    )
    assert why in message


def test_sentinel_kwargs_and_connection_options_of_the_right_types_are_used():
    import socket

    client = client_of(
        steplock_redis_url="sentinel://10.0.0.1:26379",
        steplock_redis_transport_options={
            "master_name": "m",
            "client_name": "steplock-worker",
            "socket_keepalive": True,
            "socket_keepalive_options": {socket.TCP_KEEPCNT: 3},
            "health_check_interval": 2,
            "sentinel_kwargs": {"password": "s", "socket_timeout": 0.5},
        },
    )
    pool = client.connection_pool
    assert (
        pool.connection_kwargs["client_name"],
        pool.connection_kwargs["socket_keepalive"],
        pool.connection_kwargs["socket_keepalive_options"],
        pool.connection_kwargs["health_check_interval"],
    ) == ("steplock-worker", True, {socket.TCP_KEEPCNT: 3}, 2)
    sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert (sentinel["password"], sentinel["socket_timeout"]) == ("s", 0.5)


@pytest.mark.parametrize(
    "use_ssl, why",
    [
        ({"ssl_min_version": "TLSv9"}, "ssl_min_version must be an ssl.TLSVersion or its name"),
        ({"ssl_min_version": 12}, "ssl_min_version must be an ssl.TLSVersion"),
        ({"ssl_check_hostname": "yes"}, "ssl_check_hostname must be True or False"),
        ({"ssl_validate_ocsp": 1}, "ssl_validate_ocsp must be True or False"),
        ({"ssl_ciphers": ["ECDHE"]}, "ssl_ciphers must be a string"),
        ({"ssl_password": 1234}, "ssl_password must be a string, got int"),
        (
            {"ssl_include_verify_flags": "VERIFY_X509_STRICT"},
            "ssl_include_verify_flags must be a list of ssl.VerifyFlags",
        ),
    ],
)
def test_bad_tls_option_values_are_refused_by_validation(use_ssl, why):
    [key] = use_ssl
    if key not in clients._ssl_arguments():  # e.g. ssl_min_version: redis-py 5.1+
        why = f"unknown option(s) {key}"
    message = refused_by_validation(
        "steplock_redis_use_ssl",
        steplock_redis_url="rediss://127.0.0.1:1/0",
        steplock_redis_use_ssl=use_ssl,
    )
    assert why in message


@pytest.mark.parametrize("given", ["TLSv1_2", "TLSv1.2", "tlsv1_2", ssl.TLSVersion.TLSv1_2])
def test_ssl_min_version_takes_the_enum_or_its_name(given):
    if "ssl_min_version" not in clients._ssl_arguments():  # redis-py before 5.1
        message = refused_by_validation(
            "steplock_redis_use_ssl",
            steplock_redis_url="rediss://127.0.0.1:1/0",
            steplock_redis_use_ssl={"ssl_min_version": given},
        )
        assert "unknown option(s) ssl_min_version" in message
        return
    client = client_of(
        steplock_redis_url="rediss://127.0.0.1:1/0",
        steplock_redis_use_ssl={"ssl_min_version": given, "ssl_check_hostname": False},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["ssl_min_version"] is ssl.TLSVersion.TLSv1_2
    assert kwargs["ssl_check_hostname"] is False


def test_keyfile_without_certfile(pem):
    message = refused(
        "steplock_redis_use_ssl",
        steplock_redis_url="rediss://127.0.0.1:1/0",
        steplock_redis_use_ssl={"ssl_keyfile": pem["client.key"]},
    )
    assert "ssl_certfile" in message


# -- the client factory ------------------------------------------------------------------


def factory_of_the_session_redis(settings):
    """A client factory (found by its qualified name in the tests below)."""
    import os

    FACTORY_CALLS.append(settings)
    return redis.Redis.from_url(
        os.environ["REDIS_URL"], **clients.connection_options(settings.socket_timeout)
    )


def not_a_client(settings):
    return "redis://127.0.0.1:6379/0"


def broken_factory(settings):
    raise RuntimeError("vault unreachable")


NOT_CALLABLE = 42


def an_asyncio_client(settings):
    import redis.asyncio

    return redis.asyncio.Redis(host="127.0.0.1", port=1)


class LookAlike:
    def execute_command(self, *args, **kwargs):
        return None


def a_look_alike(settings):
    return LookAlike()


def nothing(settings):
    return None


def test_factory_by_qualified_name_serves_the_lease_store(redis_server_url):
    FACTORY_CALLS.clear()
    # The broker is not Redis and no URL is set: with a factory nothing asks for one.
    app = make_app(
        broker_url="amqp://guest@127.0.0.1//",
        steplock_redis_client_factory="test_clients:factory_of_the_session_redis",
        steplock_key_prefix="factory-test",
        steplock_socket_timeout=2.5,
    )
    settings = Settings(app)
    assert settings.problems() == []
    store = lock.get_lease_store(app, settings)
    assert len(FACTORY_CALLS) == 1 and FACTORY_CALLS[0] is settings
    assert store.client.connection_pool.connection_kwargs["socket_timeout"] == 2.5
    lease = store.acquire("factory-name", ttl=5)
    try:
        assert lease is not None
        assert store.inspect("factory-name")["owner"] == lease.owner
    finally:
        assert store.release("factory-name", lease.owner) is True
    # One store per distinct configuration: the factory is not called again.
    assert lock.get_lease_store(app, Settings(app)) is store
    assert len(FACTORY_CALLS) == 1


def test_factory_as_a_callable():
    made = []

    def factory(settings):
        made.append(settings.app.main)
        return redis.Redis(host="127.0.0.1", port=1)

    client = client_of(steplock_redis_client_factory=factory)
    assert made == ["clients-tests"]
    assert client.connection_pool.connection_kwargs["port"] == 1


@pytest.mark.parametrize(
    "factory, why",
    [
        ("test_clients:no_such_function", "cannot import"),
        ("no_such_module_for_steplock.factory", "cannot import"),
        ("test_clients:NOT_CALLABLE", "must be callable"),
        (42, "must be callable"),
        ("   ", "must be a callable or its qualified name"),
        ("test_clients:not_a_client", "must return a redis-py client"),
        ("test_clients:broken_factory", "RuntimeError: vault unreachable"),
        ("test_clients:an_asyncio_client", "got redis.asyncio.client.Redis"),
        ("test_clients:a_look_alike", "got test_clients.LookAlike"),
        ("test_clients:nothing", "got builtins.NoneType"),
    ],
)
def test_bad_factories(factory, why):
    message = refused(
        "steplock_redis_client_factory",
        broker_url="redis://127.0.0.1:1/0",
        steplock_redis_client_factory=factory,
    )
    assert why in message


def test_problems_lists_each_bad_new_setting_once(pem):
    app = make_app(
        steplock_redis_url="sentinel://10.0.0.1:26379",
        steplock_redis_use_ssl={"ssl_cert_reqs": "sometimes"},
        steplock_redis_client_factory=None,
    )
    found = sorted(problem.setting for problem in Settings(app).problems())
    assert found == ["steplock_redis_transport_options", "steplock_redis_use_ssl"]


def test_the_waiters_cap_is_the_socket_timeout_connections_really_have():
    """A client built by hand (``from_url`` without a timeout) has the connection class's
    default timeout (5 s from redis-py 6): a BLPOP longer than it would time out, so the
    store must see it, sync and asyncio alike."""
    import redis.asyncio

    from celery_steplock._redis import wire
    from celery_steplock.aio.lock import _socket_timeout

    url = "redis://127.0.0.1:1/0"
    for client, read in (
        (redis.Redis.from_url(url), wire.socket_timeout),
        (redis.asyncio.Redis.from_url(url), _socket_timeout),
    ):
        real = client.connection_pool.make_connection().socket_timeout
        assert read(client) == (float(real) if real else None)
        assert read(type(client).from_url(url, socket_timeout=30)) == 30.0
        assert read(type(client).from_url(url, socket_timeout=None)) is None
