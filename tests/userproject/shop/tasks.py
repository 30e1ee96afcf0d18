"""The names README's testing example imports (``from shop.tasks import charge``)."""

from orders.tasks import charge

__all__ = ["charge"]
