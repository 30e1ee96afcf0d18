"""The one door from the core to Django and to :mod:`celery_steplock.contrib.django`.

The core imports without Django. What it needs of Django (its settings, its app registry) or
of the Django integration (the database idempotency store, the step recovery, the methods of
Celery's ``DjangoTask``) is reached through here, lazily and by name, the way Celery finds its
result backends by name: nothing below ``contrib`` imports ``contrib`` or ``django`` itself.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

__all__ = [
    "CONTRIB",
    "contrib",
    "apps_ready",
    "installed",
    "secret_key",
    "debug",
    "watch_settings",
]

#: The Django app of this package (``INSTALLED_APPS``).
CONTRIB = "celery_steplock.contrib.django"


def contrib(module: str) -> ModuleType:
    """``celery_steplock.contrib.django.<module>``, imported on first use (it imports
    Django)."""
    return importlib.import_module(f"{CONTRIB}.{module}")


def apps_ready() -> bool:
    """Whether Django is imported and its app registry is ready (models usable)."""
    registry = getattr(sys.modules.get("django.apps"), "apps", None)
    return registry is not None and bool(registry.ready)


def installed() -> bool:
    """Whether Django's app registry is ready and :data:`CONTRIB` is in ``INSTALLED_APPS``
    (its models, the effects outbox's among them, are usable); False without Django."""
    if not apps_ready():
        return False
    registry = sys.modules["django.apps"].apps
    return bool(registry.is_installed(CONTRIB))


def secret_key() -> str | bytes | None:
    """Django's ``SECRET_KEY`` when Django is imported and configured and it is set, else
    None (a project without Django, or one whose settings are not configured)."""
    if "django" not in sys.modules:
        return None
    try:
        from django.conf import settings

        if not settings.configured:
            return None
        value = getattr(settings, "SECRET_KEY", None)
    except Exception:  # noqa: BLE001 - Django refuses to give an empty SECRET_KEY
        return None
    return value if isinstance(value, (str, bytes)) and value else None


def debug() -> bool:
    """Django's ``DEBUG`` (False when Django is not configured)."""
    from django.conf import settings

    return bool(getattr(settings, "DEBUG", False))


def field_does_not_exist() -> type[Exception]:
    """Django's ``FieldDoesNotExist``."""
    from django.core.exceptions import FieldDoesNotExist

    return FieldDoesNotExist


def watch_settings(receiver: Callable[..., Any], dispatch_uid: str) -> None:
    """Connect ``receiver`` to Django's ``setting_changed`` (``override_settings``) when
    Django is imported; nothing otherwise."""
    if "django" not in sys.modules:
        return
    try:
        from django.core.signals import setting_changed
    except ImportError:
        return
    setting_changed.connect(receiver, weak=False, dispatch_uid=dispatch_uid)
