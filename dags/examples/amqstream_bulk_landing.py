"""Example 2: scheduled bulk movement: every file in a landing directory is streamed by mapped
tasks, received one at a time by one consumer, and each is handed to Spark.

As a real landing zone, it moves each sent file to ``landing/sent/<run>/``, so the next run
sends only what arrived since; received files are never overwritten (a later file of the
same name is stored with its stream id in the name)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, task

from airflow_provider_amqstream.example_support import LANDING, PARQUET, QUEUE, RECEIVED, write_sample_csv
from airflow_provider_amqstream.operators.spark import quiet_spark_conf, stream_to_parquet_job
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

with DAG(
    dag_id="amqstream_bulk_landing",
    schedule=timedelta(hours=1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    tags=["amqstream", "example"],
) as dag:

    @task
    def list_landing() -> list[str]:
        """The files to move; seeds the landing directory with samples when it is empty."""
        LANDING.mkdir(parents=True, exist_ok=True)

        def waiting() -> list[str]:
            return sorted(str(p) for p in LANDING.iterdir() if p.is_file() and not p.name.startswith("."))

        if not waiting():
            for i in range(3):
                write_sample_csv(LANDING / f"batch-{i}.csv", rows=5_000, seed=i)
        return waiting()

    @task
    def archive(result: dict, run_id: str | None = None) -> str:
        """Move a sent file out of the landing directory, into sent/<run>/."""
        src = Path(result["path"])
        dest = LANDING / "sent" / str(run_id).replace(":", "-").replace("+", "-") / src.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.exists():  # a retry of this task finds it moved already
            shutil.move(str(src), dest)
        return str(dest)

    files = list_landing()
    sent = SendStreamOperator.partial(task_id="send", destination=QUEUE + ".bulk",
                                      max_active_tis_per_dagrun=2).expand(path=files)
    archive.expand(result=sent.output)

    # One consumer: the mapped sensors run one at a time, each taking one stream.
    received = StreamCompleteSensor.partial(
        task_id="receive", source=QUEUE + ".bulk", out_dir=str(RECEIVED / "bulk"),
        max_active_tis_per_dagrun=1, poke_interval=5, timeout=3600,
    ).expand(stream_id=sent.output.map(lambda r: r["stream_id"]))

    @task
    def spark_args(result: dict) -> list[str]:
        return ["--input", result["path"], "--output", f"{PARQUET}/{result['stream_id']}",
                "--sha256", result["sha256"], "--partition-by", "region"]

    from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator

    SparkSubmitOperator.partial(
        task_id="to_parquet", application=stream_to_parquet_job(), conn_id="spark_default",
        conf=quiet_spark_conf(), max_active_tis_per_dagrun=1,
    ).expand(application_args=spark_args.expand(result=received.output))
