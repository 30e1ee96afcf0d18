"""The asyncio API of the lease core: :class:`AsyncRedisLeaseStore` (the lease store on
``redis.asyncio``, with the synchronous store's scripts, keys, fencing tokens and errors) and
the per-event-loop heartbeat. The patterns' async forms are methods of the patterns' own
objects (``a``-prefixed, as Django's async ORM names them) and their decorators accept
``async def``. docs/howto/async.md has the table of which API has which form.
"""

from .heartbeat import AsyncHeartbeat, get_async_heartbeat
from .lock import AsyncRedisLeaseStore, LeaseContext, get_async_lease_store

__all__ = [
    "AsyncRedisLeaseStore",
    "LeaseContext",
    "get_async_lease_store",
    "AsyncHeartbeat",
    "get_async_heartbeat",
]
