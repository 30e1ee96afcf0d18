"""What the asyncio API keeps per event loop, and how it ends with the loop.

A ``redis.asyncio`` connection belongs to the loop that opened it, so the asyncio clients,
lease stores and heartbeat are kept per loop, in the loop's :class:`Room`. A room closes
what it holds (the clients' connections) when its loop shuts down: ``asyncio.run``,
asgiref's ``async_to_sync`` and uvicorn call ``loop.shutdown_asyncgens()`` before closing a
loop, which closes the room's keeper (an async generator started on the loop), whose
``finally`` lets the cleanups still running finish (:func:`background`: the releases of
cancelled callers), then runs the room's closers on the loop. The room of a loop closed without that
(``run_until_complete`` then ``close``) is dropped when the next room is made, and what it
held is left to the garbage collector. Nothing here holds a loop but through its room, so a
finished loop, its connections and their file descriptors do not outlive it.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable

__all__ = ["Room", "room", "background"]


#: Seconds a shutting-down loop gives the cleanups still running (a release, a waiter entry
#: dropped: a round trip or two each) before it cancels them and closes the connections.
CLEANUP_GRACE = 5.0


class Room:
    """What one event loop keeps: ``values`` by key (the caller's own keys), the
    :func:`background` tasks still running, and the closers run, last registered first,
    when the loop shuts down."""

    __slots__ = ("values", "tasks", "_closers", "_keeper", "__weakref__")

    def __init__(self) -> None:
        self.values: dict[Any, Any] = {}
        self.tasks: set[asyncio.Future[Any]] = set()
        self._closers: list[Callable[[], Awaitable[Any]]] = []
        self._keeper: Any = None

    def on_close(self, closer: Callable[[], Awaitable[Any]]) -> None:
        """Run ``closer()`` (a coroutine function) on the loop when it shuts down."""
        self._closers.append(closer)

    async def aclose(self) -> None:
        """Let the background tasks finish (at most :data:`CLEANUP_GRACE` seconds, then
        cancel them), then forget every value and run every closer (an error of one does
        not stop the others: the loop is ending)."""
        deadline = asyncio.get_running_loop().time() + CLEANUP_GRACE
        while True:
            pending = {task for task in self.tasks if not task.done()}
            left = deadline - asyncio.get_running_loop().time()
            if not pending or left <= 0:
                break
            await asyncio.wait(pending, timeout=left)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
        closers, self._closers = self._closers, []
        self.values.clear()
        for closer in reversed(closers):
            try:
                await closer()
            except Exception:  # noqa: BLE001 - the loop is ending: nothing to tell
                pass


# id(loop) -> (a weak reference to the loop, its room); plain ids, so that no entry holds
# a loop: a room's values may (a connection holds its loop), which a weak-keyed map would
# then keep forever.
_rooms: dict[int, tuple[weakref.ref[Any], Room]] = {}
_guard = threading.Lock()


def room() -> Room:
    """The running event loop's :class:`Room` (made on first use).

    Raises:
        RuntimeError: No event loop is running.
    """
    loop = asyncio.get_running_loop()
    found = _rooms.get(id(loop))
    if found is not None and found[0]() is loop:
        return found[1]
    made = Room()
    with _guard:
        for ident, (ref, _room) in list(_rooms.items()):
            gone = ref()
            if gone is None or gone is loop or gone.is_closed():
                del _rooms[ident]
        _rooms[id(loop)] = (weakref.ref(loop), made)
    made._keeper = _keeper(id(loop), made)
    # Run the keeper to its ``yield`` now: its first step registers it with the loop's
    # async-generator hooks, so ``shutdown_asyncgens`` closes it (running its ``finally``).
    try:
        made._keeper.__anext__().send(None)
    except StopIteration:
        pass
    return made


async def _keeper(ident: int, kept: Room) -> AsyncIterator[None]:
    try:
        yield
    finally:
        try:
            await kept.aclose()  # the room still answers room() meanwhile
        finally:
            with _guard:
                found = _rooms.get(ident)
                if found is not None and found[1] is kept:
                    del _rooms[ident]


def rooms() -> int:
    """How many rooms are held (for tests: a finished loop's is gone)."""
    return len(_rooms)


def background(work: Any) -> asyncio.Future[Any]:
    """Run ``work`` (a coroutine) as a task of the running loop that nothing can cancel by
    cancelling its caller, kept (in the loop's :class:`Room`) until it ends, and waited for
    when the loop shuts down (``asyncio.run`` cancels its caller's task, whose cleanup this
    is, just before); its error, if any, is read (the lease it was freeing runs out with
    its TTL). Await it through ``asyncio.shield`` to wait for it without exposing it to the
    caller's cancellation.

    Args:
        work: A coroutine (a release, a ZREM of a waiter entry).

    Returns:
        The task.

    Raises:
        RuntimeError: No event loop is running.
    """
    kept = room()
    task = asyncio.ensure_future(work)
    kept.tasks.add(task)
    task.add_done_callback(functools.partial(_settled, kept.tasks))
    return task


def _settled(tasks: set[asyncio.Future[Any]], task: asyncio.Future[Any]) -> None:
    tasks.discard(task)
    if not task.cancelled():
        task.exception()
