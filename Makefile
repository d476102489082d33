# The two commands a new machine needs: `make demo` (set up, then the main job) and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test setup lint
setup: .venv/.streamscope-ready

.venv/.streamscope-ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh

demo: setup
	$(PYTHON) -m streamscope.demo

# Two processes, whole files each (a file's tests share its engines): 67 minutes for 5,860 tests on 2 cores on
# 2026-12-07 (89 before tests/conftest.py's `_CollectThenFreeze` and the parallel-engine files' shared script
# process; 41-46 minutes on 2026-12-05 and -06: why it doubled is not known); the slowest tests are printed at the
# end, to keep the run under CI's 90 minutes.
test: setup lint
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=30

# ruff over the whole tree, mypy over the public surface (both configured in pyproject.toml).
lint: setup
	$(PYTHON) -m ruff check streamscope tests benchmarks scripts examples
	$(PYTHON) -m mypy
