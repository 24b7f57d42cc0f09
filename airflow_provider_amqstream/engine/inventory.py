"""Where every stream of a destination is: the picture behind ``amqstream streams`` and the
Airflow page, read without consuming or reordering anything.

From the broker, with queue browsers (docs/protocol.md, "Destinations"):

* ``/queue/NAME``: streams **offered** and not yet received (offers, inline offers, packs of
  them, batch lists); an offer a receiver holds right now is shown too (a browser sees
  messages in flight);
* ``/queue/NAME.amqs_parked``: streams that **yielded** their place, until when and why;
* ``/queue/DLQ.NAME`` (or the quarantine a receiver was given): **quarantined** streams, why,
  where and when, and whether ``redrive`` can help (:func:`quarantine_cause`).

A browser sees at most ``maxBrowsePageSize`` messages of a queue (16 in the shipped config);
a section that shows that many says it may be cut (``truncated``). What the user may not
read is named (``denied``), and the other sections are still shown.

From a receiver's output directory (``out_dir/.amqstream/``), read only:

* ``<id>.part`` and ``<id>.json``: streams **in progress** (bytes durable, whether a receiver
  holds the file now, when it last grew, and a rate between two looks);
* ``batches/<sender>/<batch>.<part>.json``: **incomplete batches** (files in / announced).

Nothing here reads a chunk: a stream's data queues are only probed for its end marker (a
selector, so no chunk body leaves the broker).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.queue_tools import BROWSE_LIMIT, Browsed, QueueSession
from airflow_provider_amqstream.engine.receive.claims import find_received, find_received_many
from airflow_provider_amqstream.engine.receive.holders import Holder
from airflow_provider_amqstream.engine.records import STATE_DIR_NAME, read_json
from airflow_provider_amqstream.exceptions import LocalProtocolError, StreamError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.outcomes import Outcome
from airflow_provider_amqstream.protocol.state import ReceiverState
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

# Headers the views and actions add (docs/protocol.md, "Streams an operator acts on").
# Who a quarantine copy was filed by, kept when a sweep re-sends the copy (and so re-stamps
# it): believed on quarantine queues only, which only receivers and administrators write.
H_QUARANTINED_USER = "amqs_quarantined_user"
# On a redriven stream's offer and chunks: who redrove it, when, and who had sent it (the
# stamp its chunks carried). Information for people; no receiver reads them as identity.
H_REDRIVEN_BY = "amqs_redriven_by"
H_REDRIVEN_AT = "amqs_redriven_at"
H_REDRIVE_SENDER = "amqs_redrive_sender"


def quarantine_queue(dest: p.Destination, quarantine: str | None = None) -> str:
    """Where a receiver files the streams of ``dest`` that can never succeed: ``quarantine``
    if one was named (``--quarantine``), else ``/queue/DLQ.<name>``."""
    if quarantine:
        return str(p.Destination.parse(quarantine))
    return f"/queue/DLQ.{dest.name}"


def dlq_data_queue(data_q: str) -> str:
    """Where the broker moves the refused chunks of a stream: ``DLQ.`` + its data queue
    (``data_q``, as :meth:`~airflow_provider_amqstream.protocol.wire.Destination.data_queue`
    names it)."""
    return "/queue/DLQ." + data_q.split("/", 2)[2]


def stream_data_queues(dest: p.Destination, stream_id: str, senders: Iterable[str]) -> list[str]:
    """Every queue that may hold chunks of ``stream_id``: its data queue under each sender it
    is known by (data queues are named after their sender) and the DLQ of each."""
    return [q for s in sorted(set(senders)) for q in (dest.data_queue(stream_id, s), dlq_data_queue(
        dest.data_queue(stream_id, s)))]


def staging_queue(dest: p.Destination, stream_id: str) -> str:
    """Where ``redrive`` gathers a stream's chunks while it checks them (under ``DLQ.``, which
    only administrators read: nothing else takes them from there)."""
    return f"/queue/DLQ.{dest.name}.amqs_redrive.{p.validate_stream_id(stream_id)}"


def extra_list(extra: Mapping[str, Any], key: str) -> list[str]:
    """A connection extra holding a list: a JSON list, or a comma-separated string.

    :param extra: the connection's extra, decoded.
    :param key: the extra's name.
    """
    value = extra.get(key)
    if value in (None, ""):
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


# --------------------------------------------------------------------------- quarantine causes
def quarantine_cause(headers: Mapping[str, Any]) -> Outcome:
    """Why a stream was quarantined, from the quarantine copy of its offer: the cause its
    receiver wrote (``amqs_quarantine_cause``), unless the copy cannot give the stream back
    (an inline file or a pack keeps no body, a handshake stream needs its live sender).
    A copy without a cause this table knows counts as a bad stream.

    :param headers: the copy's headers as the broker delivered them.
    """
    if bw.is_pack(headers) or headers.get(bw.H_INLINE) == "1":
        return Outcome.INLINE
    if headers.get(p.H_MODE) == p.Mode.HANDSHAKE.value:
        return Outcome.HANDSHAKE
    return Outcome.parse(headers.get(p.H_QUARANTINE_CAUSE)) or Outcome.INVALID


# --------------------------------------------------------------------------- views
def _int(value: Any) -> int | None:
    text = str(value or "")
    return int(text) if re.fullmatch(r"[0-9]{1,20}", text) else None


def _stamp_time(headers: Mapping[str, Any]) -> float | None:
    """When the broker accepted a message (its ``timestamp`` header, milliseconds)."""
    ms = _int(headers.get("timestamp"))
    return ms / 1000.0 if ms else None


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
    :param yields: how many times it yielded.
    :param reason: why it yielded last.
    :param parked_at: when it was parked last (epoch seconds).
    """

    stream_id: str
    name: str = ""
    size: int | None = None
    first_sender: str = ""
    not_before: float | None = None
    yields: int = 0
    reason: str = ""
    parked_at: float | None = None
    pack: str | None = None


