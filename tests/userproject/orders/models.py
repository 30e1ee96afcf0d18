from django.db import models


class Order(models.Model):
    status = models.CharField(max_length=20, default="pending")
    lock_owner = models.CharField(max_length=64, blank=True, default="")
    lock_fence = models.BigIntegerField(null=True, blank=True)


class Charge(models.Model):
    """Written by the task's body, in the transaction of the order's compare-and-swap."""

    order = models.ForeignKey(Order, on_delete=models.CASCADE)
    idempotency_key = models.CharField(max_length=200)
    fence = models.BigIntegerField()
