"""XCom of a many-file send and receive stays small past MAX_XCOM_FILES: totals and the path
of the list of every file, not one entry per file; on the in-memory broker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.operators.xcom import MAX_XCOM_FILES, iter_result_files
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/xcom"
FILES = 2000
# A few hundred bytes of totals and paths; one entry per file would be ~1.4 MB for 2,000.
MAX_XCOM_BYTES = 4096


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[MemoryBroker]:
    b = MemoryBroker()
    monkeypatch.setattr(AmqStreamHook, "broker_params", lambda self: b.params("alice"))
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "state"))
    yield b
    b.close()


def test_xcom_of_2000_files_is_totals_and_a_pointer(broker: MemoryBroker, tmp_path: Path) -> None:
    src = tmp_path / "landing"
    for i in range(FILES):
        d = src / f"d{i // 500}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:04d}.txt").write_text(f"row {i}\n")
    sent = SendStreamOperator(task_id="send", path=str(src), recursive=True, destination=Q).execute({})
    assert len(json.dumps(sent)) < MAX_XCOM_BYTES, len(json.dumps(sent))
    assert sent["files"] == [] and sent["files_listed"] is False and FILES > MAX_XCOM_FILES
    assert (sent["totals"]["files"], sent["totals"]["files_sent"]) == (FILES, FILES)
    listed = list(iter_result_files(sent))
    assert len(listed) == FILES and {Path(f["path"]).name for f in listed} == {f"f{i:04d}.txt" for i in range(FILES)}

    got = ReceiveStreamsOperator(task_id="receive", source=Q, out_dir=str(tmp_path / "out"),
                                 batch_id=sent["totals"]["batch_id"], wait_timeout=5, deadline=600).execute({})
    assert len(json.dumps(got)) < MAX_XCOM_BYTES, len(json.dumps(got))
    assert got["files"] == [] and got["files_listed"] is False and got["count"] == FILES
    assert got["manifest"] and len(Path(got["manifest"]).read_text().splitlines()) == FILES
    received = list(iter_result_files(got))
    assert len(received) == FILES and all(Path(f["path"]).is_file() for f in received)


def test_xcom_of_a_few_files_lists_each(broker: MemoryBroker, tmp_path: Path) -> None:
    src = tmp_path / "few"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.txt").write_text(f"row {i}\n")
    sent = SendStreamOperator(task_id="send", path=str(src), recursive=True, destination=Q).execute({})
    assert sent["files_listed"] is True and sorted(Path(f["path"]).name for f in sent["files"]) == [
        "f0.txt", "f1.txt", "f2.txt"]
    got = ReceiveStreamsOperator(task_id="receive", source=Q, out_dir=str(tmp_path / "out"), count=3,
                                 wait_timeout=5).execute({})
    assert got["files_listed"] is True and got["count"] == 3 and len(got["files"]) == 3
