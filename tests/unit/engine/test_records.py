"""Records on the in-memory link: what a receiver and a sender remember across restarts,
and what retention forgets. No broker, no network."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    SendOptions,
    find_claimed,
    find_received,
    receive_streams,
    send_file,
    send_files,
)
from airflow_provider_amqstream.engine import store as st
from airflow_provider_amqstream.engine.receive.claims import claim_key
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/landing"
FAST = {"wait_timeout": 0.3, "idle_timeout": 0.3, "gap_grace": 0.2}


@pytest.fixture(autouse=True)
def sender_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "send-state"))
    return tmp_path / "send-state"


def restart() -> None:
    """What a new process starts with: no store opened, new writer files."""
    for s in st._STORES.values():
        s.close()
    st._STORES.clear()


def receive(broker: MemoryBroker, out: Path, **opts: object) -> list[str]:
    got = receive_streams(broker.params("rx"), Q, out, options=ReceiveOptions(**{**FAST, **opts}))  # type: ignore[arg-type]
    return [f"{r.stream_id}:{r.status}" for r in got]


def test_a_stream_received_before_a_restart_is_a_duplicate_after_it(broker: MemoryBroker, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(5000))
    out = tmp_path / "out"
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000), stream_id="big-1")
    assert receive(broker, out) == ["big-1:complete"]
    restart()
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, restart=True), stream_id="big-1")
    assert receive(broker, out) == ["big-1:duplicate"]
    assert sorted(f.name for f in out.iterdir()) == [".amqstream", "big.bin"], "nothing was written twice"
    sdir = out / ".amqstream"
    assert not list(sdir.glob("*.done")), "a record is a line in the store, not a file"
    rec = find_received(out, "big-1")
    assert rec is not None and rec["path"] == str(out / "big.bin") and rec["sender"] == "alice"


def test_small_files_received_before_a_restart_are_duplicates_after_it(broker: MemoryBroker, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.csv").write_bytes(os.urandom(300))
    out = tmp_path / "out"
    files = sorted(src.iterdir())
    send_files(broker.params("alice"), files, Q, SendOptions(chunk_size=1000), batch_id="b-1")
    first = receive(broker, out)
    assert len(first) == 40 and {s.split(":")[1] for s in first} == {"complete"}
    restart()
    send_files(broker.params("alice"), files, Q, SendOptions(chunk_size=1000, restart=True), batch_id="b-1")
    again = receive(broker, out)
    assert sorted(s.split(":")[0] for s in again) == sorted(s.split(":")[0] for s in first)
    assert {s.split(":")[1] for s in again} == {"duplicate"}
    assert len([f for f in out.iterdir() if f.suffix == ".csv"]) == 40


def test_an_expired_record_no_longer_blocks_and_its_day_is_pruned(broker: MemoryBroker, tmp_path: Path) -> None:
    src = tmp_path / "old.bin"
    src.write_bytes(os.urandom(2500))
    out = tmp_path / "out"
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000), stream_id="old-1")
    assert receive(broker, out, records_retention_days=30) == ["old-1:complete"]
    restart()
    # 40 days pass: the record's day is now older than the retention.
    root = out / ".amqstream" / "records"
    [today] = list(root.iterdir())
    os.rename(today, root / time.strftime("%Y%m%d", time.gmtime(time.time() - 40 * 86400)))
    assert find_received(out, "old-1", retention_days=30) is None
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, restart=True), stream_id="old-1")
    assert receive(broker, out, records_retention_days=30) == ["old-1:complete"], "received again"
    copies = sorted(out.glob("old*.bin"))
    assert len(copies) == 2, "beside the first copy, never over it"
    assert all(c.read_bytes() == src.read_bytes() for c in copies)
    assert [d.name for d in root.iterdir()] == [today.name], "the expired day was pruned"


def test_records_kept_for_ever_with_retention_zero(broker: MemoryBroker, tmp_path: Path) -> None:
    out = tmp_path / "out"
    old = st.RecordStore(out / ".amqstream" / "records", clock=lambda: time.time() - 400 * 86400)
    old.put_many([(st.DONE, "x-1", ["", "", 1, 1, 0, "", "", 0, "landing", "s", "x.bin"])])
    old.close()
    assert find_received(out, "x-1", retention_days=0) is not None
    assert find_received(out, "x-1") is None, "the default retention is 30 days"


def test_claims_are_found_for_their_taker_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sdir = out / ".amqstream"
    old = st.RecordStore(sdir / "records")
    for sid, at in (("s1", 2), ("s0", 1)):
        old.put_many([(st.DONE, sid, ["", "", 1, 1, 0, "", "", at, "landing", "s", f"{sid}.bin"]),
                      (st.CLAIM, claim_key("airflow:d/r/t/-1"), [sid, at])])
    assert [d["stream_id"] for d in find_claimed(out, "airflow:d/r/t/-1")] == ["s0", "s1"]
    assert find_claimed(out, "airflow:d/r/t/0") == []


def test_a_finished_send_leaves_a_record_not_a_file(broker: MemoryBroker, tmp_path: Path,
                                                    sender_state: Path) -> None:
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(3000))
    assert send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000), stream_id="a-1").status == "complete"
    assert [f.name for f in sender_state.iterdir()] == ["records"]
    restart()
    again = send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000), stream_id="a-1")
    assert again.status == "already_sent"


def test_a_senders_expired_checkpoints_and_ledgers_are_pruned_and_nothing_else(tmp_path: Path) -> None:
    from airflow_provider_amqstream.engine import records

    sdir = tmp_path / "state"
    sdir.mkdir()
    old = time.time() - 31 * 86400
    names = ["big-1@0123456789ab.json", "batch-b-1@0123456789ab.jsonl", "amqstream_send_x@0123456789ab.json",
             "notes.json", "fresh-1@0123456789ab.json"]
    for name in names:
        (sdir / name).write_text("{}")
        if not name.startswith("fresh"):
            os.utime(sdir / name, (old, old))
    records.sender_store(sdir, 30)
    assert sorted(f.name for f in sdir.iterdir() if f.is_file()) == ["fresh-1@0123456789ab.json", "notes.json"]
