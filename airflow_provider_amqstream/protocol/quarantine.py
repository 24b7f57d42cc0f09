"""What a quarantine copy of an offer says: why the stream was quarantined (the failure
table's cause, :mod:`airflow_provider_amqstream.protocol.outcomes`), who filed it, and the
marks the ``streams`` actions leave on what they move (docs/protocol.md, "Streams an
operator acts on").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import validate_stream_id
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE, Outcome

# Who a quarantine copy was filed by, kept when a sweep re-sends the copy (and so re-stamps
# it): believed on quarantine queues only, which only receivers and administrators write.
H_QUARANTINED_USER = "amqs_quarantined_user"
# On a redriven stream's offer and chunks: who redrove it, when, and who had sent it (the
# stamp its chunks carried). Information for people; no receiver reads them as identity.
H_REDRIVEN_BY = "amqs_redriven_by"
H_REDRIVEN_AT = "amqs_redriven_at"
H_REDRIVE_SENDER = "amqs_redrive_sender"


def quarantine_cause(headers: Mapping[str, Any]) -> Outcome:
    """Why a stream was quarantined, from the quarantine copy of its offer: the cause its
    receiver wrote (``amqs_quarantine_cause``), unless the copy cannot give the stream back
    (an inline file, a pack or a batch list's part keeps no body, a handshake stream needs its
    live sender).
    A copy without a cause this table knows counts as a bad stream."""
    if bw.is_pack(headers) or headers.get(bw.H_INLINE) == "1":
        return Outcome.INLINE
    if headers.get(hdr.H_KIND) == hdr.Kind.BATCH.value:
        return Outcome.BATCH_LIST
    if headers.get(hdr.H_MODE) == hdr.Mode.HANDSHAKE.value:
        return Outcome.HANDSHAKE
    return Outcome.parse(headers.get(H_QUARANTINE_CAUSE)) or Outcome.INVALID


def quarantined_by_user(headers: Mapping[str, Any], *, sweeper: str = "") -> str:
    """The user who filed a quarantine copy: the broker's stamp, or the header a sweep keeps
    when the stamp is ``sweeper``'s (only a copy that user re-sent; anyone may write the header).

    :param sweeper: the user whose sweeps (redrive, discard) re-send copies.
    """
    stamp = p.sender_of(headers)
    return p.sender_of({hdr.H_USER_ID: headers.get(H_QUARANTINED_USER)}) or stamp \
        if sweeper and stamp == sweeper else stamp


def copies_selector(stream_id: str) -> str:
    """The selector for every copy of one stream's offer (parked or quarantined)."""
    return f"{hdr.H_STREAM} = '{validate_stream_id(stream_id)}'"
