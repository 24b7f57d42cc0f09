"""The failure matrix (docs/protocol.md) with real processes killed by signal, not flags."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, checkpoint_name, receive_stream, send_file
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import cli, cli_json, make_file, read_json, sha256_file, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.kill]

CHUNK = 256 * 1024
SIZE = 256 * 2**20 + 12345
WINDOW = 4


def _receiver_progress(out: Path, sid: str) -> int:
    state = read_json(out / ".amqstream" / f"{sid}.json")
    return int(state["next_seq"]) if state else 0


def _kill(proc: object) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    proc.communicate(timeout=30)  # type: ignore[attr-defined]


def test_receiver_killed_mid_stream_resumes(params: BrokerParams, uri: str, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "big.bin", SIZE)
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=CHUNK), stream_id="rk-1")
    out = tmp_path / "out"
    args = ["receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--window", str(WINDOW),
            "--json", "-q", "--wait", "20"]
    first = cli(*args)
    wait_for(lambda: _receiver_progress(out, "rk-1") >= 100, 60, "the receiver to store 100 chunks")
    _kill(first)
    assert not (out / "big.bin").exists()
    done_before = _receiver_progress(out, "rk-1") - 1
    [res] = cli_json(cli(*args))
    assert res["sha256"] == sent.sha256 == sha256_file(out / "big.bin")
    assert res["resumed_from"] >= done_before * CHUNK > 0
    # Nothing recorded durable was written again; at most the unsynced window was.
    assert res["bytes_transferred"] <= SIZE - res["resumed_from"] + WINDOW * CHUNK


def test_second_receiver_takes_over_shared_directory(params: BrokerParams, uri: str, tmp_path: Path,
                                                     queue_name: str) -> None:
    src = make_file(tmp_path / "big.bin", SIZE)
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=CHUNK), stream_id="to-1")
    out = tmp_path / "shared"
    args = ["receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--window", str(WINDOW),
            "--json", "-q", "--wait", "30"]
    a = cli(*args)
    wait_for(lambda: _receiver_progress(out, "to-1") >= 50, 60, "receiver A to store 50 chunks")
    b = cli(*args)  # waits: A holds the only offer
    wait_for(lambda: _receiver_progress(out, "to-1") >= 150, 60, "receiver A to store 150 chunks")
    _kill(a)
    [res] = cli_json(b)
    assert res["resumed_from"] > 0
    assert res["sha256"] == sent.sha256 == sha256_file(out / "big.bin")


def test_sender_killed_mid_stream_resumes_from_confirmed_offset(params: BrokerParams, uri: str, tmp_path: Path,
                                                                queue_name: str) -> None:
    src = make_file(tmp_path / "big.bin", SIZE)
    state_dir = tmp_path / "send-state"
    args = ["send", str(src), "--to", queue_name, "--conn", uri, "--stream-id", "sk-1",
            "--chunk-size", str(CHUNK), "--window", str(WINDOW), "--json", "-q"]
    env = {"AMQSTREAM_STATE_DIR": str(state_dir)}
    first = cli(*args, env=env)
    ckpt = state_dir / checkpoint_name("sk-1", params)
    wait_for(lambda: (read_json(ckpt) or {}).get("confirmed_seq", 0) >= 200, 60, "the sender to confirm 200 chunks")
    _kill(first)
    confirmed = read_json(ckpt)["confirmed_seq"]  # type: ignore[index]
    [res] = cli_json(cli(*args, env=env))
    assert res["resumed_from"] == confirmed * CHUNK > 0
    assert res["bytes_transferred"] == SIZE - res["resumed_from"]  # it did not resend the whole file
    got = receive_stream(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sha256_file(src) == res["sha256"]


def test_broker_killed_and_restarted_mid_stream(private_broker: EmbeddedBroker, tmp_path: Path) -> None:
    uri = private_broker.info().uri
    queue = "/queue/crash.broker"
    src = make_file(tmp_path / "big.bin", SIZE)
    out = tmp_path / "out"
    receiver = cli("receive", "--from", queue, "--out-dir", str(out), "--conn", uri, "--window", str(WINDOW),
                   "--json", "-q", "--wait", "60")
    sender = cli("send", str(src), "--to", queue, "--conn", uri, "--stream-id", "bk-1", "--chunk-size",
                 str(CHUNK), "--window", str(WINDOW), "--json", "-q")
    wait_for(lambda: _receiver_progress(out, "bk-1") >= 100, 60, "the receiver to store 100 chunks")
    private_broker.kill()
    private_broker.start()
    [sent] = cli_json(sender)
    [got] = cli_json(receiver)
    assert got["sha256"] == sent["sha256"] == sha256_file(src) == sha256_file(out / "big.bin")


def test_rerun_without_chunk_size_continues_the_interrupted_one(params: BrokerParams, tmp_path: Path,
                                                                queue_name: str) -> None:
    from airflow_provider_amqstream.engine import FileCheckpoint, checkpoint_name, default_state_dir

    src = make_file(tmp_path / "f.bin", 1000)
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=100), stream_id="cs-1")
    ckpt = FileCheckpoint(default_state_dir() / checkpoint_name("cs-1", params))
    # As if killed after chunk 4: in flight (no sent_at), confirmed up to there.
    data = {k: v for k, v in (ckpt.load() or {}).items() if k != "sent_at"}
    ckpt.save({**data, "confirmed_seq": 4, "end_sent": False})
    again = send_file(params, src, queue_name, stream_id="cs-1")  # no chunk size given
    assert again.resumed_from == 400 and again.chunks == 10 and again.sha256 == sent.sha256


def test_checkpoint_exists_before_the_first_message(params: BrokerParams, tmp_path: Path, queue_name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.engine import FileCheckpoint, checkpoint_name, default_state_dir
    from airflow_provider_amqstream.exceptions import StreamError
    from airflow_provider_amqstream.transport.session import StompLink

    src = make_file(tmp_path / "f.bin", 10_000)

    def die(*a: object, **k: object) -> None:
        raise SystemExit("killed before anything was sent")

    real_send = StompLink.send
    monkeypatch.setattr(StompLink, "send", die)
    with pytest.raises(SystemExit):
        send_file(params, src, queue_name, SendOptions(chunk_size=1000), stream_id="early-1")
    monkeypatch.setattr(StompLink, "send", real_send)
    assert (FileCheckpoint(default_state_dir() / checkpoint_name("early-1", params)).load() or {})["chunk_size"] == 1000
    # A re-run naming another chunk size is refused rather than offering a conflicting stream.
    with pytest.raises(StreamError, match="different file, destination or chunk size"):
        send_file(params, src, queue_name, SendOptions(chunk_size=4096), stream_id="early-1")
    assert send_file(params, src, queue_name, stream_id="early-1").chunks == 10
