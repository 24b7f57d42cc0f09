"""Example 4: event-driven. Every stream offered on a queue starts a DAG run (no schedule, no
polling sensor per expected file): an ``AssetWatcher`` runs the amqstream trigger in the
triggerer, which only looks at the queue and fires one asset event per offered stream. The
run receives exactly the streams named by its triggering events and converts each with Spark.

The scheduler folds events that arrive close together into one run, so the run maps over
its events: one receive and one Spark task per stream. Triggered by hand, it takes the
stream ids in the ``stream_ids`` parameter instead.
"""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, AssetWatcher, Param, task
from airflow.sdk.exceptions import AirflowFailException
from example_support import PARQUET, QUEUE, README, RECEIVED

from airflow_provider_amqstream.assets.amqstream import create_asset
from airflow_provider_amqstream.operators.outlets import directory_asset
from airflow_provider_amqstream.operators.spark import StreamToParquetOperator, stream_to_parquet_job
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

INCOMING = QUEUE + ".events"

try:  # common-messaging's generic trigger, when the "messaging" extra is installed
    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger

    watch = MessageQueueTrigger(scheme="amqstream", destination=INCOMING, amqstream_conn_id="amqstream_default",
                                poll_interval=5.0)
except ImportError:  # the same trigger, named directly
    from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger

    watch = StreamOfferedTrigger(destination=INCOMING, amqstream_conn_id="amqstream_default", poll_interval=5.0)

# The destination's own asset (the one a send to it produces, the receive consumes), watched.
incoming_streams = create_asset(conn_id="amqstream_default", destination=INCOMING,
                                watchers=[AssetWatcher(name="amqstream_offers", trigger=watch)])

DOC = f"""
### A run per offered stream

No schedule and no polling sensor: the queue's asset, `amqstream://amqstream_default{INCOMING}`,
has a watcher that runs the amqstream trigger in the triggerer. It only looks at the queue
and fires one asset event per stream offered there; each event starts a run.

| task | what it does |
|---|---|
| `offered_streams` | the stream ids of the run's asset events (or, triggered by hand, of `stream_ids`) |
| `receive` | one `StreamCompleteSensor` per stream id: exactly that stream, into `{RECEIVED / "events"}` |
| `to_parquet` | one Spark application per stream: `{PARQUET}/events/<stream id>` |

**Assets:** the watched `amqstream://amqstream_default{INCOMING}` starts the runs, and
`receive` consumes it; `receive` produces `file://{RECEIVED / "events"}`, an event per stream
that arrived, which `to_parquet` consumes; `to_parquet` produces `file://{PARQUET / "events"}`.

**Run it:** send a file to `{INCOMING}`, e.g. `amqstream send data.csv --to {INCOMING}
--mode atomic`; a run starts within seconds. Triggered by hand, it receives the streams
named in `stream_ids` (at least one: a run with none fails). Connections: `amqstream_default`, `spark_default`.

Provider documentation: `{README}`.
"""

with DAG(
    dag_id="amqstream_event_driven",
    description="Event-driven: every stream offered on the queue starts a run that receives it and converts it",
    doc_md=DOC,
    schedule=[incoming_streams],
    catchup=False,
    default_args={"retries": 2, "retry_delay": timedelta(seconds=10)},
    params={"stream_ids": Param([], type="array", items={"type": "string"}, title="Stream ids",
                                description="Streams to receive when triggered by hand, one id per line (waiting on "
                                            f"{INCOMING}). Runs started by the asset watcher take theirs from their "
                                            "events and ignore this.")},
    tags=["amqstream", "example", "event-driven"],
) as dag:

    @task
    def offered_streams(triggering_asset_events: dict | None = None, params: dict | None = None) -> list[str]:
        """The stream ids this run is for: from its asset events, else from the parameters."""
        ids = [event.extra["payload"]["stream_id"]
               for events in (triggering_asset_events or {}).values() for event in events
               if isinstance((event.extra or {}).get("payload"), dict) and "stream_id" in event.extra["payload"]]
        ids += list((params or {}).get("stream_ids") or [])
        if not ids:
            # Without an id every task below is skipped and the run is green, having received
            # nothing: a run started by hand with an empty list is a mistake to say, not to hide.
            raise AirflowFailException(f"this run names no stream: triggered by hand, list the ids of streams "
                                       f"waiting on {INCOMING} in 'Stream ids' (`amqstream streams ls --from "
                                       f"{INCOMING}` shows them)")
        return list(dict.fromkeys(ids))

    # Mapped tasks are built only when they run: their assets are declared here so the DAG
    # shows them (the operators add the same ones when they run).
    received = StreamCompleteSensor.partial(
        task_id="receive", source=INCOMING, out_dir=str(RECEIVED / "events"), poke_interval=5, timeout=3600,
        # The watched asset itself, watcher and all: Airflow keeps one definition per asset, the
        # last it collects, and a copy without the watcher here left the queue unwatched.
        inlets=[incoming_streams],
        outlets=[directory_asset(str(RECEIVED / "events"))],
    ).expand(stream_id=offered_streams())

    @task
    def spark_args(result: dict) -> list[str]:
        return ["--input", result["path"], "--output", f"{PARQUET}/events/{result['stream_id']}",
                "--sha256", result["sha256"], "--format", "auto"]

    StreamToParquetOperator.partial(
        task_id="to_parquet", sensor_task_id="receive", application=stream_to_parquet_job(),
        conn_id="spark_default", max_active_tis_per_dagrun=1, parquet_dir=f"{PARQUET}/events",
        inlets=[directory_asset(str(RECEIVED / "events"))], outlets=[directory_asset(f"{PARQUET}/events")],
    ).expand(application_args=spark_args.expand(result=received.output))
