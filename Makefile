# One-command entry points. `make demo` runs the main job, `make test` the whole suite,
# `make airflow` a local Airflow deployment of the examples (Ctrl-C stops it).
# All three install what they need (Debian packages, a venv in .venv) and are quick the
# second time: the venv is rebuilt only when pyproject.toml changes.
VENV ?= .venv
STAMP := $(VENV)/.installed
# The broker's store plugin (broker/java/), rebuilt when its source changes (scripts/broker_jar.sh).
JAR := airflow_provider_amqstream/broker/java/amqstream-broker.jar

.PHONY: setup demo demo-sites test bench lint clean airflow airflow-celery
setup: $(STAMP) $(JAR)

$(JAR): $(wildcard airflow_provider_amqstream/broker/java/src/org/amqstream/broker/*.java) scripts/broker_jar.sh
	bash scripts/broker_jar.sh

$(STAMP): pyproject.toml setup.py scripts/setup.sh
	bash scripts/setup.sh "$(VENV)"

demo: setup
	VENV="$(VENV)" bash scripts/demo.sh

demo-sites: setup
	VENV="$(VENV)" bash scripts/demo_sites.sh

# exec: make forwards SIGTERM only to the process it started, which must be the script
# (a shell in between would die and leave the deployment running). A SIGINT or SIGHUP to make
# alone is not forwarded (make waits for the script): the script watches make's signal state.
airflow: setup
	VENV="$(VENV)" exec bash scripts/airflow.sh

# The same with the CeleryExecutor: Redis and two Celery workers (AMQSTREAM_EXECUTOR=celery).
airflow-celery: setup
	VENV="$(VENV)" AMQSTREAM_EXECUTOR=celery exec bash scripts/airflow.sh

test: setup
	VENV="$(VENV)" bash scripts/test.sh $(ARGS)

bench: setup
	VENV="$(VENV)" bash scripts/bench.sh $(ARGS)

# The same checks scripts/test.sh runs first (so CI enforces them): style and complexity,
# the architecture contracts in pyproject.toml, no import cycles, then types.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python scripts/import_cycles.py
	$(VENV)/bin/mypy

clean:
	rm -rf "$(VENV)" .pytest_cache .mypy_cache .import_linter_cache build *.egg-info
