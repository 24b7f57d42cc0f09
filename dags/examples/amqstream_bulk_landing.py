"""Example 2: scheduled bulk movement. Each run moves the whole landing directory in one
send task (one connection, small files pipelined), receives it in one task, converts every
file of the batch in one Spark application, and archives what it sent under
``sent/<run id>/`` (beside the landing directory) so the next run moves only what landed
since. Each day's files land in a dated subdirectory (``received/bulk/<date>``); within a
day a later file of the same name is stored with its stream id in the name (never
overwritten), and the batch's manifest says where each one landed."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, task
from example_support import LANDING, PARQUET, QUEUE, README, RECEIVED, write_sample_csv

from airflow_provider_amqstream.operators.outlets import directory_asset
from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.spark import manifest_to_parquet_operator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.operators.xcom import iter_result_files

RUN_DAY = "{{ dag_run.run_after | ds }}"

DOC = f"""
### A landing directory, every hour

Moves everything in `{LANDING}` (subdirectories kept) through `{QUEUE}.bulk` in **one** send
task over one connection: files of one chunk or less travel packed, up to 32 to a broker
message. One receive task takes the whole batch and writes its manifest (path, bytes,
SHA-256 of every file); one Spark application converts every file it lists.

| task | what it does |
|---|---|
| `seed_landing` | writes three sample CSVs (in `eu/` and `us/`) when the landing directory is empty |
| `send` | `SendStreamOperator` with `recursive=True`; a retry skips the files the broker confirmed |
| `receive` | `ReceiveStreamsOperator`: into `{RECEIVED / "bulk"}/<date>`, until the batch's manifest is written |
| `to_parquet` | one Spark application for the batch: `{PARQUET}/bulk/<run id>/` |
| `archive` | moves what was sent to `sent/<run id>/` beside the landing directory |

Each day lands in its own subdirectory (`out_dir` templated with `{RUN_DAY}`), so names
rarely meet; a file received under a name received before that day keeps both: the later one
gets its stream id in its name, and the manifest says where each landed.

**Assets:** `send` produces `amqstream://amqstream_default{QUEUE}.bulk` (the destination on the
connection's broker), which `receive` consumes; `receive` produces `file://{RECEIVED / "bulk"}`
(one event per run that brought files: the day's directory, files, bytes, manifest), which
`to_parquet` consumes; `to_parquet` produces `file://{PARQUET / "bulk"}`.

**Run it:** scheduled hourly (and on unpausing); drop files into the landing directory.
Connections: `amqstream_default`, `spark_default`.

Provider documentation: `{README}`.
"""

with DAG(
    dag_id="amqstream_bulk_landing",
    description="Hourly: the whole landing directory in one send, one receive, one Spark application",
    doc_md=DOC,
    schedule=timedelta(hours=1),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    tags=["amqstream", "example"],
) as dag:

    @task
    def seed_landing() -> str:
        """Seeds the landing directory with samples (in two subdirectories) when it is empty."""
        LANDING.mkdir(parents=True, exist_ok=True)
        if not any(p.is_file() for p in LANDING.rglob("*")):
            for i in range(3):
                write_sample_csv(LANDING / ("eu" if i % 2 else "us") / f"batch-{i}.csv", rows=5_000, seed=i)
        return str(LANDING)

    # The whole directory in one task; relative paths are kept on the receiving side. A retry
    # skips the files the broker already confirmed.
    send = SendStreamOperator(task_id="send", path="{{ ti.xcom_pull(task_ids='seed_landing') }}", recursive=True,
                              destination=QUEUE + ".bulk")
    seed_landing() >> send

    # One receive task takes every stream of the batch over one connection and finishes when
    # the batch's manifest (path, bytes, sha256 per file) is written.
    # A dated subdirectory per day (the run's date: a run triggered by hand has no logical
    # date, so no ``ds``); the asset is received/bulk, and each event says which day.
    receive = ReceiveStreamsOperator(
        task_id="receive", source=QUEUE + ".bulk", out_dir=str(RECEIVED / "bulk") + "/" + RUN_DAY,
        batch_id="{{ ti.xcom_pull(task_ids='send')['totals']['batch_id'] }}", deadline=1800)

    # One Spark application converts every file the manifest lists.
    to_parquet = manifest_to_parquet_operator(
        task_id="to_parquet", manifest="{{ ti.xcom_pull(task_ids='receive')['manifest'] }}",
        output_dir=f"{PARQUET}/bulk/{{{{ run_id | replace(':', '_') | replace('+', '_') }}}}", partition_by="region",
        inlets=[directory_asset(str(RECEIVED / "bulk"))])

    @task
    def archive(sent: dict, run_id: str | None = None) -> int:
        """Move what was sent to ``sent/<run id>/`` (same relative paths): the next run does
        not send it again, and a rerun of this run finds nothing left to move."""
        target = LANDING.parent / "sent" / str(run_id).replace(":", "_").replace("+", "_")
        moved = 0
        # Past 1,000 files XCom carries totals and the path of the list of every file (on
        # the worker that sent them); iter_result_files reads whichever there is.
        for entry in iter_result_files(sent):
            src = Path(entry["path"])
            if src.exists():
                dest = target / src.relative_to(LANDING)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(src, dest)
                moved += 1
        return moved

    send >> receive >> to_parquet >> archive(send.output)
