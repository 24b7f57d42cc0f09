"""Transport pieces that need no broker: URI parsing and the linear frame reader."""

from __future__ import annotations

import os

import pytest

from airflow_provider_amqstream.transport import BrokerParams, _FastTransport


def test_uri_with_failover_hosts_and_options() -> None:
    bp = BrokerParams.from_uri("amqstream://us%40r:p%3Ass@mq1,mq2:61614?tls=true&window=8&heartbeat_ms=0")
    assert bp.hosts == (("mq1", 61614), ("mq2", 61614))
    assert (bp.login, bp.password, bp.tls, bp.window, bp.heartbeat_ms) == ("us@r", "p:ss", True, 8, 0)
    assert "p:ss" not in repr(bp) and "p:ss" not in bp.url


def test_extra_hosts_list_overrides_host() -> None:
    bp = BrokerParams.from_parts("ignored", 61613, None, None, {"hosts": "a:1,b"})
    assert bp.hosts == (("a", 1), ("b", 61613))


def test_bad_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match="not an amqstream URI"):
        BrokerParams.from_uri("http://x")


class _FakeSock(_FastTransport):
    """The reader fed from a list of byte strings instead of a socket."""

    def __init__(self, pieces: list[bytes]) -> None:
        super().__init__([("127.0.0.1", 1)])
        self._pieces = list(pieces)
        self.running = True

    def receive(self) -> bytes:
        return self._pieces.pop(0) if self._pieces else b""


def _frame(body: bytes, cmd: bytes = b"MESSAGE") -> bytes:
    return cmd + b"\nfoo:bar\ncontent-length:" + str(len(body)).encode() + b"\n\n" + body + b"\x00"


def test_frames_with_nul_bodies_split_across_reads() -> None:
    bodies = [os.urandom(100_000) + b"\x00" * 10, b"", b"\x00\x00\n\n\x00"]
    stream = b"\n" + b"\n".join(_frame(b) for b in bodies)
    pieces = [stream[i:i + 777] for i in range(0, len(stream), 777)]
    t = _FakeSock(pieces)
    got: list[bytes] = []
    while len([f for f in got if f != b"\n"]) < 3:
        got.extend(t._BaseTransport__read())
    frames = [f for f in got if f != b"\n"]
    assert [f.split(b"\n\n", 1)[1] for f in frames] == bodies
    assert got[0] == b"\n"  # the leading EOL is reported as a heart-beat


def test_frame_without_content_length_ends_at_nul() -> None:
    t = _FakeSock([b"RECEIPT\nreceipt-id:r-1\n\n", b"\x00"])
    assert t._BaseTransport__read() == [b"RECEIPT\nreceipt-id:r-1\n\n"]
