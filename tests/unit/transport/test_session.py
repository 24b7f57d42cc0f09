"""Transport pieces that need no broker: URI parsing, the linear frame reader, the inbox."""

from __future__ import annotations

import os
import re
import threading
from urllib.parse import quote

import pytest
from stomp.utils import Frame

from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.transport.connection import FastTransport
from airflow_provider_amqstream.transport.inbox import Inbox
from airflow_provider_amqstream.transport.params import BrokerParams


def test_uri_with_failover_hosts_and_options() -> None:
    bp = params_from_uri("amqstream://us%40r:p%3Ass@mq1,mq2:61614?tls=true&window=8&heartbeat_ms=0")
    assert bp.hosts == (("mq1", 61614), ("mq2", 61614))
    assert (bp.login, bp.password, bp.tls, bp.window, bp.heartbeat_ms) == ("us@r", "p:ss", True, 8, 0)
    assert "p:ss" not in repr(bp) and "p:ss" not in bp.url


def test_extra_hosts_list_overrides_host() -> None:
    bp = BrokerParams.from_parts("ignored", 61613, None, None, {"hosts": "a:1,b"})
    assert bp.hosts == (("a", 1), ("b", 61613))


def test_bad_scheme_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'http' is not an amqstream one; accepted: amqstream://"):
        params_from_uri("http://x")


class _Wire:
    """A socket stand-in: recv and recv_into serve the same byte stream in small pieces."""

    def __init__(self, data: bytes, piece: int) -> None:
        self.data, self.pos, self.piece = data, 0, piece

    def recv(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + min(n, self.piece)]
        self.pos += len(out)
        return out

    def recv_into(self, view: memoryview) -> int:
        out = self.recv(len(view))
        view[:len(out)] = out
        return len(out)


class _FakeTransport(FastTransport):
    def __init__(self, data: bytes, piece: int = 777) -> None:
        super().__init__([("127.0.0.1", 1)])
        self.socket = _Wire(data, piece)
        self.running = True

    def receive(self) -> bytes:
        return self.socket.recv(1 << 20)


def _frame(body: bytes, cmd: bytes = b"MESSAGE") -> bytes:
    return cmd + b"\nfoo:bar\ncontent-length:" + str(len(body)).encode() + b"\n\n" + body + b"\x00"


def _read_all(t: _FakeTransport, want: int) -> list:
    got: list = []
    while len([f for f in got if f.cmd != "heartbeat"]) < want:
        got.extend(t._amqs_read())
    return got


@pytest.mark.parametrize("piece", [1, 777, 1 << 20])
def test_frames_with_nul_bodies_split_across_reads(piece: int) -> None:
    bodies = [os.urandom(100_000) + b"\x00" * 10, b"", b"\x00\x00\n\n\x00", b"\r\n\r\n" * 5]
    t = _FakeTransport(b"\n" + b"\n".join(_frame(b) for b in bodies), piece)
    got = _read_all(t, len(bodies))
    frames = [f for f in got if f.cmd != "heartbeat"]
    assert [bytes(f.body) for f in frames] == bodies
    assert all(f.headers["foo"] == "bar" and f.cmd == "MESSAGE" for f in frames)
    assert got[0].cmd == "heartbeat"  # the leading EOL is reported as a heart-beat


def test_frame_without_content_length_ends_at_nul() -> None:
    t = _FakeTransport(b"RECEIPT\nreceipt-id:r-1\n\n\x00")
    [frame] = t._amqs_read()
    assert frame.cmd == "RECEIPT" and frame.headers["receipt-id"] == "r-1" and frame.body == b""


@pytest.mark.parametrize("piece", [1000, 1 << 20])
@pytest.mark.parametrize("tls", [False, True])
def test_an_oversized_header_section_is_read_past_and_marked(piece: int, tls: bool) -> None:
    """ActiveMQ accepts a header section far over our 64 KiB cap (10 KiB per header, many of
    them). Dropping the connection made the broker hand us the same message for ever; the
    frame is delivered instead, its big headers dropped and the frame marked."""
    big = b"".join(b"junk%d:%s\n" % (i, b"x" * 10_000) for i in range(20))  # ~200 KiB
    huge_line = b"one:" + b"y" * 100_000 + b"\n"  # one header longer than the cap by itself
    body = os.urandom(5000) + b"\x00"
    hostile = (b"MESSAGE\n" + big + b"ack:a-1\n" + huge_line + b"content-length:" + str(len(body)).encode()
               + b"\nsubscription:s-1\n\n" + body + b"\x00")
    t = _FakeTransport(hostile + _frame(b"next"), piece)
    t.blocking = not tls
    frames = [f for f in _read_all(t, 2) if f.cmd != "heartbeat"]
    assert [f.cmd for f in frames] == ["MESSAGE", "MESSAGE"]
    cut, nxt = frames
    assert "amqs_truncated" in cut.headers and bytes(cut.body) == body
    assert cut.headers["ack"] == "a-1" and cut.headers["subscription"] == "s-1" and "one" not in cut.headers
    assert len(b"".join(k.encode() + v.encode() for k, v in cut.headers.items())) <= 70 * 1024
    assert bytes(nxt.body) == b"next" and "amqs_truncated" not in nxt.headers


