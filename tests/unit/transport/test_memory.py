"""The in-memory broker behaves as the parts of ActiveMQ the engine relies on do."""

from __future__ import annotations

import pytest

from airflow_provider_amqstream.exceptions import ConnectionLost
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker, compile_selector


@pytest.mark.parametrize("selector,headers,want", [
    ("amqs_inline = '1'", {"amqs_inline": "1"}, True),
    ("amqs_inline = '1'", {}, None),
    ("amqs_inline IS NULL OR amqs_inline <> '1'", {}, True),
    ("amqs_inline IS NULL OR amqs_inline <> '1'", {"amqs_inline": "2"}, True),
    ("amqs_inline IS NULL OR amqs_inline <> '1'", {"amqs_inline": "1"}, False),
    ("amqs_kind IN ('offer', 'pack') AND amqs_stream NOT IN ('a', 'b')", {"amqs_kind": "offer", "amqs_stream": "c"},
     True),
    ("amqs_kind IN ('offer', 'pack') AND amqs_stream NOT IN ('a', 'b')", {"amqs_kind": "offer", "amqs_stream": "a"},
     False),
    ("(amqs_kind = 'offer' AND amqs_stream = 'x_1') OR (amqs_kind = 'pack' AND amqs_pack_ids LIKE '%|x!_1|%' "
     "ESCAPE '!')", {"amqs_kind": "pack", "amqs_pack_ids": "|y|x_1|"}, True),
    ("amqs_kind = 'pack' AND amqs_pack_ids LIKE '%|x!_1|%' ESCAPE '!'", {"amqs_kind": "pack",
                                                                       "amqs_pack_ids": "|xa1|"}, False),
    ("NOT amqs_kind = 'offer'", {}, None),
    ("it = 'it''s'", {"it": "it's"}, True),
])
def test_selectors_follow_sql_three_valued_logic(selector: str, headers: dict[str, str], want: bool | None) -> None:
    assert compile_selector(selector)(headers) is want


def test_a_queue_serves_one_subscriber_at_a_time_within_its_prefetch(broker: MemoryBroker) -> None:
    with open_link(broker.params("p")) as tx, open_link(broker.params("c")) as rx:
        for i in range(3):
            tx.send("/queue/q", str(i).encode(), {"n": str(i)})
        sub = rx.subscribe("/queue/q", prefetch=1)
        first = rx.get(0.1, sub)
        assert first.body == b"0" and first.headers["JMSXUserID"] == "p"
        assert rx.get(0.05, sub) is None, "prefetch 1: nothing more until the first is acknowledged"
        rx.ack(first)
        second = rx.get(0.1, sub)
        rx.nack(second)
        assert [h["n"] for h, _ in broker.messages("/queue/DLQ.q")] == ["1"]
        third = rx.get(0.1, sub)
        rx.unsubscribe(sub)
        again = rx.subscribe("/queue/q", prefetch=5)
        back = rx.get(0.1, again)
        assert back.body == third.body == b"2" and back.headers["redelivered"] == "true"


def test_a_browser_sees_without_taking_and_a_dropped_link_gives_everything_back(broker: MemoryBroker) -> None:
    with open_link(broker.params("p")) as tx, open_link(broker.params("c")) as rx:
        tx.send("/queue/q", b"a", {"JMSXUserID": "forged", "k": "offer"})
        held = rx.get(0.1, rx.subscribe("/queue/q"))
        assert held.headers["JMSXUserID"] == "p", "the broker stamps the sender; a forged stamp is replaced"
        look = rx.subscribe("/queue/q", browser=True)
        assert rx.get(0.1, look).headers["browser"] == "end", "a delivered message is not waiting"
        broker.drop()
        with pytest.raises(ConnectionLost):
            rx.get(0.1)
        assert [b for _, b in broker.messages("/queue/q")] == [b"a"]
