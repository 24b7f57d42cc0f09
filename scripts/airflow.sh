#!/usr/bin/env bash
# A local Airflow deployment of the example DAGs against the embedded broker, in the
# foreground: the broker, then `airflow api-server`, `scheduler`, `dag-processor`,
# `triggerer` (LocalExecutor on SQLite, which Airflow 3.3 accepts) and a log server, each in a
# session of its own. It prints the UI address, the admin login and the line that gives
# another shell this deployment's connections. Ctrl-C, SIGTERM (to this script, or to the
# `make airflow` that runs it), SIGINT or SIGHUP to make's pid alone, SIGHUP (the terminal
# closed) or the death of the process that started it stops every process it started (by
# session, so LocalExecutor workers, tasks and spark-submit go too) and the broker if it
# started it, and exits 0. Everything lives in one directory, kept between runs, readable by
# its owner only (it holds passwords). Everything it starts listens on 127.0.0.1 only: the
# API, the broker, the log server, Spark's driver.
#
# Settings (environment):
#   AMQSTREAM_AIRFLOW_DIR    the deployment's directory (default ./airflow-local): airflow/
#                            (AIRFLOW_HOME), broker/, examples/ (the examples' files), logs/,
#                            env.sh (the connections, for another shell)
#   AMQSTREAM_AIRFLOW_PORT   the UI and API port on 127.0.0.1 (default 8080, else a free one)
#   AMQSTREAM_BROKER_PORT    the broker's STOMP port (default: the last run's while it is free,
#                            else a free one)
#   AMQSTREAM_DAGS_FOLDER    the DAGs (default dags/examples)
#   AIRFLOW__CORE__PARALLELISM  task slots (default 4: the machine this was tuned on has 2 cores)
#   AMQSTREAM_EXECUTOR       local (default: LocalExecutor) or celery: CeleryExecutor with Redis
#                            (Debian's redis-server on 127.0.0.1, a free port and a password) as
#                            Celery's broker, the metadata database as its result backend, and
#                            two workers, worker1 and worker2 (`make airflow-celery`)
#   AMQSTREAM_CELERY_WORKERS     how many Celery workers (default 2), each in workers/workerN/
#                            (its TMPDIR, send state and AMQSTREAM_WORKER_DIR), serving the
#                            queues `default` and `workerN`
#   AMQSTREAM_CELERY_CONCURRENCY task slots per worker (default 2)
#   AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT  the log server's port (default: a free one)
#   SPARK_LOCAL_IP, SPARK_CONF_DIR  Spark's address and configuration (default 127.0.0.1, and
#                            a spark-defaults.conf without the driver's web UI)
#   any other AIRFLOW__* variable is passed to every Airflow process.
set -euo pipefail
# Logs, the metadata database, env.sh and the broker's files hold passwords: nothing this
# creates may be readable by anyone but its owner.
umask 077
cd "$(dirname "$0")/.."
ROOT="$PWD"
source scripts/env.sh

DIR="${AMQSTREAM_AIRFLOW_DIR:-$ROOT/airflow-local}"
mkdir -p "$DIR/logs"
DIR="$(cd "$DIR" && pwd)"
# What an earlier run (before the umask above) left readable.
chmod -R go-rwx "$DIR"
HOST=127.0.0.1

say() { echo "airflow.sh: $*"; }

free_port() { python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
port_busy() { python -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 1)' "$1" 2>/dev/null; }

API_PORT="${AMQSTREAM_AIRFLOW_PORT:-}"
if [ -z "$API_PORT" ]; then
  API_PORT=8080
  if port_busy "$API_PORT"; then API_PORT="$(free_port)"; fi
elif port_busy "$API_PORT"; then
  say "port $API_PORT on $HOST is already in use; choose another with AMQSTREAM_AIRFLOW_PORT" >&2
  exit 1
fi

LOG_PORT="${AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT:-$(free_port)}"

export AIRFLOW_HOME="$DIR/airflow"
export AIRFLOW__CORE__DAGS_FOLDER="${AMQSTREAM_DAGS_FOLDER:-$ROOT/dags/examples}"
EXECUTOR="${AMQSTREAM_EXECUTOR:-local}"
case "$EXECUTOR" in
  local) export AIRFLOW__CORE__EXECUTOR=LocalExecutor ;;
  celery) export AIRFLOW__CORE__EXECUTOR=CeleryExecutor ;;
  *) say "AMQSTREAM_EXECUTOR=$EXECUTOR: use local or celery" >&2; exit 2 ;;
