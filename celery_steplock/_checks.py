"""The checks and bounds every setting, task option and argument goes through: each returns
the value or raises :class:`~celery_steplock.exceptions.ImproperlyConfigured` naming the
setting or option; a value out of range is refused by name, never clamped."""

from __future__ import annotations

import hashlib
import hmac
import math
import reprlib
from typing import Any, Literal, cast, overload

from .exceptions import ImproperlyConfigured

# Every setting, task option and argument of the lease store's public methods is checked
# against these, below and above: a value out of range is refused by name, never clamped.

#: Any duration, seconds: ten years (far inside what Redis PEXPIRE and a float keep exact).
MAX_SECONDS = 10 * 366 * 24 * 3600.0
#: ``steplock_lock_wait`` / ``lock_wait`` / ``acquire(wait=)``: one day.
MAX_WAIT = 24 * 3600.0
#: ``steplock_max_hold`` / ``lock_max_hold``: thirty days.
MAX_HOLD = 30 * 24 * 3600.0
#: ``steplock_retry_backoff`` and ``steplock_retry_backoff_max``: one day.
MAX_BACKOFF = 24 * 3600.0
#: ``steplock_retry_max`` / ``lock_retry_max``.
MAX_RETRIES = 1_000_000
#: ``steplock_socket_timeout``: ten minutes.
MAX_SOCKET_TIMEOUT = 600.0
#: ``steplock_fence_ttl`` / ``RedisLeaseStore(fence_ttl=)``: one second to one year.
MIN_FENCE_TTL = 1.0
MAX_FENCE_TTL = 366 * 24 * 3600.0
# A name's history (celery_steplock.history): entries kept per name, seconds kept.
MIN_HISTORY_MAX_ENTRIES = 1
MAX_HISTORY_MAX_ENTRIES = 100_000
MIN_HISTORY_MAX_AGE = 1.0
MAX_HISTORY_MAX_AGE = 366 * 24 * 3600.0
#: ``steplock_activity_flush_interval``, seconds: at least once per minute bucket.
MIN_ACTIVITY_FLUSH_INTERVAL = 1.0
MAX_ACTIVITY_FLUSH_INTERVAL = 60.0
#: ``steplock_max_waiters`` / ``RedisLeaseStore(max_waiters=)``.
MAX_WAITERS_LIMIT = 100_000
#: ``steplock_reaper_older_than``: one year.
MAX_REAPER_OLDER_THAN = 366 * 24 * 3600.0
#: ``steplock_reaper_recover``: models, and statuses per model.
MAX_RECOVER_MODELS = 1000
#: ``steplock_key_prefix`` / ``RedisLeaseStore(prefix=)``, characters.
MAX_PREFIX_LENGTH = 64
#: Field names, database aliases, qualified names of settings, characters.
MAX_IDENTIFIER_LENGTH = 255
#: ``steplock_name_secret``, characters (or bytes).
MIN_SECRET_LENGTH = 32
MAX_SECRET_LENGTH = 4096
#: An owner token given to the lease store, characters (ours are 32).
MAX_OWNER_LENGTH = 256
#: ``count`` of one SCAN step of the lease store.
MAX_SCAN_COUNT = 100_000
#: An idempotency record's TTL and lock TTL, seconds: a tenth of a second to one year.
MIN_IDEMPOTENCY_TTL = 0.1
MAX_IDEMPOTENCY_TTL = 366 * 24 * 3600.0
#: The live idempotency records one principal of the HTTP layer may hold
#: (``steplock_idempotency_max_records``, ``max_records=``): one to a million.
MIN_IDEMPOTENCY_MAX_RECORDS = 1
MAX_IDEMPOTENCY_MAX_RECORDS = 1_000_000
#: How far a Redis time stored by a pattern (a bucket's refill time, a sliding window's
#: grants, a breaker's ``opened_ms``, ticket, waiter and probe permit times) may be ahead of
#: Redis ``TIME`` before it is taken for the state of a clock that ran ahead (a failover to a
#: primary whose clock is behind): clamped to now and reported (``clock_skew``), seconds.
CLOCK_SKEW_TOLERANCE = 1.0
#: How much of an invalid value an error message quotes, characters.
MAX_SHOWN = 80

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = _shown.maxlong = MAX_SHOWN
_shown.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)`` cut to about :data:`MAX_SHOWN` characters, for error messages: a value
    of 10 MiB gives a message of a line, and a value whose repr fails gives its type."""
    try:
        return _shown.repr(value)
    except Exception:  # noqa: BLE001 - an int past the digit limit, a failing __repr__
        return f"<{type(value).__name__}>"


def setting_name(name: str) -> str:
    """``"default_ttl"`` -> ``"steplock_default_ttl"``."""
    return f"steplock_{name}"


def describe(name: str) -> str:
    """A setting's name as both Celery and Django users write it; task options as is."""
    if name.startswith("steplock_"):
        return f"{name} (CELERY_{name.upper()} in Django settings)"
    return name


