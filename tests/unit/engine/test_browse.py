"""The offer watcher on the in-memory link: what it reports, and the junk it files away so
that nothing on the queue of offers can hide a stream from it (the real broker's paging,
which makes that matter, is proved in tests/integration/test_event_trigger.py)."""

from __future__ import annotations

import pytest

from airflow_provider_amqstream.engine.receive.browse import OfferBrowser
from airflow_provider_amqstream.exceptions import AccessDenied
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker

Q = "/queue/watched"
DEST = Destination.parse(Q)


def offer(broker: MemoryBroker, user: str, stream_id: str) -> None:
    with open_link(broker.params(user)) as link:
        link.send(Q, b"", p.offer_headers(p.StreamSpec(stream_id, f"{stream_id}.bin", 10, 10), DEST, sender=user))


def test_junk_is_quarantined_and_offers_are_reported(broker: MemoryBroker) -> None:
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"hello", {})  # no amqstream header at all
        link.send(Q, b"", {hdr.H_KIND: "offer", hdr.H_STREAM: "no-version"})
        link.send(Q, b"", {hdr.H_KIND: "data", hdr.H_STREAM: "wrong-kind"})
        link.send(Q, b"not a pack", {hdr.H_KIND: "pack", "amqs_pack_ids": "|x|"})
    offer(broker, "alice", "good-1")
    browser = OfferBrowser(broker.params("receiver"), Q)
    try:
        assert [o.stream_id for o in browser.look()] == ["good-1"]
        assert browser.quarantined == 4
        left = broker.messages(Q)
        assert [h.get(hdr.H_STREAM) for h, _ in left] == ["good-1"]  # the offer stays for its receiver
        filed = broker.messages("/queue/DLQ.watched")
        assert len(filed) == 4
        assert all(h[hdr.H_QUARANTINED_FROM] == Q and "seen by a watcher" in h[hdr.H_QUARANTINE_REASON]
                   for h, _ in filed)
        assert {h.get(hdr.H_STREAM) for h, _ in filed} >= {"no-version", "wrong-kind"}
        assert [o.sender for o in browser.look()] == ["alice"]
        assert browser.quarantined == 4
    finally:
        browser.close()


def test_batch_messages_and_reoffers_are_left_alone(broker: MemoryBroker) -> None:
    entry = {"stream_id": "s-1", "dir": "", "name": "a.txt", "bytes": 3, "sha256": "0" * 64}
    with open_link(broker.params("alice")) as link:
        for headers, body in list(bw.iter_batch_messages("b-1", [entry], len([entry]))):
            link.send(Q, body, headers)
        again = p.offer_headers(p.StreamSpec("again", "again.bin", 10, 10), DEST, sender="alice")
        link.send(Q, b"", {**again, hdr.H_REOFFER: "1"})
    browser = OfferBrowser(broker.params("receiver"), Q)
    try:
        assert browser.look() == []
        assert browser.quarantined == 0
        assert len(broker.messages(Q)) == 2
    finally:
        browser.close()


def test_a_watcher_the_broker_refuses_keeps_watching(broker: MemoryBroker, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    with open_link(broker.params("mallory")) as link:
        link.send(Q, b"junk", {})
    offer(broker, "alice", "good-2")
    browser = OfferBrowser(broker.params("receiver"), Q)
    browser.quarantine = "/queue/readonly"
    link = browser._session()
    sent = link.send_confirmed

    def refuse(destination: str, body: bytes, headers: dict[str, str]) -> None:
        if destination == "/queue/readonly":  # as a broker without write on it answers
            raise AccessDenied(f"User receiver is not authorized to write to: queue://{destination[7:]}")
        sent(destination, body, headers)

    monkeypatch.setattr(link, "send_confirmed", refuse)
    try:
        assert [o.stream_id for o in browser.look()] == ["good-2"]
        assert browser.quarantined == 0
        assert len(broker.messages(Q)) == 2  # the junk stays; nothing is lost
        assert [o.stream_id for o in browser.look()] == ["good-2"]
        refusals = [r for r in caplog.records if "cannot quarantine" in r.getMessage()]
        assert len(refusals) == 1 and "write on /queue/readonly" in refusals[0].getMessage()
    finally:
        browser.close()
