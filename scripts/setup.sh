#!/usr/bin/env bash
# Install everything the project needs on a Debian/Ubuntu machine: Java and ActiveMQ
# from apt (only if missing), then a Python venv with the package and its test tools.
set -euo pipefail
VENV="${1:-.venv}"
cd "$(dirname "$0")/.."
source scripts/progress.sh

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(default-jre-headless)
[ -f "${ACTIVEMQ_HOME:-/usr/share/activemq}/bin/activemq.jar" ] || need_apt+=(activemq)
# OpenSSH server and client: the benchmark's SFTP baselines (and their smoke test).
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v sftp >/dev/null 2>&1 || need_apt+=(openssh-client)
# Headless Chromium for the UI checks of tests/system/test_deployment.py (driven by Playwright's
# Python package, which downloads no browser of its own here).
[ -x /usr/lib/chromium/chromium ] || command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# Redis, Celery's broker for the CeleryExecutor deployment (make airflow-celery, tests/system/test_celery.py).
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]} with apt-get"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  step setup "apt-get update" $SUDO apt-get update -qq
  step setup "apt-get install ${need_apt[*]}" env DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    "${need_apt[@]}" >/dev/null
fi

# The broker's store plugin (needs javac: installs default-jdk-headless if missing).
bash scripts/broker_jar.sh

PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || step setup "creating the venv $VENV" "$PY" -m venv "$VENV"
# uv resolves and installs the ~200 packages in about 55 s where pip took about 120 s (warm
# caches both; docs/decisions/test-suite-time.md), and its resolution is consistent where pip's
# was not (celery 5.6 with kombu 5.7). uv itself comes from PyPI, into the venv.
# --compile-bytecode, as pip does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it),
# nothing writes a .pyc at import, and every Python process would compile Airflow from source.
[ -x "$VENV/bin/uv" ] || "$VENV/bin/python" -m pip install -q --disable-pip-version-check uv
# pyspark 4.3 is published only as a source package holding Spark's jars. Here uv fetched and
# built it again for every new venv, twice when the reinstall below ran: about 30 s each, and
# about 1.4 GB more of uv's cache each time (35 build trees, 32 GB, after a day and a half of CI
# runs: part of what filled the disk under one). So its wheel is built once per machine (pip
# keeps a wheel it built), kept in the user's cache directory, and uv finds it there.
PYSPARK=4.3.0
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/amqstream-wheels"
if ! compgen -G "$WHEELS/pyspark-$PYSPARK-*.whl" >/dev/null; then
  mkdir -p "$WHEELS"
  tmp=$(mktemp -d "$WHEELS/.build-XXXXXX")
  step setup "building the pyspark $PYSPARK wheel (once per machine, into $WHEELS)" \
    "$VENV/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps "pyspark==$PYSPARK" -w "$tmp"
  mv "$tmp"/pyspark-*.whl "$WHEELS/" && rmdir "$tmp"
fi
UV=("$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" --find-links "$WHEELS")
# An egg-info an older setup.py left in the checkout makes the package found twice wherever the
# checkout is on sys.path, and with it the streams page's plugin entry point (setup.py says what
# that costs); setup.py now writes it under build/.
rm -rf ./*.egg-info
step setup "installing the package, Airflow, Spark and the test tools into $VENV (about 1-2 min the first time)" \
  "${UV[@]}" -e ".[dev,bench,spark,celery]" "pyspark==$PYSPARK"
# The Spark provider pulls pyspark-client, which shares ~700 files with pyspark; if it was
# installed over pyspark, reinstall pyspark so `import pyspark` and its jars agree again.
if ! "$VENV/bin/python" -c "import pyspark, sys; sys.exit(pyspark.__version__ != '$PYSPARK')" 2>/dev/null; then
  step setup "reinstalling pyspark $PYSPARK over pyspark-client" "${UV[@]}" --reinstall-package pyspark --no-deps \
    "pyspark==$PYSPARK"
fi
"$VENV/bin/python" -c 'import pyspark, airflow, stomp; print(f"setup: airflow {airflow.__version__}, pyspark {pyspark.__version__}, stomp.py {stomp.__version__}")'
touch "$VENV/.installed"