@overload
def check_seconds(
    value: Any,
    name: str,
    *,
    allow_zero: bool = ...,
    allow_none: Literal[False] = ...,
    maximum: float = ...,
    minimum: float | None = ...,
) -> float: ...
@overload
def check_seconds(
    value: Any,
    name: str,
    *,
    allow_zero: bool = ...,
    allow_none: bool = ...,
    maximum: float = ...,
    minimum: float | None = ...,
) -> float | None: ...
def check_seconds(
    value: Any,
    name: str,
    *,
    allow_zero: bool = False,
    allow_none: bool = False,
    maximum: float = MAX_SECONDS,
    minimum: float | None = None,
) -> float | None:
    """Return ``value`` as float seconds, or raise ImproperlyConfigured naming ``name``: a
    number (not a bool), above 0 (or >= 0 with ``allow_zero``; >= ``minimum`` when given)
    and at most ``maximum`` (default :data:`MAX_SECONDS`); None only with ``allow_none``."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (isinstance(value, float) and (math.isnan(value) or math.isinf(value)))
    ):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a number of seconds, got {shown(value)}", setting=name
        )
    if minimum is not None and value < minimum:
        raise ImproperlyConfigured(
            f"{describe(name)} must be between {minimum:g} and "
            f"{maximum:g} seconds, got {shown(value)}",
            setting=name,
        )
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ImproperlyConfigured(
            f"{describe(name)} must be {bound} seconds, got {shown(value)}", setting=name
        )
    if value > maximum:
        raise ImproperlyConfigured(
            f"{describe(name)} must be at most {maximum:g} seconds, got {shown(value)}",
            setting=name,
        )
    return float(value)


@overload
def check_count(
    value: Any, name: str, *, minimum: int = ..., maximum: int, allow_none: Literal[False] = ...
) -> int: ...
@overload
def check_count(
    value: Any, name: str, *, minimum: int = ..., maximum: int, allow_none: bool = ...
) -> int | None: ...
def check_count(
    value: Any, name: str, *, minimum: int = 0, maximum: int, allow_none: bool = False
) -> int | None:
    """Return ``value`` if it is a whole number (not a bool) within [minimum, maximum], or
    None with ``allow_none``; else raise ImproperlyConfigured naming ``name``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        none = "None or " if allow_none else ""
        raise ImproperlyConfigured(
            f"{describe(name)} must be {none}a whole number from "
            f"{minimum} to {maximum}, got {shown(value)}",
            setting=name,
        )
    return value


def check_text(
    value: Any,
    name: str,
    *,
    maximum: int = MAX_IDENTIFIER_LENGTH,
    what: str = "a non-empty string",
) -> str:
    """Return ``value`` if it is a non-empty str of at most ``maximum`` characters, else
    raise ImproperlyConfigured naming ``name`` (``what`` says what was expected)."""
    if not isinstance(value, str) or not value or len(value) > maximum:
        raise ImproperlyConfigured(
            f"{describe(name)} must be {what} of at most {maximum} characters, got {shown(value)}",
            setting=name,
        )
    return value


#: Bounds of a lease TTL, seconds: below the minimum the drift allowance and one round trip
#: eat the lease; above the maximum a lease is a bug (the heartbeat keeps short ones alive).
MIN_TTL = 0.05
MAX_TTL = 24 * 3600.0
#: The renewal interval may use at most this share of the TTL, leaving time for a retry.
MAX_RENEWAL_RATIO = 0.75
#: ... and at least this share (a smaller one is a renewal busy loop), and never less than
#: MIN_RENEWAL_INTERVAL seconds whatever the TTL (the heartbeat waits at least that long).
MIN_RENEWAL_RATIO = 0.05
MIN_RENEWAL_INTERVAL = 0.01


