"""The record store on its own: look-ups, torn writes, several writers, retention, size on
disk and memory. Pure file I/O in a temporary directory."""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import store as st
from airflow_provider_amqstream.engine.receive.claims import pack_done, unpack_done
from airflow_provider_amqstream.engine.records import FileCheckpoint, TransferResult

DAY = 86400.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def done(i: int, out: str = "/data/in") -> TransferResult:
    """A completion record as a bulk receive of small files writes it."""
    sid = f"part-{i:05d}.csv-{i * 7919:016x}"  # a default id: the name, a hash
    return TransferResult(sid, "/queue/landing", f"part-{i:05d}.csv", 512, 1, f"{i:064x}", 0.01, "stream",
                          path=f"{out}/part-{i:05d}.csv", finished_at=1_790_000_000.0 + i, chunk_size=1048576,
                          origin=f"{i:032x}", sender="site-a")


def test_a_record_is_found_by_its_key_and_only_by_it(tmp_path: Path) -> None:
    s = st.RecordStore(tmp_path / "records")
    s.put(st.DONE, "a-1", ["a-1", "x"])
    s.put(st.DONE, "b-1", ["b-1", "y"])
    s.put(st.CLAIM, "a-1", ["not a completion record"])
    assert s.get(st.DONE, "a-1") == ["a-1", "x"]
    assert s.get(st.DONE, "b-1") == ["b-1", "y"]
    assert s.get(st.DONE, "c-1") is None
    assert list(s.get_all(st.CLAIM, "a-1")) == [["not a completion record"]]


def test_a_completion_record_round_trips_compactly() -> None:
    res = done(3)
    value = pack_done(res, "/data/in")
    back = unpack_done(value, res.stream_id, "/data/in")
    assert back is not None
    assert TransferResult.from_json(back).path == res.path and back["sha256"] == res.sha256
    assert (back["origin"], back["bytes"], back["chunks"], back["chunk_size"], back["sender"]) == (
        res.origin, 512, 1, 1048576, "site-a")
    assert len(st.encode(st.DONE, res.stream_id, value)) < 200
    # A file published under another name, from a topic, in handshake mode, in a subdirectory.
    other = TransferResult("x-1", "/topic/t", "a.csv", 5, 1, "ab" * 32, 0.0, "handshake", path="/o/sub/a.x-1.csv",
                           finished_at=7.0, chunk_size=4)
    back = unpack_done(pack_done(other, "/o"), "x-1", "/o")
    assert back is not None and {k: back[k] for k in ("path", "name", "destination", "mode", "origin")} == {
        "path": "/o/sub/a.x-1.csv", "name": "a.csv", "destination": "/topic/t", "mode": "handshake", "origin": ""}


