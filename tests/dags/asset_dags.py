"""DAGs used by tests/integration/test_assets.py: sends and receives and the assets they produce."""

from __future__ import annotations

from airflow.sdk import DAG

from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

with DAG("amqs_test_file_asset", schedule=None,
         params={"queue": "/queue/unused", "out_dir": "/tmp/unused", "stream_id": "unused"}) as file_asset:
    StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                         stream_id="{{ params.stream_id }}", poke_interval=1, timeout=120,
                         file_asset_alias="amqs_received_files")

with DAG("amqs_test_files_asset", schedule=None,
         params={"queue": "/queue/unused", "out_dir": "/tmp/unused", "count": 1}) as files_asset:
    ReceiveStreamsOperator(task_id="receive_all", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                           count=2, wait_timeout=60, file_asset_alias="amqs_received_batches")

with DAG("amqs_test_pack_sensor", schedule=None,
         params={"queue": "/queue/unused", "out_dir": "/tmp/unused"}) as pack_sensor:
    StreamCompleteSensor(task_id="receive_next", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                         poke_interval=1, timeout=120, file_asset_alias="amqs_received_packed")

with DAG("amqs_test_send_receive_assets", schedule=None,
         params={"queue": "/queue/unused", "path": "/tmp/unused", "out_dir": "/tmp/unused",
                 "stream_id": "unused"}) as send_receive:
    send = SendStreamOperator(task_id="send", path="{{ params.path }}", destination="{{ params.queue }}",
                              stream_id="{{ params.stream_id }}")
    send >> StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                                 stream_id="{{ params.stream_id }}", poke_interval=1, timeout=120)

with DAG("amqs_test_receive_once", schedule=None,
         params={"queue": "/queue/unused", "out_dir": "/tmp/unused"}) as receive_once:
    ReceiveStreamsOperator(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                           count=1, wait_timeout=5)
