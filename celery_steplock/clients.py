"""The redis-py client of the lease store, built from the settings: the one place that knows
how a URL, transport options and TLS options become a client.

Configured the way Celery's Redis broker is (``steplock_redis_url``,
``steplock_redis_transport_options``, ``steplock_redis_use_ssl``, or
``steplock_redis_client_factory`` for anything else): docs/redis.md, with Sentinel, TLS and
client factories, and the settings reference.
"""

from __future__ import annotations

import functools
import inspect
import os
import ssl
import weakref
from typing import Any, Callable
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import FullJitterBackoff, NoBackoff
from redis.retry import Retry

from . import _loops
from .exceptions import ImproperlyConfigured
from .redact import redact, url_secrets

__all__ = [
    "URL_SCHEMES",
    "SENTINEL_OPTIONS",
    "CONNECTION_OPTIONS",
    "connection_options",
    "make_client",
    "ClientConfig",
    "client_for_settings",
    "client_identity",
    "check_url",
    "parse_sentinel_url",
    "check_transport_options",
    "check_use_ssl",
    "check_client_factory",
    "async_client_for",
    "async_twin",
]

#: The URL schemes the lease store accepts.
URL_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")

#: Transport options that only a Sentinel URL uses.
SENTINEL_OPTIONS = ("master_name", "sentinel_kwargs", "min_other_sentinels")
#: Transport options passed to every connection to the lease store's Redis.
CONNECTION_OPTIONS = (
    "health_check_interval",
    "socket_keepalive",
    "socket_keepalive_options",
    "client_name",
)

_URL = "steplock_redis_url"
_OPTIONS = "steplock_redis_transport_options"
_SSL = "steplock_redis_use_ssl"
_FACTORY = "steplock_redis_client_factory"

_CERT_REQS = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
    "cert_none": ssl.CERT_NONE,
    "cert_optional": ssl.CERT_OPTIONAL,
    "cert_required": ssl.CERT_REQUIRED,
}


def _describe(name: str) -> str:
    from ._checks import describe

    return describe(name)


def connection_options(socket_timeout: float = 5.0) -> dict[str, Any]:
    """The keyword arguments of every client the library builds.

    One quick retry, so that a hung Redis costs at most about twice the timeout per call;
    retrying is safe because every script is idempotent for one owner token. A client
    factory may pass them on (``redis.Redis(host=..., **connection_options(
    settings.socket_timeout))``).

    Args:
        socket_timeout: Seconds per attempt, connecting too.

    Returns:
        ``redis.Redis`` keyword arguments: the timeouts, the retry, replies decoded as text.
    """
    return {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": socket_timeout,
        # The delays of ExponentialWithJitterBackoff, which needs redis-py 5.3+.
        "retry": Retry(FullJitterBackoff(cap=0.2, base=0.05), 1),
        "decode_responses": True,
        "encoding_errors": "replace",
    }


# -- validation ---------------------------------------------------------------------------


def check_url(url: Any, name: str = _URL) -> str:
    """Check a lease store URL the way redis-py will parse it.

    Args:
        url: A ``redis://``, ``rediss://``, ``unix://`` or ``sentinel://`` URL.
        name: The setting named by the error.

    Returns:
        ``url``.

    Raises:
        ImproperlyConfigured: The lease store cannot use ``url`` (naming ``name``; the
            URL's secrets masked).
    """
    if not isinstance(url, str) or not url.startswith(URL_SCHEMES):
        raise ImproperlyConfigured(
            f"{_describe(name)} must be a redis://, rediss://, unix:// or sentinel:// URL, "
            f"got {redact(repr(url), url_secrets(url))}",
            setting=name,
        )
    if url.startswith("sentinel://"):
        parse_sentinel_url(url, name)
    else:
        _check_redis_url(url, name)
    return url


def _check_redis_url(url: str, name: str) -> None:
    """Parse a redis://, rediss:// or unix:// URL the way redis-py will (its own parser),
    so that a bad port or query value is refused now, naming ``name``."""
    from redis.connection import parse_url

    def bad(why: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"{_describe(name)}: {_why(why, url)}, got {redact(repr(url), url_secrets(url))}",
            setting=name,
        )

    try:
        parsed = parse_url(url)
    except (ValueError, TypeError) as exc:
        raise bad(str(exc).rstrip(".")) from None
    split = urlsplit(url)
    db = unquote(split.path).strip("/")
    # redis-py silently falls back to database 0 for a path that is not a number.
    if split.scheme != "unix" and db and "db" not in parse_qs(split.query) and not db.isdigit():
        raise bad(f"the database (the URL's path) must be a number, not {db!r}")
    reqs = parsed.get("ssl_cert_reqs")
    if isinstance(reqs, str) and reqs.lower() not in ("none", "optional", "required"):
        raise bad(f"ssl_cert_reqs must be none, optional or required, not {reqs!r}")
    version = parsed.get("ssl_min_version")
    if version is not None and not isinstance(version, ssl.TLSVersion):
        raise bad(
            f"ssl_min_version={version!r} is not read from the URL by this redis-py; "
            f"put it in {_SSL}"
        )


