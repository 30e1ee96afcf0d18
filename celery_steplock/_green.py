"""Green pools (gevent, eventlet): detection, and the native primitives the heartbeat needs.

Under ``celery worker -P gevent`` or ``-P eventlet`` the standard library is monkey patched:
``threading.Thread`` starts a greenlet, ``threading.Lock`` is a green lock and ``socket`` a
green socket. A greenlet runs until it yields, so a task body that computes for longer than a
TTL without any I/O would keep a green heartbeat from ever running and lose its lease. Under
a green pool the heartbeat therefore runs on a native OS thread (the interpreter switches
threads every ``sys.getswitchinterval()`` seconds whatever a greenlet does) and renews
through a client of its own whose sockets, locks and retry sleeps are the unpatched ones
(:func:`native_client`).

Everything here is looked up when called, never at import, so importing this module neither
imports gevent or eventlet nor fixes which primitives are used before a worker patches.
"""

from __future__ import annotations

import collections
import copy
import logging
import os
import sys
import types
from typing import Any, Callable

from .events import log_event
from .exceptions import ImproperlyConfigured

__all__ = [
    "green_pool",
    "native",
    "native_lock",
    "native_rlock",
    "native_sleep",
    "NativeCondition",
    "NativeFlag",
    "NativeThread",
    "Relay",
    "native_client",
    "native_store",
    "GreenPoolUnsupported",
]

logger = logging.getLogger("celery_steplock")


class GreenPoolUnsupported(ImproperlyConfigured):
    """The heartbeat cannot renew from a native thread under this green pool (e.g. the lock
    store's client has a connection class or pool that cannot be given unpatched sockets).

    ``pool`` names the pool (``"gevent"`` or ``"eventlet"``).
    """

    def __init__(self, message: str, pool: str | None = None):
        super().__init__(message, setting="worker_pool")
        self.pool = pool


