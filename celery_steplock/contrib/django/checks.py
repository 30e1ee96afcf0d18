"""Django system checks of celery-steplock, with stable ids (``manage.py check``).

==========================  ==============================================================
``celery_steplock.E001``    the Redis lock store does not answer PING. A *deployment*
                            check (``manage.py check --deploy``; ``--deploy --tag
                            celery_steplock`` runs this app's checks only), so ordinary
                            commands never touch the network.
``celery_steplock.E002``    a registered StepLockedTask's ``step_model`` does not exist or
                            has no field named by ``steplock_status_field``.
``celery_steplock.E003``    a ``steplock_*`` setting is invalid (one error per setting).
``celery_steplock.E004``    a StepLockedTask option is invalid (one error per option, every
                            option judged; also a ``lock_key`` placeholder or ``step_id_arg``
                            that is no argument of the task, a callable ``lock_key`` that
                            cannot take the task's arguments).
``celery_steplock.E005``    a model of ``steplock_reaper_recover`` the reaper cannot recover
                            (missing, no status or owner column, no ``updated_at`` with
                            ``steplock_reaper_older_than`` > 0, a status not among the
                            status field's choices).
``celery_steplock.E010``    ``IdempotencyMiddleware`` is in ``MIDDLEWARE`` before
                            ``AuthenticationMiddleware`` (or without it) while it scopes
                            keys by ``request.user`` (no ``scope`` in
                            ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE``): every request would be
                            anonymous to it, and keys refused.
``celery_steplock.E011``    ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE`` is invalid: not a dict, an
                            unknown option (with a did-you-mean), or an option of the wrong
                            type or out of its bounds (the validation the middleware runs
                            at its load).
``celery_steplock.W001``    a lease TTL (``steplock_default_ttl`` or a task's ``lock_ttl``)
                            is not below the broker's ``visibility_timeout`` (Redis
                            transport default: 3600 s).
``celery_steplock.W002``    StepLockedTasks without ``acks_late`` + ``reject_on_worker_lost``:
                            a killed worker's message is acknowledged and never redelivered.
``celery_steplock.W003``    the Celery app's task modules could not be imported, so E002,
                            W001, W002 and W004 only judged the tasks registered anyway.
``celery_steplock.W005``    a setting or task option that does not exist, with a
                            did-you-mean: ``CELERY_STEPLOCK_DEFUALT_TTL``, a ``STEPLOCK_*``
                            Django setting without the ``CELERY_`` namespace (or any
                            ``*STEPLOCK*`` setting when the Celery app does not read the
                            Django settings), ``@app.task(lock_tll=5)``.
``celery_steplock.W004``    a StepLockedTask's ``soft_time_limit`` is not below its
                            ``time_limit``, or its ``time_limit`` (or the lease retries'
                            ``steplock_retry_backoff_max``) is not below the broker's
                            ``visibility_timeout``.
``celery_steplock.W006``    a setting set under its former name (``steplock_bulkhead_*``,
                            now ``steplock_concurrency_limit_*``): still read for one
                            release while the new name is unset, ignored beside it.
``celery_steplock.W012``    StepLockedTasks with ``on_conflict="return_winner"`` while
                            ``CELERY_RESULT_EXTENDED`` is off: the stored results name no
                            task, so a duplicate never gets the winner's result.
``celery_steplock.W008``    a step model (the ``step_model`` of a registered
                            StepLockedTask, or a model with the
                            ``steplock_fence_field`` column) registered in an admin site
                            by a ModelAdmin without ``GuardedStepAdminMixin``: its plain
                            ``save()`` writes the status, owner and fence columns back as
                            the form loaded them (issue 24, "Writers outside Celery").
==========================  ==============================================================

Every check but E001 and W003 renders the problems of :mod:`celery_steplock.validate`, the
validator a worker runs at start, so ``manage.py check`` and the worker never disagree.

The checks read the project's Celery app (``celery.current_app``), after importing its task
modules once per process (:func:`~.leases.import_task_modules`): ``app.autodiscover_tasks()``
is lazy, and a ``manage.py`` process would otherwise see no task of a ``tasks.py`` module.
Every check function is also usable on its own: ``check_lock_store(app)`` etc. take a Celery
app and return a list of :class:`django.core.checks.CheckMessage`; they inspect the tasks
``app`` has registered, without importing anything (``check_task_modules(app)`` imports).
"""

