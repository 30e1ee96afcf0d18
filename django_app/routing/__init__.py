"""Step models on several databases, for the tests of database routers (docs/databases.md).

``Invoice`` lives on ``default`` and on ``replica`` (a copy that is never written: a replica
lagging without end), ``Parcel`` only on ``other``, ``Ledger`` on ``default`` and ``other``
(a task names the one it writes with ``step_database``). Where each table is created is
:class:`django_app.routers.SchemaRouter`'s to say; the routers that send reads and writes
are in :mod:`django_app.routers`.
"""
