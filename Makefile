# make venv | demo | test | servers | bench | soak | clean. Pass pytest arguments with ARGS="-k name -x";
# `make bench ARGS=--quick` is a small smoke run, ARGS="--only e2e wait" a subset.
PYTHON ?= python3
VENV := .venv

.PHONY: venv demo test servers bench soak clean

venv:
	@PYTHON="$(PYTHON)" bash scripts/bootstrap.sh

demo: venv
	$(VENV)/bin/python scripts/demo.py

test:
	@PYTHON="$(PYTHON)" STEPLOCK_WANT_POSTGRES=1 bash scripts/bootstrap.sh
	$(VENV)/bin/python scripts/run_tests.py $(ARGS)

# The lock, task, ACL and pool tests once per server: Redis 6.2, the system's Redis 7.x, Valkey.
servers: venv
	$(VENV)/bin/python scripts/server_matrix.py $(ARGS)

bench: venv
	$(VENV)/bin/python -m pip install -q -e '.[bench]'
	$(VENV)/bin/python benchmarks/run.py $(ARGS)

# The fault scenarios, N trials each (default 200: hours), into docs/reliability.md/.json.
soak: venv
	$(VENV)/bin/python scripts/soak.py $(ARGS)

clean:
	rm -rf $(VENV) .tox .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