def parse_sentinel_url(url: str, name: str = _URL) -> dict[str, Any]:
    """Parse kombu's Sentinel URL form.

    Args:
        url: ``sentinel://[user:password@]host:port[;sentinel://host2:port2...][/db]``; the
            credentials and database are the primary's (each part may repeat them; they
            must agree). A missing port is 26379.
        name: The setting named by the error.

    Returns:
        ``{"sentinels": [(host, port), ...], "username", "password", "db"}``.

    Raises:
        ImproperlyConfigured: ``url`` is malformed (naming ``name``).
    """

    def bad(why: str) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"{_describe(name)}: {_why(why, url)} (a sentinel URL "
            f"is sentinel://[:password@]host:port[;sentinel://host:"
            f"port...][/db]), got "
            f"{redact(repr(url), url_secrets(url))}",
            setting=name,
        )

    sentinels: list[tuple[str, int]] = []
    found: dict[str, Any] = {"username": None, "password": None, "db": None}
    for part in url.split(";"):
        part = part.strip()
        if not part.startswith("sentinel://"):
            raise bad(f"every part must start with sentinel://, not {redact(repr(part))}")
        try:
            split = urlsplit(part)
            host, port = split.hostname, split.port or 26379
        except ValueError as exc:
            raise bad(str(exc)) from None
        if not host:
            raise bad("a sentinel has no host")
        if split.query or split.fragment:
            raise bad(
                "query parameters are not read from sentinel URLs; put options in "
                f"{_OPTIONS} or {_SSL}"
            )
        db = split.path.strip("/")
        values: dict[str, Any] = {
            "username": unquote(split.username) if split.username else None,
            "password": unquote(split.password) if split.password is not None else None,
            "db": None,
        }
        if db:
            if not db.isdigit():
                raise bad(f"the database must be a number, not {db!r}")
            values["db"] = int(db)
        for key, value in values.items():
            if value is None:
                continue
            if found[key] is not None and found[key] != value:
                raise bad(f"the parts disagree on the {key}")
            found[key] = value
        sentinels.append((host, port))
    return {"sentinels": sentinels, **found}


def _why(why: str, url: str) -> str:
    """``why`` (what a parser said about ``url``) without any piece of the URL's secrets.
    Credentials holding an unencoded ``/``, ``?``, ``#`` or ``;`` make the parsers cut the URL
    inside them, and their complaint (a port, a database, a part) would quote a piece of
    the password: say so instead."""
    secrets = url_secrets(url)
    if any(c in secret for secret in secrets for c in "/?#;@"):
        return (
            "the URL is malformed, or its user name or password holds an unencoded "
            "'/', '?', '#', ';' or '@' (percent-encode them: "
            "urllib.parse.quote(password, safe=''))"
        )
    return redact(why, secrets)


