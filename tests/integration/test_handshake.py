"""Handshake mode: consumer discovery, windowed acknowledgements, re-request from
a sequence number, resume at both ends, topics with several subscribers."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import SendOptions, TransferResult, send_file
from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import HeldProxy, Receiver, cli, cli_json, make_file, read_json, sha256_file, wait_for

pytestmark = pytest.mark.broker


def test_queue_handshake_round_trip(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 5 * 2**20 + 17)
    rx = Receiver(params, queue_name, tmp_path / "out")
    sent = send_file(params, src, queue_name, SendOptions(mode="handshake", chunk_size=128 * 1024, window=8))
    got = rx.finish()
    assert got.sha256 == sent.sha256 == sha256_file(src) == sha256_file(Path(got.path or ""))
    assert got.mode == "handshake"


def test_sender_waits_for_a_consumer_then_gives_up_clearly(params: BrokerParams, tmp_path: Path,
                                                           queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 1000)
    with pytest.raises(StreamError, match=r"no receiver answered the offer .* within 1s"):
        send_file(params, src, queue_name, SendOptions(mode="handshake", request_timeout=1), stream_id="lonely-1")
    # The offer stays queued: a receiver that comes later answers it, and the sender's
    # re-run (same stream id) delivers.
    rx = Receiver(params, queue_name, tmp_path / "out")
    sent = send_file(params, src, queue_name, SendOptions(mode="handshake"), stream_id="lonely-1")
    assert rx.finish().sha256 == sent.sha256


def test_topic_every_subscriber_gets_the_whole_file(params: BrokerParams, tmp_path: Path) -> None:
    topic = f"/topic/t.fanout.{os.getpid()}"
    src = make_file(tmp_path / "f.bin", 3 * 2**20 + 5)
    receivers = [Receiver(params, topic, tmp_path / f"out{i}") for i in range(3)]
    for rx in receivers:
        assert rx.waiting.wait(30)
    sent = send_file(params, src, topic, SendOptions(mode="handshake", chunk_size=64 * 1024, window=8))
    for rx in receivers:
        got = rx.finish()
        assert got.sha256 == sent.sha256 == sha256_file(Path(got.path or ""))


def test_topic_refuses_store_and_forward(params: BrokerParams, tmp_path: Path) -> None:
    with pytest.raises(StreamError, match="mode='handshake'"):
        send_file(params, make_file(tmp_path / "f", 10), "/topic/x")


def test_lost_chunk_is_rerequested(params: BrokerParams, tmp_path: Path, queue_name: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_file(tmp_path / "f.bin", 20 * 64 * 1024)
    real_send = StompLink.send
    dropped: list[str] = []

    def lossy_send(self: StompLink, destination: str, body: bytes, headers: dict[str, str],
                   **kw: Any) -> str | None:
        # The first copy of chunk 5 never reaches the broker, as on a lossy path.
        if headers.get(hdr.H_KIND) == "data" and headers.get(hdr.H_SEQ) == "5" and not dropped:
            dropped.append(destination)
            return None
        return real_send(self, destination, body, headers, **kw)

    monkeypatch.setattr(StompLink, "send", lossy_send)
    rx = Receiver(params, queue_name, tmp_path / "out", rerequest_after=0.5)
    sent = send_file(params, src, queue_name, SendOptions(mode="handshake", chunk_size=64 * 1024, window=4),
                     stream_id="lost-1")
    got = rx.finish()
    assert dropped, "the fault was not injected"
    assert got.sha256 == sent.sha256 == sha256_file(src)
    assert sent.rerequests >= 1


def test_corrupted_chunk_is_rerequested(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 10 * 4096)
    data = src.read_bytes()
    spec = p.StreamSpec("bad-1", src.name, len(data), 4096, hdr.Mode.HANDSHAKE)
    dest = Destination.parse(queue_name)
    with StompLink(params) as link:  # a corrupted copy of chunk 3 waits ahead of the real one
        body = data[8192:12288]
        # Its first byte flipped: b"X" in its place left it intact whenever the random byte was "X".
        link.send(dest.data_queue("bad-1", params.user), bytes([body[0] ^ 0xFF]) + body[1:],
                  p.data_message(spec, 3, body)[0])
        link.round_trip()
    rx = Receiver(params, queue_name, tmp_path / "out", rerequest_after=0.5)
    sent = send_file(params, src, queue_name, SendOptions(mode="handshake", chunk_size=4096, window=4),
                     stream_id="bad-1")
    got = rx.finish()
    # At least once: the broker's redelivery policy may hand the rejected copy back once
    # before the good chunk 3 is on disk; it is refused again, never written.
    assert got.rejected >= 1
    assert got.sha256 == sent.sha256 == sha256_file(src)


@pytest.mark.kill
def test_receiver_killed_resumes_from_its_position(params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
                                                   held_proxy: Callable[..., HeldProxy]) -> None:
    chunk, size = 256 * 1024, 128 * 2**20 + 3
    src = make_file(tmp_path / "f.bin", size)
    out = tmp_path / "out"
    args = ["receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--json", "-q", "--wait", "30"]
    first = cli(*args)
    box: dict[str, TransferResult] = {}
    # The sender gets no further than 40 MiB until the receiver is killed: it is part way then.
    proxy = held_proxy(params.hosts[0][1], 40 * 2**20)
    held = dataclasses.replace(params, hosts=(("127.0.0.1", proxy.port),))
    t = threading.Thread(target=lambda: box.setdefault("sent", send_file(
        held, src, queue_name, SendOptions(mode="handshake", chunk_size=chunk, window=8), stream_id="hk-1")))
    t.start()
    wait_for(lambda: (read_json(out / ".amqstream" / "hk-1.json") or {}).get("next_seq", 0) >= 100, 60,
             "the receiver to store 100 chunks")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    proxy.release()
    [got] = cli_json(cli(*args))
    t.join(60)
    assert got["resumed_from"] > 0
    assert got["sha256"] == box["sent"].sha256 == sha256_file(src)
    assert box["sent"].rerequests >= 1  # the sender rewound to where the new receiver stood


def test_a_handshake_window_past_max_ahead_is_refused(params: BrokerParams, tmp_path: Path, queue_name: str) -> None:
    src = make_file(tmp_path / "f.bin", 1000)
    with pytest.raises(StreamError, match="window 2000 is too large for handshake mode"):
        send_file(params, src, queue_name, SendOptions(mode="handshake", window=2000))
