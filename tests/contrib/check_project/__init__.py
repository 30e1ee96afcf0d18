"""A settings module with several different mistakes and a task module with bad options:
what ``manage.py check`` and a worker's start must report all at once
(tests/contrib/test_checks.py)."""
