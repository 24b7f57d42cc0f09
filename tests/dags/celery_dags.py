"""DAGs for tests/system/test_celery.py: a receiving task whose worker the test kills.

``amqs_celery_receive`` receives one stream (by id) into ``out_dir`` (shared by the
workers); ``amqs_celery_receive_local`` into the running worker's own directory,
``{{ worker_dir() }}/in`` (each worker of ``make airflow-celery`` has one,
``AMQSTREAM_WORKER_DIR``; rendered on the worker that runs the task). The test sends the
stream from its own process.
"""

from __future__ import annotations

import os
from datetime import timedelta

from airflow.sdk import DAG

from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

PARAMS = {"queue": "", "out_dir": "", "stream_id": ""}


def worker_dir() -> str:
    """The running worker's own directory (rendered on the worker), else the temp dir."""
    return os.environ.get("AMQSTREAM_WORKER_DIR", "/tmp")


with DAG("amqs_celery_receive", schedule=None, params=PARAMS, max_active_runs=4,
         user_defined_macros={"worker_dir": worker_dir},
         default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}) as celery_receive:
    StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                         stream_id="{{ params.stream_id }}", poke_interval=1, timeout=600, idle_timeout=120,
                         window=4)

# The same on each worker's own disk (no shared directory), retried once: the retry on the
# other worker cannot continue the stream, and must say where its first bytes are.
with DAG("amqs_celery_receive_local", schedule=None, params=PARAMS, max_active_runs=4,
         user_defined_macros={"worker_dir": worker_dir},
         default_args={"retries": 1, "retry_delay": timedelta(seconds=1)}) as celery_receive_local:
    StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ worker_dir() }}/in",
                         stream_id="{{ params.stream_id }}", poke_interval=1, timeout=600, idle_timeout=120,
                         window=4)
