"""Many files in one send over one connection, in one receive; relative paths
land under the output directory and never outside it; a killed batch resumes per file."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import (
    BatchFile,
    ReceiveOptions,
    SendOptions,
    StreamFailure,
    TransferResult,
    find_manifest,
    iter_files,
    receive_streams,
    send_file,
    send_files,
)
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import HeldProxy, cli, make_file, peak_rss_kib_of, sha256_file, wait_for
from tests.integration.test_queue_liveness import RawSender

pytestmark = pytest.mark.broker


def tree(root: Path, n: int, size: int = 4096) -> list[Path]:
    """``n`` files spread over a few subdirectories (and the top level)."""
    files = []
    for i in range(n):
        sub = root / ("" if i % 3 == 0 else f"d{i % 3}") / ("deep" if i % 5 == 0 else "")
        files.append(make_file(sub / f"f{i:04d}.bin", size + i, seed=i))
    return files


def receive_all(params: BrokerParams, queue: str, out: Path, count: int, **kw: object) -> tuple[
        list[TransferResult], list[StreamFailure]]:
    failures: list[StreamFailure] = []
    opts = ReceiveOptions(**{"wait_timeout": 30, "idle_timeout": 30, **kw})  # type: ignore[arg-type]
    got = receive_streams(params, queue, out, count=count, options=opts, on_failure=failures.append)
    return got, failures


def test_a_directory_in_one_send_lands_in_the_same_tree(params: BrokerParams, tmp_path: Path,
                                                        queue_name: str) -> None:
    src = tmp_path / "landing"
    files = tree(src, 60)
    big = make_file(src / "d1" / "big.bin", 5 * 2**20 + 3, seed=99)  # past one window: the large path
    files.append(big)
    seen: list[TransferResult] = []
    res = send_files(params, iter_files([src], recursive=True), queue_name,
                     SendOptions(chunk_size=256 * 1024, window=4), on_result=seen.append)
    assert not res.failures and len(res.results) == len(files) == len(seen)
    totals = res.totals()
    assert totals["files_sent"] == len(files) and totals["bytes"] == sum(f.stat().st_size for f in files)
    out = tmp_path / "out"
    got, failures = receive_all(params, queue_name, out, len(files))
    assert not failures and len(got) == len(files)
    for f in files:
        landed = out / f.relative_to(src)
        assert sha256_file(landed) == sha256_file(f), landed
    # A second send of the same batch sends nothing and says so.
    again = send_files(params, iter_files([src], recursive=True), queue_name,
                       SendOptions(chunk_size=256 * 1024, window=4))
    assert {r.status for r in again.results} == {"already_sent"} and again.totals()["bytes_transferred"] == 0


def test_a_failed_file_does_not_stop_the_others_unless_fail_fast(params: BrokerParams, tmp_path: Path,
                                                                  queue_name: str) -> None:
    good = [make_file(tmp_path / f"g{i}.bin", 1000 + i) for i in range(3)]
    missing = tmp_path / "gone.bin"
    res = send_files(params, [good[0], missing, *good[1:]], queue_name)
    assert [f.path for f in res.failures] == [str(missing)] and len(res.results) == 3
    with pytest.raises(RuntimeError, match="gone.bin"):
        send_files(params, [missing, *good], queue_name, SendOptions(fail_fast=True))
    got, _ = receive_all(params, queue_name, tmp_path / "out", 3)
    assert sorted(Path(r.path or "").name for r in got) == sorted(g.name for g in good)


@pytest.mark.parametrize("subdir,why", [
    ("../escape", "'..'"), ("/etc", "absolute"), ("a//b", "empty"), ("x" * 300, "longer than"),
    ("/".join(["d"] * 17), "levels"),
])
def test_hostile_relative_paths_are_quarantined_and_the_next_stream_arrives(
        params: BrokerParams, tmp_path: Path, queue_name: str, subdir: str, why: str) -> None:
    dest = Destination.parse(queue_name)
    data = b"hostile" * 100
    spec = p.StreamSpec("hostile-1", "f.bin", len(data), 1024, hdr.Mode.ATOMIC)
    raw = RawSender(params)
    raw.send(dest.data_queue(spec.stream_id, params.user), data, p.data_message(spec, 1, data)[0])
    import hashlib
    raw.send(dest.data_queue(spec.stream_id, params.user), b"", p.end_headers(spec, hashlib.sha256(data).hexdigest()))
    raw.send(str(dest), b"", {**p.offer_headers(spec, dest, sender=params.user), hdr.H_DIR: subdir})
    raw.close()
    good = make_file(tmp_path / "good.bin", 5000)
    send_files(params, [BatchFile(good, "ok/sub")], queue_name)
    out = tmp_path / "out"
    got, failures = receive_all(params, queue_name, out, 1)
    assert [f.stream_id for f in failures] == ["hostile-1"] and why in failures[0].reason
    assert [Path(r.path or "") for r in got] == [out / "ok" / "sub" / "good.bin"]
    assert sha256_file(out / "ok" / "sub" / "good.bin") == sha256_file(good)
    # Nothing was written outside the output directory, nor anywhere for the hostile stream.
    assert not (tmp_path / "escape").exists() and not list(out.rglob("f.bin"))


def test_a_symlinked_subdirectory_cannot_redirect_a_file(params: BrokerParams, tmp_path: Path,
                                                         queue_name: str) -> None:
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    f1 = make_file(tmp_path / "src" / "sub" / "a.bin", 3000)
    f2 = make_file(tmp_path / "src" / "ok" / "b.bin", 3000, seed=2)
    send_files(params, [BatchFile(f1, "sub"), BatchFile(f2, "ok")], queue_name)
    got, failures = receive_all(params, queue_name, out, 1)
    assert len(failures) == 1 and "symbolic link" in failures[0].reason
    assert not list(elsewhere.iterdir())
    assert [Path(r.path or "") for r in got] == [out / "ok" / "b.bin"]
    assert sha256_file(out / "ok" / "b.bin") == sha256_file(f2)
    assert f1.exists()


def test_thousand_small_files_killed_mid_batch_resume_and_skip_confirmed(
        params: BrokerParams, uri: str, tmp_path: Path, queue_name: str, held_proxy: Callable[..., HeldProxy]) -> None:
    """The issue's acceptance test: 1,000 small files through one CLI send and one receive,
    the sender killed (SIGKILL) in the middle; the re-run skips what was confirmed."""
    src = tmp_path / "landing"
    n = 1000
    files = [make_file(src / f"p{i % 10}" / f"f{i:04d}.bin", 16 * 1024 + i, seed=i) for i in range(n)]
    state = tmp_path / "state"
    env = {"AMQSTREAM_STATE_DIR": str(state)}
    # The first run gets no further than 8 MiB (about 450 files) until it is killed: it is
    # part way then. The re-run goes through the same proxy, released: the ledger is kept per
    # broker address.
    proxy = held_proxy(params.hosts[0][1], 8 * 2**20)
    # Without --json: nobody reads its stdout until it is killed, and a full pipe would block it.
    proc = cli("send", str(src), "--recursive", "--to", queue_name, "--conn", proxy.uri(uri), "-q", env=env)

    def ledger_lines() -> int:
        assert proc.poll() is None, f"the sender ended early: {proc.communicate()}"
        ledgers = list(state.glob("batch-*.jsonl"))
        return sum(1 for _ in ledgers[0].open()) if ledgers else 0

    wait_for(lambda: ledger_lines() >= 100, 120, "the sender to confirm 100 files")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    proxy.release()
    ledger = next(state.glob("batch-*.jsonl"))
    confirmed = sum(1 for _ in ledger.open())
    assert 100 <= confirmed < n, f"killed too late ({confirmed} confirmed)"
    proc = cli("send", str(src), "--recursive", "--to", queue_name, "--conn", proxy.uri(uri), "--json", "-q",
               env=env)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    totals = lines[-1]
    assert totals["status"] == "totals" and totals["files"] == n and totals["files_failed"] == 0
    assert totals["files_already_sent"] >= confirmed
    assert sum(1 for r in lines[:-1] if r["status"] == "already_sent") == totals["files_already_sent"]
    # One receive takes them all (files resent after the kill arrive as duplicates).
    rx = tmp_path / "out"
    t0 = time.monotonic()
    proc = cli("receive", "--from", queue_name, "--out-dir", str(rx), "--conn", uri, "--follow", "--wait", "5",
               "--json", "-q")
    got, peaks = [], []
    assert proc.stdout is not None
    for line in proc.stdout:
        got.append(json.loads(line))
        # The receiver's peak memory so far, read from outside (the CLI reports transfers only);
        # it is still running: --wait 5 keeps it 5 s past the last stream.
        peaks.append(peak_rss_kib_of(proc.pid))
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    complete = [r for r in got if r["status"] == "complete"]
    assert len(complete) == n, err[-2000:]
    for f in files:
        assert sha256_file(rx / f.relative_to(src)) == sha256_file(f)
    rss = [kib for r, kib in zip(got, peaks, strict=True) if r["status"] == "complete"]
    # Memory flat in the number of files: the last hundred streams cost no more than the first hundred.
    assert max(rss[-100:]) < max(rss[:100]) + 20 * 1024, (rss[:3], rss[-3:])
    print(f"\n1,000 small files: receive {n / (time.monotonic() - t0):.0f} files/s; killed after {confirmed}")


def test_a_directory_send_writes_one_manifest_when_the_batch_is_complete(params: BrokerParams, tmp_path: Path,
                                                                         queue_name: str) -> None:
    src = tmp_path / "landing"
    files = tree(src, 12)
    res = send_files(params, iter_files([src], recursive=True), queue_name, SendOptions(manifest=True))
    out = tmp_path / "out"
    events: list[tuple[str, dict]] = []
    opts = ReceiveOptions(wait_timeout=3, idle_timeout=30, events=lambda k, d: events.append((k, d)))
    got = receive_streams(params, queue_name, out, options=opts)  # until nothing for 3 s
    assert len(got) == len(files)
    manifest = find_manifest(out, res.batch_id)
    assert manifest is not None
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(r["path"] for r in rows) == sorted(str(f.relative_to(src)) for f in files)
    for r in rows:
        assert sha256_file(out / r["path"]) == r["sha256"] and (out / r["path"]).stat().st_size == r["bytes"]
    assert [d["manifest"] for k, d in events if k == "batch_complete"] == [str(manifest)]
    assert not list((out / ".amqstream" / "batches").glob("*.json"))


def test_a_batch_listed_before_its_files_arrive_completes_later(params: BrokerParams, tmp_path: Path,
                                                               queue_name: str) -> None:
    """The batch message can be taken before its streams are published (another receiver
    held them): the manifest appears when the last listed stream is published."""
    dest = Destination.parse(queue_name)
    f = make_file(tmp_path / "a.bin", 3000)
    entry = {"stream_id": "late-a", "dir": "x", "name": "a.bin", "bytes": 3000, "sha256": sha256_file(f)}
    raw = RawSender(params)
    for headers, body in list(bw.iter_batch_messages("b-late", [entry], len([entry]))):
        raw.send(str(dest), body, headers)
    raw.close()
    out = tmp_path / "out"
    assert receive_all(params, queue_name, out, 1, wait_timeout=2)[0] == []
    assert find_manifest(out, "b-late") is None
    from airflow_provider_amqstream.engine import send_file
    send_file(params, f, queue_name, stream_id="late-a", subdir="x")
    got, _ = receive_all(params, queue_name, out, 1)
    assert [Path(r.path or "") for r in got] == [out / "x" / "a.bin"]
    manifest = find_manifest(out, "b-late")
    assert manifest is not None
    [row] = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert row["path"] == "x/a.bin" and row["sha256"] == entry["sha256"]


@pytest.mark.parametrize("body,why", [
    (b'{"stream_id": "../x", "dir": "", "name": "a", "bytes": 1, "sha256": "' + b"0" * 64 + b'"}\n', "valid"),
    (b'{"stream_id": "ok-1", "dir": "../up", "name": "a", "bytes": 1, "sha256": "' + b"0" * 64 + b'"}\n', "valid"),
    (b"not json\n", "valid entry"), (b"x" * (3 * 2**20), "over"),
])
def test_hostile_batch_messages_are_quarantined(params: BrokerParams, tmp_path: Path, queue_name: str,
                                                body: bytes, why: str) -> None:
    dest = Destination.parse(queue_name)
    raw = RawSender(params)
    raw.send(str(dest), body, {hdr.H_VERSION: "1", hdr.H_KIND: "batch", hdr.H_STREAM: "bad-b", bw.H_BATCH: "bad-b",
                               bw.H_PART: "1", bw.H_PARTS: "1"})
    raw.close()
    good = make_file(tmp_path / "good.bin", 2000)
    send_files(params, [good], queue_name)
    out = tmp_path / "out"
    got, failures = receive_all(params, queue_name, out, 1)
    assert [f.stream_id for f in failures] == ["bad-b"] and why in failures[0].reason
    assert [Path(r.path or "").name for r in got] == ["good.bin"]
    assert not list(out.glob(".amqstream/manifests/*/*.manifest.jsonl"))


@pytest.mark.broker
def test_a_drain_stops_at_its_deadline_while_offers_keep_trickling_in(params: BrokerParams, tmp_path: Path,
                                                                     queue_name: str) -> None:
    """Without a deadline a drain that sees an offer every second never runs out of wait."""
    import threading

    stop = threading.Event()

    def trickle() -> None:
        i = 0
        while not stop.is_set() and i < 120:
            send_file(params, make_file(tmp_path / "in" / f"t{i:03d}.bin", 1000 + i), queue_name,
                      SendOptions(mode="atomic"))
            i += 1
            stop.wait(0.5)

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        t0 = time.monotonic()
        got = receive_streams(params, queue_name, tmp_path / "out",
                              options=ReceiveOptions(wait_timeout=10, stop_after=3))
        took = time.monotonic() - t0
    finally:
        stop.set()
        sender.join(30)
    assert got and took < 30, (len(got), took)
    for r in got:
        assert sha256_file(Path(r.path or "")) == sha256_file(tmp_path / "in" / r.name)


def test_a_file_failing_where_a_receipt_was_due_leaves_no_file_unconfirmed(
        params: BrokerParams, tmp_path: Path, queue_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unpacked (pack=False), receipts ride on every SEAL_FILES-th small file and on the
    last. When the last one fails as it is read, the file before it goes again carrying the
    receipt, so every file sent is confirmed; the receiver reports the repeat as a duplicate."""
    import errno

    from airflow_provider_amqstream.engine.send import bulk

    files = [make_file(tmp_path / "in" / f"f{i:02d}.bin", 2000 + i) for i in range(6)]
    real = bulk._Ctx._send_small
    seals: list[tuple[str, bool]] = []

    def send_small(self: Any, link: Any, e: Any, seal: bool) -> Any:
        seals.append((e.src.name, seal))
        if e.src.name == "f05.bin":
            raise OSError(errno.EIO, "injected read error")
        return real(self, link, e, seal)

    monkeypatch.setattr(bulk._Ctx, "_send_small", send_small)
    res = send_files(params, files, queue_name, SendOptions(pack=False))
    assert [f.path for f in res.failures] == [str(files[5])]
    assert sorted(r.name for r in res.results) == [f.name for f in files[:5]]
    # Unsealed until the last, which failed; then f04 again with the receipt.
    assert seals == [*((f.name, False) for f in files[:5]), ("f05.bin", True), ("f04.bin", True)]
    got, _ = receive_all(params, queue_name, tmp_path / "out", 5)
    assert sorted(Path(r.path or "").name for r in got) == [f.name for f in files[:5]]
    for f in files[:5]:
        assert sha256_file(tmp_path / "out" / f.name) == sha256_file(f)


