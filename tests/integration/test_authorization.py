"""Users restricted to their destinations by the broker's own authorization.

One broker with an administrator and four users: ``producer`` may send to
``/queue/landing`` (and its per-test siblings) and the ``/topic/news`` handshake,
``consumer`` may receive from all of them,
``site`` owns the ``/queue/sites.>`` family, and ``spammer`` may send to ``/queue/landing``
with at most 5 streams waiting there. Streams flow for each; every step
outside a grant is refused by the broker with an error naming the user and what to do.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.auth import acl_entries
from airflow_provider_amqstream.broker.embedded import BrokerError, EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import AccessDenied, DestinationFull, StreamError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import Receiver, cli, free_port, make_file, params_as, running_broker, sha256_file, wait_for

pytestmark = pytest.mark.broker

LANDING = "/queue/landing"
# The tests that receive whatever is offered, or assert a destination or its DLQ is empty,
# have a destination each: none sees what another left, whatever order they run in.
MOVE_Q, EVIL_Q = (f"{LANDING}.{name}" for name in ("move", "evil"))


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from running_broker(tmp_path_factory.mktemp("acl") / "broker", {
        "producer": {"send": [LANDING, MOVE_Q, EVIL_Q, "/topic/news"]},
        "consumer": {"receive": [LANDING, MOVE_Q, EVIL_Q, "/topic/news"]},
        "site": {"send": ["/queue/sites.>"], "receive": ["/queue/sites.>"]},
        "spammer": {"send": ["/queue/landing"], "max_waiting": 5}})


def test_grants_become_least_privilege_entries() -> None:
    entries = acl_entries({"p": {"send": ["/queue/landing"]}, "c": {"receive": ["/queue/landing"]}})
    data, own = entries[("queue", "landing.amqs.>")], entries[("queue", "landing.amqs.p.>")]
    ctl = entries[("queue", "landing.amqs_ctl.>")]
    assert entries[("queue", "landing")] == {"read": {"amqs-user-c"}, "write": {"amqs-user-p"},
                                             "admin": {"amqs-user-c", "amqs-user-p"}}
    # A sender writes only its own data queues; a receiver reads every sender's.
    assert data["read"] == {"amqs-user-c"} and not data["write"]
    assert own["write"] == {"amqs-user-p"} and not own["read"]
    assert ctl["read"] == {"amqs-user-p"} and ctl["write"] == {"amqs-user-c"}
    # The receiver parks streams that give way where no sender may write.
    assert entries[("queue", "landing.amqs_parked")] == {"read": {"amqs-user-c"}, "write": {"amqs-user-c"},
                                                         "admin": {"amqs-user-c"}}


def test_bad_user_names_and_grants_are_refused(tmp_path: Path) -> None:
    b = EmbeddedBroker(tmp_path / "b", port=free_port())
    for name, grant, match in [("../x", "/queue/a", "not valid"), ("amqstream", "/queue/a", "administrator"),
                               ("u", "/queue/a*", "cannot grant"), ("u", None, "at least one")]:
        with pytest.raises(BrokerError, match=match):
            b.add_user(name, send=[grant] if grant else [])
    assert not b.users_file.exists()


def test_producer_and_consumer_move_a_stream_within_their_grants(acl_broker: EmbeddedBroker,
                                                                  tmp_path: Path) -> None:
    src = make_file(tmp_path / "f.bin", 2 * 2**20 + 11)
    sent = send_file(params_as(acl_broker, "producer"), src, MOVE_Q, SendOptions(chunk_size=256 * 1024))
    got = receive_stream(params_as(acl_broker, "consumer"), MOVE_Q, tmp_path / "out",
                         options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sent.sha256 == sha256_file(src)


def test_handshake_to_a_topic_within_grants(acl_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The sender reads the control queue and the receiver writes it, and neither more."""
    src = make_file(tmp_path / "f.bin", 700_000)
    rx = Receiver(params_as(acl_broker, "consumer"), "/topic/news", tmp_path / "out")
    assert rx.waiting.wait(30), "the receiver never subscribed"
    sent = send_file(params_as(acl_broker, "producer"), src, "/topic/news",
                     SendOptions(mode="handshake", chunk_size=100_000))
    assert rx.finish().sha256 == sent.sha256


