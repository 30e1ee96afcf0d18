# make venv | demo | test | clean. Pass pytest arguments with ARGS="-k name -x".
PYTHON ?= python3
VENV := .venv

.PHONY: venv demo test clean

venv:
	@PYTHON="$(PYTHON)" bash scripts/bootstrap.sh

demo: venv
	$(VENV)/bin/python scripts/demo.py

test: venv
	$(VENV)/bin/python scripts/run_tests.py $(ARGS)

clean:
	rm -rf $(VENV) .tox .pytest_cache build dist *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
