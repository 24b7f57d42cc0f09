"""Where every stream of a destination is: the picture behind ``amqstream streams`` and the
Airflow page, read without consuming or reordering anything.

From the broker, with queue browsers (docs/protocol.md, "Destinations"): streams **offered**
on ``/queue/NAME`` (one a receiver holds right now included), **yielded** on
``NAME.amqs_parked``, **quarantined** on ``DLQ.NAME`` (and whether ``redrive`` can help). A
browser sees at most ``maxBrowsePageSize`` messages of a queue, so a section that shows that
many says it may be cut (``truncated``); what the user may not read is named (``denied``).
From a receiver's :class:`~airflow_provider_amqstream.engine.state_dir.StateDir`, read only:
streams **in progress** and **incomplete batches**.

Nothing here reads a chunk: a stream's data queues are only probed for its end marker (a
selector, so no chunk body leaves the broker).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_amqstream.engine.partials import BatchProgress, InProgress, batch_progress, partial_streams
from airflow_provider_amqstream.engine.queue_tools import BROWSE_LIMIT, Browsed, QueueSession
from airflow_provider_amqstream.exceptions import LocalProtocolError, ProtocolError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.quarantine import H_REDRIVEN_BY, quarantine_cause, quarantined_by_user
from airflow_provider_amqstream.protocol.seal import H_SEAL
from airflow_provider_amqstream.transport.params import BrokerParams


def _int(value: Any) -> int | None:
    text = str(value or "")
    return int(text) if re.fullmatch(r"[0-9]{1,20}", text) else None


@dataclass
class Offered:
    """A stream offered on the destination and not yet received.

    :param kind: ``stream`` (chunks on its data queue), ``inline`` (the file in the offer),
        ``re-offer`` (a sender's re-run clearing repeats; starts no reception) or ``invalid``
        (a receiver will quarantine it: ``note`` says why).
    :param pack: the pack it travels in, if any.
    :param sender: the user the broker stamped on the offer ("" where it stamps none).
    :param offered_at: when the broker accepted the offer (epoch seconds).
    :param redriven_by: the user who put it back from the quarantine, if one did.
    :param receiving: a receiver whose directory was given holds it now (a browser also shows
        the offers receivers hold, which are not waiting).
    """

    stream_id: str
    name: str = ""
    size: int | None = None
    chunks: int | None = None
    mode: str = ""
    kind: str = "stream"
    sender: str = ""
    offered_at: float | None = None
    pack: str | None = None
    note: str = ""
    redriven_by: str = ""
    receiving: bool = False


@dataclass
class Parked:
    """A stream that yielded its place: its offer waits in the parked queue.

    :param first_sender: who offered it (``amqs_first_sender``, believed on the parked queue).
    :param not_before: when a receiver may take it again (epoch seconds).
    :param reason: why it yielded last.
    """

    stream_id: str
    name: str = ""
    size: int | None = None
    first_sender: str = ""
    not_before: float | None = None
    yields: int = 0
    reason: str = ""
    pack: str | None = None


@dataclass
class Quarantined:
    """A stream filed away as one that cannot succeed as it is.

    :param by_user: the receiving user (the broker's stamp on the copy).
    :param at: when (UTC, ISO 8601).
    :param cause: the label of its :class:`~airflow_provider_amqstream.protocol.outcomes.Outcome`
        (:func:`quarantine_cause`).
    :param sender: who offered it (``amqs_first_sender``, which only receivers write there).
    """

    stream_id: str
    name: str = ""
    size: int | None = None
    reason: str = ""
    by_host: str = ""
    by_user: str = ""
    sender: str = ""
    at: str = ""
    cause: str = ""
    redrivable: bool = False
    advice: str = ""
    redriven_by: str = ""


@dataclass
class BatchAnnounced:
    """A batch list on the destination, not yet taken by a receiver."""

    batch_id: str
    part: int | None
    parts: int | None
    files: int | None
    sender: str = ""
    offered_at: float | None = None


@dataclass
class Inventory:
    """Everything one look found about a destination's streams (see the module doc).

    :param truncated: per section, whether the broker may hold more than was shown.
    :param denied: per section, why the broker refused to show it.
    """

    destination: str
    broker: str
    taken_at: float
    offered: list[Offered] = field(default_factory=list)
    batches_offered: list[BatchAnnounced] = field(default_factory=list)
    parked: list[Parked] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    in_progress: list[InProgress] = field(default_factory=list)
    batches: list[BatchProgress] = field(default_factory=list)
    truncated: dict[str, bool] = field(default_factory=dict)
    denied: dict[str, str] = field(default_factory=dict)
    queues: dict[str, str] = field(default_factory=dict)
    browse_limit: int = BROWSE_LIMIT

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for entry, row in zip(self.in_progress, data["in_progress"], strict=True):
            row["percent"] = entry.percent
        return data


def _offers(frames: Iterable[Any]) -> list[tuple[dict[str, Any], Any]]:
    """The streams in the messages of a queue of offers: each (headers, frame), a pack's
    members each on their own (headers from the pack's index)."""
    out: list[tuple[dict[str, Any], Any]] = []
    for frame in frames:
        headers = dict(frame.headers)
        if not bw.is_pack(headers):
            out.append((headers, frame))
            continue
        try:
            members = _sealed_members(headers) if bw.is_sealed_pack(headers) else [
                m for m, _ in bw.read_pack(headers, frame.body or b"")]
        except ProtocolError as exc:
            out.append(({**headers, "_invalid": str(exc)}, frame))
            continue
        out.extend(({**headers, **member, "_pack": str(headers.get(hdr.H_STREAM, ""))}, frame) for member in members)
    return out


def _sealed_members(headers: Mapping[str, Any]) -> list[dict[str, str]]:
    """A sealed pack's files as its headers show them (``_sealed``: its receivers check the
    rest, which only they can read)."""
    return [{**member, "_sealed": "1"} for member in bw.sealed_member_offers(headers)]


def offered_streams(browsed: Browsed, dest: Destination) -> tuple[list[Offered], list[BatchAnnounced]]:
    """What a browse of the queue of offers shows (bodies kept for packs and batches):
    streams and batch lists."""
    streams: list[Offered] = []
    batches: list[BatchAnnounced] = []
    for h, frame in _offers(browsed.frames):
        sid = str(h.get(hdr.H_STREAM, ""))[:hdr.MAX_STREAM_ID]
        sender = p.sender_of(frame.headers)
        # When the broker accepted it (its ``timestamp`` header, milliseconds).
        at = ms / 1000.0 if (ms := _int(frame.headers.get("timestamp"))) else None
        kind = h.get(hdr.H_KIND)
        if kind == hdr.Kind.BATCH.value:
            try:
                if h.get(H_SEAL):  # its file count is sealed too
                    batches.append(BatchAnnounced(sid, _int(h.get(bw.H_PART)), _int(h.get(bw.H_PARTS)), None, sender,
                                                  at))
                    continue
                batch_id, part, parts, entries = bw.parse_batch(h, frame.body or b"")
                batches.append(BatchAnnounced(batch_id, part, parts, len(entries), sender, at))
            except ProtocolError as exc:
                streams.append(Offered(sid, kind="invalid", sender=sender, offered_at=at, note=str(exc)))
            continue
        entry = Offered(sid, name=str(h.get(hdr.H_NAME, ""))[:255], size=_int(h.get(hdr.H_SIZE)),
                        chunks=_int(h.get(hdr.H_CHUNKS)), mode=str(h.get(hdr.H_MODE, "")), sender=sender,
                        offered_at=at, pack=h.get("_pack"), redriven_by=str(h.get(H_REDRIVEN_BY, ""))[:256])
        if "_invalid" in h:
            entry.kind, entry.note = "invalid", f"invalid pack: {h['_invalid']}"
        elif "_sealed" in h:
            entry.kind = "inline"
        else:
            try:
                p.parse_offer(h, dest, sender=sender)
            except ProtocolError as exc:
                entry.kind, entry.note = "invalid", str(exc)
            else:
                if h.get(hdr.H_REOFFER) == "1":
                    entry.kind = "re-offer"
                elif h.get(bw.H_INLINE) == "1":
                    entry.kind = "inline"
        streams.append(entry)
    return streams, batches


def parked_streams(browsed: Browsed) -> list[Parked]:
    """What a browse of the parked queue shows (bodies kept for packs)."""
    out = []
    for h, frame in _offers(browsed.frames):
        out.append(Parked(
            str(h.get(hdr.H_STREAM, ""))[:hdr.MAX_STREAM_ID], name=str(h.get(hdr.H_NAME, ""))[:255],
            size=_int(h.get(hdr.H_SIZE)), first_sender=p.sender_of(frame.headers, parked=True),
            not_before=p.parked_until(frame.headers) or None, yields=p.yields_of(frame.headers),
            reason=str(frame.headers.get(hdr.H_YIELD_REASON, ""))[:500], pack=h.get("_pack")))
    return out


def quarantined_streams(browsed: Browsed, dest: Destination, viewer: str = "") -> list[Quarantined]:
    """What a browse of the quarantine queue shows, for ``dest`` (a named quarantine queue
    may serve several destinations).

    :param viewer: the user looking (whose sweeps kept who filed a copy).
    """
    out = []
    for frame in browsed.frames:
        h = frame.headers
        if str(h.get(hdr.H_QUARANTINED_FROM) or dest) != str(dest):
            continue
        cause = quarantine_cause(h)
        out.append(Quarantined(
            str(h.get(hdr.H_STREAM, ""))[:hdr.MAX_STREAM_ID], name=str(h.get(hdr.H_NAME, ""))[:255],
            size=_int(h.get(hdr.H_SIZE)), reason=str(h.get(hdr.H_QUARANTINE_REASON, ""))[:2000],
            by_host=str(h.get(hdr.H_QUARANTINED_BY, ""))[:255],
            by_user=quarantined_by_user(h, sweeper=viewer), at=str(h.get(hdr.H_QUARANTINED_AT, ""))[:40],
            cause=cause.label,
            redrivable=cause.redrivable, advice=cause.advice, redriven_by=str(h.get(H_REDRIVEN_BY, ""))[:256],
            sender=p.sender_of(h, parked=True)))
    return out


_NEEDS = {"offered": "read on the destination (a receiver's right)",
          "parked": "read on its parked queue (a receiver's right)",
          "quarantined": "read on the quarantine queue (on the embedded broker, the administrator's only)"}


def take_inventory(params: BrokerParams, destination: str, *, out_dirs: Iterable[str | os.PathLike[str]] = (),
                   quarantine: str | None = None, browse_limit: int = BROWSE_LIMIT,
                   previous: Mapping[str, tuple[int, float]] | None = None) -> Inventory:
    """One look at ``destination`` (see the module doc); a queue the user may not read is
    listed in ``denied``.

    :param out_dirs: receivers' output directories to read progress and batches from.
    :param quarantine: the quarantine queue receivers were given, if not ``DLQ.<name>``.
    :param browse_limit: how many messages a browser sees at most on this broker.
    :param previous: an earlier look's :func:`progress_marks`, for rates.
    """
    dest = Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: streams are kept on queues only (a topic's streams go to every "
                         "subscriber as they are sent and wait nowhere): give /queue/NAME")
    inv = Inventory(str(dest), params.url, time.time(), browse_limit=browse_limit, queues={
        "offered": str(dest), "parked": dest.parked_queue(), "quarantined": dest.quarantine_queue(quarantine)})
    with QueueSession(params, browse_limit=browse_limit) as qs:
        for section, queue in inv.queues.items():
            browsed = qs.browse(queue, keep_body=lambda f: f.headers.get(hdr.H_KIND) in (hdr.Kind.PACK.value,
                                                                                          hdr.Kind.BATCH.value))
            if browsed.denied:
                # The transport's refusal says what to grant for a transfer; a look needs other rights.
                inv.denied[section] = (f"the broker refused {params.login or '(anonymous)'} a look at {queue} "
                                       f"({params.url}): browsing needs {_NEEDS[section]}")
                continue
            inv.truncated[section] = browsed.truncated
            if section == "offered":
                inv.offered, inv.batches_offered = offered_streams(browsed, dest)
            elif section == "parked":
                inv.parked = parked_streams(browsed)
            else:
                inv.quarantined = quarantined_streams(browsed, dest, params.user)
    for out_dir in out_dirs:
        inv.in_progress.extend(partial_streams(out_dir, previous=previous))
        inv.batches.extend(batch_progress(out_dir))
    receiving = {e.stream_id for e in inv.in_progress if e.receiving_now}
    for offer in inv.offered:
        offer.receiving = offer.stream_id in receiving
    return inv


