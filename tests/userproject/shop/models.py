"""The names README's testing example imports (``from shop.models import Order``): the sample
shop keeps its models in its ``orders`` app."""

from orders.models import Charge, Order

__all__ = ["Charge", "Order"]