def green_pool() -> str | None:
    """``"gevent"`` or ``"eventlet"`` when that library has monkey patched threads or sockets
    in this process, else None. Never imports either library."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and (
        monkey.is_module_patched("threading") or monkey.is_module_patched("socket")
    ):
        return "gevent"
    patcher = sys.modules.get("eventlet.patcher")
    if patcher is not None and (
        patcher.is_monkey_patched("thread") or patcher.is_monkey_patched("socket")
    ):
        return "eventlet"
    return None


class _GeventOriginals:
    """A module-like view of what gevent saved before patching ``module`` (attributes it
    did not patch are the module's own)."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        from gevent.monkey import get_original

        value = get_original(self._module, name)
        setattr(self, name, value)
        return value


def _fresh_import(name: str) -> Any:
    """A new, unpatched copy of the pure-Python module ``socket`` or ``ssl``: executed again
    from its source (its C parts, ``_socket`` and ``_ssl``, are never patched), ``ssl``
    against the fresh ``socket``. ``sys.modules`` is left as it was."""
    import importlib

    saved = {key: sys.modules.get(key) for key in ("socket", "ssl")}
    try:
        sys.modules.pop(name, None)
        if name == "ssl":
            sys.modules["socket"] = native("socket")
        return importlib.import_module(name)
    finally:
        for key, module in saved.items():
            if module is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = module


_originals: dict[tuple[str, str], Any] = {}


def native(module: str) -> Any:
    """The unpatched ``module`` (a standard-library module name such as ``"socket"``,
    ``"_thread"``, ``"time"``, ``"ssl"``): the module itself when nothing is patched."""
    pool = green_pool()
    found = _originals.get((pool or "", module))
    if found is None:
        if pool and module in ("socket", "ssl"):
            # Neither gevent's saved attributes nor eventlet's ``original`` give a whole
            # unpatched ssl (its classes refer to the patched socket and to each other).
            found = _fresh_import(module)
        elif pool == "gevent":
            found = _GeventOriginals(module)
        elif pool == "eventlet":
            from eventlet.patcher import original

            found = original(module)
        else:
            found = __import__(module)
        _originals[(pool or "", module)] = found
    return found


def native_lock() -> Any:
    """A new OS-level lock (``acquire(blocking=True, timeout=-1)``, ``release``)."""
    return native("_thread").allocate_lock()


def native_rlock():
    """A new OS-level re-entrant lock."""
    return native("_thread").RLock()


def native_sleep(seconds: float) -> None:
    """Sleep ``seconds`` blocking the calling OS thread (never a hub)."""
    native("time").sleep(seconds)


class NativeCondition:
    """A condition variable made of OS-level locks, shared by greenlets and native threads.

    ``with cond:`` holds its lock; ``wait(timeout)`` (seconds, None: until notified) releases
    it meanwhile; ``notify()`` wakes one waiter. A greenlet that waits or contends here
    blocks its whole hub, so greenlets only take it for a few dictionary operations and
    only native threads wait on it.
    """

    def __init__(self) -> None:
        self._lock = native_lock()
        self._waiters: list = []

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        waiter = native_lock()
        waiter.acquire()
        self._waiters.append(waiter)
        self._lock.release()
        try:
            if timeout is None:
                return waiter.acquire()
            return waiter.acquire(True, max(0.0, timeout))
        finally:
            self._lock.acquire()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def notify(self, n: int = 1) -> None:
        for waiter in self._waiters[:n]:
            self._waiters.remove(waiter)
            waiter.release()


class NativeFlag:
    """The part of ``threading.Event`` a lease's loss flag needs (``is_set``, ``set``,
    ``clear``), safe to set from a native thread while greenlets read it: a plain attribute
    (one store is atomic under the GIL), no lock a greenlet could hold."""

    __slots__ = ("_value",)

    def __init__(self, value: bool = False) -> None:
        self._value = value

    def is_set(self) -> bool:
        return self._value

    def set(self) -> None:
        self._value = True

    def clear(self) -> None:
        self._value = False


class Relay:
    """Runs calls handed over by native threads on a greenlet of the green pool's hub, in
    order: log lines and signals of the native heartbeat, whose handlers and receivers hold
    green locks and do green I/O that a native thread must not touch.

    Make it from a greenlet (it starts its reader greenlet with the patched
    ``threading.Thread``). :meth:`call` is safe from any thread and never blocks: it queues
    the call and writes one byte to a socket pair the reader waits on. :meth:`drain` runs
    what is queued in the calling greenlet.
    """

    def __init__(self) -> None:
        import socket
        import threading

        self._calls: collections.deque = collections.deque()
        self._reader, self._writer = socket.socketpair()  # green sockets, non-blocking fds
        self._wake_fd = self._writer.fileno()
        threading.Thread(target=self._loop, name="steplock-relay", daemon=True).start()

    def call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._calls.append((function, args, kwargs))
        try:
            os.write(self._wake_fd, b"\0")
        except OSError:  # BlockingIOError: wake-ups are pending already
            pass

    def drain(self) -> None:
        while True:
            try:
                function, args, kwargs = self._calls.popleft()
            except IndexError:
                return
            try:
                function(*args, **kwargs)
            except Exception:  # noqa: BLE001 - one failing call must not stop the others
                log_event(
                    "heartbeat_error", logging.ERROR, exc_info=True, reason="a relayed call failed"
                )

    def _loop(self) -> None:
        while True:
            try:
                self._reader.recv(4096)
            except OSError:
                return
            self.drain()


class NativeThread:
    """An OS thread started with the unpatched ``_thread.start_new_thread``: the shape of
    ``threading.Thread`` the heartbeat exposes (``name``, ``daemon``, ``ident``,
    ``start()``, ``is_alive()``, ``join(timeout)``). It is always a daemon: nothing waits
    for it at interpreter exit."""

    daemon = True

    def __init__(self, target: Callable[[], Any], name: str) -> None:
        self.target = target
        self.name = name
        self.ident: int | None = None
        self._running = native_lock()

    def start(self) -> None:
        self._running.acquire()
        try:
            native("_thread").start_new_thread(self._bootstrap, ())
        except BaseException:
            self._running.release()
            raise

    def _bootstrap(self) -> None:
        self.ident = native("_thread").get_ident()
        try:
            self.target()
        finally:
            self._running.release()

    def is_alive(self) -> bool:
        return self._running.locked()

    def join(self, timeout: float | None = None) -> None:
        if self._running.acquire(True, -1 if timeout is None else max(0.0, timeout)):
            self._running.release()

    def __repr__(self) -> str:
        return f"<NativeThread {self.name} alive={self.is_alive()}>"


# -- the heartbeat's own client ------------------------------------------------------------


def _rebind(function: Callable, **names: Any) -> Callable:
    """``function`` with some of its module globals replaced (a copy; the original is
    untouched): how a redis-py method comes to use the unpatched ``socket``/``ssl``/``sleep``
    without any change to redis-py."""
    namespace = dict(function.__globals__)
    namespace.update(names)
    clone = types.FunctionType(
        function.__code__,
        namespace,
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    clone.__kwdefaults__ = function.__kwdefaults__
    clone.__qualname__ = function.__qualname__
    clone.__doc__ = function.__doc__
    return clone


_connection_classes: dict[tuple[str, type], type] = {}


def _unshared_ssl_context(build: Callable, *_: Any) -> Any:
    return build()


def _native_connection_class(cls: type, pool: str) -> type:
    """A subclass of redis-py connection class ``cls`` whose socket is made with the
    unpatched ``socket`` (and ``ssl``) modules. Raises GreenPoolUnsupported for a class
    whose ``_connect`` is not one of redis-py's own TCP, TLS or Unix-socket ones."""
    from redis import connection as rc

    found = _connection_classes.get((pool, cls))
    if found is not None:
        return found
    socket_module = native("socket")
    tcp = _rebind(rc.Connection._connect, socket=socket_module)
    attrs: dict[str, Any] = {}
    bases: tuple[type, ...] = (cls,)
    redis_py_tls = (
        issubclass(cls, rc.SSLConnection)
        and cls._connect is rc.SSLConnection._connect
        and all(
            getattr(cls, name, None) is getattr(rc.SSLConnection, name, None)
            for name in ("_wrap_socket_with_ssl", "_build_ssl_context")
        )
    )
    if redis_py_tls and hasattr(rc.SSLConnection, "_wrap_socket_with_ssl"):
        # redis-py 8.2 shares contexts under a lock made after the monkey-patching (a green
        # lock, which a native thread must not take): the native connections, two at most,
        # build their own.
        wrap = _rebind(
            rc.SSLConnection._wrap_socket_with_ssl,
            ssl=native("ssl"),
            socket=socket_module,
            get_shared_ssl_context=_unshared_ssl_context,
        )

        def _connect(self):
            sock = tcp(self)
            try:
                return wrap(self, sock)
            except BaseException:
                sock.close()
                raise

        attrs["_connect"] = _connect
        if hasattr(rc.SSLConnection, "_build_ssl_context"):
            # redis-py 8.2 makes the SSLContext in a method of its own, and its context's
            # wrap_socket decides the socket's class.
            attrs["_build_ssl_context"] = _rebind(
                rc.SSLConnection._build_ssl_context, ssl=native("ssl"), socket=socket_module
            )
    elif redis_py_tls:
        # redis-py 5.0 wraps the socket inside SSLConnection._connect, which makes it with
        # super()._connect(): that super() is pointed at a class whose next one has ``tcp``.
        class _NativeTCP:
            _connect = tcp

        class _SSLCell(_NativeTCP):
            pass

        function = _rebind(rc.SSLConnection._connect, ssl=native("ssl"), socket=socket_module)
        cells = tuple(
            types.CellType(_SSLCell) if name == "__class__" else cell
            for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ())
        )
        attrs["_connect"] = types.FunctionType(
            function.__code__,
            function.__globals__,
            function.__name__,
            function.__defaults__,
            cells,
        )
        bases = (_SSLCell, cls)
    elif (
        issubclass(cls, rc.UnixDomainSocketConnection)
        and cls._connect is rc.UnixDomainSocketConnection._connect
    ):
        attrs["_connect"] = _rebind(rc.UnixDomainSocketConnection._connect, socket=socket_module)
    elif issubclass(cls, rc.Connection) and cls._connect is rc.Connection._connect:
        attrs["_connect"] = tcp
    else:
        raise GreenPoolUnsupported(
            f"celery-steplock: under the {pool} pool the heartbeat renews leases from a "
            f"native thread with unpatched sockets, which it cannot do for the lock store's "
            f"connection class {cls.__module__}.{cls.__qualname__}; run this worker with "
            f"-P prefork or -P threads, or use a redis://, rediss:// or unix:// URL",
            pool=pool,
        )
    found = type(f"Native{cls.__name__}", bases, attrs)
    _connection_classes[(pool, cls)] = found
    return found


def _native_retry(retry: Any) -> Any:
    """A copy of a redis-py ``Retry`` whose backoff sleeps block the OS thread."""
    from redis import retry as rr

    if retry is None or type(retry) is not rr.Retry:
        return retry
    clone = copy.copy(retry)
    clone.__class__ = _NativeRetryType()
    return clone


_retry_type: list[type] = []


def _NativeRetryType() -> type:
    from redis import retry as rr

    if not _retry_type:
        _retry_type.append(
            type(
                "NativeRetry",
                (rr.Retry,),
                {"call_with_retry": _rebind(rr.Retry.call_with_retry, sleep=native_sleep)},
            )
        )
    return _retry_type[0]


def _nativize_locks(obj: Any, *names: str) -> None:
    for name in names:
        if hasattr(obj, name):
            setattr(obj, name, native_rlock())


def native_client(client: Any, pool: str | None = None) -> Any:
    """A new ``redis.Redis`` for the heartbeat's native thread, connecting where ``client``
    does with the same options (its pool's ``connection_kwargs``), through unpatched sockets,
    OS-level pool locks and retry sleeps; at most 2 connections. ``pool`` (default: the
    detected green pool) only names the pool in errors.

    Raises :class:`GreenPoolUnsupported` when that cannot be done: ``client`` has no single
    connection pool (e.g. ``RedisCluster``), its pool is not redis-py's ``ConnectionPool`` or
    ``BlockingConnectionPool`` (e.g. Sentinel's, which asks the sentinels through green
    sockets), or its connection class makes its socket in a way of its own.
    """
    import redis
    from redis import connection as rc

    from ._redis import cluster

    pool = pool or green_pool() or "green"
    # Checked before reading connection_pool: a deferred Cluster client would be built by
    # that read, raising while the cluster is down (and Celery drops errors of worker_init).
    source: Any = None if cluster.is_cluster(client) else getattr(client, "connection_pool", None)
    if type(source) not in (rc.ConnectionPool, rc.BlockingConnectionPool):
        what = (
            "RedisCluster"
            if cluster.is_cluster(client)
            else type(client).__name__
            if source is None
            else type(source).__name__
        )
        raise GreenPoolUnsupported(
            f"celery-steplock: under the {pool} pool the heartbeat renews leases from a "
            f"native thread with a client of its own, which it cannot derive from a {what}; "
            f"run this worker with -P prefork or -P threads",
            pool=pool,
        )
    kwargs = dict(source.connection_kwargs)
    if kwargs.get("ssl_validate_ocsp") or kwargs.get("ssl_validate_ocsp_stapled"):
        # the OCSP check calls out over HTTP through the patched ``ssl`` and ``socket``
        raise GreenPoolUnsupported(
            f"celery-steplock: under the {pool} pool the heartbeat renews leases from a "
            f"native thread, which cannot run redis-py's OCSP validation "
            f"(ssl_validate_ocsp); run this worker with -P prefork or -P threads, or leave "
            f"OCSP validation off",
            pool=pool,
        )
    kwargs["retry"] = _native_retry(kwargs.get("retry"))
    connection_class = _native_connection_class(source.connection_class, pool)
    native_pool = rc.ConnectionPool(connection_class=connection_class, max_connections=2, **kwargs)
    _nativize_locks(native_pool, "_lock", "_fork_lock")
    derived = redis.Redis(connection_pool=native_pool)
    _nativize_locks(getattr(derived, "_event_dispatcher", None), "_lock")
    _nativize_locks(derived, "single_connection_lock")
    return derived


def native_store(store: Any, pool: str | None = None) -> Any:
    """A copy of the lease store ``store`` (same prefix, scripts and clock) on
    :func:`native_client` of its client. Raises :class:`GreenPoolUnsupported` as that does."""
    twin = copy.copy(store)
    twin.client = native_client(store.client, pool)
    return twin
