"""Every way a receiver can settle what it is handed, in one table (docs/protocol.md, "When a
stream fails"), the way h11 keeps its state transitions in one module.

Each :class:`Outcome` says what the receiver does (:class:`Action`), the word reports show
(``label``: a stream's ``status``, or a quarantine's ``cause`` in ``streams ls``), whether
``redrive`` can help once the cause is fixed, and what a user can do. The value travels: on a
quarantine copy as ``amqs_quarantine_cause``, in a :class:`StreamFailure` and its event as
``cause``; whoever reads one reads it here (:meth:`Outcome.parse`), never from the reason's
prose, which is free to change.
"""

from __future__ import annotations

from enum import Enum

from airflow_provider_amqstream.exceptions import (
    StreamBusy,
    StreamElsewhere,
    StreamNoRoom,
    StreamRefused,
    StreamStalled,
)

H_QUARANTINE_CAUSE = "amqs_quarantine_cause"


class Action(Enum):
    """What a receiver does with a stream (or one message of it)."""

    QUARANTINE = "quarantine"  # can never succeed: filed away, its chunks to the DLQ
    YIELD = "yield"  # not now: partial data kept, its offer parked
    REFUSE = "refuse"  # one message refused (to the DLQ), the stream goes on
    DUPLICATE = "duplicate"  # received before: acknowledged, nothing written


_BAD = ("the stream itself is bad (invalid, corrupt or incomplete): it can never succeed; discard it and have the "
        "sender send it again")
Q, Y, R, D = Action.QUARANTINE, Action.YIELD, Action.REFUSE, Action.DUPLICATE


class Outcome(Enum):
    """One row of the table: ``(value, action, label, redrivable, advice)``."""

    action: Action
    label: str
    redrivable: bool
    advice: str

    def __new__(cls, value: str, action: Action, label: str, redrivable: bool, advice: str) -> Outcome:
        row = object.__new__(cls)
        row._value_ = value
        row.action, row.label, row.redrivable, row.advice = action, label, redrivable, advice
        return row

    # Quarantined: the stream can never succeed as it is.
    INVALID = ("invalid", Q, "corrupt", False, _BAD)  # an offer, batch, pack or chunk breaks the protocol
    CORRUPT = ("corrupt", Q, "corrupt", False, _BAD)  # a CRC-32, length or SHA-256 check failed
    INCOMPLETE = ("incomplete", Q, "corrupt", False, _BAD)  # chunks missing after the end marker
    MAX_BYTES = ("max_bytes", Q, "max_bytes", True,
                 "over the receiver's max_bytes: raise the limit (or receive it elsewhere), then redrive")
    REUSED_ID = ("reused_id", Q, "reused_id", True,
                 "its id was used by another stream in that directory: receive it into another directory (or move "
                 "the other's completion record away), then redrive")
    ID_OF_OTHER_USER = ("id_of_other_user", Q, "reused_id", True,
                        "its id belongs to another user's stream in that directory: receive it elsewhere, then redrive")
    PARTIAL_OF_OTHER = ("partial_of_other", Q, "reused_id", True,
                        "another stream's partial data under the same id is in that directory: let it finish (or "
                        "discard it), then redrive")
    PARTIAL_OF_OTHER_USER = ("partial_of_other_user", Q, "reused_id", True,
                             "another user's partial data under the same id is in that directory: let it finish, "
                             "then redrive")
    GAVE_WAY = ("gave_way", Q, "no_room", True,
                "it gave way too often (no room, or a silent sender): free space, then redrive if its chunks are "
                "complete")
    FOREIGN_PARKED = ("foreign_parked", Q, "foreign_parked", False,
                      "another user put it on the parked queue, where only a receiver's own parked copies are "
                      "believed: nothing to do; run the receivers of a destination as one user")
    SEAL_BROKEN = ("seal_broken", Q, "corrupt", False,
                   "a sealed chunk or header does not open (altered, truncated, reordered or moved from another "
                   "stream): discard it and have the sender send it again")
    NO_KEY = ("no_key", Q, "no_key", True,
              "sealed for keys this receiver lacks: give it the recipient's key file (keys), then redrive it (a "
              "batch list's part cannot be redriven: once the receiver has the key, re-run the send, which "
              "announces the list again)")
    UNSEALED = ("unsealed", Q, "unsealed", True,
                "the connection requires sealed streams (seal: required) and this one is not: the sender must "
                "seal it (seal_to), or redrive it to a receiver that does not require sealing")
    # What a quarantine copy cannot give back, whatever its cause: redrive is refused.
    INLINE = ("inline", Q, "inline", False,
              "the file travelled in its offer (or pack), and the quarantine copy keeps only the headers: fix the "
              "cause the reason gives (no_key: give the receiver the recipient's key file), then the sender must "
              "send it again (a many-file send with --restart: its ledger counts the file as sent)")
    HANDSHAKE = ("handshake", Q, "handshake", False,
                 "a handshake stream needs its live sender: the sender must send it again")
    BATCH_LIST = ("batch_list", Q, "batch_list", False,
                  "a batch list's part (the list is in its body): fix the cause the reason gives (no_key: give the "
                  "receiver the recipient's key file), then re-run the send, which announces the list again, and "
                  "discard this copy")
    # Yielded: the offer is parked, the partial data kept, and the stream tried again later.
    STALLED = ("stalled", Y, "stalled", False, "the sender went silent: re-run it; the stream continues later")
    NO_ROOM = ("no_room", Y, "no_room", False, "the file does not fit the free space: free some; it continues later")
    ELSEWHERE = ("elsewhere", Y, "elsewhere", False,
                 "another receiver's directory holds its first chunks: receive it there, as the report says")
    BUSY = ("busy", Y, "busy", False, "another receiver process of that directory is receiving it: nothing to do")
    REFUSED = ("refused", Y, "refused", False,
               "the broker refused its data queue: its sender is at its max_waiting cap; it continues once the "
               "sender's other streams are taken")
    # Refused: one message goes to the DLQ, the stream goes on.
    FOREIGN_CHUNK = ("foreign_chunk", R, "foreign_chunk", False,
                     "a chunk sent by another user than the stream's sender: nothing to do, it cannot spoil the stream")
    RESENT_CHUNK = ("resent_chunk", R, "resent_chunk", False,
                    "a corrupt chunk of a handshake stream: its live sender is asked for it again")
    # Received before.
    DUPLICATE = ("duplicate", D, "duplicate", False, "a repeat of a stream published there: nothing to do")

    @staticmethod
    def parse(value: object) -> Outcome | None:
        """The outcome a header or record names; None for none, or a value this table lacks."""
        return _BY_VALUE.get(str(value or ""))


_BY_VALUE = {o.value: o for o in Outcome}


_YIELDS = ((StreamStalled, Outcome.STALLED), (StreamBusy, Outcome.BUSY), (StreamElsewhere, Outcome.ELSEWHERE),
           (StreamNoRoom, Outcome.NO_ROOM), (StreamRefused, Outcome.REFUSED))


def yielded(exc: BaseException) -> Outcome:
    """The outcome of a stream that yielded with ``exc`` (a :class:`StreamYielded` kind)."""
    return next((o for kind, o in _YIELDS if isinstance(exc, kind)), Outcome.NO_ROOM)
