#!/usr/bin/env bash
# The whole test suite. The tests start their own ActiveMQ brokers on free loopback
# ports with throwaway data dirs, and stop them at the end.
#
# Without arguments: the checks, then every test but those marked `serial` in parallel
# workers (AMQSTREAM_TEST_WORKERS, default 3: most tests wait on a broker, not a core),
# then the `serial` ones (time and heap bounds, deployments, Spark, several brokers) one at
# a time on a machine left to them. With arguments (`make test ARGS=...`): the checks, then
# one plain pytest run with those arguments.
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
"$VENV/bin/python" -m pytest -n "${AMQSTREAM_TEST_WORKERS:-3}" -m "not soak and not serial" || status=$?
# Run the serial part even when the parallel one failed: one CI run reports everything.
"$VENV/bin/python" -m pytest -m "serial and not soak" || status=$?
exit "$status"
