# Two set-up commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: demo test bench serve lint clean venv

# Installs are quiet: one line, the log in $(VENV)/install.log, shown in full only when it fails.
QUIETLY = > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }

$(VENV)/bin/python:
	@echo "creating $(VENV)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --upgrade pip $(QUIETLY)

$(VENV)/.base: pyproject.toml | $(VENV)/bin/python
	@echo "installing fencemq into $(VENV) (log: $(VENV)/install.log)"
	@$(PY) -m pip install -e . $(QUIETLY)
	@touch $@

$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	@echo "installing fencemq with its test, spark and bench extras into $(VENV) (log: $(VENV)/install.log)"
	@$(PY) -m pip install -e '.[test,spark,bench]' $(QUIETLY)
	@touch $@ $(VENV)/.base

demo: $(VENV)/.base
	@$(VENV)/bin/fencemq demo

lint: $(VENV)/.test
	$(VENV)/bin/ruff check broker cli spark bench tests

test: lint
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest $(PYTEST_ARGS)

bench: $(VENV)/.test
	$(PY) -m bench.run $(BENCH_ARGS)

serve: $(VENV)/.base
	$(VENV)/bin/fencemq serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
