"""Example 3a: the producer site. Streams every file it finds in its outbox and moves
each sent file to outbox/sent/<date>/, so the next run does not send it again and every
run's files are kept (a name already archived that day gets the stream id added)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, task
from example_support import BASE, QUEUE, README, SITE_A_CONN, write_sample_csv

from airflow_provider_amqstream.operators.outlets import destination_asset
from airflow_provider_amqstream.operators.stream import SendStreamOperator

OUTBOX = BASE / "site-a" / "outbox"

DOC = f"""
### Site A: the producer

Sends every file in its outbox `{OUTBOX}` to `{QUEUE}.sites` as an **atomic** stream (a
receiver sees it only once every chunk is stored in the broker), one mapped `send` task per
file, then archives each sent file under `outbox/sent/<date>/` (a name archived before that
day gets the stream id added). When the outbox is empty a sample CSV is written, so the
example always has something to send.

Its consumer is `amqstream_site_b_consumer`; the two may run on different machines, each
with its own broker (`make demo-sites` bridges two). Connection: `{SITE_A_CONN}`.

**Assets:** each `send` produces `amqstream://{SITE_A_CONN}{QUEUE}.sites`, which site B's
`receive` consumes (through the same connection id: with a broker per site, each site's
connection names its own broker and the two assets are apart).

**Run it:** scheduled every 30 minutes; put files into the outbox.

Provider documentation: `{README}`.
"""

with DAG(
    dag_id="amqstream_site_a_producer",
    description="Site A: every file of its outbox as an atomic stream to site B, then archived",
    doc_md=DOC,
    schedule=timedelta(minutes=30),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 3, "retry_delay": timedelta(seconds=30)},
    tags=["amqstream", "example", "site-a"],
) as dag:

    @task
    def outbox_files() -> list[str]:
        OUTBOX.mkdir(parents=True, exist_ok=True)
        if not any(p.is_file() for p in OUTBOX.iterdir()):
            write_sample_csv(OUTBOX / "site-a-orders.csv", rows=10_000)
        return sorted(str(p) for p in OUTBOX.iterdir() if p.is_file())

    @task
    def archive(result: dict, ds: str | None = None) -> str:
        src = Path(result["path"])
        day = OUTBOX / "sent" / str(ds)
        dest = day / src.name
        if dest.exists():
            dest = day / f"{src.stem}.{result['stream_id']}{src.suffix}"
        day.mkdir(parents=True, exist_ok=True)
        if src.exists():  # a retry of this task finds it moved already
            shutil.move(str(src), dest)
        return str(dest)

    # A mapped task is built only when it runs: its outlet (the destination's asset) is
    # declared here so the DAG shows it.
    sent = SendStreamOperator.partial(task_id="send", destination=QUEUE + ".sites", mode="atomic",
                                      amqstream_conn_id=SITE_A_CONN,
                                      outlets=[destination_asset(SITE_A_CONN, QUEUE + ".sites")],
                                      ).expand(path=outbox_files())
    archive.expand(result=sent.output)
