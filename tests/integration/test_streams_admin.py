"""``amqstream streams ls|show|redrive|discard`` on a real broker.

One destination is brought into every state a stream can be in, by real senders (raw STOMP)
and real receivers: a stream offered and waiting, one in progress (its partial data in the
receiver's directory, held by a receiver), one parked after its sender went silent, one
quarantined over ``max_bytes`` (redriven, then received byte-exact with a higher limit), one
quarantined for a corrupt chunk (never redriven), one over ``max_bytes`` whose sender never
finished (refused after its chunks were checked), and an incomplete batch. The commands run
as the real CLI; what they did is checked by browsing every queue involved.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import stomp

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, StreamQuarantined, StreamStalled, receive_stream
from airflow_provider_amqstream.engine import inventory as inv
from airflow_provider_amqstream.engine.discard import discard
from airflow_provider_amqstream.engine.queue_tools import H_SWEEP, QueueSession, move_queue, take_matching
from airflow_provider_amqstream.engine.receive.session import receive_streams
from airflow_provider_amqstream.engine.redrive import RedriveRefused, redrive
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import quarantine as qr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import RawSender, assert_old_gen_bounded, browse, cli, params_as, play, running_broker, wait_for

pytestmark = pytest.mark.broker

CHUNK = 1000


def _data(n: int, seed: int) -> bytes:
    out = b""
    block = hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block
    return out[:n]


def _spec(sid: str, size: int) -> p.StreamSpec:
    return p.StreamSpec(sid, f"{sid}.bin", size, CHUNK)


def _run(*args: str, timeout: float = 120) -> tuple[int, str, str]:
    proc = cli(*args)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _ids(rows: list[dict[str, Any]]) -> set[str]:
    return {r["stream_id"] for r in rows}


@dataclasses.dataclass
class Scene:
    queue: str
    out: Path
    data: dict[str, bytes]


def build_scene(params: BrokerParams, queue_name: str, out: Path) -> Scene:
    """One destination with a stream in every state (see the module doc); the receiver's
    directory is ``out``."""
    data = {sid: _data(size, n) for n, (sid, size) in enumerate(
        [("parked-1", 3 * CHUNK), ("big-1", 4 * CHUNK + 7), ("bad-1", 3 * CHUNK), ("cut-1", 5 * CHUNK),
         ("b1", 1500), ("wait-1", 2 * CHUNK + 1)])}
    q = queue_name
    # A sender that stops after its first chunk: the receiver yields (parks it) after the idle
    # timeout and keeps the chunk it has.
    play(params, q, _spec("parked-1", 3 * CHUNK), data["parked-1"], [1], end=False)
    with pytest.raises(StreamStalled):
        receive_stream(params, q, out, stream_id="parked-1",
                       options=ReceiveOptions(wait_timeout=10, idle_timeout=0.5))
    # Over the receiver's limit: quarantined at its offer, its chunks left on its data queue.
    play(params, q, _spec("big-1", 4 * CHUNK + 7), data["big-1"], [1, 2, 3, 4, 5])
    with pytest.raises(StreamQuarantined, match="max_bytes"):
        receive_stream(params, q, out, stream_id="big-1", options=ReceiveOptions(wait_timeout=10, max_bytes=1000))
    # A corrupt chunk: quarantined, its chunks refused (to the broker's DLQ).
    def corrupt(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (b"X" + body[1:]) if seq == 2 else body

    play(params, q, _spec("bad-1", 3 * CHUNK), data["bad-1"], [1, 2, 3], tamper=corrupt)
    with pytest.raises(StreamQuarantined, match="CRC"):
        receive_stream(params, q, out, stream_id="bad-1", options=ReceiveOptions(wait_timeout=10))
    # Over the limit, and its sender never finished: chunks 4, 5 and the end marker missing.
    play(params, q, _spec("cut-1", 5 * CHUNK), data["cut-1"], [1, 2, 3], end=False)
    with pytest.raises(StreamQuarantined):
        receive_stream(params, q, out, stream_id="cut-1", options=ReceiveOptions(wait_timeout=10, max_bytes=1000))
    # A batch of two files of which one arrives: incomplete in the receiver's directory.
    play(params, q, _spec("b1", 1500), data["b1"], [1, 2])
    raw = RawSender(params)
    entries = [{"stream_id": "b1", "dir": "", "name": "b1.bin", "bytes": 1500,
                "sha256": hashlib.sha256(data["b1"]).hexdigest()},
               {"stream_id": "b2", "dir": "", "name": "b2.bin", "bytes": 10, "sha256": "0" * 64}]
    for headers, body in list(bw.iter_batch_messages("batch-7", entries, len(entries))):
        raw.send(q, body, headers)
    raw.close()
    got = receive_streams(params, q, out, options=ReceiveOptions(wait_timeout=2))
    assert [r.stream_id for r in got] == ["b1"]
    # And one offered that nobody took yet.
    play(params, q, _spec("wait-1", 2 * CHUNK + 1), data["wait-1"], [1, 2, 3])
    return Scene(q, out, data)


@pytest.fixture
def scene(params: BrokerParams, queue_name: str, tmp_path: Path) -> Scene:
    return build_scene(params, queue_name, tmp_path / "in")


@pytest.fixture
def held(scene: Scene) -> Iterator[Path]:
    """parked-1's partial file held as a receiver holds it while receiving."""
    part = scene.out / ".amqstream" / "parked-1.part"
    fd = os.open(part, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield part
    finally:
        os.close(fd)


def test_ls_shows_every_state_of_a_destination(scene: Scene, uri: str, params: BrokerParams, held: Path) -> None:
    code, out, err = _run("streams", "ls", "--conn", uri, "--from", scene.queue, "--out-dir", str(scene.out),
                          "--json")
    assert code == 0, err
    view = json.loads(out)
    assert view["destination"] == scene.queue
    offered = {o["stream_id"]: o for o in view["offered"]}
    assert set(offered) == {"wait-1"}, view["offered"]
    assert offered["wait-1"]["size"] == 2 * CHUNK + 1 and offered["wait-1"]["name"] == "wait-1.bin"
    assert offered["wait-1"]["sender"] == params.login and offered["wait-1"]["offered_at"]
    parked = {x["stream_id"]: x for x in view["parked"]}
    assert set(parked) == {"parked-1"}
    assert parked["parked-1"]["yields"] == 1 and "nothing arrived" in parked["parked-1"]["reason"]
    assert parked["parked-1"]["first_sender"] == params.login and parked["parked-1"]["not_before"] > view["taken_at"]
    quarantined = {x["stream_id"]: x for x in view["quarantined"]}
    assert set(quarantined) == {"big-1", "bad-1", "cut-1"}
    assert quarantined["big-1"]["cause"] == "max_bytes" and quarantined["big-1"]["redrivable"]
    assert quarantined["bad-1"]["cause"] == "corrupt" and not quarantined["bad-1"]["redrivable"]
    assert quarantined["big-1"]["by_user"] == params.login and quarantined["big-1"]["at"]
    progress = {x["stream_id"]: x for x in view["in_progress"]}
    assert set(progress) == {"parked-1"}
    assert progress["parked-1"]["durable_bytes"] == CHUNK and progress["parked-1"]["size"] == 3 * CHUNK
    assert progress["parked-1"]["receiving_now"] is True and progress["parked-1"]["percent"] == pytest.approx(33.3, 0.1)
    assert view["taken_at"] - 120 < progress["parked-1"]["since"] <= progress["parked-1"]["last_progress_at"]
    (batch,) = view["batches"]
    assert (batch["batch_id"], batch["files_in"], batch["files_announced"]) == ("batch-7", 1, 2)
    assert view["truncated"] == {"offered": False, "parked": False, "quarantined": False} and not view["denied"]
    # The same for people; and nothing was consumed: the queues hold what they held.
    code, text, err = _run("streams", "ls", "--conn", uri, "--from", scene.queue, "--out-dir", str(scene.out),
                           "--rate-window", "0")
    assert code == 0, err
    for expected in ("offered, not yet received (1):", "wait-1", "yielding (parked) (1):", "quarantined (3):",
                     "[max_bytes]", "redrive: yes", "receiving now", "batch-7", "1 of 2 files in"):
        assert expected in text, text
    assert len(browse(params, scene.queue)) == 1 and len(browse(params, Destination.parse(scene.queue)
                                                                 .parked_queue())) == 1


def test_ls_without_from_lists_every_destination_the_connection_names(scene: Scene, params: BrokerParams) -> None:
    """No --conn and no --from: amqstream_default's 'destinations' extra (as the local
    deployment and the connection form fill it) names what ls shows, each in turn."""
    (host, port), = params.hosts
    conn = json.dumps({"conn_type": "amqstream", "host": host, "port": port, "login": params.login,
                       "password": params.password, "extra": {"destinations": f"{scene.queue},{scene.queue}.empty"}})
    proc = cli("streams", "ls", "--json", env={"AIRFLOW_CONN_AMQSTREAM_DEFAULT": conn})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    views = [json.loads(line) for line in out.splitlines()]
    assert [v["destination"] for v in views] == [scene.queue, scene.queue + ".empty"]
    assert _ids(views[0]["offered"]) == {"wait-1"} and views[1]["offered"] == []


def test_show_one_stream_both_sides(scene: Scene, uri: str, params: BrokerParams) -> None:
    code, out, err = _run("streams", "show", "parked-1", "--conn", uri, "--from", scene.queue, "--out-dir",
                          str(scene.out), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["parked"][0]["yields"] == 1 and rep["in_progress"][0]["durable_bytes"] == CHUNK
    assert not rep["quarantined"] and not rep["received"]
    code, out, err = _run("streams", "show", "b1", "--conn", uri, "--from", scene.queue, "--out-dir",
                          str(scene.out), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["received"][0]["bytes"] == 1500 and rep["in_batches"][0]["batch_id"] == "batch-7"
    code, text, err = _run("streams", "show", "big-1", "--conn", uri, "--from", scene.queue)
    assert code == 0, err
    assert "quarantined at" in text and "[max_bytes]" in text and "holds its end marker" in text, text
    code, text, err = _run("streams", "show", "nothing-here", "--conn", uri, "--from", scene.queue)
    assert code == 3 and "nothing known about it" in text, (code, text, err)


def _queues_of(q: str, sid: str, sender: str) -> list[str]:
    dest = Destination.parse(q)
    data_q = dest.data_queue(sid, sender)
    return [data_q, dead_letter_queue(data_q), dest.staging_queue(sid)]


def test_redrive_after_max_bytes_then_the_stream_arrives_byte_exact(scene: Scene, uri: str, params: BrokerParams,
                                                                   tmp_path: Path) -> None:
    dest = Destination.parse(scene.queue)
    code, out, err = _run("streams", "redrive", "big-1", "--conn", uri, "--from", scene.queue, "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["chunks"] == 5 and res["bytes"] == 4 * CHUNK + 7 and res["sha256_checked"]
    assert res["sender_before"] == params.login and res["redriven_by"] == params.login
    # Its offer is back without the quarantine's headers; no copy is left in the quarantine.
    offers = [f for f in browse(params, scene.queue) if f.headers.get(hdr.H_STREAM) == "big-1"]
    assert len(offers) == 1 and not any(k.startswith("amqs_quarantine") for k in offers[0].headers)
    assert offers[0].headers[qr.H_REDRIVE_SENDER] == params.login
    assert not [f for f in browse(params, f"/queue/DLQ.{dest.name}") if f.headers.get(hdr.H_STREAM) == "big-1"]
    assert not browse(params, dest.staging_queue("big-1"))
    # With a higher limit it arrives, byte for byte, recorded as the redriving user's.
    got = receive_stream(params, scene.queue, tmp_path / "again", stream_id="big-1",
                         options=ReceiveOptions(wait_timeout=10, max_bytes=10 * CHUNK))
    assert got is not None and Path(got.path).read_bytes() == scene.data["big-1"]
    assert got.sender == params.login
    for queue in _queues_of(scene.queue, "big-1", params.user):
        assert not browse(params, queue), queue


def test_redrive_refuses_what_can_never_arrive(scene: Scene, uri: str, params: BrokerParams) -> None:
    dest = Destination.parse(scene.queue)
    # Corrupt: refused at its cause, nothing moved.
    code, _, err = _run("streams", "redrive", "bad-1", "--conn", uri, "--from", scene.queue)
    assert code == 1 and "bad-1" in err and "cannot be redriven" in err and "corrupt" in err, err
    assert [f for f in browse(params, f"/queue/DLQ.{dest.name}") if f.headers.get(hdr.H_STREAM) == "bad-1"]
    # Over max_bytes but incomplete: refused after the check, naming what is missing; its offer
    # stays quarantined and its chunks are filed with the broker's DLQ of its data queue.
    code, _, err = _run("streams", "redrive", "cut-1", "--conn", uri, "--from", scene.queue)
    assert code == 1 and "chunks 4-5 of 5 are missing" in err and "end marker is missing" in err, err
    assert not [f for f in browse(params, scene.queue) if f.headers.get(hdr.H_STREAM) == "cut-1"]
    assert [f for f in browse(params, f"/queue/DLQ.{dest.name}") if f.headers.get(hdr.H_STREAM) == "cut-1"]
    assert not browse(params, dest.data_queue("cut-1", params.user)) and not browse(params,
                                                                                   dest.staging_queue("cut-1"))
    kept = browse(params, dead_letter_queue(dest.data_queue("cut-1", params.user)))
    assert sorted(int(f.headers[hdr.H_SEQ]) for f in kept) == [1, 2, 3]
    assert all(f.headers[qr.H_REDRIVE_SENDER] == params.login for f in kept)


def test_discard_leaves_nothing_behind(scene: Scene, uri: str, params: BrokerParams, held: Path) -> None:
    dest = Destination.parse(scene.queue)
    # Held by a receiver: refused, nothing removed.
    code, _, err = _run("streams", "discard", "parked-1", "--yes", "--conn", uri, "--from", scene.queue,
                        "--out-dir", str(scene.out))
    assert code == 1 and "being received" in err and held.exists(), err
    assert [f for f in browse(params, dest.parked_queue()) if f.headers.get(hdr.H_STREAM) == "parked-1"]
    # Without a terminal and without --yes: asks, so refuses.
    code, _, err = _run("streams", "discard", "bad-1", "--conn", uri, "--from", scene.queue)
    assert code == 1 and "--yes" in err, err
    code, out, err = _run("streams", "discard", "bad-1", "--yes", "--conn", uri, "--from", scene.queue, "--json")
    assert code == 0, err
    res = json.loads(out)
    bad_dlq = dead_letter_queue(dest.data_queue("bad-1", params.user))
    assert res["removed"] == {f"/queue/DLQ.{dest.name}": 1, bad_dlq: 4}, res
    assert res["broker_bytes"] == 3 * CHUNK and res["bytes_freed"] == 3 * CHUNK
    for queue in (scene.queue, dest.parked_queue(), f"/queue/DLQ.{dest.name}",
                  *_queues_of(scene.queue, "bad-1", params.user)):
        assert not [f for f in browse(params, queue) if f.headers.get(hdr.H_STREAM) == "bad-1"], queue


def test_discard_a_parked_stream_and_its_partial_data(scene: Scene, uri: str, params: BrokerParams) -> None:
    dest = Destination.parse(scene.queue)
    code, text, err = _run("streams", "discard", "parked-1", "--yes", "--conn", uri, "--from", scene.queue,
                           "--out-dir", str(scene.out))
    assert code == 0, err
    assert "discarded stream parked-1" in text and "freed" in text, text
    for queue in (scene.queue, dest.parked_queue(), f"/queue/DLQ.{dest.name}",
                  *_queues_of(scene.queue, "parked-1", params.user)):
        assert not [f for f in browse(params, queue) if f.headers.get(hdr.H_STREAM) == "parked-1"], queue
    assert not list((scene.out / ".amqstream").glob("parked-1.*"))
    # The others are untouched.
    assert {f.headers[hdr.H_STREAM] for f in browse(params, f"/queue/DLQ.{dest.name}")} == {"big-1", "bad-1", "cut-1"}
    assert [f.headers[hdr.H_STREAM] for f in browse(params, scene.queue)] == ["wait-1"]


def test_redrive_and_discard_reach_past_what_a_browser_sees(params: BrokerParams, queue_name: str) -> None:
    """20 quarantine copies: the last ones are past the first page. Discard and redrive find
    them; a sweep passes the others to the tail, each once, with who filed it."""
    dest = Destination.parse(queue_name)
    qq = f"/queue/DLQ.{dest.name}"
    raw = RawSender(params)
    for n in range(20):
        spec = _spec(f"deep-{n}", 10)
        raw.send(qq, b"", {**p.offer_headers(spec, dest, sender=params.user),
                           hdr.H_QUARANTINE_REASON: "chunk 1 failed its CRC-32 check",
                           hdr.H_QUARANTINED_FROM: str(dest), hdr.H_QUARANTINED_BY: "host-x",
                           hdr.H_QUARANTINED_AT: f"2026-11-25T10:00:{n:02d}+00:00"})
    raw.close()
    seen = inv.take_inventory(params, queue_name)
    assert len(seen.quarantined) == 16 and seen.truncated["quarantined"]
    assert discard(params, queue_name, "deep-19").removed == {qq: 1}
    with pytest.raises(RedriveRefused, match="corrupt"):
        redrive(params, queue_name, "deep-18")
    # The sweep itself, whatever the broker's paging lets a selector see: one that matches
    # nothing makes it rotate the queue.
    with QueueSession(params) as qs:
        found, sub = take_matching(qs.link, qq, lambda f: f.headers.get(hdr.H_STREAM) == "deep-17",
                                   selector=f"{hdr.H_STREAM} = 'none'", sweep=True,
                                   stamp=lambda f: {qr.H_QUARANTINED_USER: qr.quarantined_by_user(f.headers)})
        assert [f.headers[hdr.H_STREAM] for f in found] == ["deep-17"]
        for frame in found:
            qs.link.ack(frame)
        qs.link.unsubscribe(sub)
        left: list[dict[str, Any]] = []
        gone = move_queue(qs.link, qq, None, decide=lambda f: left.append(dict(f.headers)))
    assert gone.dropped == 18 and sorted(h[hdr.H_STREAM] for h in left) == sorted(f"deep-{n}" for n in (*range(17), 18))
    assert all(h.get(H_SWEEP) and h[qr.H_QUARANTINED_USER] == params.login for h in left)
    assert all(h[hdr.H_QUARANTINED_BY] == "host-x" for h in left)


# The forged-copy test has a destination of its own: the other receives whatever is offered on
# /queue/landing, and neither may see what the other left in its queues, in either order.
FORGED_Q = "/queue/landing.forged"


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path_factory.mktemp("acl") / "broker",
                              {"consumer": {"receive": ["/queue/landing", FORGED_Q]},
                               "producer": {"send": ["/queue/landing", FORGED_Q]}})


def test_users_without_the_rights_are_refused_clearly(acl_broker: EmbeddedBroker, tmp_path: Path) -> None:
    admin = params_as(acl_broker, None)
    play(admin, "/queue/landing", _spec("s-1", 2500), _data(2500, 9), [1, 2, 3])
    with pytest.raises(StreamQuarantined):
        receive_stream(admin, "/queue/landing", tmp_path / "in", options=ReceiveOptions(wait_timeout=10,
                                                                                        max_bytes=10))
    consumer = acl_broker.info(user="consumer").uri
    # A receiver sees the offers and parked streams, not the quarantine, and is told why.
    code, out, err = _run("streams", "ls", "--conn", consumer, "--from", "/queue/landing", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert set(view["denied"]) == {"quarantined"} and "refused consumer" in view["denied"]["quarantined"]
    assert "/queue/DLQ.landing" in view["denied"]["quarantined"] and "administrator" in view["denied"]["quarantined"]
    code, text, _ = _run("streams", "ls", "--conn", consumer, "--from", "/queue/landing")
    assert "quarantined: not shown: the broker refused consumer a look at /queue/DLQ.landing" in text, text
    # It may not redrive or discard: refused, naming the user and the queue, and nothing moves.
    code, _, err = _run("streams", "redrive", "s-1", "--conn", consumer, "--from", "/queue/landing")
    assert code == 1 and "refused user consumer" in err and "not authorized" in err, err
    code, _, err = _run("streams", "discard", "s-1", "--yes", "--conn", consumer, "--from", "/queue/landing")
    assert code == 1 and "refused user consumer" in err, err
    assert [f for f in browse(admin, "/queue/DLQ.landing") if f.headers.get(hdr.H_STREAM) == "s-1"]
    assert len(browse(admin, Destination.parse("/queue/landing").data_queue("s-1", admin.user))) == 4
    # A sender may look at nothing of the kind.
    producer = acl_broker.info(user="producer").uri
    code, out, err = _run("streams", "ls", "--conn", producer, "--from", "/queue/landing", "--json")
    assert code == 0 and set(json.loads(out)["denied"]) == {"offered", "parked", "quarantined"}, (out, err)


def test_redrive_refuses_a_quarantine_copy_a_receiving_user_forged(acl_broker: EmbeddedBroker) -> None:
    """consumer may only receive from its destinations, which lets it write their quarantine queue:
    it takes producer's offer and files a copy naming producer as the sender, under a name of
    its choosing and a cause redrive accepts. The administrator's redrive refuses it, naming
    consumer, and nothing moves: producer's chunks stay, nothing is offered in anyone's name."""
    admin, consumer = params_as(acl_broker, None), params_as(acl_broker, "consumer")
    producer = params_as(acl_broker, "producer")
    dest = Destination.parse(FORGED_Q)
    spec = _spec("pay-1", 2500)
    play(producer, str(dest), spec, _data(2500, 3), [1, 2, 3])
    # consumer takes the offer off the destination (a receiver may) and forges the copy.
    conn = stomp.Connection12([consumer.hosts[0]], auto_decode=False)
    got: list[Any] = []
    listener = stomp.ConnectionListener()
    listener.on_message = got.append  # type: ignore[method-assign]
    conn.set_listener("", listener)
    conn.connect(consumer.login, consumer.password, wait=True)
    conn.subscribe(str(dest), id="1", ack="client-individual")
    offer = wait_for(lambda: next((f for f in got if f.headers.get(hdr.H_STREAM) == "pay-1"), None), 30,
                     "producer's offer")
    conn.ack(offer.headers["ack"])
    keep = {k: v for k, v in offer.headers.items() if k.startswith("amqs_")}
    conn.send(f"/queue/DLQ.{dest.name}", b"", headers={
        **keep, hdr.H_NAME: "payroll.csv", hdr.H_FIRST_SENDER: "producer", H_QUARANTINE_CAUSE: "max_bytes",
        hdr.H_QUARANTINE_REASON: "over max_bytes", hdr.H_QUARANTINED_FROM: str(dest),
        hdr.H_QUARANTINED_AT: "2026-11-28T09:00:00+00:00", qr.H_QUARANTINED_USER: "admin", "persistent": "true"})
    conn.disconnect(receipt="bye")
    data_q = dest.data_queue("pay-1", "producer")
    with pytest.raises(RedriveRefused) as refused:
        redrive(admin, str(dest), "pay-1", quiet=0.5)
    text = str(refused.value)
    assert "filed by consumer" in text and "producer" in text and "--receiver" in text and "pay-1" in text, text
    assert len(browse(admin, data_q)) == 4, "producer's chunks and end marker stay where they were"
    assert not [f for f in browse(admin, str(dest)) if f.headers.get(hdr.H_STREAM) == "pay-1"], "nothing offered"
    assert not browse(admin, dest.data_queue("pay-1", admin.user))
    # The copy stays for an administrator to look at (and discard).
    assert [f for f in browse(admin, f"/queue/DLQ.{dest.name}") if f.headers.get(hdr.H_STREAM) == "pay-1"]
    assert_old_gen_bounded(acl_broker, "a forged quarantine copy")