def check_transport_options(
    value: Any, url: str | None, *, strict: bool = True, name: str = _OPTIONS
) -> dict[str, Any]:
    """The transport options the lease store uses.

    Args:
        value: A dict of :data:`SENTINEL_OPTIONS` and :data:`CONNECTION_OPTIONS` (None:
            none).
        url: The lease store's URL when known (a Sentinel URL needs ``master_name``).
        strict: True when the setting was given for the lease store: an unknown key is an
            error; False when inherited from ``broker_transport_options``: keys the lease
            store does not use are dropped.
        name: The setting named by the errors.

    Returns:
        The options the lease store reads, checked.

    Raises:
        ImproperlyConfigured: A key or value is invalid (naming ``name``).
    """
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ImproperlyConfigured(
            f"{_describe(name)} must be a dict, got {redact(repr(value))}", setting=name
        )
    known = SENTINEL_OPTIONS + CONNECTION_OPTIONS
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown and strict:
        raise ImproperlyConfigured(
            f"{_describe(name)} has unknown option(s) {', '.join(unknown)}; the lease store "
            f"reads {', '.join(known)}",
            setting=name,
        )
    options = {k: v for k, v in value.items() if k in known}
    sentinel = isinstance(url, str) and url.startswith("sentinel://")
    master = options.get("master_name")
    if sentinel and not (isinstance(master, str) and master):
        raise ImproperlyConfigured(
            f"{_describe(name)} must name the primary of a sentinel:// URL: "
            f'{{"master_name": "mymaster"}} (the name the sentinels monitor), got '
            f"{master!r}",
            setting=name,
        )
    if master is not None and not (isinstance(master, str) and master):
        raise ImproperlyConfigured(
            f"{_describe(name)}: master_name must be a non-empty string, got {master!r}",
            setting=name,
        )
    kwargs = options.get("sentinel_kwargs")
    if kwargs is not None and not (
        isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)
    ):
        raise ImproperlyConfigured(
            f"{_describe(name)}: sentinel_kwargs must be a dict of "
            f"connection options, got {redact(repr(kwargs))}",
            setting=name,
        )
    if kwargs:
        accepted = _connection_arguments()
        unknown = sorted(k for k in kwargs if k not in accepted)
        if unknown:
            raise ImproperlyConfigured(
                f"{_describe(name)}: sentinel_kwargs has unknown option(s) "
                f"{', '.join(unknown)}; it takes the keyword arguments of redis.Redis "
                f"(password, username, socket_timeout, ssl, ...)",
                setting=name,
            )
        for key in ("socket_timeout", "socket_connect_timeout"):
            _check_seconds(kwargs.get(key), f"sentinel_kwargs[{key!r}]", name)
    _check_seconds(options.get("health_check_interval"), "health_check_interval", name)
    keepalive = options.get("socket_keepalive")
    if keepalive is not None and not isinstance(keepalive, bool):
        raise ImproperlyConfigured(
            f"{_describe(name)}: socket_keepalive must be True or False, got {keepalive!r}",
            setting=name,
        )
    keepalive_options = options.get("socket_keepalive_options")
    if keepalive_options is not None and not (
        isinstance(keepalive_options, dict)
        and all(
            isinstance(k, int)
            and not isinstance(k, bool)
            and isinstance(v, (int, bytes))
            and not isinstance(v, bool)
            for k, v in keepalive_options.items()
        )
    ):
        raise ImproperlyConfigured(
            f"{_describe(name)}: socket_keepalive_options must be a dict of socket option "
            f"numbers to values (e.g. {{socket.TCP_KEEPIDLE: 60}}), got "
            f"{keepalive_options!r}",
            setting=name,
        )
    client_name = options.get("client_name")
    if client_name is not None and not (
        isinstance(client_name, str) and client_name and not any(c.isspace() for c in client_name)
    ):
        raise ImproperlyConfigured(
            f"{_describe(name)}: client_name must be a non-empty "
            f"string without spaces, got {client_name!r}",
            setting=name,
        )
    others = options.get("min_other_sentinels")
    if others is not None and (
        isinstance(others, bool) or not isinstance(others, int) or others < 0
    ):
        raise ImproperlyConfigured(
            f"{_describe(name)}: min_other_sentinels must be a whole number >= 0, got {others!r}",
            setting=name,
        )
    return options


def _check_seconds(value: Any, key: str, name: str) -> None:
    from ._checks import MAX_SOCKET_TIMEOUT, shown

    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= MAX_SOCKET_TIMEOUT
    ):  # NaN: refused
        raise ImproperlyConfigured(
            f"{_describe(name)}: {key} must be a number of seconds "
            f">= 0 and at most {MAX_SOCKET_TIMEOUT:g}, got "
            f"{shown(value)}",
            setting=name,
        )


@functools.cache
def _connection_arguments() -> frozenset[str]:
    """The keyword arguments ``redis.Redis`` takes (what a sentinel connection is built
    with), minus those that are not connection options."""
    names = set(inspect.signature(redis.Redis.__init__).parameters)
    return frozenset(
        names - {"self", "connection_pool", "single_connection_client", "kwargs", "args"}
    )


@functools.cache
def _ssl_arguments() -> frozenset[str]:
    return frozenset(
        p
        for p in inspect.signature(redis.SSLConnection.__init__).parameters
        if p.startswith("ssl_")
    )


#: ssl_* options that must be booleans.
_SSL_FLAGS = ("ssl_check_hostname", "ssl_validate_ocsp", "ssl_validate_ocsp_stapled")
#: ssl_* options that must be strings.
_SSL_TEXT = ("ssl_ca_path", "ssl_ciphers", "ssl_ocsp_expected_cert")


