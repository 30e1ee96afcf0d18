# make venv | demo | test | corners | servers | matrix | bench | soak | clean. Pass pytest
# arguments with ARGS="-k name -x"; `make bench ARGS=--quick` is a small smoke run,
# ARGS="--only e2e wait" a subset. `make corners` runs the version corners
# (requirements/corners/*.txt, each in its own venv under .venv-corners/; CORNERS=newest picks
# one); `make test CORNERS=oldest` runs the main passes and then that corner. CI runs both.
PYTHON ?= python3
VENV := .venv
CORNERS ?=
ALL_CORNERS := oldest,middle,newest

.PHONY: venv demo test corners servers matrix bench soak clean

venv:
	@PYTHON="$(PYTHON)" bash scripts/bootstrap.sh

demo: venv
	$(VENV)/bin/python scripts/demo.py

test:
	@PYTHON="$(PYTHON)" STEPLOCK_WANT_POSTGRES=1 STEPLOCK_CORNERS="$(CORNERS)" bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py $(if $(CORNERS),--corner $(CORNERS)) $(ARGS)

corners:
	@PYTHON="$(PYTHON)" STEPLOCK_CORNERS="$(or $(CORNERS),$(ALL_CORNERS))" bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py --corners-only --corner $(or $(CORNERS),$(ALL_CORNERS)) $(ARGS)

# Every tox env (tox.ini: Python 3.10-3.13 x Django 5.2/6.0/6.1 x Celery and redis-py
# series), each the whole suite; hours. ARGS go to tox, e.g. ARGS="-e py312-django60".
matrix: venv
	$(VENV)/bin/python scripts/matrix.py $(ARGS)

# The lock, task, ACL and pool tests once per server: Redis 6.2, the system's Redis 7.x, Valkey.
servers: venv
	$(VENV)/bin/python scripts/server_matrix.py $(ARGS)

bench: venv
	$(VENV)/bin/python -m pip install -q -r requirements/bench.txt
	$(VENV)/bin/python benchmarks/run.py $(ARGS)

# The fault scenarios, N trials each (default 200: hours), into docs/reliability.md/.json.
soak: venv
	$(VENV)/bin/python scripts/soak.py $(ARGS)

clean:
	rm -rf $(VENV) .venv-corners .tox .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
