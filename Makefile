# The two commands a new machine needs: `make demo` (set up, then the main job) and `make test`.
PYTHON := .venv/bin/python

.PHONY: demo test setup
setup: .venv/.streamscope-ready

.venv/.streamscope-ready: pyproject.toml scripts/setup.sh
	scripts/setup.sh

demo: setup
	$(PYTHON) -m streamscope.demo

test: setup
	$(PYTHON) -m pytest -q