def test_family_grant_covers_its_members(acl_broker: EmbeddedBroker, tmp_path: Path) -> None:
    src = make_file(tmp_path / "f.bin", 5000)
    site = params_as(acl_broker, "site")
    send_file(site, src, "/queue/sites.paris", SendOptions(chunk_size=1000))
    got = receive_stream(site, "/queue/sites.paris", tmp_path / "out", options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sha256_file(src)


@pytest.mark.parametrize("user,action,dest", [
    ("producer", "send", "/queue/payroll"),          # not its destination
    ("consumer", "send", "/queue/landing"),          # a consumer cannot forge offers
    ("producer", "receive", "/queue/landing"),       # a producer cannot take streams
    ("consumer", "receive", "/queue/payroll"),
    ("site", "send", "/queue/landing"),
])
def test_outside_the_grant_is_refused_clearly(acl_broker: EmbeddedBroker, tmp_path: Path,
                                              user: str, action: str, dest: str) -> None:
    params = params_as(acl_broker, user)
    src = make_file(tmp_path / "f.bin", 3000)
    with pytest.raises(AccessDenied) as err:
        if action == "send":
            send_file(params, src, dest, SendOptions(chunk_size=1000, reconnect_timeout=5))
        else:
            receive_stream(params, dest, tmp_path / "out", options=ReceiveOptions(wait_timeout=5))
    text = str(err.value)
    assert f"refused user {user}" in text and "amqstream users add" in text
    assert params.password not in text


def test_a_receiver_cannot_be_sent_to_read_another_queue(acl_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """A producer's offer that names a data queue elsewhere (one the consumer may read)
    is refused by the receiver rather than followed."""
    spec = p.StreamSpec("evil-1", "x.bin", 10, 10, hdr.Mode.STREAM)
    evil = Destination.parse(EVIL_Q)
    headers = p.offer_headers(spec, evil, sender="producer") | {
        hdr.H_DATA_DEST: "/queue/landing.amqs.producer.other-stream"}
    with StompLink(params_as(acl_broker, "producer")) as link:
        link.send_confirmed(EVIL_Q, b"", headers)
    with pytest.raises(StreamError, match="not this stream's queue"):
        receive_stream(params_as(acl_broker, "consumer"), EVIL_Q, tmp_path / "out",
                       options=ReceiveOptions(wait_timeout=20))
    # Refused by a consumer that may not write anywhere: still moved to the DLQ, where the
    # administrator finds it, and gone from the offers.
    with StompLink(params_as(acl_broker, None)) as admin:
        admin.subscribe(f"/queue/DLQ.{evil.name}", prefetch=1)
        dead = admin.get(30)
        assert dead is not None and dead.headers.get(hdr.H_STREAM) == "evil-1"
        admin.ack(dead)
        admin.subscribe(EVIL_Q, browser=True)
        end = admin.get(30)
        assert end is not None and end.headers.get("browser") == "end", "the refused offer is still queued"


def test_a_sender_writes_only_its_own_data_queues_and_only_so_many(acl_broker: EmbeddedBroker,
                                                                   tmp_path: Path) -> None:
    """A send-only user, with raw stomp.py: another user's data queue is refused by the
    broker; its own are capped (5 here), so it cannot make the broker keep a queue for every
    message it leaves behind. Others send meanwhile; it sends again once its queues go."""
    landing = Destination.parse("/queue/landing")
    with StompLink(params_as(acl_broker, "spammer")) as link, pytest.raises(AccessDenied, match="spammer"):
        link.send_confirmed(landing.data_queue("theirs-1", "producer"), b"x", {})
    spam = [landing.data_queue(f"spam-{i}", "spammer") for i in range(6)]
    with StompLink(params_as(acl_broker, "spammer")) as link:
        for queue in spam[:5]:
            link.send_confirmed(queue, b"x", {})
    with StompLink(params_as(acl_broker, "spammer")) as link, pytest.raises(DestinationFull) as full:
        link.send_confirmed(spam[5], b"x", {})
    text = str(full.value)
    assert "refused user spammer a new data queue: 5 of its streams already wait on /queue/landing" in text, text
    assert "--max-waiting" in text
    # The cap is the spammer's alone: another sender's stream still arrives.
    src = make_file(tmp_path / "f.bin", 300_000)
    sent = send_file(params_as(acl_broker, "producer"), src, "/queue/landing", SendOptions(chunk_size=64 * 1024))
    got = receive_stream(params_as(acl_broker, "consumer"), "/queue/landing", tmp_path / "out",
                         options=ReceiveOptions(wait_timeout=20), stream_id=sent.stream_id)
    assert got is not None and got.sha256 == sha256_file(src)
    with StompLink(params_as(acl_broker, None)) as admin:
        for queue in spam[:5]:
            admin.subscribe(queue, prefetch=1)
            junk = admin.get(10)
            assert junk is not None
            admin.ack(junk)
    # Emptied, the queues are dropped by the broker's purge (60 s idle, every 10 s): room again.
    def room() -> bool:
        try:
            with StompLink(params_as(acl_broker, "spammer")) as link:
                link.send_confirmed(spam[5], b"x", {})
        except DestinationFull:
            return False
        return True

    wait_for(room, 150, "the spammer's emptied data queues to be dropped", interval=2)


def test_users_cli_adds_lists_and_removes(tmp_path: Path) -> None:
    d = str(tmp_path / "b")
    add = cli("users", "add", "alice", "--send", "/queue/a", "--receive", "/queue/b", "--max-waiting", "50",
              "--data-dir", d)
    out, err = add.communicate(timeout=60)
    assert add.returncode == 0, err
    assert "amqstream://alice:" in out
    assert json.loads((tmp_path / "b" / "users.json").read_text())["users"]["alice"]["max_waiting"] == 50
    bad = cli("users", "add", "bob", "--send", "/queue/a", "--max-waiting", "0", "--data-dir", d)
    assert "--max-waiting 0 is not between 1 and 1000000" in bad.communicate(timeout=60)[1] and bad.returncode != 0
    listed = cli("users", "list", "--data-dir", d).communicate(timeout=60)[0]
    assert listed.strip() == "alice: send /queue/a; receive /queue/b"
    assert (tmp_path / "b" / "users.json").stat().st_mode & 0o077 == 0
    rm = cli("users", "remove", "alice", "--data-dir", d)
    assert "user alice removed" in rm.communicate(timeout=60)[0]
    again = cli("users", "remove", "alice", "--data-dir", d)
    assert "no user 'alice'" in again.communicate(timeout=60)[1] and again.returncode == 1


@pytest.mark.parametrize("user", ["producer", "consumer"])
def test_temporary_destinations_are_for_the_administrator_only(acl_broker: EmbeddedBroker, user: str) -> None:
    with StompLink(params_as(acl_broker, user)) as link, pytest.raises(AccessDenied, match=f"refused user {user}"):
        link.subscribe("/temp-queue/scratch")
    with StompLink(params_as(acl_broker, user)) as link, pytest.raises(AccessDenied, match=f"refused user {user}"):
        link.send_confirmed("/temp-topic/scratch", b"x", {})
    with StompLink(params_as(acl_broker, None)) as link:  # the administrator may
        link.subscribe("/temp-queue/scratch")
        link.send_confirmed("/temp-queue/scratch", b"x", {})
        frame = link.get(10)
        assert frame is not None and bytes(frame.body) == b"x"