def check_use_ssl(value: Any, *, strict: bool = True, name: str = _SSL) -> dict[str, Any]:
    """The TLS options: ``ssl_*`` keyword arguments of redis-py's ``SSLConnection``.

    Args:
        value: A dict as Celery's ``broker_use_ssl`` takes it, ``True`` (TLS with
            redis-py's defaults: the server certificate verified against the system's CAs),
            or None/``False``/``{}`` (none). ``ssl_cert_reqs`` may be an ``ssl.VerifyMode``
            or ``"required"``, ``"optional"``, ``"none"`` (``"CERT_REQUIRED"``... too). A
            certificate or key file must exist.
        strict: As in :func:`check_transport_options`.
        name: The setting named by the errors.

    Returns:
        The options, with ``ssl`` True when there are any; ``{}`` for none.

    Raises:
        ImproperlyConfigured: An option is unknown or invalid (naming ``name``).
    """
    if value is None or value is False:
        return {}
    if value is True:
        return {"ssl": True}
    if not isinstance(value, dict):
        raise ImproperlyConfigured(
            f"{_describe(name)} must be a dict of ssl_* options "
            f"(as broker_use_ssl), got {redact(repr(value))}",
            setting=name,
        )
    accepted = _ssl_arguments() | {"ssl"}
    unknown = sorted(str(k) for k in value if k not in accepted)
    if unknown and strict:
        raise ImproperlyConfigured(
            f"{_describe(name)} has unknown option(s) {', '.join(unknown)}; redis-py "
            f"accepts {', '.join(sorted(accepted))}",
            setting=name,
        )
    options = {k: v for k, v in value.items() if k in accepted}
    reqs = options.get("ssl_cert_reqs")
    if isinstance(reqs, str):
        if reqs.lower() not in _CERT_REQS:
            raise ImproperlyConfigured(
                f"{_describe(name)}: ssl_cert_reqs must be ssl.CERT_REQUIRED, CERT_OPTIONAL, "
                f'CERT_NONE or "required"/"optional"/"none", got {reqs!r}',
                setting=name,
            )
        options["ssl_cert_reqs"] = _CERT_REQS[reqs.lower()]
    elif reqs is not None and reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ImproperlyConfigured(
            f"{_describe(name)}: ssl_cert_reqs must be one of "
            f"ssl.CERT_REQUIRED, CERT_OPTIONAL, CERT_NONE, got {reqs!r}",
            setting=name,
        )
    for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = options.get(key)
        if path is not None and not (
            isinstance(path, (str, os.PathLike)) and os.path.isfile(path)
        ):
            raise ImproperlyConfigured(
                f"{_describe(name)}: {key} must be the path of a readable file, got {path!r}",
                setting=name,
            )
        if path is not None:
            options[key] = os.fspath(path)
    for key in _SSL_FLAGS:
        if key in options and not isinstance(options[key], bool):
            raise ImproperlyConfigured(
                f"{_describe(name)}: {key} must be True or False, got {options[key]!r}",
                setting=name,
            )
    for key in _SSL_TEXT:
        if options.get(key) is not None and not isinstance(options[key], str):
            raise ImproperlyConfigured(
                f"{_describe(name)}: {key} must be a string, got {options[key]!r}", setting=name
            )
    password = options.get("ssl_password")
    if password is not None and not isinstance(password, (str, bytes)):
        raise ImproperlyConfigured(
            f"{_describe(name)}: ssl_password must be a string, got {type(password).__name__}",
            setting=name,
        )
    ca_data = options.get("ssl_ca_data")
    if ca_data is not None and not isinstance(ca_data, (str, bytes)):
        raise ImproperlyConfigured(
            f"{_describe(name)}: ssl_ca_data must be PEM text or DER bytes, got {ca_data!r}",
            setting=name,
        )
    version = options.get("ssl_min_version")
    if isinstance(version, str):
        member = version.strip().replace(".", "_")
        if member.upper().startswith("TLSV"):
            member = "TLSv" + member[4:]
        if member not in ssl.TLSVersion.__members__:
            raise ImproperlyConfigured(
                f"{_describe(name)}: ssl_min_version must be an ssl.TLSVersion or its name "
                f'("TLSv1_2", "TLSv1_3"), got {version!r}',
                setting=name,
            )
        options["ssl_min_version"] = ssl.TLSVersion[member]
    elif version is not None and not isinstance(version, ssl.TLSVersion):
        raise ImproperlyConfigured(
            f"{_describe(name)}: ssl_min_version must be an "
            f"ssl.TLSVersion (e.g. ssl.TLSVersion.TLSv1_2), got "
            f"{version!r}",
            setting=name,
        )
    for key in ("ssl_include_verify_flags", "ssl_exclude_verify_flags"):
        flags = options.get(key)
        if flags is not None and not (
            isinstance(flags, (list, tuple)) and all(isinstance(f, ssl.VerifyFlags) for f in flags)
        ):
            raise ImproperlyConfigured(
                f"{_describe(name)}: {key} must be a list of ssl.VerifyFlags, got {flags!r}",
                setting=name,
            )
    if options.get("ssl_keyfile") and not options.get("ssl_certfile"):
        raise ImproperlyConfigured(
            f"{_describe(name)}: ssl_keyfile needs ssl_certfile (the "
            f"client certificate of mutual TLS)",
            setting=name,
        )
    if options:
        options["ssl"] = True
    return options


