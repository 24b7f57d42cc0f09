#!/usr/bin/env bash
# The whole test suite. The tests start their own ActiveMQ brokers on free loopback
# ports with throwaway data dirs, and stop them at the end.
#
# Without arguments: the checks, then the tests in three parts (markers set in
# tests/conftest.py): those that only wait on brokers in parallel workers
# (AMQSTREAM_TEST_WORKERS, default 5); the system tests (`serial`: deployments, Spark,
# several brokers) three files at a time (AMQSTREAM_SYSTEM_WORKERS, default 3), each file in
# one worker; then those asserting time bounds, or heap bounds under load they make
# (`quiet`), with nothing else beside them, each file in a worker of its own
# (AMQSTREAM_QUIET_WORKERS, default 5, one per file). With arguments (`make test ARGS=...`):
# the checks, then one plain pytest run with those arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export AIRFLOW_HOME="$(mktemp -d)/airflow"
trap 'rm -rf "$(dirname "$AIRFLOW_HOME")"' EXIT
# The tests' Spark drivers map their classes from an archive made once per machine and venv
# (tests/spark_cds.py): made now, if missing, beside the checks and the broker-bound part,
# which need little of it. It only saves time: without it the drivers run as before.
if [ "$#" -eq 0 ]; then
  "$VENV/bin/python" -m tests.spark_cds &
  cds=$!
fi
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
"$VENV/bin/python" scripts/import_cycles.py
"$VENV/bin/mypy"  # the whole package, strict ([tool.mypy] in pyproject.toml)
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest "$@"
fi
# At its peak a run from a clean clone used 6-7 GiB of disk, its venv included (a 2 GiB
# file sent and received, a broker's journal, the kill tests' files; passing tests' directories
# go as they end). A full disk fails tests with errors that do not say so: say it first.
free_kib=$(df -Pk "${TMPDIR:-/tmp}" | awk 'NR == 2 {print $4}')
if [ "${free_kib:-0}" -lt $((8 * 1024 * 1024)) ]; then
  echo "test: only $((${free_kib:-0} / 1024 / 1024)) GiB free in ${TMPDIR:-/tmp}; the suite needs about 7 GiB" \
       "at its peak. Free some, or point TMPDIR at a larger disk." >&2
fi
status=0
# worksteal: a worker that runs out takes tests queued for another, so a long test handed out
# late does not leave two workers idle (277 s against 301-313 s with the default `load`). Five
# workers, not three: most of these tests wait (on a broker's purge schedule, an idle timeout),
# and with three the cores sat half idle. The parts run one after the other: side by side, the
# system tests took 60 % longer and the two together longer than in turn
# (docs/decisions/test-suite-time.md).
"$VENV/bin/python" -m pytest -n "${AMQSTREAM_TEST_WORKERS:-5}" --dist worksteal --durations=15 \
  -m "not soak and not serial and not quiet" || status=$?
# Each part runs even when one before it failed: one CI run reports everything.
wait "$cds" || true  # it says why it made none
# Three files at a time: with the Spark class archive the part no longer fills two cores
# (297 s against 369 s with two, the same hour), and test_deployment.py, the longest file,
# is then most of it.
"$VENV/bin/python" -m pytest -n "${AMQSTREAM_SYSTEM_WORKERS:-3}" --dist loadfile --durations=15 -m "serial and not soak" || status=$?
"$VENV/bin/python" -m pytest -n "${AMQSTREAM_QUIET_WORKERS:-5}" --dist loadfile --durations=10 \
  -m "quiet and not soak" || status=$?
exit "$status"