def check_ttl(value: Any, name: str) -> float:
    """Return ``value`` as a TTL in seconds within [MIN_TTL, MAX_TTL], else raise."""
    if type(value) is float and MIN_TTL <= value <= MAX_TTL:
        return value  # the common case, on the lease store's hot paths
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not MIN_TTL <= value <= MAX_TTL
    ):  # NaN compares false
        raise ImproperlyConfigured(
            f"{describe(name)} must be a number of seconds between "
            f"{MIN_TTL} and {MAX_TTL:.0f}, got {shown(value)}",
            setting=name,
        )
    return float(value)


def check_fence_ttl(value: Any, name: str) -> float:
    """Return ``value`` as a fencing counter's lifetime in seconds within [MIN_FENCE_TTL,
    MAX_FENCE_TTL], else raise ImproperlyConfigured naming ``name``."""
    return check_seconds(value, name, minimum=MIN_FENCE_TTL, maximum=MAX_FENCE_TTL)


#: The message of the documented derivation of the name secret from Django's SECRET_KEY.
NAME_SECRET_DERIVATION = b"celery_steplock lock names v1"


def derive_name_secret(secret_key: str | bytes) -> bytes:
    """The name secret derived from a Django ``SECRET_KEY``: HMAC-SHA256 with ``SECRET_KEY``
    (UTF-8) as the key over :data:`NAME_SECRET_DERIVATION`, 32 bytes. One-way: the lock names
    and idempotency keys made with it reveal nothing of ``SECRET_KEY``."""
    key = secret_key.encode() if isinstance(secret_key, str) else bytes(secret_key)
    return hmac.new(key, NAME_SECRET_DERIVATION, hashlib.sha256).digest()


def check_name_secret(value: Any, name: str = "steplock_name_secret") -> bytes:
    """Return ``value`` (str or bytes of MIN_SECRET_LENGTH to MAX_SECRET_LENGTH) as the bytes
    of the HMAC key, else raise ImproperlyConfigured naming ``name`` (the value is never
    quoted: it is a secret)."""
    if (
        not isinstance(value, (str, bytes))
        or not MIN_SECRET_LENGTH <= len(value) <= MAX_SECRET_LENGTH
    ):
        what = (
            f"{len(value)} characters"
            if isinstance(value, (str, bytes))
            else f"a {type(value).__name__}"
        )
        raise ImproperlyConfigured(
            f"{describe(name)} must be a string of {MIN_SECRET_LENGTH} to {MAX_SECRET_LENGTH} "
            f"characters shared by every worker (e.g. secrets.token_urlsafe(32)), got {what}",
            setting=name,
        )
    return value.encode() if isinstance(value, str) else bytes(value)


def check_key_prefix(prefix: Any, name: str = "steplock_key_prefix") -> str:
    """Return ``prefix`` if it can namespace the lease store's keys, else raise
    ImproperlyConfigured naming ``name``."""
    if (
        not isinstance(prefix, str)
        or not prefix
        or len(prefix) > MAX_PREFIX_LENGTH
        or any(c in "{}*?[]\\" or c.isspace() or not c.isprintable() for c in prefix)
    ):
        raise ImproperlyConfigured(
            f"{describe(name)} must be a non-empty string of at most "
            f"{MAX_PREFIX_LENGTH} printable characters without "
            f"braces, glob characters (*?[]\\) or spaces, got {shown(prefix)}",
            setting=name,
        )
    return prefix


def check_bool(value: Any, name: str) -> bool:
    """Return ``value`` if it is a bool, else raise (``"false"`` is not False)."""
    if not isinstance(value, bool):
        raise ImproperlyConfigured(
            f"{describe(name)} must be True or False, got {shown(value)}", setting=name
        )
    return value


def check_choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise ImproperlyConfigured."""
    if value not in choices:
        raise ImproperlyConfigured(
            f"{describe(name)} must be one of {', '.join(map(repr, choices))}, got {shown(value)}",
            setting=name,
        )
    return cast(str, value)


def check_database(value: Any, name: str) -> str | None:
    """Return ``value`` if it is None or a database name (a non-empty string without
    surrounding spaces), else raise ImproperlyConfigured naming ``name``. Whether the
    database exists is the step store's to say."""
    if value is not None and (
        not isinstance(value, str)
        or not value
        or value != value.strip()
        or len(value) > MAX_IDENTIFIER_LENGTH
    ):
        raise ImproperlyConfigured(
            f"{describe(name)} must be None or a database alias (a key of DATABASES), "
            f"got {shown(value)}",
            setting=name,
        )
    return value