esac
export AIRFLOW__CORE__PARALLELISM="${AIRFLOW__CORE__PARALLELISM:-4}"
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
export AIRFLOW__API__HOST="$HOST"
export AIRFLOW__API__PORT="$API_PORT"
# Tasks reach the API through base_url: left at its default (port 8080) every task of a
# server on another port fails with httpx.ConnectError.
export AIRFLOW__API__BASE_URL="http://$HOST:$API_PORT"
export AIRFLOW__API__WORKERS="${AIRFLOW__API__WORKERS:-1}"
# The Test button in the connection list (off by default in Airflow 3).
export AIRFLOW__CORE__TEST_CONNECTION="${AIRFLOW__CORE__TEST_CONNECTION:-Enabled}"
# Loopback only. Airflow's own log servers (one per scheduler and triggerer) bind every
# interface and no setting changes that: the components run without them (--skip-serve-logs)
# and one log server of ours serves both kinds of log on 127.0.0.1, at the host name every
# component records.
export AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT="$LOG_PORT"
export AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT="$LOG_PORT"
export AIRFLOW__CORE__HOSTNAME_CALLABLE="${AIRFLOW__CORE__HOSTNAME_CALLABLE:-airflow_provider_amqstream.local_deployment.hostname}"
# Celery workers record their own names (local_deployment.hostname); the API server's task log
# handler fetches what they serve from the one log server on 127.0.0.1 all the same.
export AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS="${AIRFLOW__LOGGING__LOGGING_CONFIG_CLASS:-airflow_provider_amqstream.local_deployment.LOGGING_CONFIG}"
export AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_SERVER_HOST="$HOST"
# The metadata database is one SQLite file every component writes (unless the user names
# another database): wait up to a minute for its lock, not sqlite3's 5 s (see local_deployment.py).
if [ -z "${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-}" ]; then
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS:-airflow_provider_amqstream.local_deployment.SQLITE_CONNECT_ARGS}"
  export AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC="${AIRFLOW__DATABASE__SQL_ALCHEMY_CONNECT_ARGS_ASYNC:-airflow_provider_amqstream.local_deployment.SQLITE_CONNECT_ARGS_ASYNC}"
fi
# Spark's driver (its RPC, block manager and web UI) binds SPARK_LOCAL_IP; otherwise it takes
# the machine's external address. The web UI is off: tasks' drivers live seconds, and two at
# once fought over port 4040 (a warning in the task log).
export SPARK_LOCAL_IP="${SPARK_LOCAL_IP:-$HOST}"
if [ -z "${SPARK_CONF_DIR:-}" ]; then
  export SPARK_CONF_DIR="$DIR/spark-conf"
  mkdir -p "$SPARK_CONF_DIR"
  printf '%s\n' "# Written by scripts/airflow.sh for the local deployment (set SPARK_CONF_DIR to use your own)." \
    "spark.ui.enabled false" >"$SPARK_CONF_DIR/spark-defaults.conf"
fi
export AMQSTREAM_BROKER_DIR="$DIR/broker"
export AMQSTREAM_EXAMPLE_DIR="${AMQSTREAM_EXAMPLE_DIR:-$DIR/examples}"
export AMQSTREAM_STATE_DIR="$DIR/send-state"
if [ -z "${AIRFLOW_CONN_SPARK_DEFAULT:-}" ]; then
  export AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[2]", "extra": {"spark-binary": "spark-submit", "deploy-mode": "client"}}'
fi

