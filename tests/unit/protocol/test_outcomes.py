"""The failure table (protocol/outcomes.py) is the one place an outcome is defined: the table
in docs/protocol.md is generated from it, and what a receiver writes is read back through it."""

from __future__ import annotations

from pathlib import Path

from airflow_provider_amqstream.exceptions import (
    StreamBusy,
    StreamElsewhere,
    StreamNoRoom,
    StreamRefused,
    StreamStalled,
)
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE, Action, Outcome, yielded

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def doc_table() -> str:
    """docs/protocol.md's table of outcomes, as the module says it must read."""
    rows = ["| `amqs_quarantine_cause` / `cause` | action | shown as | redrive can help | what to do |",
            "|---|---|---|---|---|"]
    rows += [f"| `{o.value}` | {o.action.value} | `{o.label}` | {'yes' if o.redrivable else 'no'} | {o.advice} |"
             for o in Outcome]
    return "\n".join(rows) + "\n"


def test_the_docs_table_is_the_modules() -> None:
    assert doc_table() in DOC.read_text(), f"docs/protocol.md must hold this table, as generated:\n{doc_table()}"


def test_every_outcome_has_an_action_a_label_and_advice() -> None:
    assert all(isinstance(o.action, Action) and o.label and o.advice for o in Outcome)
    assert len({o.value for o in Outcome}) == len(Outcome)
    # Only a quarantine can be redriven, and a yield's label is a stream's status.
    assert all(o.action is Action.QUARANTINE for o in Outcome if o.redrivable)
    yields = {o.label for o in Outcome if o.action is Action.YIELD}
    assert yields == {"stalled", "no_room", "elsewhere", "busy", "refused"}


def test_a_quarantine_copy_carries_its_cause_and_no_earlier_one() -> None:
    spec = p.StreamSpec("s", "s.bin", 10, 10)
    offer = {**p.offer_headers(spec, Destination.parse("/queue/q"), sender="a"),
             H_QUARANTINE_CAUSE: "max_bytes"}
    h = p.quarantined_headers(offer, cause=Outcome.CORRUPT, reason="x", source="/queue/q", by="h", at="t",
                              sender="a")
    assert Outcome.parse(h[H_QUARANTINE_CAUSE]) is Outcome.CORRUPT
    assert Outcome.parse("no such cause") is None and Outcome.parse(None) is None


def test_each_kind_of_yield_has_its_row() -> None:
    assert [yielded(e("x")) for e in (StreamStalled, StreamNoRoom, StreamElsewhere, StreamBusy, StreamRefused)] == [
        Outcome.STALLED, Outcome.NO_ROOM, Outcome.ELSEWHERE, Outcome.BUSY, Outcome.REFUSED]