@dataclass
class Quarantined:
    """A stream filed away as one that cannot succeed as it is.

    :param reason: the receiver's reason.
    :param quarantined_from: the destination it was offered on.
    :param by_host: the receiver's host.
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
    quarantined_from: str = ""
    by_host: str = ""
    by_user: str = ""
    sender: str = ""
    at: str = ""
    cause: str = ""
    redrivable: bool = False
    advice: str = ""
    redriven_by: str = ""


@dataclass
class InProgress:
    """A stream partly received into an output directory.

    :param durable_bytes: bytes on disk and recorded (a resumed reception starts there).
    :param receiving_now: a receiver holds the partial file open (its lock), or None where
        this cannot be told.
    :param last_progress_at: when the partial file last grew (epoch seconds).
    :param since: when its reception began (epoch seconds; None for partial data older than
        this record).
    :param rate: bytes per second between two looks, when there were two.
    :param sender: who sent it, as the broker stamped it.
    """

    stream_id: str
    out_dir: str
    name: str = ""
    size: int | None = None
    durable_bytes: int = 0
    receiving_now: bool | None = None
    last_progress_at: float | None = None
    since: float | None = None
    rate: float | None = None
    sender: str = ""

    @property
    def percent(self) -> float | None:
        return 100.0 * self.durable_bytes / self.size if self.size else None


@dataclass
class BatchProgress:
    """A batch an output directory waits on: its files in, of those announced.

    :param files_announced: files listed in the parts that arrived (all of them once
        ``parts_seen == parts``).
    :param files_in: of those, files published here by the same sender.
    """

    batch_id: str
    sender: str
    out_dir: str
    parts_seen: int
    parts: int
    files_announced: int
    files_in: int
    since: float | None = None


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


# --------------------------------------------------------------------------- broker side
def _offers(frames: Iterable[Any]) -> list[tuple[dict[str, Any], Any]]:
    """The streams in the messages of a queue of offers: each (headers, frame), a pack's
    members each on their own (headers from the pack's index)."""
    out: list[tuple[dict[str, Any], Any]] = []
    for frame in frames:
        headers = dict(frame.headers)
        if bw.is_pack(headers):
            try:
                members = bw.read_pack(headers, frame.body or b"")
            except p.ProtocolError as exc:
                out.append(({**headers, "_invalid": str(exc)}, frame))
                continue
            for member, _ in members:
                out.append(({**headers, **member, "_pack": str(headers.get(p.H_STREAM, ""))}, frame))
            continue
        out.append((headers, frame))
    return out


def offered_streams(browsed: Browsed, dest: p.Destination) -> tuple[list[Offered], list[BatchAnnounced]]:
    """What a browse of the queue of offers shows: streams and batch lists.

    :param browsed: the browse of ``/queue/NAME`` (bodies kept for packs and batches).
    :param dest: the destination.
    """
    streams: list[Offered] = []
    batches: list[BatchAnnounced] = []
    for h, frame in _offers(browsed.frames):
        sid = str(h.get(p.H_STREAM, ""))[:p.MAX_STREAM_ID]
        sender = p.sender_of(frame.headers)
        at = _stamp_time(frame.headers)
        kind = h.get(p.H_KIND)
        if kind == p.Kind.BATCH.value:
            try:
                batch_id, part, parts, entries = bw.parse_batch(h, frame.body or b"")
                batches.append(BatchAnnounced(batch_id, part, parts, len(entries), sender, at))
            except p.ProtocolError as exc:
                streams.append(Offered(sid, kind="invalid", sender=sender, offered_at=at, note=str(exc)))
            continue
        entry = Offered(sid, name=str(h.get(p.H_NAME, ""))[:255], size=_int(h.get(p.H_SIZE)),
                        chunks=_int(h.get(p.H_CHUNKS)), mode=str(h.get(p.H_MODE, "")), sender=sender,
                        offered_at=at, pack=h.get("_pack"), redriven_by=str(h.get(H_REDRIVEN_BY, ""))[:256])
        if "_invalid" in h:
            entry.kind, entry.note = "invalid", f"invalid pack: {h['_invalid']}"
        else:
            try:
                p.parse_offer(h, dest, sender=sender)
            except p.ProtocolError as exc:
                entry.kind, entry.note = "invalid", str(exc)
            else:
                if h.get(p.H_REOFFER) == "1":
                    entry.kind = "re-offer"
                elif h.get(bw.H_INLINE) == "1":
                    entry.kind = "inline"
        streams.append(entry)
    return streams, batches


def parked_streams(browsed: Browsed, dest: p.Destination) -> list[Parked]:
    """What a browse of the parked queue shows.

    :param browsed: the browse of ``/queue/NAME.amqs_parked`` (bodies kept for packs).
    :param dest: the destination.
    """
    out = []
    for h, frame in _offers(browsed.frames):
        out.append(Parked(
            str(h.get(p.H_STREAM, ""))[:p.MAX_STREAM_ID], name=str(h.get(p.H_NAME, ""))[:255],
            size=_int(h.get(p.H_SIZE)), first_sender=p.sender_of(frame.headers, parked=True),
            not_before=p.parked_until(frame.headers) or None, yields=p.yields_of(frame.headers),
            reason=str(frame.headers.get(p.H_YIELD_REASON, ""))[:500], parked_at=_stamp_time(frame.headers),
            pack=h.get("_pack")))
    return out


def quarantined_by_user(headers: Mapping[str, Any], *, sweeper: str = "") -> str:
    """The user who filed a quarantine copy: the broker's stamp, or the header a sweep keeps
    when the stamp is ``sweeper``'s (only a copy that user re-sent; anyone may write the header).

    :param headers: the copy's headers as delivered.
    :param sweeper: the user whose sweeps (redrive, discard) re-send copies.
    """
    stamp = p.sender_of(headers)
    return p.sender_of({p.H_USER_ID: headers.get(H_QUARANTINED_USER)}) or stamp \
        if sweeper and stamp == sweeper else stamp


def quarantined_streams(browsed: Browsed, dest: p.Destination, viewer: str = "") -> list[Quarantined]:
    """What a browse of the quarantine queue shows, for ``dest`` (a named quarantine queue
    may serve several destinations).

    :param browsed: the browse of the quarantine queue.
    :param dest: the destination.
    :param viewer: the user looking (whose sweeps kept who filed a copy).
    """
    out = []
    for frame in browsed.frames:
        h = frame.headers
        source = str(h.get(p.H_QUARANTINED_FROM, ""))
        if source and source != str(dest):
            continue
        cause = quarantine_cause(h)
        out.append(Quarantined(
            str(h.get(p.H_STREAM, ""))[:p.MAX_STREAM_ID], name=str(h.get(p.H_NAME, ""))[:255],
            size=_int(h.get(p.H_SIZE)), reason=str(h.get(p.H_QUARANTINE_REASON, ""))[:2000],
            quarantined_from=source, by_host=str(h.get(p.H_QUARANTINED_BY, ""))[:255],
            by_user=quarantined_by_user(h, sweeper=viewer), at=str(h.get(p.H_QUARANTINED_AT, ""))[:40],
            cause=cause.label,
            redrivable=cause.redrivable, advice=cause.advice, redriven_by=str(h.get(H_REDRIVEN_BY, ""))[:256],
            sender=p.sender_of(h, parked=True)))
    return out


def _keep_pack_or_batch(frame: Any) -> bool:
    return frame.headers.get(p.H_KIND) in (p.Kind.PACK.value, p.Kind.BATCH.value)


# --------------------------------------------------------------------------- receiver side
def held_inodes() -> set[tuple[int, int, int]] | None:
    """(major, minor, inode) of every file some process holds a lock on (``/proc/locks``),
    or None where the kernel does not say. Reading it takes no lock: a receiver trying its
    own lock at that moment is never disturbed."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    held = set()
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a blocked waiter has "->" first)
        if parts and parts[1] == "->":
            parts = parts[1:]
        if len(parts) < 6:
            continue
        try:
            major, minor, inode = parts[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
        except ValueError:
            continue
    return held


def partial_streams(out_dir: str | os.PathLike[str], *, previous: Mapping[str, tuple[int, float]] | None = None,
                    ) -> list[InProgress]:
    """The streams partly received into ``out_dir``, from its state directory, read only.

    :param out_dir: a receiver's output directory.
    :param previous: an earlier look's ``{stream id: (durable bytes, monotonic time)}``, to
        measure a rate (see :func:`progress_marks`).
    """
    sdir = Path(out_dir) / STATE_DIR_NAME
    try:
        names = sorted(e.name for e in os.scandir(sdir) if e.name.endswith(".part"))
    except (FileNotFoundError, NotADirectoryError):
        return []
    held = held_inodes()
    out = []
    for name in names:
        sid = name[: -len(".part")]
        try:
            p.validate_stream_id(sid)
            st = os.stat(sdir / name, follow_symlinks=False)
        except (p.ProtocolError, OSError):
            continue
        entry = InProgress(sid, str(out_dir), last_progress_at=st.st_mtime)
        try:
            state = read_json(sdir / f"{sid}.json")
        except (OSError, ValueError) as exc:
            log.warning("stream %s in %s: resume state unreadable (%s)", sid, out_dir, exc)
            state = None
        if state is not None:
            try:
                rs = ReceiverState.from_json(state)
                entry.name, entry.size, entry.durable_bytes = rs.spec.name, rs.spec.size, rs.received_bytes
            except (p.ProtocolError, KeyError, TypeError, ValueError) as exc:
                log.warning("stream %s in %s: resume state not understood (%s)", sid, out_dir, exc)
            entry.sender = str(state.get("sender") or "")
            if isinstance(state.get("started_at"), (int, float)):
                entry.since = float(state["started_at"])
        if held is not None:
            entry.receiving_now = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held
        if previous and sid in previous:
            before, when = previous[sid]
            dt = time.monotonic() - when
            if dt > 0 and entry.durable_bytes >= before:
                entry.rate = (entry.durable_bytes - before) / dt
        out.append(entry)
    return out


def progress_marks(entries: Iterable[InProgress]) -> dict[str, tuple[int, float]]:
    """``previous`` for the next :func:`partial_streams`: where each stream stands now."""
    now = time.monotonic()
    return {e.stream_id: (e.durable_bytes, now) for e in entries}


def _valid_id(sid: str) -> bool:
    try:
        p.validate_stream_id(sid)
    except p.ProtocolError:
        return False
    return True


def batch_progress(out_dir: str | os.PathLike[str]) -> list[BatchProgress]:
    """The batches ``out_dir`` waits on: parts that arrived, files listed, files in.

    :param out_dir: a receiver's output directory.
    """
    sdir = Path(out_dir) / STATE_DIR_NAME
    root = sdir / "batches"
    out: list[BatchProgress] = []
    try:
        owners = sorted(d for d in root.iterdir() if d.is_dir() and not d.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return out
    for owner in owners:
        for first in sorted(owner.glob("*.1.json")):
            batch_id = first.name[: -len(".1.json")]
            try:
                head = read_json(first) or {}
                parts = int(head.get("parts", 1))
                seen, listed = [], []
                for k in range(1, min(parts, bw.MAX_BATCH_PARTS) + 1):
                    part = head if k == 1 else read_json(owner / f"{batch_id}.{k}.json")
                    if part is not None:
                        seen.append(k)
                        listed.extend(str(e.get("stream_id", "")) for e in part.get("entries", []))
                sender = str(head.get("sender") or "")
                try:
                    known = find_received_many(out_dir, [sid for sid in listed if _valid_id(sid)])
                except (StreamError, OSError, ValueError):
                    known = {}
                files_in = sum(str(rec.get("sender") or "") == sender for rec in known.values())
                out.append(BatchProgress(batch_id, sender, str(out_dir), len(seen), parts, len(listed), files_in,
                                         first.stat().st_mtime))
            except (OSError, ValueError, TypeError, AttributeError) as exc:
                log.warning("batch %s in %s: its recorded parts are unreadable (%s)", batch_id, owner, exc)
    return out


# --------------------------------------------------------------------------- the whole picture
def take_inventory(params: BrokerParams, destination: str, *, out_dirs: Iterable[str | os.PathLike[str]] = (),
                   quarantine: str | None = None, browse_limit: int = BROWSE_LIMIT,
                   previous: Mapping[str, tuple[int, float]] | None = None) -> Inventory:
    """One look at ``destination``: the broker's queues of it (browsed) and the receivers'
    directories given (read). Consumes, reorders and writes nothing.

    :param params: the broker and user (browsing needs read rights on each queue; a queue
        the user may not read is listed in ``denied``).
    :param destination: ``/queue/NAME``.
    :param out_dirs: receivers' output directories to read progress and batches from.
    :param quarantine: the quarantine queue receivers were given, if not ``DLQ.<name>``.
    :param browse_limit: how many messages a browser sees at most on this broker.
    :param previous: an earlier look's :func:`progress_marks`, for rates.
    """
    dest = p.Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: streams are kept on queues only (a topic's streams go to every "
                         "subscriber as they are sent and wait nowhere): give /queue/NAME")
    inv = Inventory(str(dest), params.url, time.time(), browse_limit=browse_limit)
    queues = {"offered": str(dest), "parked": dest.parked_queue(), "quarantined": quarantine_queue(dest, quarantine)}
    inv.queues = dict(queues)
    with QueueSession(params, browse_limit=browse_limit) as qs:
        for section, queue in queues.items():
            browsed = qs.browse(queue, keep_body=_keep_pack_or_batch)
            if browsed.denied:
                inv.denied[section] = _denied_text(browsed.denied, queue, section)
                continue
            inv.truncated[section] = browsed.truncated
            if section == "offered":
                inv.offered, inv.batches_offered = offered_streams(browsed, dest)
            elif section == "parked":
                inv.parked = parked_streams(browsed, dest)
            else:
                inv.quarantined = quarantined_streams(browsed, dest, params.user)
    for out_dir in out_dirs:
        inv.in_progress.extend(partial_streams(out_dir, previous=previous))
        inv.batches.extend(batch_progress(out_dir))
    receiving = {e.stream_id for e in inv.in_progress if e.receiving_now}
    for offer in inv.offered:
        offer.receiving = offer.stream_id in receiving
    return inv


_NEEDS = {"offered": "read on the destination (a receiver's right)",
          "parked": "read on its parked queue (a receiver's right)",
          "quarantined": "read on the quarantine queue (on the embedded broker, the administrator's only)"}


def _denied_text(error: str, queue: str, section: str) -> str:
    # The transport's text names broker, user and the refused queue; what to grant differs here.
    m = re.search(r"refused user (\S+):", error)
    who = m.group(1) if m else "this user"
    return f"the broker refused {who} a look at {queue}: browsing needs {_NEEDS.get(section, 'read')}"


# --------------------------------------------------------------------------- one stream
@dataclass
class QueueProbe:
    """What the broker shows of one of a stream's queues: its end marker, if it is among
    the first messages, and who sent that (without reading any chunk)."""

    queue: str
    end_marker: bool = False
    sender: str = ""
    denied: str = ""


@dataclass
class StreamReport:
    """Everything known about one stream, both sides (``amqstream streams show``)."""

    stream_id: str
    destination: str
    broker: str
    offered: list[Offered] = field(default_factory=list)
    parked: list[Parked] = field(default_factory=list)
    quarantined: list[Quarantined] = field(default_factory=list)
    in_progress: list[InProgress] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    in_batches: list[dict[str, Any]] = field(default_factory=list)
    queues: list[QueueProbe] = field(default_factory=list)
    # Receivers' notes of where they hold its partial data (host, out_dir, part, since):
    # directories on other machines that --out-dir cannot reach (engine/receive/holders.py).
    held: list[dict[str, Any]] = field(default_factory=list)
    truncated: dict[str, bool] = field(default_factory=dict)
    denied: dict[str, str] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        return bool(self.offered or self.parked or self.quarantined or self.in_progress or self.received or self.held
                    or any(q.end_marker for q in self.queues))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _probe(qs: QueueSession, queue: str) -> QueueProbe:
    # A selector for the end marker: the broker sends only that message (empty body).
    b = qs.browse(queue, selector=f"{p.H_KIND} = '{p.Kind.END.value}'")
    if b.denied:
        return QueueProbe(queue, denied=b.denied)
    end = b.frames[0] if b.frames else None
    return QueueProbe(queue, end_marker=end is not None, sender=p.sender_of(end.headers) if end else "")


def show_stream(params: BrokerParams, destination: str, stream_id: str, *,
                out_dirs: Iterable[str | os.PathLike[str]] = (), quarantine: str | None = None,
                browse_limit: int = BROWSE_LIMIT) -> StreamReport:
    """Everything known about ``stream_id`` on ``destination``: its offer, parked and
    quarantine copies, whether its data queues hold an end marker, and in each receiver's
    directory given its partial data, completion record and the batches listing it.

    :param params: the broker and user.
    :param destination: ``/queue/NAME``.
    :param stream_id: the stream.
    :param out_dirs: receivers' output directories.
    :param quarantine: the quarantine queue receivers were given, if not ``DLQ.<name>``.
    :param browse_limit: how many messages a browser sees at most on this broker.
    """
    sid = p.validate_stream_id(stream_id)
    out_dirs = list(out_dirs)
    inv = take_inventory(params, destination, out_dirs=out_dirs, quarantine=quarantine, browse_limit=browse_limit)
    dest = p.Destination.parse(destination)
    rep = StreamReport(sid, inv.destination, inv.broker, truncated=inv.truncated, denied=inv.denied)
    rep.offered = [o for o in inv.offered if o.stream_id == sid or o.pack == sid]
    rep.parked = [o for o in inv.parked if o.stream_id == sid or o.pack == sid]
    rep.quarantined = [q for q in inv.quarantined if q.stream_id == sid]
    rep.in_progress = [e for e in inv.in_progress if e.stream_id == sid]
    senders = ({o.sender for o in rep.offered} | {o.first_sender for o in rep.parked}
               | {q.sender for q in rep.quarantined} | {e.sender for e in rep.in_progress})
    queues = stream_data_queues(dest, sid, senders)
    with QueueSession(params, browse_limit=browse_limit) as qs:
        rep.queues = [_probe(qs, q) for q in (*queues, staging_queue(dest, sid))]
        notes = qs.browse(dest.held_queue(sid))
        if notes.denied:
            rep.denied[dest.held_queue(sid)] = notes.denied
        rep.held = [asdict(h) for f in notes.frames if (h := Holder.from_headers(f.headers)) is not None]
    for out_dir in out_dirs:
        sdir = Path(out_dir) / STATE_DIR_NAME
        try:
            done = find_received(out_dir, sid)
        except (StreamError, OSError, ValueError) as exc:
            done = {"error": f"completion record unreadable: {exc}"}
        if done is not None:
            rep.received.append({"out_dir": str(out_dir), **done})
        for batch in _batches_listing(sdir, sid):
            rep.in_batches.append({"out_dir": str(out_dir), **batch})
    return rep


def _batches_listing(sdir: Path, stream_id: str) -> list[dict[str, Any]]:
    """The waiting batches in a state directory whose parts list ``stream_id``."""
    found = []
    for part in sorted((sdir / "batches").glob("*/*.json")):
        try:
            data = read_json(part) or {}
        except (OSError, ValueError):
            continue
        if any(e.get("stream_id") == stream_id for e in data.get("entries", [])):
            found.append({"batch_id": data.get("batch_id"), "part": data.get("part"), "parts": data.get("parts"),
                          "sender": data.get("sender")})
    return found
