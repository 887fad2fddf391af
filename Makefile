# On a fresh machine: `make` (fencemq into .venv, and what else there is), `make demo`, `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.DEFAULT_GOAL := install
.PHONY: install help demo test test-long test-fuzz test-promises test-rolling test-cluster test-failover test-stateful test-ui ui-screenshots \
        test-spark-cluster bench serve lint clean venv

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

# What `make test` needs: the test extra, and spark for the analytics (the bench's peers are not needed).
$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	@echo "installing fencemq with its test and spark extras into $(VENV) (log: $(VENV)/install.log)"
	@$(PY) -m pip install -e '.[test,spark]' $(QUIETLY)
	@touch $@ $(VENV)/.base

$(VENV)/.bench: pyproject.toml | $(VENV)/bin/python
	@echo "installing fencemq with its test, spark and bench extras into $(VENV) (log: $(VENV)/install.log)"
	@$(PY) -m pip install -e '.[test,spark,bench]' $(QUIETLY)
	@touch $@ $(VENV)/.test $(VENV)/.base

$(VENV)/.ui-test: pyproject.toml | $(VENV)/bin/python
	@echo "installing fencemq with its test, spark and ui-test extras into $(VENV) (log: $(VENV)/install.log)"
	@$(PY) -m pip install -e '.[test,spark,ui-test]' $(QUIETLY)
	@touch $@ $(VENV)/.test $(VENV)/.base

install: $(VENV)/.base
	@echo "fencemq is installed: $(VENV)/bin/fencemq (source $(VENV)/bin/activate puts it on your PATH)"
	@$(MAKE) --no-print-directory help

help:
	@echo "make demo                a private Redis, a worker and a scripted tour of the guarantees (~2 s)"
	@echo "make serve               a worker on 127.0.0.1:7379 (a private Redis unless FENCEMQ_REDIS_URL is set)"
	@echo "make test                lint and the test suite (~5 min on 2 idle cores)"
	@echo "make test-long, test-fuzz, test-promises, test-rolling, test-ui, test-spark-cluster, test-cluster,"
	@echo "     test-failover, test-stateful"
	@echo "                         the longer suites CI runs after make test (.ci/run)"
	@echo "make bench               every speed goal, results in bench/results/"
	@echo "make clean               remove $(VENV) and build leftovers"

demo: $(VENV)/.base
	@$(VENV)/bin/fencemq demo

lint: $(VENV)/.test
	$(VENV)/bin/ruff check broker cli spark bench tests

# The RESP fuzzer sends 6,000 frames here; `make test-fuzz` (run by .ci/run) sends its full 21,000. The fences
# meet the reference model in 30 sequences per primary here, and lmq compaction is held to the uncompacted
# layout in 60; `make test-stateful` runs the full 300 of each.
# The suite runs in TEST_WORKERS processes (pytest-xdist; each file's tests in one process, which starts its own
# private Redis): most tests wait on sockets and timers, not on the CPU, so 3 processes on 2 cores take a third
# of one's time. TEST_WORKERS=0 runs it in this process (pdb, -x). The 10 slowest tests are listed at the end.
TEST_WORKERS ?= 3
test: lint
	FENCEMQ_FUZZ_EXAMPLES=$${FENCEMQ_FUZZ_EXAMPLES:-100} FENCEMQ_MODEL_EXAMPLES=$${FENCEMQ_MODEL_EXAMPLES:-30} \
	FENCEMQ_COMPACTION_EXAMPLES=$${FENCEMQ_COMPACTION_EXAMPLES:-60} \
	PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=10 $(PYTEST_ARGS)

# The tests marked long (make test skips them, saying so): more Spark jobs over the same analytics.
test-long: $(VENV)/.test
	FENCEMQ_LONG_TESTS=1 PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m long -q \
	    --durations=10 $(PYTEST_ARGS)

test-fuzz: $(VENV)/.test
	FENCEMQ_FUZZ_EXAMPLES=$${FENCEMQ_FUZZ_EXAMPLES:-350} $(PY) -m pytest tests/fuzz -q $(PYTEST_ARGS)

# The fence tests again, on a 3-master Redis Cluster (every call must stay in one hash slot), in TEST_WORKERS
# processes (each starts its own Cluster); the reference model's sequences at 30 per primary (test-stateful
# runs 300 on one server).
test-cluster: $(VENV)/.test
	FENCEMQ_MODEL_EXAMPLES=$${FENCEMQ_MODEL_EXAMPLES:-30} FENCEMQ_COMPACTION_EXAMPLES=$${FENCEMQ_COMPACTION_EXAMPLES:-60} \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests/fences --redis-cluster -q -rf \
	    --durations=15 $(PYTEST_ARGS)

