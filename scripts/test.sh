#!/usr/bin/env bash
# The whole test suite. The tests start their own ActiveMQ brokers on free loopback
# ports with throwaway data dirs, and stop them at the end.
#
# Without arguments: the checks, then the tests in three parts (markers set in
# tests/conftest.py). Side by side: those that only wait on brokers, in parallel workers
# (AMQSTREAM_TEST_WORKERS, default 2), and the system tests (`serial`: deployments, Spark,
# several brokers), two files at a time (AMQSTREAM_SYSTEM_WORKERS, default 2), each file in
# one worker. Then those asserting time bounds, or heap bounds under load they make
# (`alone`), one at a time. With arguments (`make test ARGS=...`): the checks, then one plain
# pytest run with those arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export AIRFLOW_HOME="$(mktemp -d)/airflow"
trap 'rm -rf "$(dirname "$AIRFLOW_HOME")"' EXIT
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
"$VENV/bin/mypy"  # protocol/ and transport/ ([tool.mypy] in pyproject.toml)
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest "$@"
fi
status=0
base="$(dirname "$AIRFLOW_HOME")"
# The broker-bound tests and the system tests run side by side, each session with an Airflow
# home and a block of ports of its own (tests/helpers.py). The system tests are CPU-bound
# (deployments, Spark); the broker-bound ones mostly wait on a broker, so they fill the cores
# the system tests leave idle (docs/decisions/test-suite-time.md). worksteal: a worker that
# runs out takes tests queued for the other. The broker-bound session's output is kept in a
# file and printed when both are done, so that the two do not interleave.
AIRFLOW_HOME="$base/parallel/airflow" AMQSTREAM_TEST_PORT_BLOCK=0 "$VENV/bin/python" -m pytest \
  -n "${AMQSTREAM_TEST_WORKERS:-2}" --dist worksteal -m "not soak and not serial and not alone" \
  >"$base/parallel.log" 2>&1 &
parallel=$!
# Each part runs even when one before it failed: one CI run reports everything.
AIRFLOW_HOME="$base/system/airflow" AMQSTREAM_TEST_PORT_BLOCK=3 "$VENV/bin/python" -m pytest \
  -n "${AMQSTREAM_SYSTEM_WORKERS:-2}" --dist loadfile --durations=15 -m "serial and not soak" || status=$?
wait "$parallel" || status=$?
echo "=== the broker-bound tests, run beside the system tests ==="
cat "$base/parallel.log"
AIRFLOW_HOME="$base/alone/airflow" "$VENV/bin/python" -m pytest --durations=10 -m "alone and not soak" || status=$?
exit "$status"
