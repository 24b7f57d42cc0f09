"""Example 1: one file end to end: send it, receive and verify it, convert it with Spark, check it."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, Param, task
from example_support import DEMO_FILE, PARQUET, QUEUE, README, RECEIVED, write_sample_csv

from airflow_provider_amqstream.operators.outlets import directory_asset
from airflow_provider_amqstream.operators.spark import stream_to_parquet_operator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

DOC = f"""
### One file end to end

Sends one file to `{QUEUE}.one` as a chunked stream, receives it with a sensor (every chunk
checked with CRC-32, the whole file with SHA-256 before it is published), converts it to
Parquet with Spark, and checks that Spark read as many rows as the file has.

| task | what it does |
|---|---|
| `ensure_input` | writes a sample sales CSV of `rows` rows at `path` if nothing is there yet |
| `send` | `SendStreamOperator`: the file to `{QUEUE}.one`; a retry resumes at the last chunk the broker confirmed |
| `receive` | `StreamCompleteSensor`: the stream into `{RECEIVED / "one"}` |
| `to_parquet` | Spark (`spark_default`) writes `{PARQUET / "one"}/<stream id>` |
| `check` | compares row counts and checksums; its XCom is the run's report |

**Assets:** `send` produces `amqstream://amqstream_default{QUEUE}.one` (the destination on
the connection's broker), which `receive` consumes; `receive` produces
`file://{RECEIVED / "one"}` (an event per stream that arrived: stream id, path, bytes,
SHA-256), which `to_parquet` consumes; `to_parquet` produces `file://{PARQUET / "one"}`.

**Run it:** not scheduled; trigger it, with a `path` to a CSV of your own or the default (a
sample is written there). Connections: `amqstream_default` and `spark_default`.

Provider documentation: `{README}`.
"""

with DAG(
    dag_id="amqstream_one_file",
    description="One file through ActiveMQ: send, receive and verify, convert to Parquet with Spark, check",
    doc_md=DOC,
    schedule=None,
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=5)},
    params={
        "path": Param(DEMO_FILE, type="string", title="File to send",
                      description="Path of the CSV to send (on the worker). If nothing is there, a sample sales "
                                  "CSV of `rows` rows is written first."),
        "rows": Param(50_000, type="integer", minimum=1, title="Rows of the sample",
                      description="Rows of the sample CSV written when `path` does not exist; ignored otherwise."),
    },
    tags=["amqstream", "example"],
) as dag:

    @task
    def ensure_input(params: dict | None = None) -> str:
        """Make a sample CSV if the input does not exist yet (so the example runs as is)."""
        path = Path(params["path"])
        if not path.exists():
            write_sample_csv(path, rows=int(params["rows"]))
        return str(path)

    path = ensure_input()
    stream_id = "one-file-{{ run_id | replace(':', '-') | replace('+', '-') }}"

    send = SendStreamOperator(task_id="send", path=path, destination=QUEUE + ".one", stream_id=stream_id)

    receive = StreamCompleteSensor(task_id="receive", source=QUEUE + ".one", out_dir=str(RECEIVED / "one"),
                                   stream_id=stream_id, overwrite=True, poke_interval=5, timeout=3600)

    to_parquet = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive",
                                            output_dir=str(PARQUET / "one"), partition_by="region",
                                            inlets=[directory_asset(str(RECEIVED / "one"))])

    @task
    def check(received: dict, ti=None) -> dict:
        """Compare Spark's row count with the received CSV's and report the figures."""
        summary_path = Path(PARQUET) / "one" / received["stream_id"] / "_amqstream_summary.json"
        summary = json.loads(summary_path.read_text())
        with open(received["path"], "rb") as fh:
            csv_rows = sum(1 for _ in fh) - 1
        if summary["rows"] != csv_rows:
            raise ValueError(f"Spark read {summary['rows']} rows but {received['path']} has {csv_rows}")
        if summary["source_sha256"] != received["sha256"]:
            raise ValueError("the Spark job converted a different file than the one received")
        sent = ti.xcom_pull(task_ids="send")
        report = {"rows": csv_rows, "bytes": received["bytes"], "sha256": received["sha256"],
                  "send_seconds": round(sent["seconds"], 3), "receive_seconds": round(received["seconds"], 3),
                  "parquet": summary["output"], "parquet_bytes": summary["parquet_bytes"],
                  "columns": summary["columns"]}
        print("AMQSTREAM_REPORT " + json.dumps(report))
        if os.environ.get("AMQSTREAM_REPORT_FILE"):
            Path(os.environ["AMQSTREAM_REPORT_FILE"]).write_text(json.dumps(report, indent=2))
        return report

    send >> receive >> to_parquet >> check(receive.output)