def test_a_full_destination_is_waited_for_not_fatal(params: BrokerParams, tmp_path: Path, queue_name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue whose memory limit stays full (a receiver stopped with messages prefetched)
    makes the broker refuse messages after its flow-control wait: the send waits and goes
    on, from its first unconfirmed file, once the destination takes messages again."""
    import collections

    from airflow_provider_amqstream.engine.send import bulk
    from airflow_provider_amqstream.exceptions import DestinationFull

    files = tree(tmp_path / "src", 12)
    real, calls = bulk._Ctx.run, []

    def full_once(self: Any, link: Any, todo: Any, fail: Any) -> None:
        calls.append(1)  # the files still to send are read lazily: no len()
        if len(calls) == 1:
            real(self, link, collections.deque(todo.popleft() for _ in range(6)), fail)  # half get through
            raise DestinationFull(f"broker {params.url} refused messages: memory limit (test)")
        real(self, link, todo, fail)

    monkeypatch.setattr(bulk._Ctx, "run", full_once)
    res = send_files(params, iter_files([tmp_path / "src"], recursive=True), queue_name,
                     SendOptions(reconnect_timeout=30))
    assert not res.failures and len(res.results) == 12 and len(calls) == 2
    got, failures = receive_all(params, queue_name, tmp_path / "out", 12)
    assert not failures and sorted(r.sha256 for r in got) == sorted(sha256_file(f) for f in files)


def test_a_destination_that_stays_full_gives_up_at_the_deadline(params: BrokerParams, tmp_path: Path,
                                                                queue_name: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker still lets a sender connect while a destination is full, so a connection
    alone must not restart the reconnect deadline: without progress the send ends, naming
    the cause."""
    import threading

    from airflow_provider_amqstream.engine.send import bulk
    from airflow_provider_amqstream.exceptions import DestinationFull, StreamError

    tree(tmp_path / "src", 3)
    attempts: list[int] = []

    def always_full(self: Any, link: Any, todo: Any, fail: Any) -> None:
        attempts.append(1)
        raise DestinationFull(f"broker {params.url} refused messages: a destination's memory limit stayed full")

    monkeypatch.setattr(bulk._Ctx, "run", always_full)
    outcome: dict[str, BaseException] = {}

    def send() -> None:
        try:
            send_files(params, iter_files([tmp_path / "src"], recursive=True), queue_name,
                       SendOptions(reconnect_timeout=1.0))
        except BaseException as exc:  # handed to the test thread below
            outcome["exc"] = exc

    t = threading.Thread(target=send, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the sender kept retrying a full destination past its deadline"
    exc = outcome.get("exc")
    assert isinstance(exc, StreamError) and "gave up" in str(exc) and "memory limit" in str(exc)
    assert 2 <= len(attempts) <= 5


def test_many_files_cli_summary_shape_and_lists(uri: str, tmp_path: Path, queue_name: str) -> None:
    """3,000 tiny files, one CLI send and one CLI receive on a real broker: the send's totals line
    points to a list of every file, the receive prints one line per file, and the manifest
    lists all of them (memory itself: tests/unit/engine/test_many_files_memory.py, and
    benchmarks/scale.py at up to 300,000 files)."""
    n = 3000
    src = tmp_path / "landing"
    for i in range(n):
        d = src / f"d{i // 1000}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:04d}.txt").write_bytes(b"%06d\n" % i)
    env = {"AMQSTREAM_STATE_DIR": str(tmp_path / "state")}
    rx = cli("receive", "--from", queue_name, "--out-dir", str(tmp_path / "out"), "--conn", uri, "--count", str(n),
             "--json", "-q", "--wait", "120")
    tx = cli("send", str(src), "--recursive", "--to", queue_name, "--conn", uri, "--json", "-q", env=env)
    s_out, s_err = tx.communicate(timeout=600)
    r_out, r_err = rx.communicate(timeout=600)
    assert tx.returncode == 0 and rx.returncode == 0, (s_err[-1500:], r_err[-1500:])
    sent = [json.loads(line) for line in s_out.splitlines()]
    totals = sent[-1]
    assert totals["status"] == "totals"
    assert (totals["files"], totals["files_sent"], totals["files_failed"]) == (n, n, 0)
    assert totals["bytes"] == 7 * n and len(sent) == n + 1
    listed = [json.loads(line) for line in Path(totals["files_list"]).read_text().splitlines()]
    assert sorted(r["stream_id"] for r in listed) == sorted(r["stream_id"] for r in sent[:-1])
    got = [json.loads(line) for line in r_out.splitlines()]
    assert len(got) == n and all(r["status"] == "complete" for r in got)
    manifest = find_manifest(tmp_path / "out", totals["batch_id"])
    assert manifest is not None
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert sorted(r["path"] for r in rows) == sorted(f"d{i // 1000}/f{i:04d}.txt" for i in range(n))