from __future__ import annotations

from django.core import checks

from ... import validate
from ...conf import Settings
from ...exceptions import ImproperlyConfigured
from ...validate import REDIS_VISIBILITY_TIMEOUT, Problem

__all__ = [
    "TAG",
    "REDIS_VISIBILITY_TIMEOUT",
    "register_checks",
    "check_lock_store",
    "check_step_models",
    "check_settings",
    "check_task_options",
    "check_visibility_timeout",
    "check_worker_lost",
    "check_time_limits",
    "check_return_winner",
    "check_task_modules",
    "check_unknown_names",
    "check_recovery",
    "check_step_admins",
]

TAG = "celery_steplock"
#: PING timeout of E001, seconds (at most; lower when ``steplock_socket_timeout`` is).
PING_TIMEOUT = 2.0


def _app():
    from .leases import celery_app

    return celery_app()


def _app_with_tasks():
    """The project's Celery app, its task modules imported (once per process; an import
    error is W003's to report)."""
    from .leases import import_task_modules

    app = _app()
    import_task_modules(app)
    return app


def render(problems: list[Problem]) -> list[checks.CheckMessage]:
    """Django check messages of the validator's problems (errors and warnings by id)."""
    return [
        (checks.Error if p.is_error else checks.Warning)(
            p.message, hint=p.hint, obj=p.obj, id=p.id
        )
        for p in problems
    ]


# -- checks on a Celery app ----------------------------------------------------------------


def check_settings(app) -> list[checks.CheckMessage]:
    """E003: one Error per invalid ``steplock_*`` setting (and a step store that cannot be
    imported)."""
    return render(
        validate.settings_problems(app)
        + validate.step_store_problems(app)
        + validate.step_database_problems(app)
    )


def check_task_options(app) -> list[checks.CheckMessage]:
    """E004: one Error per invalid StepLockedTask option (what stops a worker's start)."""
    return render(validate.task_problems(app))


def check_visibility_timeout(app) -> list[checks.CheckMessage]:
    """W001: lease TTLs that are not below the broker's ``visibility_timeout``
    (:func:`celery_steplock.validate.visibility_timeout_problems`)."""
    return render(validate.visibility_timeout_problems(app))


def check_worker_lost(app) -> list[checks.CheckMessage]:
    """W002: StepLockedTasks whose message is acknowledged although their worker died
    (:func:`celery_steplock.validate.worker_lost_problems`)."""
    return render(validate.worker_lost_problems(app))


def check_step_models(app, app_configs=None) -> list[checks.CheckMessage]:
    """E002: StepLockedTasks whose ``step_model`` is missing or lacks the status field.

    With ``app_configs`` (``manage.py check <app_label>``), only models of those apps are
    checked, and missing models are not reported.
    """
    found = validate.step_model_problems(app)
    if app_configs is not None:
        found = [p for p in found if _model_app_config(app, p.obj) in app_configs]
    return render(found)


def _model_app_config(app, task_name: str):
    """The app config of a task's step model, None when it does not resolve."""
    from django.apps import apps

    spec = app.tasks[task_name].step_model
    try:
        model = apps.get_model(spec) if isinstance(spec, str) else spec
        return model._meta.app_config
    except (LookupError, ValueError, AttributeError):
        return None


