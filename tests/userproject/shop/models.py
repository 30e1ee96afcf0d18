"""The names the eager-mode example of docs/howto/testing.md imports (``from shop.models
import Order``): the sample shop keeps its models in its ``orders`` app."""

from orders.models import Charge, Order

__all__ = ["Charge", "Order"]