def test_absurd_content_length_is_refused_without_allocating() -> None:
    from stomp.exception import ConnectionClosedException

    t = _FakeTransport(b"MESSAGE\ncontent-length:99999999999\n\n")
    with pytest.raises(ConnectionClosedException):
        t._amqs_read()


def _deliver_in_thread(inbox: Inbox, frame: Frame) -> threading.Event:
    done = threading.Event()
    threading.Thread(target=lambda: (inbox.on_message(frame), done.set()), daemon=True).start()
    return done


def test_inbox_holds_the_reader_while_the_consumer_is_behind() -> None:
    inbox = Inbox()
    inbox.MAX_HOLD = 60
    inbox.on_message(Frame("MESSAGE", {}, bytearray(inbox.HIGH_WATER + 1)))  # below the mark: at once
    done = _deliver_in_thread(inbox, Frame("MESSAGE", {}, b"next"))
    assert not done.wait(0.3), "the reader was not held back with the consumer a window behind"
    inbox.taken(inbox.messages.get_nowait())
    assert done.wait(10), "taking a frame did not release the reader"
    assert inbox.held == 4


def test_inbox_never_holds_the_reader_while_a_receipt_is_awaited() -> None:
    inbox = Inbox()
    inbox.MAX_HOLD = 60
    inbox.on_message(Frame("MESSAGE", {}, bytearray(inbox.HIGH_WATER + 1)))
    inbox.receipt_waiters = 1  # the receipt may be behind this frame on the wire
    assert _deliver_in_thread(inbox, Frame("MESSAGE", {}, b"next")).wait(10)


def test_inbox_hold_is_bounded() -> None:
    inbox = Inbox()
    inbox.MAX_HOLD = 0.05
    inbox.on_message(Frame("MESSAGE", {}, bytearray(inbox.HIGH_WATER + 1)))
    assert _deliver_in_thread(inbox, Frame("MESSAGE", {}, b"next")).wait(10)
    assert inbox.messages.qsize() == 2


def test_a_refused_connect_waits_for_the_brokers_reason() -> None:
    # stomp.py wakes connect(wait=True) before the listener sees the ERROR frame; the
    # reason must still be the broker's, not "did not complete the handshake".
    inbox = Inbox()
    refusal = Frame("ERROR", {"message": "User name [x] or password is invalid."}, b"")
    threading.Timer(0.2, inbox.on_error, [refusal]).start()
    inbox.await_connected(timeout=30)
    assert inbox.errors == ["User name [x] or password is invalid."]


def test_waiting_for_a_refusal_ends_with_the_socket() -> None:
    inbox = Inbox()
    threading.Timer(0.2, inbox.on_disconnected).start()
    inbox.await_connected(timeout=30)
    assert inbox.lost and not inbox.errors


@pytest.mark.parametrize("secret", ["Zq#9k", "Zq/9k", "Zq?9k", "Xy#Zq/9k?Wv"])
def test_a_password_with_reserved_characters_is_never_echoed(secret: str) -> None:
    with pytest.raises(ValueError) as err:
        params_from_uri(f"amqstream://user:{secret}@mq.example.com:61613?heartbeat_ms=0")
    text = str(err.value)
    assert "percent-encoded" in text
    for piece in {secret, *[s for s in re.split(r"[#/?@]", secret) if len(s) > 1]}:
        assert piece not in text, piece
    # Percent-encoded, the same password works.
    good = params_from_uri("amqstream://user:" + quote(secret, safe="") + "@mq.example.com:61613")
    assert good.password == secret


def test_bad_numbers_in_the_extras_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"connection extra 'heartbeat_ms' must be a whole number, got 'abc'"):
        BrokerParams.from_parts("h", 61613, None, None, {"heartbeat_ms": "abc"})
    with pytest.raises(ValueError, match=r"connection extra 'receipt_timeout' must be a number"):
        BrokerParams.from_parts("h", 61613, None, None, {"receipt_timeout": "soon"})
    with pytest.raises(ValueError, match=r"broker host 'b:x': the port must be a number"):
        BrokerParams.from_parts("a,b:x", 61613, None, None, {})


def test_a_content_length_in_other_digits_closes_instead_of_crashing() -> None:
    from stomp.exception import ConnectionClosedException

    t = _FakeTransport(b"MESSAGE\ncontent-length:\xc2\xb2\n\nxx\x00")  # "²": isdigit() but not int()
    with pytest.raises(ConnectionClosedException):
        t._amqs_read()


