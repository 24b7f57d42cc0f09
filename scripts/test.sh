#!/usr/bin/env bash
# The whole test suite. The tests start their own ActiveMQ brokers on free loopback
# ports with throwaway data dirs, and stop them at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export AIRFLOW_HOME="$(mktemp -d)/airflow"
trap 'rm -rf "$(dirname "$AIRFLOW_HOME")"' EXIT
"$VENV/bin/ruff" check .
"$VENV/bin/lint-imports"
"$VENV/bin/mypy"  # protocol/ and transport/ ([tool.mypy] in pyproject.toml)
"$VENV/bin/python" -m pytest "$@"
