"""No stream can block a queue, and nothing is dropped silently.

Against the real broker and real receivers: a stream that can never succeed is
quarantined (its offer filed under DLQ.<queue> with the reason) and the receiver goes
on; a stream whose sender went silent yields its place; a reused stream id is refused
loudly, never acknowledged into nothing; a sender's "already sent" is per broker.
Hostile streams are played with raw stomp.py as an authorized sender would.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    SendOptions,
    TransferResult,
    receive_stream,
    receive_streams,
    send_file,
)
from airflow_provider_amqstream.engine.receive.stream import consumer_name
from airflow_provider_amqstream.exceptions import StreamError, StreamQuarantined, StreamStalled, TransportError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import ROOT, RawSender, browse, cli, make_file, play, send_stream, sha256_file, wait_for

pytestmark = pytest.mark.broker


def dlq(params: BrokerParams, queue: str) -> list[Any]:
    return browse(params, "/queue/DLQ." + Destination.parse(queue).name)


def test_poisoned_and_abandoned_streams_do_not_hold_up_twenty_good_ones(
        params: BrokerParams, uri: str, tmp_path: Path, queue_name: str) -> None:
    """One --follow run, a poisoned and an abandoned stream at the
    head of the queue, twenty good streams behind them; all twenty arrive byte-exact."""
    data = make_file(tmp_path / "bad.bin", 8000).read_bytes()
    poisoned = p.StreamSpec("poison-1", "bad.bin", len(data), 1000)

    def flip(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (bytes([body[0] ^ 1]) + body[1:]) if seq == 2 else body

    play(params, queue_name, poisoned, data, list(range(1, 9)), tamper=flip)
    abandoned = p.StreamSpec("gone-1", "gone.bin", len(data), 1000)
    play(params, queue_name, abandoned, data, [1, 2, 3], end=False)  # its sender died after chunk 3
    good = [make_file(tmp_path / "good" / f"g{i:02d}.bin", 64 * 1024 + i) for i in range(20)]
    for f in good:
        send_file(params, f, queue_name, SendOptions(chunk_size=16 * 1024))
    out = tmp_path / "out"
    idle = 3.0
    t0, started = time.monotonic(), time.time()
    proc = cli("receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--follow", "--wait", "4",
               "--idle-timeout", str(idle), "--json", "-q")
    stdout, stderr = proc.communicate(timeout=240)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    done = [r for r in lines if r["status"] == "complete"]
    assert sorted(Path(r["path"]).name for r in done) == sorted(f.name for f in good)
    for f in good:
        assert sha256_file(out / f.name) == sha256_file(f)
    [q] = [r for r in lines if r["status"] == "quarantined"]
    assert q["stream_id"] == "poison-1" and "CRC-32" in q["reason"]
    [s] = [r for r in lines if r["status"] == "stalled"]
    assert s["stream_id"] == "gone-1" and s["offset"] == 3000 and s["retry_after"] >= 60
    assert "poison-1" in stderr and "gone-1" in stderr
    # Poisoned: filed with the reason, no partial data. Abandoned: partial data kept for a resume.
    [filed] = dlq(params, queue_name)
    assert filed.headers[hdr.H_STREAM] == "poison-1" and "CRC-32" in filed.headers[hdr.H_QUARANTINE_REASON]
    assert not list((out / ".amqstream").glob("poison-1.*"))
    assert (out / ".amqstream" / "gone-1.part").exists() and (out / ".amqstream" / "gone-1.json").exists()
    # The stalled stream's offer was parked for its turn.
    assert browse(params, queue_name) == []
    [parked] = browse(params, Destination.parse(queue_name).parked_queue())
    assert parked.headers[hdr.H_STREAM] == "gone-1" and p.parked_until(parked.headers) > time.time() + 50
    # The promise: the good streams wait for the abandoned one no longer than idle_timeout.
    # The slack covers the process start (the CLI's import) and the poisoned stream's quarantine.
    last = max(r["finished_at"] for r in done) - started
    transfer = sum(r["seconds"] for r in done)
    assert last <= idle + transfer + 10, (last, transfer)
    print(f"\nissue-9 figure: 20 good streams behind a poisoned and an abandoned one, one --follow run: "
          f"the last arrived {last:.1f}s after start (idle_timeout {idle:.0f}s, their transfer times add up to "
          f"{transfer:.1f}s); {wall:.1f}s wall including the final --wait 4s")


@pytest.mark.parametrize("case", ["wrong-password", "no-broker", "out-dir-is-a-file"])
def test_follow_exits_non_zero_for_failures_of_its_own(params: BrokerParams, uri: str, tmp_path: Path,
                                                       queue_name: str, case: str) -> None:
    """Failures of other streams never stop --follow (above); its own do, at once, saying why."""
    from tests.helpers import free_port

    out = tmp_path / "out"
    if case == "wrong-password":
        uri = uri.replace(f":{params.password}@", ":not-the-password@")
        want = "refused login"
    elif case == "no-broker":
        uri = f"amqstream://u:pw@127.0.0.1:{free_port()}?connect_timeout=2"
        want = "cannot reach any broker"
    else:
        out.write_text("a file where the output directory should be")
        want = str(out)
    proc = cli("receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--follow", "-q")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None) and want in err, (proc.returncode, err)
    assert params.password not in err and "Traceback" not in err


def test_a_stalled_stream_gets_its_turn_back_and_completes(params: BrokerParams, tmp_path: Path,
                                                           queue_name: str) -> None:
    data = make_file(tmp_path / "late.bin", 6000).read_bytes()
    spec = p.StreamSpec("late-1", "late.bin", len(data), 1000)
    play(params, queue_name, spec, data, [1, 2], end=False)
    out = tmp_path / "out"
    opts = ReceiveOptions(wait_timeout=5, idle_timeout=1, yield_backoff=2)
    with pytest.raises(StreamStalled, match=r"late-1.*at byte 2000 of 6000.*partial data is kept"):
        receive_stream(params, queue_name, out, options=opts)
    # Skipped for its back-off: nothing else is offered, so nothing is received meanwhile.
    assert receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=0.5)) is None
    # The sender comes back with the rest; after the back-off the stream resumes at byte 2000.
    play_rest = RawSender(params)
    send_stream(play_rest.send, queue_name, spec, data, range(3, 7), offer=False)
    play_rest.close()
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.resumed_from == 2000 and (out / "late.bin").read_bytes() == data
    assert browse(params, queue_name) == browse(params, Destination.parse(queue_name).parked_queue()) == []


@pytest.mark.parametrize("case", ["bad-offset", "wrong-sha", "unknown-kind", "past-the-end"])
def test_protocol_violations_are_quarantined_and_the_next_stream_arrives(
        params: BrokerParams, tmp_path: Path, queue_name: str, case: str) -> None:
    data = make_file(tmp_path / "f.bin", 5000).read_bytes()
    spec = p.StreamSpec(f"pv-{case}", "f.bin", len(data), 1000)

    def tamper(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        if seq == 3 and case == "bad-offset":
            headers[hdr.H_OFFSET] = "0"
        if seq == 3 and case == "unknown-kind":
            headers[hdr.H_KIND] = "offer"
        if seq == 3 and case == "past-the-end":
            headers[hdr.H_SEQ] = "9"
        return headers, body

    play(params, queue_name, spec, data, list(range(1, 6)), tamper=tamper,
         sha="0" * 64 if case == "wrong-sha" else None)
    good = make_file(tmp_path / "good.bin", 3000)
    sent = send_file(params, good, queue_name, SendOptions(chunk_size=1000))
    got: list[TransferResult] = []
    failures: list[Any] = []
    receive_streams(params, queue_name, tmp_path / "out", count=1, options=ReceiveOptions(wait_timeout=10),
                    on_result=got.append, on_failure=failures.append)
    assert [r.sha256 for r in got] == [sent.sha256]
    [f] = failures
    assert f.status == "quarantined" and f.stream_id == spec.stream_id and f.quarantine.startswith("/queue/DLQ.")
    [filed] = dlq(params, queue_name)
    assert filed.headers[hdr.H_STREAM] == spec.stream_id and filed.headers[hdr.H_QUARANTINE_REASON]
    assert not (tmp_path / "out" / "f.bin").exists()
    assert not list((tmp_path / "out" / ".amqstream").glob(f"{spec.stream_id}.*"))


def test_oversized_stream_is_quarantined_by_the_cli_max_bytes(params: BrokerParams, uri: str, tmp_path: Path,
                                                              queue_name: str) -> None:
    big = make_file(tmp_path / "big.bin", 50_000)
    small = make_file(tmp_path / "small.bin", 5_000)
    send_file(params, big, queue_name, SendOptions(chunk_size=10_000))
    send_file(params, small, queue_name, SendOptions(chunk_size=10_000))
    proc = cli("receive", "--from", queue_name, "--out-dir", str(tmp_path / "out"), "--conn", uri, "--count", "1",
               "--max-bytes", "10000", "--wait", "10", "--json", "-q")
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stdout.splitlines()]
    assert [(r["status"], r.get("name") or r["stream_id"].split("-")[0]) for r in lines] == [
        ("quarantined", "big.bin"), ("complete", "small.bin")]
    assert "over this receiver's limit of 10000" in lines[0]["reason"]
    assert sha256_file(tmp_path / "out" / "small.bin") == sha256_file(small)


def test_a_reused_stream_id_is_refused_loudly_and_a_repeat_is_a_duplicate(
        params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    first = make_file(tmp_path / "a" / "report.csv", 4000, seed=1)
    other = make_file(tmp_path / "b" / "report.csv", 4000, seed=2)
    out = tmp_path / "out"
    sent = send_file(params, first, queue_name, SendOptions(chunk_size=1000), stream_id="daily-report")
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.sha256 == sent.sha256
    # Another file under the same id (what `send --restart --stream-id` did): never acked into nothing.
    send_file(params, other, queue_name, SendOptions(chunk_size=1000, restart=True), stream_id="daily-report")
    with pytest.raises(StreamQuarantined, match="daily-report was already used by another stream"):
        receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert sha256_file(out / "report.csv") == sent.sha256  # the first file is untouched
    [filed] = dlq(params, queue_name)
    assert filed.headers[hdr.H_ORIGIN] and "already used" in filed.headers[hdr.H_QUARANTINE_REASON]
    # The same stream again is a duplicate: acknowledged, drained, reported, nothing written.
    os.utime(first, ns=(first.stat().st_atime_ns, first.stat().st_mtime_ns))
    send_file(params, first, queue_name, SendOptions(chunk_size=1000, restart=True), stream_id="daily-report")
    again = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert again is not None and again.status == "duplicate" and again.bytes_transferred == 0
    assert sorted(x.name for x in out.iterdir()) == [".amqstream", "report.csv"]
    assert browse(params, Destination.parse(queue_name).data_queue("daily-report", params.user)) == []


def test_already_sent_is_per_broker_and_proves_the_credentials(
        params: BrokerParams, uri: str, private_broker: EmbeddedBroker, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 3000)
    first = send_file(params, src, queue_name)
    assert first.status == "complete"
    assert send_file(params, src, queue_name).status == "already_sent"
    # The command says where and when it was sent, and that nothing was sent now.
    proc = cli("send", str(src), "--to", queue_name, "--conn", uri)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    day = time.strftime("%Y-%m-%d", time.gmtime(first.finished_at))
    assert f"already sent completely to {queue_name} on {params.url} at {day}" in out and "Nothing sent" in out, out
    info = private_broker.info()
    other = BrokerParams(hosts=((info.host, info.port),), login=info.user, password=info.password)
    # The same file to another broker is another transfer, not "already sent".
    again = send_file(other, src, queue_name)
    assert again.status == "complete" and again.bytes_transferred == 3000
    got = receive_stream(other, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=10))
    assert got is not None and got.sha256 == first.sha256
    # A wrong password fails even when the checkpoint says the stream was sent.
    with pytest.raises(TransportError, match="refused login"):
        send_file(BrokerParams(hosts=params.hosts, login=params.login, password="wrong"), src, queue_name)


def test_the_output_directory_is_never_written_through_a_link(params: BrokerParams, tmp_path: Path,
                                                              queue_name: str) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    data = make_file(tmp_path / "f.bin", 3000).read_bytes()
    spec = p.StreamSpec("link-1", "f.bin", len(data), 1000)
    play(params, queue_name, spec, data, [1, 2, 3])
    # A link planted where the receiver keeps its partial file.
    out = tmp_path / "out"
    (out / ".amqstream").mkdir(parents=True, mode=0o700)
    (out / ".amqstream" / "link-1.part").symlink_to(victim)
    (out / ".amqstream" / "link-1.json").symlink_to(victim)
    for planted in ("link-1.json", "link-1.part"):
        with pytest.raises(StreamError, match=f"{planted} is a symbolic link"):
            receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
        assert victim.read_text() == "keep me"
        (out / ".amqstream" / planted).unlink()
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert got is not None and (out / "f.bin").read_bytes() == data and victim.read_text() == "keep me"
    # A state directory that is a link is refused outright.
    linked = tmp_path / "out2"
    linked.mkdir()
    (linked / ".amqstream").symlink_to(tmp_path)
    with pytest.raises(Exception, match="not a directory"):
        receive_stream(params, queue_name, linked, options=ReceiveOptions(wait_timeout=1))


def test_a_state_directory_another_user_owns_is_refused(params: BrokerParams, tmp_path: Path,
                                                       queue_name: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    src = make_file(tmp_path / "f.bin", 3000)
    send_file(params, src, queue_name, SendOptions(mode="atomic"))
    out = tmp_path / "out"
    (out / ".amqstream").mkdir(parents=True, mode=0o700)
    os.chown(out / ".amqstream", 65534, 65534)
    with pytest.raises(StreamError, match="belongs to user id 65534"):
        receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    # Nothing was taken: once the directory is ours again the stream arrives.
    os.chown(out / ".amqstream", os.geteuid(), os.getegid())
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=10))
    assert got is not None and (out / "f.bin").read_bytes() == src.read_bytes()


def test_handshake_sender_ignores_an_impostor_on_the_control_queue(params: BrokerParams, tmp_path: Path,
                                                                   queue_name: str) -> None:
    """A peer who may write control messages (any receiver may) sends a forged ``done`` and
    ``hello next_seq=1`` again and again. The sender neither stops early nor rewinds for it."""
    src = make_file(tmp_path / "f.bin", 64 * 16 * 1024)
    dest = Destination.parse(queue_name)
    spec = p.StreamSpec("hs-guard", "f.bin", src.stat().st_size, 16 * 1024, hdr.Mode.HANDSHAKE)
    ctl = dest.control_queue("hs-guard")
    impostor = RawSender(params)
    token = "e" * 32
    for _ in range(3):  # queued before the sender even subscribes: it reads these first
        impostor.send(ctl, b"", p.control_headers(spec, hdr.Kind.DONE, "evil:1", spec.chunks + 1, token))
        impostor.send(ctl, b"", p.control_headers(spec, hdr.Kind.HELLO, "evil:2", 1, token))
    out = tmp_path / "out"
    box: dict[str, Any] = {}
    opened = threading.Event()
    opts = ReceiveOptions(wait_timeout=60, idle_timeout=60,
                          events=lambda kind, data: opened.set() if kind == "stream_open" else None)
    rx = threading.Thread(target=lambda: box.setdefault("got", receive_stream(params, queue_name, out, options=opts)),
                          daemon=True)
    rx.start()
    tx = threading.Thread(target=lambda: box.setdefault("sent", send_file(
        params, src, queue_name, SendOptions(mode="handshake", chunk_size=16 * 1024, window=8, ack_timeout=60),
        stream_id="hs-guard")), daemon=True)
    tx.start()
    assert opened.wait(60), "the receiver never took the offer"
    # An impostor who answers an offer before its receiver can hold it up (documented); here
    # the real receiver is bound first: its first batch is on disk.
    wait_for(lambda: (out / ".amqstream" / "hs-guard.json").exists(), 60, "the first batch on disk")
    while tx.is_alive():  # keep forging while the transfer runs
        impostor.send(ctl, b"", p.control_headers(spec, hdr.Kind.HELLO, "evil:2", 1, token))
        impostor.send(ctl, b"", p.control_headers(spec, hdr.Kind.DONE, consumer_name(out), spec.chunks + 1, token))
        tx.join(0.05)
    impostor.close()
    rx.join(60)
    sent, got = box["sent"], box["got"]
    assert got is not None and got.sha256 == sent.sha256 == sha256_file(src) == sha256_file(out / "f.bin")
    # Messages forged before the offer existed were discarded; later ones were ignored: no
    # rewind was made for the impostor.
    assert sent.bytes_transferred <= 2 * spec.size


def test_sensor_reports_a_poisoned_stream_and_receives_the_good_one(
        airflow_db: Path, uri: str, params: BrokerParams, tmp_path: Path, queue_name: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration.test_airflow import _load

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    data = make_file(tmp_path / "bad.bin", 5000).read_bytes()
    spec = p.StreamSpec("sensor-poison", "bad.bin", len(data), 1000)
    play(params, queue_name, spec, data, list(range(1, 6)), sha="0" * 64)
    good = make_file(tmp_path / "good.bin", 4000)
    sent = send_file(params, good, queue_name, SendOptions(chunk_size=1000))
    record = tmp_path / "record.json"
    dag = _load(ROOT / "tests" / "dags", "amqs_test_sensor_policy")
    dr = dag.test(run_conf={"queue": queue_name, "out_dir": str(tmp_path / "out"), "record": str(record)})
    assert dr.state == "success"
    got = json.loads(record.read_text())
    assert got["sha256"] == sent.sha256 and got["status"] == "complete"
    [failure] = json.loads(Path(str(record) + ".failures").read_text())
    assert failure["stream_id"] == "sensor-poison" and failure["status"] == "quarantined"
    assert "SHA-256 mismatch" in failure["reason"]
    # Filed where the sensor was told to put streams that can never succeed.
    [filed] = browse(params, queue_name + ".bad")
    assert filed.headers[hdr.H_STREAM] == "sensor-poison" and hdr.H_QUARANTINE_REASON in filed.headers
