"""Staff users and logged-in clients for the admin tests (tests/contrib/test_admin*.py)."""

from __future__ import annotations

from django.contrib.auth.models import Permission
from django.test import Client


def staff_user(django_user_model, username: str, *perms: str):
    """A staff user (password ``"pw"``) holding ``perms`` (``"app_label.codename"`` each)."""
    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label=app_label, codename=codename)
        )
    return user


def login(user, **kwargs) -> Client:
    """A test client (``kwargs``: :class:`django.test.Client`'s) logged in as ``user``."""
    client = Client(**kwargs)
    client.force_login(user)
    return client


def staff(django_user_model, username: str, *perms: str) -> Client:
    """A client logged in as a new :func:`staff_user`."""
    return login(staff_user(django_user_model, username, *perms))
