"""DAGs for tests/system/test_deployment.py: a send slow enough to be killed mid-transfer (16 KiB
chunks, one broker confirmation per chunk: ~4 MiB/s here) with a sensor receiving it at the
same time; and a sensor alone, for a stream the test sends itself and holds short of the end, so
the sensor is still running whatever the machine's load when the test reads its log."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG

from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

PARAMS = {"path": "", "queue": "", "out_dir": "", "stream_id": ""}

with DAG("amqs_deploy_slow_transfer", schedule=None, params=PARAMS, max_active_runs=4,
         default_args={"retries": 2, "retry_delay": timedelta(seconds=1)}) as slow_transfer:
    SendStreamOperator(task_id="send", path="{{ params.path }}", destination="{{ params.queue }}",
                       stream_id="{{ params.stream_id }}", chunk_size=16 * 1024, window=1, progress_interval=2)
    StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                         stream_id="{{ params.stream_id }}", poke_interval=2, timeout=600, idle_timeout=60)

with DAG("amqs_deploy_receive", schedule=None, params=PARAMS, max_active_runs=4) as receive_only:
    # The test's sender stops short of the end until the UI has shown a progress line, for
    # minutes without a chunk, so the sensor must not presume it dead sooner.
    StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                         stream_id="{{ params.stream_id }}", poke_interval=2, timeout=600, idle_timeout=400)
