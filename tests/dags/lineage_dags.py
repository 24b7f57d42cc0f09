"""A DAG for tests/system/test_lineage_spark.py: a file sent and received and a glob of files sent and received,
so the test can read the OpenLineage events Airflow's listener emits for every task."""

from __future__ import annotations

from airflow.sdk import DAG

from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

PARAMS = {"path": "", "queue": "", "out_dir": "", "stream_id": "", "glob": "", "many_queue": ""}

with DAG("amqs_test_lineage", schedule=None, params=PARAMS):
    send = SendStreamOperator(task_id="send", path="{{ params.path }}", destination="{{ params.queue }}",
                              stream_id="{{ params.stream_id }}", mode="atomic")
    receive = StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                                   stream_id="{{ params.stream_id }}", poke_interval=1, timeout=60)
    many = SendStreamOperator(task_id="send_many", path="{{ params.glob }}", destination="{{ params.many_queue }}",
                              mode="atomic")
    receive_many = ReceiveStreamsOperator(task_id="receive_many", source="{{ params.many_queue }}",
                                          out_dir="{{ params.out_dir }}/many", count=3, wait_timeout=60)
    send >> receive >> many >> receive_many