def check_client_factory(value: Any, name: str = _FACTORY) -> Callable[..., Any] | None:
    """The client factory of ``steplock_redis_client_factory``.

    Args:
        value: None, a callable ``factory(settings) -> redis client``, or the qualified
            name of one (``"package.module:function"`` or ``"package.module.function"``),
            imported here.
        name: The setting named by the errors.

    Returns:
        The callable, or None.

    Raises:
        ImproperlyConfigured: It cannot be imported or is not callable (naming ``name``).
    """
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            raise ImproperlyConfigured(
                f"{_describe(name)} must be a callable or its qualified name, got {value!r}",
                setting=name,
            )
        from celery.utils.imports import symbol_by_name

        try:
            factory = symbol_by_name(value.strip())
        except (ImportError, AttributeError, ValueError) as exc:
            raise ImproperlyConfigured(
                f"{_describe(name)}: cannot import {value!r}: {exc}", setting=name
            ) from exc
    else:
        factory = value
    if not callable(factory):
        raise ImproperlyConfigured(
            f"{_describe(name)} must be callable "
            f"(factory(settings) -> redis client), got {factory!r}",
            setting=name,
        )
    return factory


# -- clients ------------------------------------------------------------------------------


def make_client(
    url: str,
    socket_timeout: float = 5.0,
    *,
    transport_options: dict[str, Any] | None = None,
    use_ssl: dict[str, Any] | bool | None = None,
    cluster: bool = False,
) -> redis.Redis:
    """A redis-py client for the lease store; nothing connects before the first command.

    For a ``sentinel://`` URL the client is ``Sentinel(...).master_for(master_name)``: its
    pool is a ``SentinelConnectionPool`` that finds the primary through the sentinels, and a
    demoted primary's ``READONLY`` drops the connection so that the retry reaches the new
    one.

    Args:
        url: A ``redis://``, ``rediss://`` (TLS), ``unix://`` or ``sentinel://`` URL
            (docs/redis.md).
        socket_timeout: Seconds per attempt (:func:`connection_options`: one quick retry).
        transport_options: As ``steplock_redis_transport_options`` takes them.
        use_ssl: As ``steplock_redis_use_ssl`` takes them; with a ``rediss://`` URL its
            query parameters win.
        cluster: True for a ``redis.cluster.RedisCluster`` with ``url``'s node as its entry
            point (see :func:`celery_steplock._redis.cluster.make_client`), the connection
            and TLS options passed to every node's connections.

    Returns:
        The client.

    Raises:
        ImproperlyConfigured: Invalid input, e.g. TLS options with a ``unix://`` URL
            (naming the setting).
    """
    check_url(url)
    options = check_transport_options(transport_options, url)
    tls = check_use_ssl(use_ssl)
    _check_combination(url, tls, cluster)
    if cluster:
        from ._redis import cluster as redis_cluster

        passed = {k: v for k, v in options.items() if k in CONNECTION_OPTIONS}
        query = parse_qs(urlsplit(url).query)
        passed.update({k: v for k, v in tls.items() if k != "ssl" and k not in query})
        if tls:
            # What the cluster client's node connections are (it does not read ``ssl``).
            passed["connection_class"] = redis.SSLConnection
        return redis_cluster.make_client(url, socket_timeout, **passed)  # type: ignore[return-value]
    kwargs = connection_options(socket_timeout)
    kwargs.update({k: v for k, v in options.items() if k in CONNECTION_OPTIONS})
    if url.startswith("sentinel://"):
        return _sentinel_client(url, options, tls, kwargs)
    if tls and url.startswith(("rediss://", "redis://")):
        # The URL's own query parameters (redis-py reads ssl_* from it) win; TLS options
        # with a redis:// URL turn TLS on, as broker_use_ssl does for Celery's broker.
        query = parse_qs(urlsplit(url).query)
        kwargs.update({k: v for k, v in tls.items() if k != "ssl" and k not in query})
        kwargs["connection_class"] = redis.SSLConnection
    return redis.Redis.from_url(url, **kwargs)


