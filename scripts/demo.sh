#!/usr/bin/env bash
# The main job, end to end: generate a realistic CSV of a few hundred MB (once), start
# the embedded ActiveMQ broker, run example DAG 1 (send -> receive + verify -> Spark ->
# check) with `airflow dags test` against it and local Spark, print the Parquet summary
# and the transfer figures, and stop the broker it started.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/progress.sh
OUT="${AMQSTREAM_DEMO_DIR:-$PWD/demo-output}"
ROWS="${AMQSTREAM_DEMO_ROWS:-5000000}"
PORT="${AMQSTREAM_DEMO_PORT:-61623}"
mkdir -p "$OUT"
export AIRFLOW_HOME="$OUT/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="$PWD/dags/examples"
export AMQSTREAM_BROKER_DIR="$OUT/broker"
export AMQSTREAM_EXAMPLE_DIR="$OUT"
export AMQSTREAM_STATE_DIR="$OUT/send-state"
export AMQSTREAM_REPORT_FILE="$OUT/report.json"
export AMQSTREAM_DEMO_FILE="$OUT/sales-${ROWS}.csv"
export AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[*]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}'

if [ ! -f "$AMQSTREAM_DEMO_FILE" ]; then
  step demo "generating $ROWS rows of sales data into $AMQSTREAM_DEMO_FILE (once)" \
    env PYTHONPATH=dags/examples python -c "import sys; from example_support import write_sample_csv as w; w(sys.argv[1], int(sys.argv[2]))" \
    "$AMQSTREAM_DEMO_FILE" "$ROWS"
fi
echo "demo: input $(du -h "$AMQSTREAM_DEMO_FILE" | cut -f1) $AMQSTREAM_DEMO_FILE"

started_broker=0
if ! amqstream broker status >/dev/null 2>&1; then
  step demo "starting the embedded broker" amqstream broker start --port "$PORT" >/dev/null  # its output shows the password once
  echo "demo: started the embedded broker on 127.0.0.1:$PORT (data in $AMQSTREAM_BROKER_DIR)"
  started_broker=1
fi
cleanup() { [ "$started_broker" = 1 ] && amqstream broker stop >/dev/null; }
trap cleanup EXIT
# Ctrl-C is a stop asked for, not a failure: exit 0 (make adds no "Error 130"), the broker stopped.
trap 'echo "demo: stopped"; exit 0' INT TERM
AIRFLOW_CONN_AMQSTREAM_DEFAULT="$(amqstream broker uri)"
export AIRFLOW_CONN_AMQSTREAM_DEFAULT

# The metadata database holds the connections Airflow saves (passwords too): its owner's only,
# as in scripts/airflow.sh, and an earlier run's file is made so as well.
mkdir -p "$AIRFLOW_HOME" && chmod 700 "$AIRFLOW_HOME"
(umask 077 && step demo "preparing the metadata database (airflow db migrate)" airflow db migrate >/dev/null)
if [ -f "$AIRFLOW_HOME/airflow.db" ]; then chmod 600 "$AIRFLOW_HOME/airflow.db"; fi
rm -f "$AMQSTREAM_REPORT_FILE"
# Every 10 s: the time so far and the log's last line (where the run is).
STEP_LOG="$OUT/dags-test.log" step demo "running DAG amqstream_one_file with airflow dags test (broker $(amqstream broker status | cut -d, -f2), Spark local[*]; log $OUT/dags-test.log)" \
  airflow dags test amqstream_one_file -c "{\"path\": \"$AMQSTREAM_DEMO_FILE\"}" > "$OUT/dags-test.log" 2>&1 || {
  echo "demo: the DAG run failed; the last lines of $OUT/dags-test.log:" >&2
  tail -40 "$OUT/dags-test.log" >&2
  exit 1
}
python - "$AMQSTREAM_REPORT_FILE" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
mib = r["bytes"] / 2**20
print("demo: verified transfer and Spark conversion")
print(f"  file       {mib:,.1f} MiB, {r['rows']:,} rows, sha256 {r['sha256']}")
print(f"  send       {r['send_seconds']:.2f}s ({mib / max(r['send_seconds'], 1e-6):,.0f} MiB/s into the broker)")
print(f"  receive    {r['receive_seconds']:.2f}s ({mib / max(r['receive_seconds'], 1e-6):,.0f} MiB/s, verified)")
print(f"  parquet    {r['parquet']} ({r['parquet_bytes'] / 2**20:,.1f} MiB, partitioned by region)")
print(f"  columns    {', '.join(r['columns'])}")
print(f"  rows check Spark rows == CSV rows == {r['rows']:,}")
PY
