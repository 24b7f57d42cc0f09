"""A retry on another worker, on the in-memory link: a receiver killed mid-stream took the
first chunks into its own directory; a receiver on another directory (another worker's
disk) must neither dead-letter the rest nor throw away what it can still use, and must
say where the first bytes are and how to finish."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, StreamFailure, receive_stream, receive_streams
from airflow_provider_amqstream.engine.receive import holders
from airflow_provider_amqstream.engine.receive.stream import StreamReceiver
from airflow_provider_amqstream.exceptions import StreamElsewhere
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker
from tests.helpers import send_stream

Q = "/queue/landing"
DEST = Destination.parse(Q)
FAST = {"wait_timeout": 0.5, "idle_timeout": 0.5, "gap_grace": 0.2, "window": 4}
CHUNK = 1000
CHUNKS = 40


class Killed(BaseException):
    """The receiving process dies here (nothing of the engine's own handling runs)."""


def _send(broker: MemoryBroker, spec: p.StreamSpec, data: bytes, seqs: range, *, offer: bool, end: bool) -> None:
    with open_link(broker.params("site-a")) as link:
        send_stream(link.send, Q, spec, data, seqs, offer=offer, end=end)


def _killed_after(broker: MemoryBroker, out: Path, sid: str, durable: int) -> None:
    """Receive into ``out`` and die once ``durable`` bytes are on disk and acknowledged."""
    acknowledge = StreamReceiver._durable

    def then_die(self: StreamReceiver, frames: list[Any]) -> None:
        acknowledge(self, frames)
        if self.file.state.contiguous_bytes >= durable:
            raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamReceiver, "_durable", then_die)
        with pytest.raises(Killed):
            receive_stream(broker.params("rx"), Q, out, stream_id=sid, options=ReceiveOptions(**FAST))


def _stream(broker: MemoryBroker, tmp_path: Path, sid: str) -> tuple[p.StreamSpec, bytes]:
    data = os.urandom(CHUNKS * CHUNK - 7)
    spec = p.StreamSpec(sid, f"{sid}.bin", len(data), CHUNK)
    _send(broker, spec, data, range(1, 13), offer=True, end=False)  # the sender is mid-stream
    return spec, data


def test_a_retry_elsewhere_leaves_the_rest_for_the_first_receiver_and_says_where(
        broker: MemoryBroker, tmp_path: Path) -> None:
    spec, data = _stream(broker, tmp_path, "moved-1")
    worker1, worker2 = tmp_path / "worker1" / "in", tmp_path / "worker2" / "in"
    _killed_after(broker, worker1, "moved-1", 4 * CHUNK)
    [note] = broker.messages(DEST.held_queue("moved-1"))
    assert note[0][hdr.H_HELD_DIR] == str(worker1.resolve()) and note[0][hdr.H_HELD_HOST] == socket.gethostname()
    _send(broker, spec, data, range(13, CHUNKS + 1), offer=False, end=True)  # the sender finishes
    waiting = len(broker.messages(DEST.data_queue("moved-1", "site-a")))

    # The retry, on another worker's disk: it takes no chunk, says where the first bytes are.
    with pytest.raises(StreamElsewhere) as err:
        receive_stream(broker.params("rx"), Q, worker2, stream_id="moved-1", options=ReceiveOptions(**FAST))
    text = str(err.value)
    assert f"host {socket.gethostname()}, directory {worker1.resolve()}" in text, text
    assert str(worker1.resolve() / ".amqstream" / "moved-1.part") in text, text
    assert f"amqstream receive --from {Q} --out-dir {worker1.resolve()} --stream-id moved-1" in text, text
    assert f"amqstream send PATH --to {Q} --stream-id moved-1 --restart" in text, text
    assert f"amqstream streams discard moved-1 --from {Q} --yes" in text, text
    assert err.value.failure is not None and err.value.failure.status == "elsewhere"
    assert len(broker.messages(DEST.data_queue("moved-1", "site-a"))) == waiting > CHUNKS - 12, "chunks were taken"
    assert not broker.messages("/queue/DLQ.landing.amqs.moved-1") and not broker.messages("/queue/DLQ.landing")
    assert not (worker2 / ".amqstream" / "moved-1.part").exists()
    assert len(broker.messages(DEST.held_queue("moved-1"))) == 1  # the first receiver's note stays

    # Back on the first worker (or with that directory shared): it resumes and completes.
    got = receive_stream(broker.params("rx"), Q, worker1, stream_id="moved-1", options=ReceiveOptions(**FAST))
    assert got is not None and got.resumed_from >= 4 * CHUNK
    assert Path(got.path or "").read_bytes() == data
    assert broker.messages(DEST.held_queue("moved-1")) == [], "the published stream's note was left behind"
    assert broker.messages(DEST.data_queue("moved-1", "site-a")) == []