PIDS=()
NAMES=()
WORKERS=()
started_broker=0
stopping=0
watcher=""

# Stop what this script started: each component leads a session of its own, and its
# LocalExecutor workers, tasks (in process groups of their own) and spark-submit JVMs stay
# in it. The scheduler, triggerer and DAG processor go first, while their tasks can still
# report to the API (with the API gone first they retry for minutes), then the api-server,
# then the broker: SIGTERM to every process of a session, SIGKILL to what is left of it
# after 30 s.
session_pids() { ps -eo pid=,sid= | awk -v s="$1" '$2 == s { print $1 }'; }
signal_session() { local p; for p in $(session_pids "$2"); do kill "-$1" "$p" 2>/dev/null || true; done; }
stop_sessions() {  # names of components to stop together
  local i name deadline
  for name in "$@"; do
    for i in "${!NAMES[@]}"; do [ "${NAMES[i]}" = "$name" ] && signal_session TERM "${PIDS[i]}"; done
  done
  deadline=$((SECONDS + 30))
  for name in "$@"; do
    for i in "${!NAMES[@]}"; do
      [ "${NAMES[i]}" = "$name" ] || continue
      while [ -n "$(session_pids "${PIDS[i]}")" ] && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
      if [ -n "$(session_pids "${PIDS[i]}")" ]; then
        say "$name (session ${PIDS[i]}) did not stop in 30 s; killing what is left of it"
        signal_session KILL "${PIDS[i]}"
      fi
    done
  done
}
stop_all() {
  [ "$stopping" = 1 ] && return
  stopping=1
  # Nothing may cut the stop short: not another signal, not a reader that has gone (a closed
  # terminal or pipe fails every `say` from here on), not one failing command under `set -e`.
  # A signal to the whole process group (Ctrl-C, a CI job cancelled) has already ended the
  # watcher, and `kill` of it failing once ended the script here, before it stopped anything.
  trap '' INT TERM HUP PIPE
  set +e
  [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
  say "stopping ${NAMES[*]:-nothing}"
  stop_sessions scheduler triggerer dag-processor
  # Celery workers after the scheduler (no new tasks), before the API (their tasks report to
  # it) and before Redis (a worker shutting down still talks to its broker).
  stop_sessions "${WORKERS[@]}"
  stop_sessions api-server log-server redis
  if [ "$started_broker" = 1 ]; then
    if amqstream broker stop >/dev/null; then say "stopped the broker"; else say "could not stop the broker in $AMQSTREAM_BROKER_DIR"; fi
  fi
  rm -f "$DIR/pids"
  say "stopped"
}
# A stop asked for (Ctrl-C, SIGTERM, SIGHUP) is no failure: exit 0, so `make` prints no
# "Error 130" after it.
trap 'stop_all; exit 0' INT TERM HUP
trap 'stop_all' EXIT
# Whoever started this may die without a signal to it (`make` killed with SIGKILL, a CI job
# cancelled): then this is an orphan, and stops everything as for SIGTERM. And a SIGINT or
# SIGHUP to `make`'s pid alone reaches only make, which then waits for this script for ever:
# make's handler sets the signal back to its default before it waits, so the watcher sees the
# signal leave make's caught set (/proc/PID/status SigCgt) and stops everything too.
parent=$PPID
caught() {  # the SIGHUP, SIGINT and SIGTERM bits of process $1's caught set ("" if it is gone)
  local m; m="$(awk '/^SigCgt:/ { print $2 }' "/proc/$1/status" 2>/dev/null)" || true
  if [ -n "$m" ]; then echo $(( 0x$m & 0x4003 )); fi
}
watch_make=""; [ "$(cat "/proc/$parent/comm" 2>/dev/null)" = make ] && watch_make="$(caught "$parent")"
( trap - INT TERM HUP EXIT  # the watcher only watches: the stop is the script's own
  set +e
  while [ "$(ps -o ppid= -p $$ 2>/dev/null | tr -d ' ')" = "$parent" ]; do
    if [ -n "$watch_make" ] && [ "$(caught "$parent")" != "$watch_make" ]; then
      echo "airflow.sh: make (pid $parent) was told to stop"; break
    fi
    sleep 2
  done
  kill -TERM $$ 2>/dev/null ) &
watcher=$!

# The broker: this deployment's own, unless one already runs on its data dir.
if amqstream broker status >/dev/null 2>&1; then
  say "using the broker already running in $AMQSTREAM_BROKER_DIR"
else
  # The port of the last run while it is free: connections saved against it keep working.
  BROKER_PORT="${AMQSTREAM_BROKER_PORT:-$(cat "$AMQSTREAM_BROKER_DIR/broker.port" 2>/dev/null || true)}"
  if [ -z "$BROKER_PORT" ] || { [ -z "${AMQSTREAM_BROKER_PORT:-}" ] && port_busy "$BROKER_PORT"; }; then
    [ -n "$BROKER_PORT" ] && say "the broker's port of the last run ($BROKER_PORT) is in use; taking another"
    BROKER_PORT="$(free_port)"
  fi
  say "starting the broker on $HOST:$BROKER_PORT"
  amqstream broker start --port "$BROKER_PORT" >"$DIR/logs/broker-start.log" 2>&1 || {
    say "the broker did not start:" >&2; cat "$DIR/logs/broker-start.log" >&2; exit 1; }
  started_broker=1
fi
# With the examples' destinations in its extra: the streams page and `amqstream streams ls` show them.
AIRFLOW_CONN_AMQSTREAM_DEFAULT="$(amqstream broker uri | python -m airflow_provider_amqstream.local_deployment \
  default-conn --queue "${AMQSTREAM_QUEUE:-/queue/amqstream.examples}")"
export AIRFLOW_CONN_AMQSTREAM_DEFAULT

start() {
  local name="$1"; shift
  # setsid: each component leads a session of its own, which its children stay in.
  setsid "$@" >"$DIR/logs/$name.log" 2>&1 &
  PIDS+=("$!")
  NAMES+=("$name")
  echo "$name $!" >>"$DIR/pids"
}
rm -f "$DIR/pids"

CELERY_ENV=()
if [ "$EXECUTOR" = celery ]; then
  source scripts/celery.sh
  start_redis
  CELERY_ENV=(AIRFLOW__CORE__EXECUTOR AIRFLOW__CELERY__BROKER_URL AIRFLOW__CELERY__RESULT_BACKEND)
fi

# Another shell gets this deployment's connections (and its Airflow) by sourcing this. It
# holds the broker's password: mode 0600, as everything here.
ENV_FILE="$DIR/env.sh"
{
  echo "# Written by scripts/airflow.sh: the local deployment in $DIR, for another shell:"
  echo "#   source $ENV_FILE"
  echo "# then \`amqstream ...\` and \`airflow ...\` use its broker, connections and metadata database."
  for name in AIRFLOW_HOME AIRFLOW__CORE__DAGS_FOLDER AIRFLOW__CORE__LOAD_EXAMPLES AIRFLOW_CONN_AMQSTREAM_DEFAULT \
              AIRFLOW_CONN_SPARK_DEFAULT AMQSTREAM_BROKER_DIR AMQSTREAM_EXAMPLE_DIR SPARK_LOCAL_IP SPARK_CONF_DIR \
              "${CELERY_ENV[@]}"; do
    value="${!name}"
    printf "export %s='%s'\n" "$name" "${value//\'/\'\\\'\'}"  # single-quoted; a ' becomes '\''
  done
  printf "export PATH='%s':\"\$PATH\"\n" "$VENV/bin"
} >"$ENV_FILE"
chmod 600 "$ENV_FILE"

say "preparing the metadata database (airflow db migrate)"
airflow db migrate >"$DIR/logs/db-migrate.log" 2>&1 || {
  say "airflow db migrate failed:" >&2; tail -30 "$DIR/logs/db-migrate.log" >&2; exit 1; }

start api-server airflow api-server
start scheduler airflow scheduler --skip-serve-logs
start dag-processor airflow dag-processor
start triggerer airflow triggerer --skip-serve-logs
start log-server python -m airflow_provider_amqstream.local_deployment serve-logs --host "$HOST" --port "$LOG_PORT"
[ "$EXECUTOR" = celery ] && start_workers

say "started ${NAMES[*]}; waiting for the API at $AIRFLOW__API__BASE_URL"
# Ready when the API answers healthy; the admin password exists from then on.
PASSWORDS="${AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE:-$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated}"
if ! python - "$AIRFLOW__API__BASE_URL" "$PASSWORDS" "$DIR/pids" <<'PY'
import json, os, sys, time, urllib.request
base, passwords, pids = sys.argv[1:]
start = time.monotonic()
deadline = start + float(os.environ.get("AMQSTREAM_AIRFLOW_START_TIMEOUT", "180"))
said = start
while time.monotonic() < deadline:
    if time.monotonic() - said >= 10:
        said = time.monotonic()
        print(f"airflow.sh: still waiting for the API ({said - start:.0f} s)", flush=True)
    for line in open(pids):
        name, pid = line.split()
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            sys.exit(f"airflow.sh: {name} exited during start-up; see its log")
    try:
        with urllib.request.urlopen(base + "/api/v2/monitor/health", timeout=5) as r:
            if r.status == 200 and os.path.exists(passwords) and json.load(open(passwords)).get("admin"):
                sys.exit(0)
    except (OSError, ValueError):
        pass
    time.sleep(1)
sys.exit(f"airflow.sh: the API at {base} did not answer in time")
PY
then
  say "start-up failed; logs in $DIR/logs" >&2
  exit 1
fi
ADMIN_PASSWORD="$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["admin"])' "$PASSWORDS")"

cat <<EOF
airflow.sh: ready
  UI          $AIRFLOW__API__BASE_URL   user admin, password $ADMIN_PASSWORD
              (the password is kept in $PASSWORDS)
  broker      $(amqstream broker status)
  connection  amqstream_default and spark_default (local[2]), set in this script's environment;
              in another shell:  source $ENV_FILE
  DAGs        $AIRFLOW__CORE__DAGS_FOLDER (unpaused), files under $AMQSTREAM_EXAMPLE_DIR
  logs        $DIR/logs/ (components), $AIRFLOW_HOME/logs/ (tasks, served on $HOST:$LOG_PORT)
EOF
if [ "$EXECUTOR" = celery ]; then celery_banner; fi
echo "  Ctrl-C stops everything this started."

# Wait until a signal comes or a component dies; a dead component stops the rest, except a
# Celery worker while another is left: its tasks are retried on the others (what a lost
# machine does to a real deployment), and the test suite kills one on purpose.
set +e
gone=()
while true; do
  live=()
  for i in "${!PIDS[@]}"; do [[ " ${gone[*]} " == *" $i "* ]] || live+=("${PIDS[i]}"); done
  wait -n "${live[@]}"
  status=$?
  [ "$stopping" = 1 ] && exit 0
  fatal=0
  for i in "${!PIDS[@]}"; do
    [[ " ${gone[*]} " == *" $i "* ]] && continue
    kill -0 "${PIDS[i]}" 2>/dev/null && continue
    gone+=("$i")
    say "${NAMES[i]} exited (status $status); see $DIR/logs/${NAMES[i]}.log" >&2
    if [[ "${NAMES[i]}" == worker* ]]; then
      left=0
      for w in "${!PIDS[@]}"; do
        [[ "${NAMES[w]}" == worker* && " ${gone[*]} " != *" $w "* ]] && left=$((left + 1))
      done
      if [ "$left" -gt 0 ]; then
        say "$left Celery worker(s) left: their tasks, and the retries of ${NAMES[i]}'s, go on there" >&2
        # Its session may still hold orphans (a task's children): they go with it.
        signal_session KILL "${PIDS[i]}"
        continue
      fi
    fi
    fatal=1
  done
  [ "$fatal" = 1 ] && exit 1
done
