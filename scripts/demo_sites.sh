#!/usr/bin/env bash
# Example 3 on two sites, each with its own embedded broker: site B listens for OpenWire,
# site A bridges to it. The producer DAG sends through A's connection, the consumer DAG
# receives (and runs Spark) through B's. Stops the brokers it started.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
OUT="${AMQSTREAM_DEMO_DIR:-$PWD/demo-output}/sites"
mkdir -p "$OUT"
export AIRFLOW_HOME="$OUT/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="$PWD/dags/examples"
export AMQSTREAM_EXAMPLE_DIR="$OUT"
export AMQSTREAM_STATE_DIR="$OUT/send-state"
export AMQSTREAM_SITE_A_CONN_ID=amqstream_site_a AMQSTREAM_SITE_B_CONN_ID=amqstream_site_b
export AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[*]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}'
# Three distinct free ports, picked in one process with all three held until the last is
# picked (one process per port could be handed the same one).
read -r PORT_A PORT_B OPENWIRE < <(python - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))
PY
)
A=(--data-dir "$OUT/broker-a" --port "$PORT_A")
B=(--data-dir "$OUT/broker-b" --port "$PORT_B")
cleanup() { amqstream broker "${A[@]}" stop >/dev/null || true; amqstream broker "${B[@]}" stop >/dev/null || true; }
trap cleanup EXIT
amqstream broker "${B[@]}" start --openwire-port "$OPENWIRE" --bridge-secret "$OUT/bridge.json" >/dev/null
amqstream broker "${A[@]}" start --network-to "tcp://127.0.0.1:$OPENWIRE" --bridge-secret "$OUT/bridge.json" >/dev/null
echo "demo-sites: site A's broker bridged to site B's (OpenWire 127.0.0.1:$OPENWIRE)"
AIRFLOW_CONN_AMQSTREAM_SITE_A="$(amqstream broker "${A[@]}" uri)"
# network=true: site B's deferred sensor also draws offers still waiting at site A.
AIRFLOW_CONN_AMQSTREAM_SITE_B="$(amqstream broker "${B[@]}" uri)?network=true"
export AIRFLOW_CONN_AMQSTREAM_SITE_A AIRFLOW_CONN_AMQSTREAM_SITE_B
airflow db migrate >/dev/null
for dag in amqstream_site_a_producer amqstream_site_b_consumer; do
  echo "demo-sites: airflow dags test $dag"
  airflow dags test "$dag" > "$OUT/$dag.log" 2>&1 || {
    echo "demo-sites: $dag failed; the last lines of $OUT/$dag.log:" >&2
    tail -40 "$OUT/$dag.log" >&2
    exit 1
  }
done
echo "demo-sites: received at site B: $(ls "$OUT/received/site-b")"
ls -d "$OUT"/parquet/site-b/*/ | sed 's/^/demo-sites: parquet /'
