"""The assets the operators declare and emit, on the in-memory broker: the destination a send
produces (named by its connection id, declared when the DAG is parsed), the landing directory a
receive produces (one event per run that brought something new; none for repeats or for
nothing), the Parquet directory of the Spark hand-off, and bounded extras. No broker, no
Airflow database: the task's ``outlet_events`` are Airflow's own accessors."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.assets.amqstream import destination_uri
from airflow_provider_amqstream.assets.files import dir_uri, static_root
from airflow_provider_amqstream.engine import SendOptions
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.operators.outlets import MAX_IDS, Arrivals
from airflow_provider_amqstream.transport.memory import MemoryBroker

HOST = "MQ-Unit-Assets"  # the broker, which no asset names: they name the connection
PORT = 61700
Q = "/queue/assets.unit"


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryBroker]:
    b = MemoryBroker(name=HOST)
    params = dataclasses.replace(b.params("tester"), hosts=((HOST, PORT),))
    monkeypatch.setattr(AmqStreamHook, "broker_params", lambda self: params)
    yield b
    b.close()


def _context(task: Any) -> dict[str, Any]:
    from airflow.sdk.execution_time.context import OutletEventAccessors

    return {"ti": None, "task": task, "outlet_events": OutletEventAccessors()}


def _events(context: dict[str, Any], task: Any) -> list[tuple[str, str, dict[str, Any]]]:
    """(alias or "", asset URI, extra) of every event Airflow would record for the task when it
    succeeds: one per asset left in its outlets (with the extra it set), one per alias event."""
    from airflow.sdk import Asset

    accessors = context["outlet_events"]
    static = [("", o.uri, accessors[o].extra) for o in task.outlets if isinstance(o, Asset)]
    return static + [(e.source_alias_name, e.dest_asset_key.uri, e.extra)
                     for acc in accessors._dict.values() for e in acc.asset_alias_events]


def test_uris_name_the_connection_and_the_directory_without_the_machine() -> None:
    from airflow.sdk import Asset

    uri = destination_uri("amqstream_Prod", "/queue/in")
    assert uri == "amqstream://amqstream_Prod/queue/in"  # a connection id is case-sensitive
    assert Asset(uri=uri).uri == uri  # what Airflow stores: already normalised
    assert Asset(uri="amqstream://MQ1.Example.com:61614/topic/t").uri == "amqstream://mq1.example.com:61614/topic/t"
    assert dir_uri("/data/in") == "file:///data/in"
    assert Asset(uri=dir_uri("/data/in")).uri == "file:///data/in"
    assert static_root("/data/in/{{ ds }}") == "/data/in"
    assert static_root("/data/in/{{ ds }}/x") == "/data/in"
    assert static_root("/data/in-{{ ds }}") == "/data"
    assert static_root("/data/in/") == "/data/in"


def test_arrivals_count_real_arrivals_only_and_stay_small() -> None:
    results = [{"stream_id": f"s-{i}", "path": f"/in/f{i}", "bytes": 10, "sha256": "x", "status": "complete"}
               for i in range(1_000)]
    results.append({"stream_id": "dup", "path": "/in/dup", "bytes": 99, "status": "duplicate"})
    got = Arrivals.of(iter(results))
    assert (got.files, got.bytes, got.duplicates) == (1_000, 10_000, 1)
    extra = got.extra("/in", manifest="/in/.amqstream/m.jsonl", batch_id="b-1")
    assert extra["stream_ids"] == [f"s-{i}" for i in range(MAX_IDS)] and extra["stream_ids_truncated"] is True
    assert extra["manifest"] == "/in/.amqstream/m.jsonl" and extra["files"] == 1_000
    assert len(json.dumps(extra)) < 1_000  # bounded, whatever the number of files
    one = Arrivals.of([results[0]]).extra("/in")
    assert (one["stream_id"], one["path"], one["sha256"]) == ("s-0", "/in/f0", "x")


def test_send_then_receive_emit_the_destination_and_the_landing_directory(broker: MemoryBroker,
                                                                          tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
    from airflow_provider_amqstream.operators.stream import SendStreamOperator

    src = tmp_path / "sales.csv"
    src.write_bytes(b"a,b\n1,2\n" * 500)
    send = SendStreamOperator(task_id="send", path=str(src), destination=Q, stream_id="asset-1")
    dest = f"amqstream://amqstream_default{Q}"
    assert [o.uri for o in send.outlets] == [dest]  # declared when the DAG is parsed
    ctx = _context(send)
    sent = send.execute(ctx)
    [(name, uri, extra)] = _events(ctx, send)
    assert (name, uri) == ("", dest)
    assert extra["stream_id"] == "asset-1" and extra["sha256"] == sent["sha256"] and extra["bytes"] == sent["bytes"]

    template = str(tmp_path / "in") + "/{{ ds }}"
    recv = ReceiveStreamsOperator(task_id="receive", source=Q, out_dir=template, wait_timeout=0.5)
    landing = f"file://{(tmp_path / 'in').resolve()}"
    assert [i.uri for i in recv.inlets] == [dest] and [o.uri for o in recv.outlets] == [landing]
    recv.out_dir = str(tmp_path / "in" / "2026-11-26")  # as Airflow renders it
    ctx = _context(recv)
    got = recv.execute(ctx)
    assert got["count"] == 1
    [(name, uri, extra)] = _events(ctx, recv)
    assert (name, uri) == ("", landing)
    assert extra["out_dir"] == str((tmp_path / "in" / "2026-11-26").resolve())
    assert (extra["files"], extra["bytes"], extra["stream_id"]) == (1, src.stat().st_size, "asset-1")


def test_a_receive_of_nothing_or_of_repeats_emits_no_event(broker: MemoryBroker, tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
    from airflow_provider_amqstream.operators.stream import SendStreamOperator

    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 3_000)
    out = str(tmp_path / "in")

    def receive() -> tuple[dict[str, Any], list[Any]]:
        op = ReceiveStreamsOperator(task_id="receive", source=Q, out_dir=out, wait_timeout=0.5)
        ctx = _context(op)
        return op.execute(ctx), _events(ctx, op)

    nothing, events = receive()  # nothing offered
    assert (nothing["files"], nothing["failed"], nothing["manifest"], nothing["count"], events) == ([], [], None, 0, [])
    SendStreamOperator(task_id="send", path=str(src), destination=Q, stream_id="rep-1").execute(
        _context(None))
    first, events = receive()
    assert len(events) == 1 and first["files"][0]["status"] == "complete"
    # The same stream sent again (a sender that restarted from scratch): received before.
    from airflow_provider_amqstream.engine import send_file

    send_file(AmqStreamHook().broker_params(), src, Q, SendOptions(restart=True), stream_id="rep-1")
    again, events = receive()
    assert [f["status"] for f in again["files"]] == ["duplicate"] and events == []


def test_the_sensor_announces_its_stream_once(broker: MemoryBroker, tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.stream import SendStreamOperator
    from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

    src = tmp_path / "one.csv"
    src.write_bytes(b"h\n" + b"1\n" * 1_000)
    SendStreamOperator(task_id="send", path=str(src), destination=Q, stream_id="sensed-1").execute(_context(None))
    out = str(tmp_path / "in")

    def poke() -> list[Any]:
        sensor = StreamCompleteSensor(task_id="receive", source=Q, out_dir=out, stream_id="sensed-1", offer_wait=0.5)
        ctx = _context(sensor)
        assert sensor.poke(ctx).is_done
        return _events(ctx, sensor)

    [(_, uri, extra)] = poke()
    assert uri == f"file://{Path(out).resolve()}" and extra["stream_id"] == "sensed-1" and extra["files"] == 1
    assert poke() == []  # a re-run for a stream out_dir holds already: no second event


def test_the_spark_hand_off_produces_its_parquet_directory(tmp_path: Path) -> None:
    from airflow_provider_amqstream.operators.spark import (
        manifest_to_parquet_operator,
        parquet_extra,
        stream_to_parquet_operator,
    )

    one = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive", output_dir=str(tmp_path / "pq"))
    assert [o.uri for o in one.outlets] == [f"file://{(tmp_path / 'pq').resolve()}"]
    batch = manifest_to_parquet_operator(task_id="batch", manifest="m", output_dir=str(tmp_path / "pq") + "/{{ ds }}")
    assert [o.uri for o in batch.outlets] == [f"file://{(tmp_path / 'pq').resolve()}"]
    ds = tmp_path / "pq" / "s-1"
    ds.mkdir(parents=True)
    (ds / "_amqstream_summary.json").write_text(json.dumps({"rows": 3, "columns": ["a", "b"], "parquet_bytes": 9,
                                                            "source_sha256": "abc"}))
    assert parquet_extra(str(ds)) == {"output": str(ds.resolve()), "rows": 3, "columns": 2, "parquet_bytes": 9,
                                      "source_sha256": "abc"}


def test_every_example_declares_its_assets() -> None:
    """Each example's sends produce their destination, its receives consume it and produce
    their landing directory, its Spark tasks produce their Parquet directory; mapped tasks
    (built only when they run) declare theirs too, so the DAG shows them."""
    import example_support
    from airflow.dag_processing.dagbag import DagBag

    from tests.helpers import ROOT

    bag = DagBag(dag_folder=ROOT / "dags" / "examples")
    assert bag.import_errors == {}
    seen: dict[str, tuple[list[str], list[str]]] = {}
    for dag_id, dag in bag.dags.items():
        for task in dag.tasks:
            kwargs = getattr(task, "partial_kwargs", None) or {}
            ins = kwargs.get("inlets") or getattr(task, "inlets", [])
            outs = kwargs.get("outlets") or getattr(task, "outlets", [])
            seen[f"{dag_id}.{task.task_id}"] = ([getattr(i, "name", "") for i in ins],
                                              [getattr(o, "uri", None) or getattr(o, "name", "") for o in outs])
    queue, received, parquet = example_support.QUEUE, example_support.RECEIVED, example_support.PARQUET
    for dag_id, suffix in (("amqstream_one_file", ".one"), ("amqstream_bulk_landing", ".bulk"),
                           ("amqstream_site_a_producer", ".sites")):
        assert seen[f"{dag_id}.send"][1] == [f"amqstream://amqstream_default{queue}{suffix}"], dag_id
    for dag_id, suffix, landing in (("amqstream_one_file", ".one", "one"), ("amqstream_bulk_landing", ".bulk", "bulk"),
                                    ("amqstream_site_b_consumer", ".sites", "site-b"),
                                    ("amqstream_event_driven", ".events", "events")):
        ins, outs = seen[f"{dag_id}.receive"]
        assert ins == [f"amqstream://amqstream_default{queue}{suffix}"], dag_id
        assert outs == [f"file://{(received / landing).resolve()}"], dag_id
        # Spark consumes the landing directory and produces its Parquet directory.
        assert seen[f"{dag_id}.to_parquet"] == ([f"file://{(received / landing).resolve()}"],
                                                [f"file://{(parquet / landing).resolve()}"]), dag_id
