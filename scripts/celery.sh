# The CeleryExecutor mode of scripts/airflow.sh (AMQSTREAM_EXECUTOR=celery, `make
# airflow-celery`), sourced by it: Redis as Celery's broker and the Celery workers. Uses
# airflow.sh's DIR, HOST, say, start and free_port.
#
# Redis is Debian's redis-server, this deployment's own: on 127.0.0.1 and a free port, with a
# password generated for each start (in redis/redis.conf, mode 0600, never on a command line),
# no persistence (Airflow queues a task again if Redis loses it). Celery's result backend is
# the metadata database (SQLite here: Airflow 3.3 accepts it with the CeleryExecutor, workers
# reach the metadata only through the API server, and Celery's own table lives beside
# Airflow's). Each worker has its own directory (workers/workerN: TMPDIR, the send state,
# AMQSTREAM_WORKER_DIR for a DAG that wants a worker-local output directory), a Celery host
# name workerN, and serves the queues `default` (every task) and `workerN` (tasks pinned to it
# with queue="workerN").

start_redis() {
  command -v redis-server >/dev/null || {
    say "no redis-server: apt-get install redis-server (make setup does)" >&2; exit 1; }
  python -c 'import airflow.providers.celery, redis' 2>/dev/null || {
    say "the Celery provider is not installed: pip install -e '.[celery]' (make setup does)" >&2; exit 1; }
  local rdir="$DIR/redis" password
  mkdir -p "$rdir"
  REDIS_PORT="${AMQSTREAM_REDIS_PORT:-$(free_port)}"
  password="$(python -c 'import secrets; print(secrets.token_urlsafe(24))')"
  # Loopback only, a password, protected mode; no snapshots or append-only file.
  cat >"$rdir/redis.conf" <<EOF
# Written by scripts/airflow.sh for the local CeleryExecutor deployment; replaced at each start.
bind $HOST
port $REDIS_PORT
protected-mode yes
requirepass $password
daemonize no
dir $rdir
save ""
appendonly no
logfile ""
EOF
  chmod 600 "$rdir/redis.conf"
  start redis redis-server "$rdir/redis.conf"
  local deadline=$((SECONDS + 30))
  until REDISCLI_AUTH="$password" redis-cli -h "$HOST" -p "$REDIS_PORT" ping 2>/dev/null | grep -q PONG; do
    if [ "$SECONDS" -ge "$deadline" ]; then
      say "redis-server did not answer on $HOST:$REDIS_PORT in 30 s; see $DIR/logs/redis.log" >&2; exit 1
    fi
    sleep 0.2
  done
  export AIRFLOW__CELERY__BROKER_URL="redis://:$password@$HOST:$REDIS_PORT/0"
  if [ -n "${AIRFLOW__DATABASE__SQL_ALCHEMY_CONN:-}" ]; then
    export AIRFLOW__CELERY__RESULT_BACKEND="${AIRFLOW__CELERY__RESULT_BACKEND:-db+$AIRFLOW__DATABASE__SQL_ALCHEMY_CONN}"
  else
    export AIRFLOW__CELERY__RESULT_BACKEND="${AIRFLOW__CELERY__RESULT_BACKEND:-db+sqlite:///$AIRFLOW_HOME/airflow.db}"
  fi
  # A worker that dies takes its tasks' heartbeats with it: the scheduler fails (and retries)
  # them after this many seconds (Airflow's default, 300, is long for a demo).
  export AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="${AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT:-60}"
}

start_workers() {
  local n="${AMQSTREAM_CELERY_WORKERS:-2}" i wdir
  for i in $(seq 1 "$n"); do
    wdir="$DIR/workers/worker$i"
    mkdir -p "$wdir/tmp" "$wdir/send-state"
    # AMQSTREAM_HOSTNAME: the host name its task instances record (local_deployment.hostname),
    # so the UI tells the workers apart; their served logs are still fetched from 127.0.0.1.
    start "worker$i" env TMPDIR="$wdir/tmp" AMQSTREAM_STATE_DIR="$wdir/send-state" AMQSTREAM_WORKER_DIR="$wdir" \
      AMQSTREAM_HOSTNAME="worker$i" \
      airflow celery worker --celery-hostname "worker$i" --queues "default,worker$i" --skip-serve-logs \
      --concurrency "${AMQSTREAM_CELERY_CONCURRENCY:-2}"
    WORKERS+=("worker$i")
  done
}

celery_banner() {
  echo "  executor    CeleryExecutor: Redis on $HOST:$REDIS_PORT (password in $DIR/redis/redis.conf),"
  echo "              results in the metadata database; workers ${WORKERS[*]} (queues default and their own"
  echo "              name; each in $DIR/workers/<name>), ${AMQSTREAM_CELERY_CONCURRENCY:-2} task slots each"
}
