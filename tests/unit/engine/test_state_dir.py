"""The state directories' layouts, each spelled once (engine/state_dir.py), and the one copy
that cannot import it: the Spark job, which runs inside spark-submit without the package."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import SendOptions, send_file, send_files
from airflow_provider_amqstream.engine.state_dir import SendStateDir, StateDir
from airflow_provider_amqstream.spark import stream_to_parquet as job
from airflow_provider_amqstream.transport.memory import MemoryBroker


def test_the_spark_job_finds_manifests_where_a_receiver_keeps_them(tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = StateDir(out).manifest("alice", "b-1")
    manifest.parent.mkdir(parents=True)
    (out / "a").mkdir()
    (out / "a" / "x.csv").write_text("n\n1\n")
    manifest.write_text(json.dumps({"path": "a/x.csv", "bytes": 4, "sha256": ""}) + "\n")
    assert job._root_of(manifest) == out
    assert [(src, row["path"]) for src, row in job._manifest_files(str(out))] == [(out / "a" / "x.csv", "a/x.csv")]


def test_what_a_sender_leaves_in_flight_is_named_by_its_state_dir(broker: MemoryBroker, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "send-state"
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(state))
    params = broker.params("alice")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(5000))
    small = [tmp_path / f"s{i}.bin" for i in range(3)]
    for f in small:
        f.write_bytes(os.urandom(100))

    def stop(done: int, total: int) -> None:
        raise KeyboardInterrupt  # killed after the first window: its checkpoint stays

    with pytest.raises(KeyboardInterrupt):
        send_file(params, big, "/queue/q", SendOptions(chunk_size=1000, window=1, progress=stop), stream_id="big-1")
    send_files(params, small, "/queue/q", SendOptions(chunk_size=1000), batch_id="b-1")
    sdir = SendStateDir()
    expected = {sdir.checkpoint("big-1", params), sdir.ledger("b-1", params), sdir.files_list("b-1", params)}
    assert {Path(e.path) for e in sdir.ours()} == expected
    assert {p for p in state.iterdir() if p.name != "records"} == expected
