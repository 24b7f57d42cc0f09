"""Identity from the broker: the shipped config makes ActiveMQ stamp every message with the
user it authenticated (``JMSXUserID`` on STOMP MESSAGE frames), a sender cannot forge that
stamp, and the event trigger reports it as the offer's ``sender``.

One broker with four users: ``alice`` and ``bob`` may only send to ``/queue/ident`` and its
per-test siblings, ``reader`` and ``forger`` may only receive from them.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stomp

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import (
    SendOptions,
    StreamFailure,
    default_stream_id,
    find_manifest,
    id_key,
    receive_streams,
    send_file,
    send_files,
)
from airflow_provider_amqstream.engine.receive.browse import Offer, OfferBrowser, parse_visible_offer
from airflow_provider_amqstream.engine.receive.claims import find_received
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions
from airflow_provider_amqstream.exceptions import AccessDenied
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger
from tests.helpers import (
    StompFrames,
    assert_old_gen_bounded,
    browse,
    free_port,
    make_file,
    params_as,
    play,
    running_broker,
    sha256_file,
    wait_for,
)

QUEUE = "/queue/ident"
# Each test that leaves or takes messages has its own destination, so none sees another's
# leftovers whatever order the tests run in.
FORGED_Q, STAMP_Q, IDS_Q, EVENTS_Q = (f"{QUEUE}.{name}" for name in ("forged", "stamp", "ids", "events"))
_ALL_Q = [QUEUE, FORGED_Q, STAMP_Q, IDS_Q, EVENTS_Q]
CONN_ID = "amqs_ident_reader"


@pytest.fixture(scope="module")
def ident_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path_factory.mktemp("ident") / "broker", {
        "alice": {"send": _ALL_Q}, "bob": {"send": _ALL_Q}, "reader": {"receive": _ALL_Q},
        "forger": {"receive": _ALL_Q}})


def _drain(params: BrokerParams, dest: str, count: int, timeout: float = 30.0) -> list[dict[str, str]]:
    """Take ``count`` messages off ``dest`` (acknowledged), returning their headers."""
    got = []
    with StompLink(params) as link:
        link.subscribe(dest, prefetch=count)
        while len(got) < count:
            frame = link.get(timeout)
            assert frame is not None, f"only {len(got)} of {count} messages arrived on {dest} within {timeout}s"
            link.ack(frame)
            got.append(dict(frame.headers))
    return got


def _raw_send(params: BrokerParams, dest: str, headers: dict[str, str], body: bytes = b"") -> None:
    """SEND one frame with exactly ``headers`` (any name, any value) and wait for the receipt."""
    listener = StompFrames()
    conn = stomp.Connection12([params.hosts[0]], auto_decode=False)
    conn.set_listener("frames", listener)
    conn.connect(params.login, params.password, wait=True)
    try:
        conn.send(dest, body, headers={**headers, "persistent": "true", "receipt": "sent"})
        kind, got = listener.frames.get(timeout=15)
        assert (kind, got.get("receipt-id")) == ("RECEIPT", "sent"), (kind, got)
    finally:
        conn.disconnect()


def test_sender_of_reads_the_broker_stamp_and_nothing_else() -> None:
    assert p.sender_of({"JMSXUserID": "alice", "amqs_stream": "s-1"}) == "alice"
    assert p.sender_of({}) == ""
    # What a sender chooses is not identity, however it is named.
    assert p.sender_of({"amqs_sender": "alice", "amqs_user": "alice", "login": "alice"}) == ""
    # Not something a broker stamps: unknown, not cut down to look like another user.
    for value in ("", "al\x00ice", "alice\n", "a" * (hdr.MAX_USER_ID + 1), 7, None):
        assert p.sender_of({"JMSXUserID": value}) == "", repr(value)
    assert p.sender_of({"JMSXUserID": "a" * hdr.MAX_USER_ID}) == "a" * hdr.MAX_USER_ID


def test_only_a_parked_offer_names_a_first_sender() -> None:
    """An offer a receiver parked (in the parked queue only receivers may write) is stamped
    with the receiver; it names the first sender, believed only for the parked queue."""
    parked = {"JMSXUserID": "reader", hdr.H_FIRST_SENDER: "alice"}
    assert p.sender_of(parked, parked=True) == "alice"
    assert p.sender_of(parked) == "reader"
    # A sender writing the header on the queue of offers gains nothing: the stamp is its own.
    assert p.sender_of({"JMSXUserID": "bob", hdr.H_FIRST_SENDER: "alice"}) == "bob"
    assert p.sender_of({"JMSXUserID": "reader", hdr.H_FIRST_SENDER: "al\x07ice"}, parked=True) == ""


def test_a_receive_only_user_cannot_publish_a_file_or_a_batch_as_another_sender(
        ident_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """``forger`` may only receive, so it may write the parked queue. With raw stomp.py it
    parks, due at once, an inline offer of ``payroll.csv`` and a batch listing it, both
    naming alice as their first sender. A receiver believes only the copies its own user
    parked: both are quarantined naming who parked them, nothing is published or recorded
    as alice's, and alice's own stream arrives. Before, the forger's bytes were published as
    ``payroll.csv``, recorded as alice's, with a manifest in alice's ``manifests/``."""
    dest = Destination.parse(FORGED_Q)
    forger = params_as(ident_broker, "forger")
    body = b"name,salary\nforger,1000000\n"
    spec = p.StreamSpec("payroll-1", "payroll.csv", len(body), 1024 * 1024, hdr.Mode.ATOMIC)
    inline, wire = bw.inline_offer(spec, dest, body, hashlib.sha256(body).hexdigest(), sender="alice")
    entry = {"stream_id": "payroll-1", "dir": "", "name": "payroll.csv", "bytes": len(body),
             "sha256": hashlib.sha256(body).hexdigest()}
    [(batch, listing)] = list(bw.iter_batch_messages("payroll-batch", [entry], len([entry])))
    for headers, data in ((inline, wire), (batch, listing)):
        _raw_send(forger, dest.parked_queue(),
                  p.parked_headers(headers, sender="alice", not_before=time.time() - 1, reason="forged"), data)
    src = make_file(tmp_path / "alice.csv", 5_000, seed=5)
    send_file(params_as(ident_broker, "alice"), src, FORGED_Q)
    out = tmp_path / "out"
    failures: list[StreamFailure] = []
    # Until all is quiet for a few sweeps of the parked queue (offers.SWEEP_PAUSE apart).
    got = receive_streams(params_as(ident_broker, "reader"), FORGED_Q, out, on_failure=failures.append,
                          options=ReceiveOptions(wait_timeout=6, idle_timeout=30))
    assert [r.name for r in got] == ["alice.csv"] and sha256_file(Path(got[0].path)) == sha256_file(src)
    assert sorted((f.stream_id, f.status) for f in failures) == [("payroll-1", "quarantined"),
                                                                  ("payroll-batch", "quarantined")]
    assert all("user 'forger' put it" in f.reason for f in failures), [f.reason for f in failures]
    assert not (out / "payroll.csv").exists() and find_manifest(out, "payroll-batch", "alice") is None
    assert not list(out.rglob("*.manifest.jsonl"))
    assert find_received(out, "payroll-1") is None, "recorded as received"
    assert browse(params_as(ident_broker, "reader"), dest.parked_queue()) == []
    assert_old_gen_bounded(ident_broker, "forged parked copies")


def test_a_pack_member_cannot_name_its_own_sender() -> None:
    """A pack's members are headers its sender wrote; the sender of each is the pack's stamp."""
    dest = Destination.parse(QUEUE)
    member = {**p.offer_headers(p.StreamSpec("m-1", "m.bin", 10, 10), dest, sender="bob"), "JMSXUserID": "alice",
              "timestamp": "1"}
    offer = parse_visible_offer(member, dest, stamped={"JMSXUserID": "bob", "timestamp": "1795000000000"})
    assert (offer.sender, offer.offered_at) == ("bob", 1795000000000)
    unstamped = parse_visible_offer(member, dest, stamped={"message-id": "ID:1"})
    assert (unstamped.sender, unstamped.offered_at) == (None, None)
    # Nor can a member name a first sender for a pack the receiver put back.
    claims = {**member, hdr.H_FIRST_SENDER: "alice", hdr.H_DATA_DEST: dest.data_queue("m-1", "reader")}
    requeued = parse_visible_offer(claims, dest, stamped={"JMSXUserID": "reader"})
    assert requeued.sender == "reader"


def test_the_shipped_config_has_the_broker_stamp_senders(tmp_path: Path) -> None:
    b = EmbeddedBroker(tmp_path / "b", port=free_port())
    b.render_config()
    xml = (tmp_path / "b" / "conf" / "activemq.xml").read_text()
    broker_element = xml[xml.index("<broker "):].split(">", 1)[0]
    assert 'populateJMSXUserID="true"' in broker_element
    assert 'useAuthenticatedPrincipalForJMSXUserID="true"' in broker_element


@pytest.mark.broker
def test_a_send_only_user_cannot_forge_its_identity(ident_broker: EmbeddedBroker) -> None:
    """alice writes ``JMSXUserID: admin`` (and, once, bob's name) on her SEND frames; the
    broker delivers each as alice's. The administrator's own message says who it is."""
    alice = params_as(ident_broker, "alice")
    offer_like = {hdr.H_KIND: "note"}
    _raw_send(alice, STAMP_Q, {**offer_like, "JMSXUserID": "admin"}, b"one")
    _raw_send(alice, STAMP_Q, {**offer_like, "JMSXUserID": "bob", "amqs_sender": "bob"}, b"two")
    _raw_send(params_as(ident_broker, None), STAMP_Q, offer_like, b"three")
    got = _drain(params_as(ident_broker, "reader"), STAMP_Q, 3)
    # In any order: with our jar the administrator's first offer outranks alice's second.
    assert sorted(h.get("JMSXUserID") for h in got) == ["alice", "alice", "amqstream"]
    assert sorted(p.sender_of(h) for h in got) == ["alice", "alice", "amqstream"]
    assert [h.get("JMSXUserID") for h in got if h.get("amqs_sender") == "bob"] == ["alice"]


@pytest.mark.broker
def test_another_user_cannot_take_a_default_stream_id_first(ident_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """bob knows alice's file (name, size, mtime) and where it goes, and offers, as a
    send-only user with raw stomp.py, the id it would get without a key, with data of his
    own, before alice sends. Alice's default id is keyed by her connection's secret, so it is
    not that one: her file arrives byte-exact under her own stream, and bob's under his."""
    alice, bob = params_as(ident_broker, "alice"), params_as(ident_broker, "bob")
    src = make_file(tmp_path / "report.csv", 50_000, seed=3)
    guess = default_stream_id(src, IDS_Q)
    junk = b"bob's data, not alice's"
    play(bob, IDS_Q, p.StreamSpec(guess, "report.csv", len(junk), len(junk)), junk, [1])
    sent = send_file(alice, src, IDS_Q)
    assert sent.stream_id == default_stream_id(src, IDS_Q, key=id_key(alice)) != guess
    out = tmp_path / "out"
    got = receive_streams(params_as(ident_broker, "reader"), IDS_Q, out, count=2,
                          options=ReceiveOptions(wait_timeout=30, idle_timeout=30))
    by_id = {r.stream_id: r for r in got}
    assert set(by_id) == {guess, sent.stream_id}
    assert sha256_file(Path(by_id[sent.stream_id].path)) == sha256_file(src)
    assert Path(by_id[guess].path).read_bytes() == junk
    assert (by_id[sent.stream_id].sender, by_id[guess].sender) == ("alice", "bob")


@pytest.mark.broker
def test_an_ordinary_user_cannot_write_advisory_topics_on_a_lone_broker(ident_broker: EmbeddedBroker) -> None:
    """Without a network there are no advisories, and no user but the administrator may
    write where they would be."""
    with StompLink(params_as(ident_broker, "alice")) as link, pytest.raises(AccessDenied, match="refused user alice"):
        link.send_confirmed("/topic/ActiveMQ.Advisory.Consumer.Queue.ident", b"x", {})


async def _events(trigger: StreamOfferedTrigger, count: int, timeout: float) -> list[dict[str, Any]]:
    """The payloads of the first ``count`` events ``trigger`` fires."""
    payloads: list[dict[str, Any]] = []
    run = trigger.run()

    async def take() -> None:
        async for event in run:
            payloads.append(event.payload)
            if len(payloads) == count:
                return

    try:
        await asyncio.wait_for(take(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"{len(payloads)} of {count} events within {timeout}s: {payloads}") from None
    finally:
        await run.aclose()
    return payloads


@pytest.mark.broker
def test_the_event_trigger_reports_the_authenticated_sender(ident_broker: EmbeddedBroker, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Offers from two users, two of them packed and one forged, and one the receiving user
    put back in the queue: each event's sender is the user the broker authenticated,
    whatever the offer's headers say, except that the receiving user's own copy names its
    first sender."""
    alice, bob = params_as(ident_broker, "alice"), params_as(ident_broker, "bob")
    by_alice = send_file(alice, make_file(tmp_path / "a.bin", 300_000, seed=1), EVENTS_Q,
                         SendOptions(mode="atomic", chunk_size=2**17), stream_id="from-alice")
    packed = send_files(bob, [make_file(tmp_path / "small" / f"b{i}.bin", 2000 + i, seed=10 + i) for i in range(2)],
                        EVENTS_Q).results
    # bob's offer claiming to be alice's, in every header a sender writes.
    dest = Destination.parse(EVENTS_Q)
    forged = p.offer_headers(p.StreamSpec("bob-as-alice", "f.bin", 10, 10, hdr.Mode.ATOMIC), dest, sender="bob")
    _raw_send(bob, EVENTS_Q, {**forged, "JMSXUserID": "alice", "amqs_sender": "alice", hdr.H_FIRST_SENDER: "alice"})
    # Naming alice's data queue as well makes it an invalid offer, which fires nothing.
    _raw_send(bob, EVENTS_Q, p.offer_headers(p.StreamSpec("bob-in-alice", "f.bin", 10, 10, hdr.Mode.ATOMIC), dest,
                                          sender="alice"))
    assert sum(bw.is_pack(f.headers) for f in browse(params_as(ident_broker, None), EVENTS_Q)) == 1, \
        "bob's files not packed"

    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", ident_broker.info(user="reader").uri)
    trigger = StreamOfferedTrigger(destination=EVENTS_Q, amqstream_conn_id=CONN_ID, poll_interval=0.1, pace=0)
    events = asyncio.run(_events(trigger, 4, 60))
    senders = {e["stream_id"]: e["sender"] for e in events}
    assert senders == {by_alice.stream_id: "alice", packed[0].stream_id: "bob", packed[1].stream_id: "bob",
                       "bob-as-alice": "bob"}
    [filed] = wait_for(lambda: [f for f in browse(params_as(ident_broker, None), f"/queue/DLQ.{dest.name}")
                                if f.headers.get(hdr.H_STREAM) == "bob-in-alice"], 30,
                    "the watcher to file bob-in-alice")
    assert "for its sender 'bob'" in filed.headers[hdr.H_QUARANTINE_REASON]


def test_the_trigger_says_once_when_the_broker_stamps_no_sender(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """On a broker that does not stamp (an external one without populateJMSXUserID) events
    carry ``sender`` None, and the trigger's log says why, once."""
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", "amqstream://reader:reader-secret-pw@127.0.0.1:1")
    unstamped = [Offer(f"s-{i}", f"f{i}.bin", 10, 1, "atomic", QUEUE, None, None) for i in range(3)]
    monkeypatch.setattr(OfferBrowser, "look", lambda self, *a, **k: unstamped)
    monkeypatch.setattr(OfferBrowser, "close", lambda self: None)
    trigger = StreamOfferedTrigger(destination=QUEUE, amqstream_conn_id=CONN_ID, poll_interval=0.1, pace=0)
    events = asyncio.run(_events(trigger, 3, 30))
    assert [e["sender"] for e in events] == [None, None, None]
    out = capsys.readouterr()
    notes = [line for line in (out.out + out.err).splitlines() if "carry no sender" in line]
    assert len(notes) == 1 and "populateJMSXUserID" in notes[0], notes
    assert "reader-secret-pw" not in out.out + out.err
