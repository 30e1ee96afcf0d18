"""Database routers of the example project (docs/databases.md).

``DATABASE_ROUTERS`` lists :class:`ProjectRouter` (``STEPLOCK_DATABASE_ROUTERS`` replaces
the list). It only has opinions on the ``routing`` app's models, so everything else stays
on ``default``:

- ``routing.Invoice``: reads from ``replica``, writes to ``default``. ``replica`` is a
  separate database that nothing ever writes: a read replica lagging without end, the worst
  a real one can do.
- ``routing.Parcel``: reads and writes on ``other`` (its only home).
- ``routing.Ledger``: no opinion (``default``); a task names ``other`` with
  ``step_database``.

:class:`SchemaRouter` alone says where each table is created and nothing about reads or
writes.
"""

#: Where each model of the ``routing`` app has its table.
HOMES = {
    "invoice": ("default", "replica"),
    "parcel": ("other",),
    "ledger": ("default", "other"),
}

#: Aliases that hold only ``routing`` tables.
EXTRA = ("replica", "other")


class SchemaRouter:
    """Tables: the ``routing`` app's models on their :data:`HOMES`, every other app's on
    ``default`` only."""

    def allow_migrate(self, db, app_label, model_name=None, **hints):
        if app_label == "routing":
            return db in HOMES.get(model_name, ()) if model_name else db in ("default", *EXTRA)
        if db in EXTRA:
            return False
        return None


class ProjectRouter(SchemaRouter):
    """Reads and writes of the ``routing`` models (see the module)."""

    reads = {"invoice": "replica", "parcel": "other"}
    writes = {"invoice": "default", "parcel": "other"}

    def db_for_read(self, model, **hints):
        if model._meta.app_label == "routing":
            return self.reads.get(model._meta.model_name)
        return None

    def db_for_write(self, model, **hints):
        if model._meta.app_label == "routing":
            return self.writes.get(model._meta.model_name)
        return None

    def allow_relation(self, obj1, obj2, **hints):
        return None