# Redis failing over under load (tests/failover, ~5 min): a primary + 2 replicas + 3 Sentinels and a
# 3-master Cluster with 2 replicas each, masters killed, one host crash (a replica held behind with
# SIGSTOP, the dead host's connections aborted with `ss -K`: root), the old primaries returning; in
# each durability mode. FENCEMQ_FAILOVER_REPORT=file.jsonl keeps each run's figures; .ci/run runs both halves
# (FAILOVER_TESTS=tests/failover/test_sentinel_failover.py runs one).
FAILOVER_TESTS ?= tests/failover
test-failover: $(VENV)/.test
	FENCEMQ_TEST_FAILOVER=1 $(PY) -m pytest $(FAILOVER_TESTS) -q -s -p no:cacheprovider $(PYTEST_ARGS)

# The model-based test of all five guarantees, 1,000 sequences (make test runs 30) in 12 shards, beside
# the fences against the reference model (300 sequences per primary; make test runs 30) and lmq compaction against
# the uncompacted layout (300; make test runs 60), in 4 processes. Twelve shorter shards rather than one per
# process: pytest-xdist queues a test behind a running one, and with 4 shards two pairs ran one after the other.
# On 2 cores the shards' workers run behind their 1.5 s session leases, so leases lapse more often than on a
# quiet machine: the three sequences found that way (a broker bug and two of the test's own) are in the README
# and replayed in tests/stateful/test_found_sequences.py. FENCEMQ_STATEFUL_EXAMPLES and FENCEMQ_STATEFUL_SHARDS change the count.
STATEFUL_WORKERS ?= 4
test-stateful: $(VENV)/.test
	FENCEMQ_STATEFUL_EXAMPLES=$${FENCEMQ_STATEFUL_EXAMPLES:-1000} FENCEMQ_STATEFUL_SHARDS=$${FENCEMQ_STATEFUL_SHARDS:-12} \
	$(PY) -m pytest -n $(STATEFUL_WORKERS) --dist worksteal tests/stateful \
	    tests/fences/test_reference_model.py tests/fences/test_lmq_at_rest.py -q --durations=10 $(PYTEST_ARGS)

# Promises kept at the edges (issue #30): the pipelined-run property test in full (make test runs 25 examples)
# and an MQTT worker killed at every step of the QoS 1 and QoS 2 flows (make test kills it at 3 of the 18).
test-promises: $(VENV)/.test
	FENCEMQ_PIPELINE_EXAMPLES=$${FENCEMQ_PIPELINE_EXAMPLES:-500} FENCEMQ_KILL_STEPS=all $(PY) -m pytest \
		tests/server/test_pipelined_runs.py tests/server/mqtt/test_kill_resume.py -q $(PYTEST_ARGS)

# Issue #31's rolling restart: three worker processes SIGTERMed and started again in turn, then one killed
# with -9, under SDK (async and blocking) and paho MQTT 5 load; no exception, nothing lost (~1 min).
test-rolling: $(VENV)/.test
	FENCEMQ_ROLLING=1 $(PY) -m pytest tests/rolling -q -s $(PYTEST_ARGS)

# The web UI in a real browser: Debian's Chromium (/usr/bin/chromium, which .ci/run installs) driven by
# Playwright; `make test` skips these. ui-screenshots also rewrites docs/ui/*.png (shown in the README).
test-ui: $(VENV)/.ui-test
	FENCEMQ_TEST_BROWSER=1 $(PY) -m pytest tests/ui -m browser -q $(PYTEST_ARGS)

ui-screenshots: $(VENV)/.ui-test
	FENCEMQ_TEST_BROWSER=1 FENCEMQ_UI_SCREENSHOTS=docs/ui $(PY) -m pytest tests/ui -m browser -k renders -q

# `fencemq analyze --master spark://…` on a standalone Spark master + worker started from pyspark's own
# distribution (a minute or more: two JVMs, then the job's); skipped, saying why, without Java.
test-spark-cluster: $(VENV)/.test
	FENCEMQ_SPARK_CLUSTER=1 PYSPARK_PYTHON=$(abspath $(PY)) $(PY) -m pytest tests/spark/test_standalone_cluster.py -q $(PYTEST_ARGS)

# Every speed goal of issue #14 in one run: bench/results/*.json, e2e.png and goals.json/goals.png (pass/fail).
BENCH_LMQS ?= 1000000
bench: $(VENV)/.bench
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.fanout
	$(PY) -m bench.preempt_rate
	$(PY) -m bench.lmq_memory --lmqs $(BENCH_LMQS)
	$(PY) -m bench.scale
	$(PY) -m bench.mqtt_share
	$(PY) -m bench.attacks
	$(PY) -m bench.connections
	$(PY) -m bench.goals

serve: $(VENV)/.base
	$(VENV)/bin/fencemq serve

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
