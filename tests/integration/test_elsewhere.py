"""A retry on another worker, against the real broker and its authorization: a receiver
killed mid-stream took the first chunks into its own directory; a receiver on another
directory (another worker's disk) leaves the rest on the broker for it, dead-letters
nothing and says where the first bytes are. Users hold only their grants: ``producer`` may
send to ``/queue/moved``'s per-test siblings, ``consumer`` receive from them (and note where it
holds streams)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.cli_streams import render_report
from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    SendOptions,
    StreamFailure,
    receive_stream,
    receive_streams,
    send_file,
)
from airflow_provider_amqstream.engine.receive import holders
from airflow_provider_amqstream.engine.receive.stream import StreamReceiver
from airflow_provider_amqstream.engine.show import show_stream
from airflow_provider_amqstream.exceptions import StreamElsewhere
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import browse, make_file, params_as, running_broker, sha256_file

pytestmark = pytest.mark.broker

Q = "/queue/moved"
# Each test has its own destination: the second receives whatever is offered and both assert
# that nothing reached the DLQ, so neither may see what the other left, in either order.
FIRST_Q, RESEND_Q = (f"{Q}.{name}" for name in ("first", "resend"))
CHUNK = 64 * 1024
OPTS = {"wait_timeout": 10, "idle_timeout": 10, "gap_grace": 2, "window": 4}


class Killed(BaseException):
    """The process dies here: none of the engine's own handling runs."""


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path_factory.mktemp("moved") / "broker",
                              {"producer": {"send": [FIRST_Q, RESEND_Q]}, "consumer": {"receive": [FIRST_Q, RESEND_Q]}})


def _send_half_then_all(broker: EmbeddedBroker, q: str, src: Path, sid: str) -> None:
    """Send until half the file is confirmed, die; the caller re-runs :func:`_finish`."""
    def die_at_half(done: int, total: int) -> None:
        if done >= total // 2:
            raise Killed

    with pytest.raises(Killed):
        send_file(params_as(broker, "producer"), src, q, SendOptions(chunk_size=CHUNK, window=4, progress=die_at_half),
                  stream_id=sid)


def _finish(broker: EmbeddedBroker, q: str, src: Path, sid: str, **kw: Any) -> str:
    return send_file(params_as(broker, "producer"), src, q, SendOptions(chunk_size=CHUNK, window=4, **kw),
                     stream_id=sid).sha256


def _receive_and_die(broker: EmbeddedBroker, q: str, out: Path, sid: str, chunks: int) -> None:
    acknowledge = StreamReceiver._durable

    def then_die(self: StreamReceiver, frames: list[Any]) -> None:
        acknowledge(self, frames)
        if self.file.state.next_seq > chunks:
            raise Killed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StreamReceiver, "_durable", then_die)
        with pytest.raises(Killed):
            receive_stream(params_as(broker, "consumer"), q, out, stream_id=sid, options=ReceiveOptions(**OPTS))


def _dead_letters(broker: EmbeddedBroker, q: str, sid: str) -> list[Any]:
    admin, name = params_as(broker, None), Destination.parse(q).name
    return browse(admin, f"/queue/DLQ.{name}", 2) + browse(admin, f"/queue/DLQ.{name}.amqs.producer.{sid}", 2)


def test_a_retry_elsewhere_leaves_the_chunks_and_the_first_worker_finishes(acl_broker: EmbeddedBroker,
                                                                          tmp_path: Path) -> None:
    q, dest = FIRST_Q, Destination.parse(FIRST_Q)
    src = make_file(tmp_path / "big.bin", 40 * CHUNK + 17, seed=1)
    sid = "moved-real-1"
    worker1, worker2 = tmp_path / "worker1" / "in", tmp_path / "worker2" / "in"
    _send_half_then_all(acl_broker, q, src, sid)
    _receive_and_die(acl_broker, q, worker1, sid, 8)
    [note] = browse(params_as(acl_broker, None), dest.held_queue(sid), 2)
    assert note.headers[hdr.H_HELD_DIR] == str(worker1.resolve())
    assert note.headers[hdr.H_HELD_HOST] == socket.gethostname()
    sha = _finish(acl_broker, q, src, sid)

    with pytest.raises(StreamElsewhere) as err:
        receive_stream(params_as(acl_broker, "consumer"), q, worker2, stream_id=sid, options=ReceiveOptions(**OPTS))
    text = str(err.value)
    assert f"directory {worker1.resolve()} (partial file {worker1.resolve() / '.amqstream' / (sid + '.part')}" in text
    assert f"--out-dir {worker1.resolve()} --stream-id {sid}" in text and "--restart" in text, text
    assert not _dead_letters(acl_broker, q, sid)
    assert not (worker2 / ".amqstream" / f"{sid}.part").exists()
    # `amqstream streams show` tells where the data is, with no access to that directory.
    report = render_report(show_stream(params_as(acl_broker, None), q, sid))
    assert f"partial data held by a receiver on host {socket.gethostname()} in {worker1.resolve()}" in report, report

    got = receive_stream(params_as(acl_broker, "consumer"), q, worker1, stream_id=sid, options=ReceiveOptions(**OPTS))
    assert got is not None and got.sha256 == sha == sha256_file(src) and got.resumed_from >= 8 * CHUNK
    assert Path(got.path or "").read_bytes() == src.read_bytes()
    assert browse(params_as(acl_broker, None), dest.held_queue(sid), 2) == []


def test_without_a_note_the_retry_keeps_its_part_and_a_resend_completes_it(acl_broker: EmbeddedBroker,
                                                                          tmp_path: Path) -> None:
    q = RESEND_Q
    src = make_file(tmp_path / "big.bin", 40 * CHUNK + 17, seed=2)
    sid = "moved-real-2"
    worker1, worker2 = tmp_path / "worker1" / "in", tmp_path / "worker2" / "in"
    _send_half_then_all(acl_broker, q, src, sid)
    _receive_and_die(acl_broker, q, worker1, sid, 8)
    with StompLink(params_as(acl_broker, None)) as link:  # as left by a receiver older than the notes
        assert holders.release(link, Destination.parse(q), sid) == 1
    _finish(acl_broker, q, src, sid)

    failures: list[StreamFailure] = []
    got = receive_streams(params_as(acl_broker, "consumer"), q, worker2, on_failure=failures.append,
                          options=ReceiveOptions(**{**OPTS, "wait_timeout": 5}))
    assert got == [] and [f.status for f in failures] == ["elsewhere"], failures
    assert "cannot be known" in failures[0].reason and "Nothing was dead-lettered" in failures[0].reason
    assert (worker2 / ".amqstream" / f"{sid}.part").exists()
    assert not _dead_letters(acl_broker, q, sid)

    # The sender sends the file again: worker2's directory takes only the chunks it lacks.
    sha = _finish(acl_broker, q, src, sid, restart=True)
    got_again = receive_stream(params_as(acl_broker, "consumer"), q, worker2, stream_id=sid,
                               options=ReceiveOptions(**OPTS))
    assert got_again is not None and got_again.sha256 == sha == sha256_file(src)
    assert Path(got_again.path or "").read_bytes() == src.read_bytes()
    assert got_again.bytes_transferred < src.stat().st_size