def check_unknown_names(app, django_settings=None) -> list[checks.CheckMessage]:
    """W005: settings and task options that do not exist, and Django settings that name
    steplock but that the Celery app never reads (``django_settings``: default
    ``django.conf.settings``); W006: settings set under a former name."""
    from django.conf import settings

    return render(
        validate.unknown_name_problems(app)
        + validate.deprecated_name_problems(app)
        + validate.django_setting_problems(
            app, settings if django_settings is None else django_settings
        )
    )


def check_recovery(app) -> list[checks.CheckMessage]:
    """E005: models of ``steplock_reaper_recover`` the reaper cannot recover
    (:func:`celery_steplock.validate.recovery_problems`)."""
    return render(validate.recovery_problems(app))


def check_time_limits(app) -> list[checks.CheckMessage]:
    """W004: time limits that do not pair with the lease
    (:func:`celery_steplock.validate.time_limit_problems`)."""
    return render(validate.time_limit_problems(app))


def check_return_winner(app) -> list[checks.CheckMessage]:
    """W012: ``on_conflict="return_winner"`` without ``result_extended``
    (:func:`celery_steplock.validate.return_winner_problems`)."""
    return render(validate.return_winner_problems(app))


def check_task_modules(app) -> list[checks.CheckMessage]:
    """W003: import the app's task modules (once per process, as the other checks need
    them) and warn when that failed."""
    from .leases import import_task_modules

    error = import_task_modules(app)
    if error is None:
        return []
    return [
        checks.Warning(
            f"The task modules of the Celery app {app.main!r} could not be imported: "
            f"{type(error).__name__}: {error}. The StepLockedTask checks (E002, E004, W001, "
            f"W002, W004, W005) only judged the tasks registered anyway, and a worker of this "
            f"project would fail to start.",
            hint="Fix the import error (its traceback is logged by the celery_steplock logger).",
            obj=app.main,
            id="celery_steplock.W003",
        )
    ]


def check_lock_store(app) -> list[checks.CheckMessage]:
    """E001: PING the Redis lock store (one connection, at most ``PING_TIMEOUT`` seconds)."""
    import redis

    from celery_steplock.clients import client_for_settings
    from celery_steplock.redact import redact, secrets_of

    try:
        settings = Settings(app)
        url = "the client factory" if settings.redis_client_factory else settings.redis_url
        timeout = min(settings.socket_timeout, PING_TIMEOUT)
        client = client_for_settings(settings, socket_timeout=timeout)
    except ImproperlyConfigured:
        return []  # E003 reports it
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        return [
            checks.Error(
                redact(f"The Redis lock store {url} is unreachable: {exc}", secrets_of(app)),
                hint="Start Redis or fix CELERY_STEPLOCK_REDIS_URL (default: the broker URL). "
                "StepLockedTasks fail closed while it is down: their bodies do not run.",
                obj="steplock_redis_url",
                id="celery_steplock.E001",
            )
        ]
    finally:
        client.close()
    return []


def _step_models(app, settings: Settings) -> dict[str, list[str]]:
    """Label -> the StepLockedTasks naming it as ``step_model`` (empty for a model that is a
    step model by its fence column alone)."""
    from django.apps import apps

    from ...plan import is_step_locked

    found: dict[str, list[str]] = {}
    for name, task in sorted(app.tasks.items()):
        spec = getattr(task, "step_model", None)
        if spec is None or not is_step_locked(task):
            continue
        try:
            model = apps.get_model(spec) if isinstance(spec, str) else spec
            label = model._meta.label
        except (LookupError, ValueError, AttributeError):
            continue  # E002 reports it
        found.setdefault(label, []).append(name)
    for model in apps.get_models():
        if any(f.name == settings.fence_field for f in model._meta.concrete_fields):
            found.setdefault(model._meta.label, [])
    return found