def test_a_flow_control_refusal_is_a_full_destination_said_once() -> None:
    from airflow_provider_amqstream.exceptions import DestinationFull, TransportError
    from airflow_provider_amqstream.transport.errors import reported

    params = params_from_uri("stomp://127.0.0.1:61613")
    inbox = Inbox()
    # As ActiveMQ 5.17 words it (from a broker log).
    refusal = ("Usage Manager Memory Limit Wait Timeout. Stopping producer (ID:vm-1:12:-1:1) to prevent flooding "
               "queue://bulk.in. See http://activemq.apache.org/producer-flow-control.html for more info: "
               "javax.jms.ResourceAllocationException: Usage Manager Memory Limit Wait Timeout")
    for _ in range(3):  # one ERROR frame per refused message
        inbox.on_error(Frame("ERROR", {"message": refusal}, b""))
    exc = reported(params, inbox.errors)
    assert isinstance(exc, DestinationFull)
    assert "memory limit" in str(exc) and "stomp://127.0.0.1:61613" in str(exc)
    assert "refused messages to /queue/bulk.in (" in str(exc) and str(exc).count("ResourceAllocationException") == 1
    other = Inbox()
    other.on_error(Frame("ERROR", {"message": "Invalid selector"}, b""))
    assert type(reported(params, other.errors)) is TransportError


class _Trickle:
    """A blocking socket that takes at most ``piece`` bytes per sendmsg, as the kernel may."""

    def __init__(self, piece: int) -> None:
        self.piece, self.out, self.calls = piece, bytearray(), 0

    def sendmsg(self, parts: list[memoryview]) -> int:
        self.calls += 1
        data = b"".join(bytes(p) for p in parts)[:self.piece]
        self.out += data
        return len(data)

    def sendall(self, data: bytes) -> None:
        self.out += data


@pytest.mark.parametrize("piece", [1, 4093, 1 << 21])
def test_a_body_goes_out_without_a_joined_copy_and_whole_after_partial_sends(piece: int) -> None:
    t = FastTransport([("127.0.0.1", 1)])
    t.socket = _Trickle(piece)  # type: ignore[assignment]
    body = os.urandom(20_000 if piece == 1 else 300_000)
    t.transmit(Frame("SEND", {"destination": "/queue/q"}, body))
    t.transmit(Frame("ACK", {"id": "1"}, None))  # no body: stomp.py's own path
    sent = bytes(t.socket.out)  # type: ignore[attr-defined]
    assert t.socket.calls >= min(len(sent) // piece, 1)  # type: ignore[attr-defined]  # header, body, NUL: no join
    ack = b"ACK\nid:1\n\n\x00"
    assert sent.endswith(ack)
    reread = _FakeTransport(sent[:-len(ack)])
    [frame] = reread._amqs_read()
    assert (frame.cmd, frame.headers["destination"], bytes(frame.body)) == ("SEND", "/queue/q", body)


def test_a_body_buffer_is_reused_only_once_nobody_holds_it() -> None:
    bodies = [os.urandom(200_000) for _ in range(6)]
    t = _FakeTransport(b"".join(_frame(b) for b in bodies), piece=1 << 16)
    kept = _read_all(t, 1)
    for want in bodies[1:]:
        got = [f for f in t._amqs_read() if f.cmd != "heartbeat"]
        assert [bytes(f.body) for f in got] == [want]
        del got  # the engine drops a chunk once it is written
    # The first frame, still held, kept its bytes; the dropped ones shared one buffer.
    assert bytes(kept[0].body) == bodies[0]
    assert len({id(b) for b in t._amqs_bodies}) == len(t._amqs_bodies) == 2


def test_the_cap_on_a_senders_quarantine_destinations_is_said_as_such() -> None:
    from airflow_provider_amqstream.exceptions import DestinationFull
    from airflow_provider_amqstream.transport.errors import reported

    params = params_from_uri("stomp://admin:pw@127.0.0.1:61613")
    text = str(reported(params, ["The maxmimum number of destinations allowed (3) for the policy "
                                 "queue://DLQ.qcap.a.amqs.mallory.> has already been reached."]))
    assert "quarantine destination for /queue/qcap.a" in text and "data queue" not in text, text
    assert "3 quarantined streams of sender mallory" in text and "streams discard ID --from /queue/qcap.a" in text
    assert "users add mallory" in text and "refused user admin" in text
    exc = reported(params, ["The maxmimum number of destinations allowed (5) for the policy queue://in.amqs.bob.> "
                            "has already been reached."])
    assert isinstance(exc, DestinationFull)
    assert "a new data queue: 5 of its streams already wait on /queue/in" in str(exc)
