# Sourced by the demo and test scripts: a private Airflow home and the venv on PATH
# (spark-submit must be found by name by every Airflow process).
VENV="${VENV:-.venv}"
VENV="$(cd "$VENV" && pwd)"
export PATH="$VENV/bin:$PATH"
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW__CORE__UNIT_TEST_MODE=False
export AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION=False
export PYSPARK_PYTHON="$VENV/bin/python"
export PYTHONUNBUFFERED=1