def check_step_admins(app, sites=None) -> list[checks.CheckMessage]:
    """W008: step models an admin site saves with a plain ``ModelAdmin.save_model()``.

    Args:
        app: The Celery app (its tasks name the step models).
        sites: The admin sites to judge (default: every ``AdminSite`` instance,
            ``django.contrib.admin.sites.all_sites``).

    Returns:
        One Warning per (site, step model) whose ModelAdmin lacks
        :class:`~celery_steplock.contrib.django.mixins.GuardedStepAdminMixin`.
    """
    from django.apps import apps

    if sites is None:
        if not apps.is_installed("django.contrib.admin"):
            return []
        from django.contrib.admin.sites import all_sites

        sites = sorted(all_sites, key=lambda site: site.name)
    from .mixins import GuardedStepAdminMixin

    try:
        settings = Settings(app)
        names = (settings.status_field, settings.owner_field, settings.fence_field)
        step_models = _step_models(app, settings)
    except ImproperlyConfigured:
        return []  # E003 reports it
    found: list[checks.CheckMessage] = []
    for site in sites:
        for model, model_admin in sorted(
            site._registry.items(), key=lambda item: item[0]._meta.label
        ):
            label = model._meta.label
            if label not in step_models or isinstance(model_admin, GuardedStepAdminMixin):
                continue
            columns = [f.name for f in model._meta.concrete_fields if f.name in names]
            tasks = step_models[label]
            whose = f" (the step model of {', '.join(tasks)})" if tasks else ""
            admin_class = type(model_admin)
            found.append(
                checks.Warning(
                    f"{admin_class.__module__}.{admin_class.__qualname__} registers {label}"
                    f"{whose} in the admin site {site.name!r} with a plain ModelAdmin save: "
                    f"its save() writes {', '.join(columns) or 'the status'} back as the form "
                    f"loaded them, so a form saved after a task committed restores the old "
                    f"status and erases the fencing token, and a redelivery of the same "
                    f"message commits the same transition again.",
                    hint=(
                        "Add celery_steplock.contrib.django.mixins.GuardedStepAdminMixin "
                        f"before ModelAdmin in the bases of {admin_class.__qualname__}: the "
                        "status, owner and fence become read-only and a status change goes "
                        "through guarded_transition under the step's lease."
                    ),
                    obj=model,
                    id="celery_steplock.W008",
                )
            )
    return found


def check_idempotency_middleware(django_settings=None) -> list[checks.CheckMessage]:
    """E010: ``IdempotencyMiddleware`` placed where ``request.user`` is not yet set.

    Args:
        django_settings: The settings object (default ``django.conf.settings``).

    Returns:
        One Error when the middleware comes before ``AuthenticationMiddleware`` (a subclass
        counts) or runs without it, unless ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE`` names a
        ``scope`` of its own; else none.
    """
    from django.conf import settings
    from django.contrib.auth.middleware import AuthenticationMiddleware
    from django.utils.module_loading import import_string

    from .idempotency import IdempotencyMiddleware

    django_settings = settings if django_settings is None else django_settings
    config = getattr(django_settings, "STEPLOCK_IDEMPOTENCY_MIDDLEWARE", None) or {}
    if isinstance(config, dict) and config.get("scope") is not None:
        return []

    def position(kind: type) -> int | None:
        for index, path in enumerate(getattr(django_settings, "MIDDLEWARE", None) or ()):
            try:
                found = import_string(path)
            except ImportError:
                continue
            if isinstance(found, type) and issubclass(found, kind):
                return index
        return None

    ours, auth = position(IdempotencyMiddleware), position(AuthenticationMiddleware)
    if ours is None or (auth is not None and auth < ours):
        return []
    where = "without" if auth is None else "before"
    return [
        checks.Error(
            f"IdempotencyMiddleware is in MIDDLEWARE {where} AuthenticationMiddleware: "
            f"request.user is not set when it runs, so every request has no principal and "
            f"its Idempotency-Key is refused (403), and a request is not yet known to "
            f"@login_required when a replay would be served.",
            hint="Move celery_steplock.contrib.django.idempotency.IdempotencyMiddleware "
            "after django.contrib.auth.middleware.AuthenticationMiddleware, or give "
            "STEPLOCK_IDEMPOTENCY_MIDDLEWARE a 'scope' function.",
            obj="MIDDLEWARE",
            id="celery_steplock.E010",
        )
    ]