def test_a_shared_directory_resumes_on_the_other_worker(broker: MemoryBroker, tmp_path: Path) -> None:
    spec, data = _stream(broker, tmp_path, "shared-1")
    shared = tmp_path / "nfs" / "in"
    _killed_after(broker, shared, "shared-1", 4 * CHUNK)
    _send(broker, spec, data, range(13, CHUNKS + 1), offer=False, end=True)
    got = receive_stream(broker.params("rx"), Q, shared, stream_id="shared-1", options=ReceiveOptions(**FAST))
    assert got is not None and got.resumed_from >= 4 * CHUNK and Path(got.path or "").read_bytes() == data
    assert broker.messages(DEST.held_queue("shared-1")) == []


def test_without_a_note_the_receiver_keeps_what_it_got_and_a_resend_completes_it(
        broker: MemoryBroker, tmp_path: Path) -> None:
    """A first receiver that left no note (removed since): where the first bytes went
    cannot be known; the retry keeps the rest, dead-letters nothing, and a send of the
    file again completes it there."""
    spec, data = _stream(broker, tmp_path, "nonote-1")
    worker1, worker2 = tmp_path / "worker1" / "in", tmp_path / "worker2" / "in"
    _killed_after(broker, worker1, "nonote-1", 4 * CHUNK)
    with open_link(broker.params("admin")) as link:
        assert holders.release(link, DEST, "nonote-1") == 1
    _send(broker, spec, data, range(13, CHUNKS + 1), offer=False, end=True)
    failures: list[StreamFailure] = []
    got = receive_streams(broker.params("rx"), Q, worker2, on_failure=failures.append,
                          options=ReceiveOptions(**FAST))
    assert got == [] and [f.status for f in failures] == ["elsewhere"], failures
    reason = failures[0].reason
    assert "chunks 1-" in reason and "cannot be known" in reason, reason
    assert f"amqstream send PATH --to {Q} --stream-id nonote-1 --restart" in reason, reason
    assert str(worker2 / ".amqstream" / "nonote-1.part") in reason and "Nothing was dead-lettered" in reason
    assert (worker2 / ".amqstream" / "nonote-1.part").exists()
    assert not broker.messages("/queue/DLQ.landing.amqs.nonote-1") and not broker.messages("/queue/DLQ.landing")
    assert len(broker.messages(DEST.parked_queue())) == 1

    # The sender sends the file again (a new offer, every chunk): the retry's directory
    # takes only what it lacks and publishes the file.
    _send(broker, spec, data, range(1, CHUNKS + 1), offer=True, end=True)
    got = receive_stream(broker.params("rx"), Q, worker2, stream_id="nonote-1", options=ReceiveOptions(**FAST))
    assert got is not None and Path(got.path or "").read_bytes() == data
    assert got.duplicates == CHUNKS - 4 and got.bytes_transferred == 4 * CHUNK  # only what it lacked


def test_the_report_of_a_directory_holding_part_names_the_other_holder_and_what_it_keeps(tmp_path: Path) -> None:
    worker1, worker2 = tmp_path / "worker1", tmp_path / "worker2"
    other = holders.Holder("h1", str(worker1), str(worker1 / ".amqstream" / "split-1.part"), since=1.7e9)
    text = holders.elsewhere_report("stream split-1", DEST, "split-1", worker2, [other],
                                    data_q=DEST.data_queue("split-1", "site-a"), missing="chunks 1-8 (bytes 0-7999)",
                                    kept="32 of its 40 chunks")
    assert "another receiver took chunks 1-8 (bytes 0-7999)" in text and f"not this directory ({worker2})" in text
    assert f"host h1, directory {worker1} (partial file {other.part}, since 2023-11-14" in text, text
    assert "This directory keeps 32 of its 40 chunks" in text and f"--to {Q} --stream-id split-1 --restart" in text


def test_a_stream_within_one_window_leaves_no_note(broker: MemoryBroker, tmp_path: Path) -> None:
    data = os.urandom(3 * CHUNK)
    spec = p.StreamSpec("small-1", "small.bin", len(data), CHUNK)
    _send(broker, spec, data, range(1, 4), offer=True, end=True)
    seen: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append(len(broker.messages(DEST.held_queue("small-1"))))

    got = receive_stream(broker.params("rx"), Q, tmp_path / "in", options=ReceiveOptions(**FAST, progress=progress))
    assert got is not None and Path(got.path or "").read_bytes() == data
    assert seen and set(seen) == {0}


def test_a_directory_that_kept_nothing_withdraws_its_note(broker: MemoryBroker, tmp_path: Path) -> None:
    """A stream offered and never sent: the receiver noted it, then yielded with no chunk on
    disk; a note left behind would send every later receiver elsewhere for nothing."""
    spec = p.StreamSpec("silent-1", "silent.bin", CHUNKS * CHUNK, CHUNK)
    _send(broker, spec, b"", range(0), offer=True, end=False)
    failures: list[StreamFailure] = []
    got = receive_streams(broker.params("rx"), Q, tmp_path / "in", on_failure=failures.append,
                          options=ReceiveOptions(**FAST))
    assert got == [] and [f.status for f in failures] == ["stalled"], failures
    assert not (tmp_path / "in" / ".amqstream" / "silent-1.part").exists()
    assert broker.messages(DEST.held_queue("silent-1")) == []
