"""Example 3b: the consumer site. Waits (deferred, no worker slot) for the next stream from
site A, receives and verifies it, and converts it to Parquet with Spark. Nothing is
overwritten: a file of a name received before is stored with its stream id in the name,
and each stream's dataset has its own directory (``parquet/site-b/<stream id>``)."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG
from example_support import PARQUET, QUEUE, README, RECEIVED, SITE_B_CONN

from airflow_provider_amqstream.operators.outlets import directory_asset
from airflow_provider_amqstream.operators.spark import stream_to_parquet_operator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

DOC = f"""
### Site B: the consumer

Waits for the next stream from site A on `{QUEUE}.sites` with a **deferrable** sensor: while
nothing is offered it holds no worker slot, the triggerer watches the queue. Then it receives
and verifies the stream into `{RECEIVED / "site-b"}` and converts it with Spark to
`{PARQUET / "site-b"}/<stream id>`. Nothing is overwritten: a name received before gets the
stream id added.

Its producer is `amqstream_site_a_producer`. Connection: `{SITE_B_CONN}`, `spark_default`.

**Assets:** `receive` consumes `amqstream://{SITE_B_CONN}{QUEUE}.sites` (what site A's
`send` produces) and produces `file://{RECEIVED / "site-b"}`, an event per stream that
arrived, which `to_parquet` consumes; `to_parquet` produces `file://{PARQUET / "site-b"}`.

**Run it:** scheduled every 5 minutes (one run at a time); each run takes one stream.

Provider documentation: `{README}`.
"""

with DAG(
    dag_id="amqstream_site_b_consumer",
    description="Site B: wait (deferred) for site A's next stream, receive and verify it, convert it with Spark",
    doc_md=DOC,
    schedule=timedelta(minutes=5),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=30)},
    tags=["amqstream", "example", "site-b"],
) as dag:
    receive = StreamCompleteSensor(task_id="receive", source=QUEUE + ".sites", out_dir=str(RECEIVED / "site-b"),
                                   amqstream_conn_id=SITE_B_CONN, deferrable=True, poke_interval=10,
                                   timeout=4 * 3600)
    receive >> stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive",
                                          output_dir=str(PARQUET / "site-b"),
                                          inlets=[directory_asset(str(RECEIVED / "site-b"))])