def check_idempotency_settings(django_settings=None) -> list[checks.CheckMessage]:
    """E011: an invalid ``STEPLOCK_IDEMPOTENCY_MIDDLEWARE``, judged by the middleware's own
    validation (:func:`~.idempotency.middleware_policy`), whether or not the middleware is
    in ``MIDDLEWARE`` (the setting is read by no one else).

    Args:
        django_settings: The settings object (default ``django.conf.settings``).

    Returns:
        One Error naming the first bad option, or none.
    """
    from django.conf import settings

    from .idempotency import MIDDLEWARE_SETTING, middleware_policy

    django_settings = settings if django_settings is None else django_settings
    try:
        middleware_policy(getattr(django_settings, MIDDLEWARE_SETTING, None))
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                f"Invalid {MIDDLEWARE_SETTING}: {exc}",
                hint="See IdempotencyMiddleware for its options.",
                obj=MIDDLEWARE_SETTING,
                id="celery_steplock.E011",
            )
        ]
    return []


def idempotency_middleware_check(app_configs=None, **kwargs):
    return check_idempotency_middleware() + check_idempotency_settings()


# -- registered check functions (Django calls them with app_configs and databases) --------


def settings_check(app_configs=None, **kwargs):
    return check_settings(_app_with_tasks())


def task_modules_check(app_configs=None, **kwargs):
    return check_task_modules(_app())


def visibility_timeout_check(app_configs=None, **kwargs):
    return check_visibility_timeout(_app_with_tasks())


def worker_lost_check(app_configs=None, **kwargs):
    return check_worker_lost(_app_with_tasks())


def time_limits_check(app_configs=None, **kwargs):
    return check_time_limits(_app_with_tasks())


def return_winner_check(app_configs=None, **kwargs):
    return check_return_winner(_app_with_tasks())


def unknown_names_check(app_configs=None, **kwargs):
    return check_unknown_names(_app_with_tasks())


def task_options_check(app_configs=None, **kwargs):
    return check_task_options(_app_with_tasks())


def recovery_check(app_configs=None, **kwargs):
    return check_recovery(_app())


def step_model_check(app_configs=None, **kwargs):
    return check_step_models(_app_with_tasks(), app_configs)


def step_admin_check(app_configs=None, **kwargs):
    return check_step_admins(_app_with_tasks())


def lock_store_check(app_configs=None, **kwargs):
    return check_lock_store(_app())


def name_secret_check(app_configs=None, **kwargs):
    """W010/W011 (deploy check): no name secret, or one derived from an insecure SECRET_KEY
    (:func:`celery_steplock.validate.name_secret_problems`)."""
    return render(validate.name_secret_problems(_app()))


def register_checks() -> None:
    """Register the checks (idempotent: Django's registry is a set of functions)."""
    checks.register(settings_check, TAG)
    checks.register(task_modules_check, TAG)
    checks.register(visibility_timeout_check, TAG)
    checks.register(worker_lost_check, TAG)
    checks.register(time_limits_check, TAG)
    checks.register(return_winner_check, TAG)
    checks.register(task_options_check, TAG)
    checks.register(unknown_names_check, TAG)
    checks.register(step_model_check, TAG)
    checks.register(recovery_check, TAG)
    checks.register(idempotency_middleware_check, TAG)
    checks.register(step_admin_check, TAG, checks.Tags.admin)
    # The network check only with --deploy: `manage.py migrate` must not wait on Redis.
    checks.register(lock_store_check, TAG, deploy=True)
    checks.register(name_secret_check, TAG, deploy=True)