def test_a_torn_tail_is_ignored_and_spoils_no_other_record(tmp_path: Path) -> None:
    s = st.RecordStore(tmp_path / "records")
    s.put(st.DONE, "whole-1", ["whole-1"])
    [seg] = (tmp_path / "records").rglob("*.log")
    # "torn-1" filed in the same bucket, so that the look-up reads this very file.
    torn_key = next(k for k in (f"torn-{i}" for i in range(1000)) if st.bucket(st.DONE, k) == seg.parent.name)
    torn = st.encode(st.DONE, torn_key, [torn_key])
    with open(seg, "ab") as fh:
        fh.write(torn[: len(torn) // 2])  # a crash mid-write: no newline, half the line
    assert s.get(st.DONE, torn_key) is None
    assert s.get(st.DONE, "whole-1") == ["whole-1"]
    # A line whose bytes were damaged (CRC mismatch) is ignored too.
    bad = bytearray(st.encode(st.DONE, "flip-1", ["flip-1"]))
    bad[-12] ^= 1
    after = st.encode(st.DONE, "after-1", ["after-1"])
    bucket = seg.parent.parent / st.bucket(st.DONE, "after-1")
    bucket.mkdir(exist_ok=True)
    (bucket / "other-1-0.log").write_bytes(bytes(bad) + after)
    assert s.get(st.DONE, "flip-1") is None
    assert s.get(st.DONE, "after-1") == ["after-1"]


def test_a_writer_whose_write_failed_starts_a_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = st.RecordStore(tmp_path / "records")
    s.put(st.DONE, "k-1", ["k-1"])
    first = s._name
    real = os.write

    def short_then_fail(fd: int, data: memoryview) -> int:
        monkeypatch.setattr(os, "write", real)
        real(fd, bytes(data[:5]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_fail)
    with pytest.raises(OSError):
        s.put(st.DONE, "k-2", ["k-2"])
    assert s._name != first
    s.put(st.DONE, "k-3", ["k-3"])
    assert s.get(st.DONE, "k-1") == ["k-1"] and s.get(st.DONE, "k-3") == ["k-3"] and s.get(st.DONE, "k-2") is None


def test_two_writers_on_one_directory_see_each_other_and_never_share_a_file(tmp_path: Path) -> None:
    a, b = st.RecordStore(tmp_path / "records"), st.RecordStore(tmp_path / "records")
    for i in range(300):
        (a if i % 2 else b).put(st.DONE, f"s-{i}", [f"s-{i}"], sync=False)
    assert all(a.get(st.DONE, f"s-{i}") == [f"s-{i}"] for i in range(300))
    assert all(b.get(st.DONE, f"s-{i}") == [f"s-{i}"] for i in range(300))
    writers = {f.name for f in (tmp_path / "records").rglob("*.log")}
    assert writers == {a._name, b._name}


def test_records_past_the_retention_are_pruned_by_whole_days(tmp_path: Path) -> None:
    now = 1_790_000_000.0
    clock = Clock(now - 31 * DAY)
    s = st.RecordStore(tmp_path / "records", retention_days=30, clock=clock)
    s.put(st.DONE, "old-1", ["old-1"])
    clock.t = now - 29 * DAY
    s.put(st.DONE, "young-1", ["young-1"])
    clock.t = now
    # Expired records are invisible at once, before any pruning.
    assert s.get(st.DONE, "old-1") is None and s.get(st.DONE, "young-1") == ["young-1"]
    assert len(list((tmp_path / "records").iterdir())) == 2
    assert s.prune() == 1
    assert [d.name for d in (tmp_path / "records").iterdir()] == [time.strftime("%Y%m%d",
                                                                  time.gmtime(now - 29 * DAY))]
    assert s.get(st.DONE, "young-1") == ["young-1"]
    assert st.RecordStore(tmp_path / "records", retention_days=0, clock=clock).prune() == 0


def test_a_pruner_that_died_mid_way_is_finished_by_the_next(tmp_path: Path) -> None:
    root = tmp_path / "records"
    (root / ".expired-20200101-abcd" / "3f").mkdir(parents=True)
    (root / ".expired-20200101-abcd" / "3f" / "w.log").write_bytes(b"x")
    st.RecordStore(root).prune()
    assert list(root.iterdir()) == []


def test_a_finished_sender_checkpoint_becomes_a_record(tmp_path: Path) -> None:
    ck = FileCheckpoint(tmp_path / "s-1@0123456789ab.json")
    ck.save({"stream_id": "s-1", "confirmed_seq": 3})
    assert ck.path.exists() and ck.load() == {"stream_id": "s-1", "confirmed_seq": 3}
    ck.save({"stream_id": "s-1", "confirmed_seq": 9, "sent_at": 5.0}, final=True)
    assert not ck.path.exists(), "a finished stream keeps a record, not a file"
    assert FileCheckpoint(tmp_path / "s-1@0123456789ab.json").load() == {
        "stream_id": "s-1", "confirmed_seq": 9, "sent_at": 5.0}
    assert FileCheckpoint(tmp_path / "s-2@0123456789ab.json").load() is None


def test_size_on_disk_per_stream_at_ten_thousand_streams(tmp_path: Path) -> None:
    """Completion records and claims of 10,000 small streams, written as a bulk receive
    writes them (groups of 64): at most ~200 bytes a stream on disk, blocks and directory
    entries included, instead of a file (4 KiB) per record."""
    s = st.RecordStore(tmp_path / "records")
    n = 10_000
    for g in range(0, n, 64):
        s.put_many([(st.DONE, done(i).stream_id, pack_done(done(i), "/data/in")) for i in range(g, min(g + 64, n))],
                   sync=False)
    s.close()  # ext4 counts blocks reserved ahead for a file open for appending
    used, files = s.disk_usage()
    assert files <= st.BUCKETS
    assert used / n <= 200, f"{used / n:.0f} bytes a stream"
    assert s.get(st.DONE, done(n - 1).stream_id) == pack_done(done(n - 1), "/data/in")


def test_memory_stays_flat_writing_and_looking_up_fifty_thousand_records(tmp_path: Path) -> None:
    s = st.RecordStore(tmp_path / "records")
    tracemalloc.start()
    try:
        for g in range(0, 50_000, 500):
            s.put_many([(st.DONE, f"m-{i}", [f"m-{i}", i]) for i in range(g, g + 500)], sync=False)
        _, peak_write = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for i in range(0, 50_000, 499):
            assert s.get(st.DONE, f"m-{i}") == [f"m-{i}", i]
        assert s.get(st.DONE, "absent") is None
        _, peak_read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 50,000 records are ~3 MB on disk; what is held at once is one group, and one line
    # (a look-up maps the file it searches: page cache, not this process's heap).
    assert peak_write < 1_000_000, peak_write
    assert peak_read < 200_000, peak_read


def test_look_up_reads_one_bucket(tmp_path: Path) -> None:
    s = st.RecordStore(tmp_path / "records")
    s.put_many([(st.DONE, f"b-{i}", [i]) for i in range(5_000)], sync=False)
    opened: list[str] = []
    real = os.open

    def spy(path: str, *args: int) -> int:
        opened.append(str(path))
        return real(path, *args)

    os.open = spy  # type: ignore[assignment]
    try:
        assert s.get(st.DONE, "b-4321") == [4321]
    finally:
        os.open = real  # type: ignore[assignment]
    assert len(opened) == 1, opened


def test_many_keys_are_found_in_one_pass(tmp_path: Path) -> None:
    old = st.RecordStore(tmp_path / "records", clock=lambda: time.time() - DAY)
    old.put_many([(st.DONE, f"k-{i}", ["old", i]) for i in range(0, 300, 3)], sync=False)
    old.close()
    s = st.RecordStore(tmp_path / "records")
    s.put_many([(st.DONE, f"k-{i}", ["new", i]) for i in range(0, 300, 2)], sync=False)
    got = s.get_many(st.DONE, [f"k-{i}" for i in range(300)] + ["absent"])
    assert set(got) == {f"k-{i}" for i in range(300) if i % 2 == 0 or i % 3 == 0}
    assert got["k-6"] == ["new", 6] and got["k-3"] == ["old", 3], "the newest day wins"
