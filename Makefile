# The two commands a new machine needs: `make demo` (set up, then the main job) and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test setup lint
setup: .venv/.streamscope-ready

.venv/.streamscope-ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh

demo: setup
	$(PYTHON) -m streamscope.demo

# Two processes, whole files each (a file's tests share its engines): 16 minutes on 2 cores (2026-12-01).
test: setup lint
	$(PYTHON) -m pytest -q -n 2 --dist loadfile

# ruff over the whole tree, mypy over the public surface (both configured in pyproject.toml).
lint: setup
	$(PYTHON) -m ruff check streamscope tests benchmarks scripts
	$(PYTHON) -m mypy