def _check_combination(url: str, tls: dict[str, Any], cluster: bool) -> None:
    """Raise ImproperlyConfigured for settings that are each valid but would be ignored
    together: TLS options with a Unix socket, the Cluster flag with a Sentinel or Unix URL."""
    if tls and url.startswith("unix://"):
        raise ImproperlyConfigured(
            f"{_describe(_SSL)} is set but steplock_redis_url is a unix:// URL, which "
            f"connects without TLS; remove the TLS options or use a rediss:// URL",
            setting=_SSL,
        )
    if cluster and url.startswith(("sentinel://", "unix://")):
        raise ImproperlyConfigured(
            "steplock_redis_cluster is True but steplock_redis_url is a "
            f"{url.split(':', 1)[0]}:// URL; a Redis Cluster is reached through "
            "a redis:// or rediss:// URL of one of its nodes",
            setting="steplock_redis_cluster",
        )


def _sentinel_class():
    from redis.sentinel import MasterNotFoundError, Sentinel

    from ._redis import wire

    class _Sentinel(Sentinel):
        # redis-py's error says neither whether the sentinels answered nor briefly where
        # they are: a wrong sentinel password or master_name is a configuration error.
        def discover_master(self, service_name):
            try:
                return super().discover_master(service_name)
            except wire.SentinelDiscoveryError:
                raise
            except MasterNotFoundError as exc:
                raise wire.sentinel_discovery_error(self, service_name, exc) from None

    return _Sentinel


def _sentinel_client(
    url: str, options: dict[str, Any], tls: dict[str, Any], kwargs: dict[str, Any]
) -> redis.Redis:
    _Sentinel = _sentinel_class()
    parsed = parse_sentinel_url(url)
    primary = dict(kwargs)
    for key in ("username", "password", "db"):
        if parsed[key] is not None:
            primary[key] = parsed[key]
    primary.update(tls)
    sentinel_kwargs = options.get("sentinel_kwargs")
    if sentinel_kwargs is None:
        sentinel_kwargs = {}
    # No retry per sentinel: a sentinel that does not answer is skipped for the next one
    # (redis-py's default would retry it with backoff of seconds before moving on).
    sentinel_kwargs = {
        "socket_timeout": kwargs["socket_timeout"],
        "socket_connect_timeout": kwargs["socket_connect_timeout"],
        "retry": Retry(NoBackoff(), 0),
        **sentinel_kwargs,
    }
    sentinel = _Sentinel(
        parsed["sentinels"],
        min_other_sentinels=options.get("min_other_sentinels", 0),
        sentinel_kwargs=sentinel_kwargs,
        **primary,
    )
    return sentinel.master_for(options["master_name"])


