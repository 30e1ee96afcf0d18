"""The names the eager-mode example of docs/howto/testing.md imports (``from shop.tasks import charge``)."""

from orders.tasks import charge

__all__ = ["charge"]
