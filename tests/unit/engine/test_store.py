"""The record store on its own: look-ups, torn writes, several writers, retention, size on
disk and memory. Pure file I/O in a temporary directory."""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

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
    s.put_many([(st.DONE, "a-1", ["a-1", "x"])])
    s.put_many([(st.DONE, "b-1", ["b-1", "y"])])
    s.put_many([(st.CLAIM, "a-1", ["not a completion record"])])
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
    s.put_many([(st.DONE, "whole-1", ["whole-1"])])
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
    s.put_many([(st.DONE, "k-1", ["k-1"])])
    first = s._name
    real = os.write

    def short_then_fail(fd: int, data: memoryview) -> int:
        monkeypatch.setattr(os, "write", real)
        real(fd, bytes(data[:5]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", short_then_fail)
    with pytest.raises(OSError):
        s.put_many([(st.DONE, "k-2", ["k-2"])])
    assert s._name != first
    s.put_many([(st.DONE, "k-3", ["k-3"])])
    assert s.get(st.DONE, "k-1") == ["k-1"] and s.get(st.DONE, "k-3") == ["k-3"] and s.get(st.DONE, "k-2") is None


def test_two_writers_on_one_directory_see_each_other_and_never_share_a_file(tmp_path: Path) -> None:
    a, b = st.RecordStore(tmp_path / "records"), st.RecordStore(tmp_path / "records")
    for i in range(300):
        (a if i % 2 else b).put_many([(st.DONE, f"s-{i}", [f"s-{i}"])], sync=False)
    assert all(a.get(st.DONE, f"s-{i}") == [f"s-{i}"] for i in range(300))
    assert all(b.get(st.DONE, f"s-{i}") == [f"s-{i}"] for i in range(300))
    writers = {f.name for f in (tmp_path / "records").rglob("*.log")}
    assert writers == {a._name, b._name}


def test_records_past_the_retention_are_pruned_by_whole_days(tmp_path: Path) -> None:
    now = 1_790_000_000.0
    clock = Clock(now - 31 * DAY)
    s = st.RecordStore(tmp_path / "records", retention_days=30, clock=clock)
    s.put_many([(st.DONE, "old-1", ["old-1"])])
    clock.t = now - 29 * DAY
    s.put_many([(st.DONE, "young-1", ["young-1"])])
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


def _past_days(root: Path, clock: Clock, days: int, per_day: int) -> RecordStoreAndKeys:
    s = st.RecordStore(root, clock=clock)
    keys = []
    now = clock.t
    for d in range(days, 0, -1):
        clock.t = now - d * DAY
        batch = [f"d{d}-{i}" for i in range(per_day)]
        s.put_many([(st.DONE, k, [k, d]) for k in batch], sync=False)
        keys += batch
    clock.t = now
    s.close()
    return s, keys


RecordStoreAndKeys = tuple[st.RecordStore, list[str]]


def test_past_days_merge_into_one_sorted_file_per_bucket_found_by_bisection(tmp_path: Path) -> None:
    clock = Clock(1_790_000_000.0)
    s, keys = _past_days(tmp_path / "records", clock, 5, 400)
    s.put_many([(st.DONE, "today-1", ["today-1", 0])])
    s.put_many([(st.DONE, "d2-7", ["d2-7", "again today"])])
    assert st.prune_quietly(s) == 0
    root = tmp_path / "records"
    assert sorted(p.name for p in root.iterdir()) == [time.strftime("%Y%m%d", time.gmtime(clock.t)), "past"]
    assert len(list(root.glob("past/*/*.sorted"))) == st.BUCKETS and not list(root.glob("past/**/*.tmp"))
    for f in root.glob("past/*/*.sorted"):
        heads = [line.split(b"\t")[0] for line in f.read_bytes().splitlines()]
        assert heads == sorted(heads)
    assert all(s.get(st.DONE, k) == [k, int(k[1])] for k in keys[::37])
    assert s.get(st.DONE, "today-1") == ["today-1", 0] and s.get(st.DONE, "absent") is None
    assert list(s.get_all(st.DONE, "d2-7")) == [["d2-7", "again today"], ["d2-7", 2]], "newest first"
    got = s.get_many(st.DONE, [*keys[:50], "today-1", "absent"])
    assert set(got) == {*keys[:50], "today-1"} and got["d5-3"] == ["d5-3", 5]
    # A look-up of a merged day opens one file, however many days and records there are.
    opened: list[str] = []
    real = os.open

    def spy(path: str, *args: int) -> int:
        opened.append(str(path))
        return real(path, *args)

    os.open = spy  # type: ignore[assignment]
    try:
        assert s.get(st.DONE, "d4-99") == ["d4-99", 4]
    finally:
        os.open = real  # type: ignore[assignment]
    assert len([p for p in opened if "/past/" in p]) == 1, opened


def test_a_day_is_merged_only_an_hour_after_it_ended(tmp_path: Path) -> None:
    midnight = 1_790_035_200.0  # 00:00 UTC
    clock = Clock(midnight + 30 * 60)
    s, _ = _past_days(tmp_path / "records", clock, 1, 10)
    assert s.compact() == 0 and not (tmp_path / "records" / "past").exists()
    clock.t = midnight + st.COMPACT_AFTER + 1
    buckets = len(list((tmp_path / "records").glob("*/*")))
    assert s.compact() == buckets > 0 and not list((tmp_path / "records").glob("*/*/*.log"))
    assert s.get(st.DONE, "d1-3") == ["d1-3", 1]


def test_merged_records_past_the_retention_are_ignored_then_dropped(tmp_path: Path) -> None:
    clock = Clock(1_790_000_000.0)
    root = tmp_path / "records"
    s, _ = _past_days(root, clock, 3, 50)
    st.prune_quietly(s)
    size = sum(f.stat().st_size for f in root.glob("past/*/*.sorted"))
    later = st.RecordStore(root, retention_days=2.5, clock=clock)
    assert later.get(st.DONE, "d3-1") is None and later.get(st.DONE, "d2-1") == ["d2-1", 2]
    later.put_many([(st.DONE, "x", ["x"])])
    clock.t += 2 * DAY  # a new past day to merge: the merge drops the expired ones
    st.prune_quietly(later)
    assert later.get(st.DONE, "d2-1") is None and later.get(st.DONE, "x") == ["x"]
    assert sum(f.stat().st_size for f in root.glob("past/*/*.sorted")) < size / 2


def test_a_crash_during_a_merge_loses_no_record_and_the_next_merge_cleans_up(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock(1_790_000_000.0)
    root = tmp_path / "records"
    s, keys = _past_days(root, clock, 2, 200)
    # A torn tail (a crash while writing) is never merged.
    log_file = next(root.glob("*/00/*.log"))
    with open(log_file, "ab") as fh:
        fh.write(b"dtorn\t[1]")
    # Killed after the merged file is in place, before the inputs are removed: every record twice.
    real_unlink = os.unlink

    def die(path: str, *a: object, **k: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "unlink", die)
    with pytest.raises(KeyboardInterrupt):
        s.compact()
    # Killed while writing the temporary file: a .tmp left, an hour later removed.
    monkeypatch.setattr(os, "unlink", real_unlink)
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", die)
    with pytest.raises(KeyboardInterrupt):
        s.compact()
    monkeypatch.setattr(os, "rename", real_rename)
    assert all(s.get(st.DONE, k) == [k, int(k[1])] for k in keys)
    clock.t += st.COMPACT_AFTER + 60
    s.compact()
    assert not list(root.glob("past/*/*.tmp")) and not list(root.glob("*/*/*.log"))
    assert all(len(list(s.get_all(st.DONE, k))) == 1 for k in keys), "the copies are merged away"
    assert s.get(st.DONE, "torn") is None
    lines = sum(len(f.read_bytes().splitlines()) for f in root.glob("past/*/*.sorted"))
    assert lines == len(keys)


def test_a_log_written_to_during_a_merge_keeps_its_new_record(tmp_path: Path) -> None:
    clock = Clock(1_790_000_000.0)
    root = tmp_path / "records"
    s, _ = _past_days(root, clock, 1, 20)
    late = st.RecordStore(root, clock=Clock(clock.t - DAY))
    late.put_many([(st.DONE, "late-0", ["late-0"])])
    real_rename = os.rename

    def rename_then_write(src: str, dst: str) -> None:
        real_rename(src, dst)
        if "late-1" not in str(list(late.get_all(st.DONE, "late-1"))):
            late.put_many([(st.DONE, "late-1", ["late-1"])])  # a writer whose clock is a day behind

    os.rename = rename_then_write  # type: ignore[assignment]
    try:
        s.compact()
    finally:
        os.rename = real_rename  # type: ignore[assignment]
    assert s.get(st.DONE, "late-0") == ["late-0"] and s.get(st.DONE, "late-1") == ["late-1"]
    s.compact()
    assert s.get(st.DONE, "late-1") == ["late-1"]


def test_memory_stays_flat_merging_and_looking_up(tmp_path: Path) -> None:
    clock = Clock(1_790_000_000.0)
    s, keys = _past_days(tmp_path / "records", clock, 4, 25_000)
    tracemalloc.start()
    try:
        s.compact()
        _, peak_merge = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        for k in keys[::997]:
            assert s.get(st.DONE, k) is not None
        _, peak_read = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # 100,000 records (~3 MB); a merge holds one bucket of the days merged (1/32), a look-up a line.
    assert peak_merge < 1_500_000, peak_merge
    assert peak_read < 200_000, peak_read


def test_a_full_log_is_sorted_into_runs_so_a_look_up_reads_a_bounded_part_of_the_day(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "LOG_LIMIT", 2048)
    s = st.RecordStore(tmp_path / "records")
    keys = [f"k-{i:05d}" for i in range(6000)]
    for lo in range(0, len(keys), 64):  # a receiver's groups, synced by the caller
        s.put_many([(st.DONE, k, [k, "x" * 20]) for k in keys[lo:lo + 64]], sync=False)
    root = tmp_path / "records"
    per_bucket = max(len(list(d.iterdir())) for d in root.glob("*/*"))
    day_bytes = sum(f.stat().st_size for f in root.glob("*/*/*"))
    # Runs of sizes 1, 2, 4 ... logs: at most log2 of a bucket's logs, and the log being written.
    assert per_bucket <= (2 * day_bytes // st.BUCKETS // 2048).bit_length() + 1, per_bucket
    scanned: list[int] = []
    searched: list[int] = []
    real_scan, real_search = st._scan, st._search
    monkeypatch.setattr(st, "_scan", lambda data, head: scanned.append(len(data)) or real_scan(data, head))
    monkeypatch.setattr(st, "_search", lambda data, head, c: searched.append(1) or real_search(data, head, c))
    assert all(s.get(st.DONE, k) == [k, "x" * 20] for k in keys[::97])
    assert s.get(st.DONE, "absent") is None
    # Read linearly: one log per look-up, never more than LOG_LIMIT and a group; the rest bisected.
    assert scanned and max(scanned) <= 2048 + 64 * 60 and len(scanned) <= len(keys[::97]) + 1
    assert len(searched) <= (len(keys[::97]) + 1) * per_bucket
    got = s.get_many(st.DONE, [*keys[:300], "absent"])
    assert set(got) == set(keys[:300])
    # Merged past days take the day's runs in too.
    clock = Clock(time.time() + DAY + st.COMPACT_AFTER + 1)
    later = st.RecordStore(root, clock=clock)
    assert later.compact() == st.BUCKETS and not list(root.glob("2*/*/*"))
    assert all(later.get(st.DONE, k) == [k, "x" * 20] for k in keys[::13])
    assert sum(len(f.read_bytes().splitlines()) for f in root.glob("past/*/*.sorted")) == len(keys)


def test_a_look_up_that_listed_a_log_sorted_away_meanwhile_lists_again(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(st, "LOG_LIMIT", 1024)
    s, reader = st.RecordStore(tmp_path / "records"), st.RecordStore(tmp_path / "records")
    s.put_many([(st.DONE, "first", ["first"])])
    b = st.bucket(st.DONE, "first")
    stale = reader._files(b, reader._days())
    i = 0
    while s._logs:  # until the log that holds "first" is sorted into a run and removed
        i += 1
        s.put_many([(st.DONE, f"more-{i}", ["m"] * 20)]) if st.bucket(st.DONE, f"more-{i}") == b else None
    listings = iter([stale])
    real = reader._files
    monkeypatch.setattr(reader, "_files", lambda bb, days: next(listings, None) or real(bb, days))
    assert reader.get(st.DONE, "first") == ["first"]


def test_a_look_up_of_many_buckets_lists_the_days_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = st.RecordStore(tmp_path / "records")
    keys = [f"k-{i}" for i in range(300)]
    s.put_many([(st.DONE, k, [k]) for k in keys[::2]])
    root = str(tmp_path / "records")
    listed: list[str] = []
    real = os.listdir

    def spy(path: Any = ".") -> list[str]:
        listed.append(str(path))
        return real(path)

    monkeypatch.setattr(st.os, "listdir", spy)
    got = s.get_many(st.DONE, keys)
    assert got == {k: [k] for k in keys[::2]}
    assert len({st.bucket(st.DONE, k) for k in keys}) > 16 and listed.count(root) == 1