class ClientConfig:
    """The client inputs of one :class:`~celery_steplock.conf.Settings`, each setting read once.

    Args:
        settings: The app's settings.
        socket_timeout: Seconds; overrides ``steplock_socket_timeout`` when given.

    Attributes:
        factory: The client factory, or None.
        url: The URL (None with a factory).
        options: The transport options (None with a factory).
        tls: The TLS options (None with a factory).
        timeout: The socket timeout, seconds.
        cluster: Whether the client is a Redis Cluster client.

    Raises:
        ImproperlyConfigured: Naming the first invalid setting.
    """

    __slots__ = ("settings", "factory", "url", "options", "tls", "timeout", "cluster")

    def __init__(self, settings, socket_timeout: float | None = None):
        self.settings = settings
        self.timeout = settings.socket_timeout if socket_timeout is None else socket_timeout
        self.factory = settings.redis_client_factory
        self.url: Any = None
        self.options: Any = None
        self.tls: Any = None
        self.cluster = False
        if self.factory is None:
            self.url, self.options, self.tls = settings.redis_connection()
            self.cluster = settings.redis_cluster
            _check_combination(self.url, self.tls or {}, self.cluster)
        elif settings.redis_cluster:
            # The factory builds the client: the flag would be silently ignored.
            raise ImproperlyConfigured(
                f"steplock_redis_cluster is True but {_FACTORY} is set, and the factory's "
                f"client is used as it is; remove steplock_redis_cluster and return a "
                f"redis.cluster.RedisCluster from the factory",
                setting="steplock_redis_cluster",
            )

    @property
    def identity(self) -> tuple:
        """A hashable key: equal keys, equal clients (a factory counts by its identity)."""
        if self.factory is not None:
            return ("factory", self.factory, self.timeout)
        return (
            "url",
            self.url,
            _freeze(self.options),
            _freeze(self.tls),
            self.timeout,
            self.cluster,
        )

    def client(self) -> redis.Redis:
        """A new client (see :func:`client_for_settings`).

        Returns:
            The factory's client, or :func:`make_client`'s.

        Raises:
            ImproperlyConfigured: The factory raised, or returned no synchronous redis-py
                client (``redis.Redis`` or ``redis.cluster.RedisCluster``).
        """
        if self.factory is None:
            return make_client(
                self.url,
                self.timeout,
                transport_options=self.options,
                use_ssl=self.tls,
                cluster=self.cluster,
            )
        try:
            client = self.factory(self.settings)
        except ImproperlyConfigured:
            raise
        except Exception as exc:
            raise ImproperlyConfigured(
                f"{_describe(_FACTORY)}: {self.factory!r} raised "
                f"{type(exc).__name__}: {redact(exc)}",
                setting=_FACTORY,
            ) from exc
        from redis.cluster import RedisCluster

        # Only redis-py's synchronous clients: the library reads their pools (an asyncio
        # client's commands return coroutines, a look-alike has no pool to read).
        if not isinstance(client, (redis.Redis, RedisCluster)):
            raise ImproperlyConfigured(
                f"{_describe(_FACTORY)}: {self.factory!r} must return a redis-py client, a "
                f"synchronous one (redis.Redis or redis.cluster.RedisCluster), got "
                f"{type(client).__module__}.{type(client).__qualname__}",
                setting=_FACTORY,
            )
        return client  # type: ignore[return-value]

    def waiter_client(self) -> redis.Redis | None:
        """A second client for the lease store's waiters, when the store cannot derive one.

        Returns:
            A new client for a Sentinel URL (its pool finds the primary through the
            sentinels, so no pool can be derived from it), else None: a Cluster or factory
            client is shared.
        """
        if self.factory is None and not self.cluster and self.url.startswith("sentinel://"):
            return self.client()
        return None


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set)):
        return tuple(_freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def client_identity(settings) -> tuple:
    """A hashable key of what :func:`client_for_settings` builds.

    Args:
        settings: A :class:`~celery_steplock.conf.Settings`.

    Returns:
        Equal keys for equal clients (a factory counts by its identity).

    Raises:
        ImproperlyConfigured: A client setting is invalid.
    """
    return ClientConfig(settings).identity


def client_for_settings(settings, socket_timeout: float | None = None) -> redis.Redis:
    """The lease store's client for the settings.

    Args:
        settings: A :class:`~celery_steplock.conf.Settings`.
        socket_timeout: Seconds; overrides ``steplock_socket_timeout`` for a URL-built
            client.

    Returns:
        The client factory's client when ``steplock_redis_client_factory`` is set, else
        :func:`make_client` of the URL, transport options and TLS options.

    Raises:
        ImproperlyConfigured: A setting is invalid (naming it), or the factory fails or
            returns something that is not a redis client.
    """
    return ClientConfig(settings, socket_timeout).client()


# -- the asyncio clients ------------------------------------------------------------------


def async_client_for(client: Any) -> Any:
    """The ``redis.asyncio`` client of the running event loop that reaches what ``client``
    reaches (:func:`async_twin`, built once per loop and client).

    Args:
        client: A synchronous redis-py client (the lease store's, or one given to a
            pattern), or an asyncio client (returned as it is).

    Returns:
        A ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``.

    Raises:
        RuntimeError: No event loop is running.
        InvalidArgument: ``client`` has a shape no asyncio client can copy (naming
            ``client``).
    """
    if _is_async(client):
        return client
    # Kept in the loop's room (a redis.asyncio connection belongs to the loop that opened
    # it), by the client's id with a weak reference to tell a reused id apart, and closed
    # when the loop shuts down.
    kept = _loops.room()
    found = kept.values.get(("client", id(client)))
    if found is not None and found[0]() is client:
        return found[1]
    twin = async_twin(client)
    kept.values[("client", id(client))] = (weakref.ref(client), twin)
    kept.on_close(functools.partial(aclose_client, twin))
    return twin


async def aclose_client(client: Any) -> None:
    """Close a ``redis.asyncio`` client and every connection it opened: its pool's (a
    client built on a pool of its own making leaves the pool open on a plain ``aclose``),
    a Cluster client's nodes', a Sentinel client's connections to the sentinels.

    Args:
        client: A redis-py asyncio client.
    """
    # redis-py 5.0.1+ names it aclose (5.0: close); a Cluster client's takes no argument.
    close = getattr(client, "aclose", None) or client.close
    if "close_connection_pool" in inspect.signature(close).parameters:
        await close(close_connection_pool=True)
    else:
        await close()
    manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
    for sentinel in getattr(manager, "sentinels", ()):
        await aclose_client(sentinel)


def _is_async(client: Any) -> bool:
    from ._redis import aio

    return aio.is_async_client(client)


@functools.cache
def _accepted(*classes: type) -> frozenset[str]:
    names: set[str] = set()
    for cls in classes:
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                names.update(inspect.signature(init).parameters)
    return frozenset(names) - {"self", "args", "kwargs"}


def _async_retry(retry: Any) -> Any:
    from redis.asyncio.retry import Retry as AsyncRetry

    if retry is None or isinstance(retry, AsyncRetry):
        return retry
    return AsyncRetry(retry._backoff, retry._retries, tuple(retry._supported_errors))


def _async_kwargs(kwargs: dict[str, Any], *classes: type) -> dict[str, Any]:
    accepted = _accepted(*classes)
    out = {k: v for k, v in kwargs.items() if k in accepted and not k.startswith("maint_")}
    if "retry" in out:
        out["retry"] = _async_retry(out["retry"])
    if isinstance(out.get("ssl_cert_reqs"), int):
        # redis-py 5.0's asyncio TLS context reads this option only as a name.
        names = {
            ssl.CERT_NONE: "none",
            ssl.CERT_OPTIONAL: "optional",
            ssl.CERT_REQUIRED: "required",
        }
        out["ssl_cert_reqs"] = names[out["ssl_cert_reqs"]]
    return out


def async_twin(client: Any) -> Any:
    """A new ``redis.asyncio`` client with ``client``'s address, credentials, database, TLS,
    timeouts, retry policy and pool size: the same server through the same settings
    (``steplock_redis_url``, ``..._transport_options``, ``..._use_ssl``,
    ``..._cluster``). A Sentinel client's twin finds the primary through the same
    sentinels; a ``RedisCluster``'s twin is a ``redis.asyncio.cluster.RedisCluster`` from
    the same startup nodes.

    Args:
        client: A synchronous ``redis.Redis`` or ``redis.cluster.RedisCluster``.

    Returns:
        The asyncio client (nothing connects before its first command).

    Raises:
        InvalidArgument: ``client`` is neither (a client factory's look-alike): pass a
            ``redis.asyncio`` client instead (naming ``client``).
    """
    import redis.asyncio as aredis
    import redis.asyncio.connection as aconn

    from ._redis import cluster
    from .exceptions import InvalidArgument

    if cluster.is_cluster(client):
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        sync = cluster.resolve(client)
        manager = sync.nodes_manager
        nodes = [ClusterNode(n.host, n.port) for n in manager.startup_nodes.values()]
        kwargs = _async_kwargs(dict(manager.connection_kwargs), RedisCluster)
        kwargs.pop("host", None)
        kwargs.pop("port", None)
        if issubclass(
            manager.connection_kwargs.get("connection_class", object), redis.SSLConnection
        ):
            kwargs["ssl"] = True
        return RedisCluster(startup_nodes=nodes, **kwargs)
    pool = getattr(client, "connection_pool", None)
    if not isinstance(client, redis.Redis) or pool is None:
        raise InvalidArgument(
            f"client: no asyncio client can be built like {type(client).__module__}."
            f"{type(client).__qualname__}; pass a redis.asyncio client to the async API",
            argument="client",
        )
    from redis.sentinel import SentinelConnectionPool

    if isinstance(pool, SentinelConnectionPool):
        from redis.asyncio.sentinel import Sentinel as AsyncSentinel

        manager = pool.sentinel_manager
        addresses = []
        sentinel_kwargs: dict[str, Any] = {}
        for sentinel in manager.sentinels:
            skw = sentinel.connection_pool.connection_kwargs
            addresses.append((skw["host"], skw["port"]))
            # The sentinels' own clients take Redis() arguments; the primary's, a connection's.
            sentinel_kwargs = _async_kwargs(skw, aredis.Redis)
        sentinel_kwargs.pop("host", None)
        sentinel_kwargs.pop("port", None)
        primary = _async_kwargs(dict(manager.connection_kwargs), aconn.SSLConnection)
        primary = {k: v for k, v in primary.items() if k in _accepted(aredis.Redis)}
        if "ssl" in manager.connection_kwargs:
            primary["ssl"] = manager.connection_kwargs["ssl"]
        return AsyncSentinel(
            addresses,
            min_other_sentinels=manager.min_other_sentinels,
            sentinel_kwargs=sentinel_kwargs,
            **primary,
        ).master_for(pool.service_name)
    classes = {
        redis.SSLConnection: aconn.SSLConnection,
        redis.UnixDomainSocketConnection: aconn.UnixDomainSocketConnection,
    }
    cls = next(
        (a for s, a in classes.items() if issubclass(pool.connection_class, s)), aconn.Connection
    )
    kwargs = _async_kwargs(dict(pool.connection_kwargs), cls)
    return aredis.Redis(
        connection_pool=aredis.ConnectionPool(
            connection_class=cls, max_connections=pool.max_connections, **kwargs
        )
    )
