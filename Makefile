# The two commands a new machine needs: `make demo` (set up, then the main job) and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test setup lint
setup: .venv/.streamscope-ready

.venv/.streamscope-ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh

demo: setup
	$(PYTHON) -m streamscope.demo

# Two processes, whole files each (a file's tests share its engines): 28 minutes for 5,866 tests on 2 idle cores on
# 2026-12-07, with tests/conftest.py keeping GNU OpenMP's threads from spinning (OMP_WAIT_POLICY=PASSIVE); earlier
# runs took 64-89 minutes with other work beside them, and CI's machine took 76 minutes for the whole job. The
# slowest tests are printed at the end, to keep the run under CI's 90 minutes.
test: setup lint
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=30

# ruff over the whole tree, mypy over the public surface (both configured in pyproject.toml).
lint: setup
	$(PYTHON) -m ruff check streamscope tests benchmarks scripts examples
	$(PYTHON) -m mypy
