# make venv | demo | test | test-mysql | corners | servers | matrix | bench | soak | nemesis | overlap | lint | docs | dist | clean. Pass pytest
# arguments with ARGS="-k name -x"; `make bench ARGS=--quick` is a small smoke run,
# ARGS="--only e2e wait" a subset. `make corners` runs the version corners
# (requirements/corners/*.txt, each in its own venv under .venv-corners/; CORNERS=newest picks
# one); `make test CORNERS=oldest` runs the main passes and then that corner. CI runs both.
PYTHON ?= python3
VENV := .venv
CORNERS ?=
ALL_CORNERS := oldest,middle,newest

.PHONY: venv demo test test-mysql corners servers matrix bench soak lint docs dist clean nemesis overlap

venv:
	@PYTHON="$(PYTHON)" bash scripts/bootstrap.sh

# Only what the demo needs goes into .venv (STEPLOCK_BOOTSTRAP=demo: the project with its django
# extra and requirements/demo.txt); any other target tops it up to the whole set.
demo:
	@PYTHON="$(PYTHON)" STEPLOCK_BOOTSTRAP=demo bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/demo.py

# The SQLite, PostgreSQL and common passes (about 20 minutes on 2 cores); test-mysql runs the
# step-database tests once more on MariaDB (about 10 minutes). CI runs both.
test:
	@PYTHON="$(PYTHON)" STEPLOCK_WANT_POSTGRES=1 STEPLOCK_WANT_RABBITMQ=1 STEPLOCK_CORNERS="$(CORNERS)" bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py $(if $(CORNERS),--corner $(CORNERS)) $(ARGS)

test-mysql:
	@PYTHON="$(PYTHON)" STEPLOCK_WANT_MYSQL=1 bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py --only mariadb $(ARGS)

corners:
	@PYTHON="$(PYTHON)" STEPLOCK_CORNERS="$(or $(CORNERS),$(ALL_CORNERS))" bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py --corners-only --corner $(or $(CORNERS),$(ALL_CORNERS)) $(ARGS)

# Every tox env (tox.ini: Python 3.10-3.13 x Django 5.2/6.0/6.1 x Celery and redis-py
# series), each the whole suite; hours. ARGS go to tox, e.g. ARGS="-e py312-django60".
matrix: venv
	$(VENV)/bin/python scripts/matrix.py $(ARGS)

# The lock, task, ACL and pool tests once per server: Redis 6.2, the system's Redis 7.x, Redis 8.0
# (built once from Debian's source package: minutes), Valkey 8.0 (Debian backports), Valkey 9.x;
# ARGS="--only redis-8" picks one (repeatable).
servers: venv
	$(VENV)/bin/python scripts/server_matrix.py $(ARGS)

bench: venv
	$(VENV)/bin/python -m pip install -q -r requirements/bench.txt
	$(VENV)/bin/python benchmarks/run.py $(ARGS)

# The fault scenarios, N trials each (default 200), on labs side by side (--labs, default 6;
# TTL 1 s: under 2 hours on 2 cores), into docs/reliability.md/.json.
soak: venv
	$(VENV)/bin/python scripts/soak.py $(ARGS)

# The randomized fault run (30 minutes by default): make nemesis ARGS="--duration 1800 --seed 7"
nemesis: venv
	$(VENV)/bin/python scripts/nemesis.py $(ARGS)

# The overlap guard with two real celery beat processes, 60 s of beat per policy (the default
# test gives each 15 s); prints the figures (runs, sends, skipped, max concurrent).
overlap: venv
	OVERLAP_BEAT_SECONDS=60 OVERLAP_REPORT=1 $(VENV)/bin/python scripts/run_tests.py --only common --jobs 1 tests/test_overlap_beat.py -s $(ARGS)

# The lint and docs tools go into .venv only for these targets (never for `make test`); a stamp
# per requirements file keeps the second run instant.
$(VENV)/.lint-stamp: requirements/lint.txt | venv
	$(VENV)/bin/python -m pip install -q -r requirements/lint.txt
	touch $@

$(VENV)/.docs-stamp: requirements/docs.txt | venv
	$(VENV)/bin/python -m pip install -q -r requirements/docs.txt
	touch $@

# ruff (lint rules and formatting), mypy (django-stubs, celery-types; strict on the core
# modules) and import-linter (the floors of the package: no upward import, no circle, no Django
# below contrib); their settings are in pyproject.toml.
lint: $(VENV)/.lint-stamp
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/mypy

# The documentation site into docs/_build/html; warnings are errors. The settings and signals
# references are generated from conf.SETTINGS and signals.py by docs/_ext/steplock_reference.py.
docs: $(VENV)/.docs-stamp
	$(VENV)/bin/python -m sphinx -E -W --keep-going -q -b html docs docs/_build/html

# sdist and wheel into dist/, then the index's checks and what must (not) be inside.
dist: $(VENV)/.lint-stamp
	rm -rf dist build
	$(VENV)/bin/python -m build -q --outdir dist .
	$(VENV)/bin/twine check --strict dist/*
	$(VENV)/bin/check-wheel-contents dist/*.whl
	$(VENV)/bin/python scripts/check_dist.py dist

clean:
	rm -rf $(VENV) .venv-corners .tox .pytest_cache build dist *.egg-info docs/_build celery_steplock/_scm_version.txt
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
