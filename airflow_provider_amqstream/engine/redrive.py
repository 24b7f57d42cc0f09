"""Acting on a stream that is stuck: ``redrive`` a quarantined one whose cause was fixed,
``discard`` one that can never arrive.

**Redrive** (docs/protocol.md, "Streams an operator acts on") puts a quarantined stream
back on its destination, intact, after proving it can arrive: its quarantine cause lies
outside the stream (over ``max_bytes``, a reused id, no room: :func:`quarantine_cause`),
its offer is valid, and its chunks (refused ones from ``DLQ.NAME.amqs.<sender>.<id>``, and
those a refusal at the offer left on ``NAME.amqs.<sender>.<id>``) are all there: every chunk 1..n with its
CRC-32, the end marker agreeing with the offer, the SHA-256 of the whole when the chunks
came in order, and all from one sender. The broker pages in only a few messages of a queue
at a time, so the chunks cannot be held while they are checked: they are gathered into a
staging queue (``DLQ.NAME.amqs_redrive.<id>``), checked on the way, and then either moved
on to the redriving user's data queue, followed by the offer (the receiver starts once
everything is there, as in atomic mode), or, when the check fails, all filed under the
stream's ``DLQ.`` data queue; a
redrive interrupted half-way is finished by the next one, which starts by returning what
the staging queue holds.

**Identity.** The broker stamps every message with the user who sends it, and a redrive
re-sends the offer and every chunk: a redriven stream is the **redriving user's** to every
receiver (its completion record names that user; a batch of the original sender no longer
lists it). Re-stamping must not launder another user's chunks into the stream, so a redrive
refuses chunks from more than one sender. The original sender travels in
``amqs_redrive_sender`` for people and logs, and is believed only where only
administrators write (the ``DLQ.`` queues), so that a second redrive of the same stream
still compares the original stamps (docs/security.md). Every receiving user may write the
quarantine queue, and a copy's ``amqs_first_sender`` names whose chunks redrive takes: a copy
is believed only when the broker stamped it with the redriving user or a user named in
``receivers`` (``--receiver``), else the redrive is refused naming who filed it.

**Discard** removes a stream's messages everywhere on its destination: offers, parked and
quarantine copies, chunks (data queue, its DLQ, the staging queue), handshake control
messages, and, in the receivers' directories given, its partial data. A stream whose offer
a receiver holds right now is refused: its chunks are in use.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.inventory import (
    H_QUARANTINED_USER,
    H_REDRIVE_SENDER,
    H_REDRIVEN_AT,
    H_REDRIVEN_BY,
    dlq_data_queue,
    held_inodes,
    offered_streams,
    parked_streams,
    quarantine_cause,
    quarantine_queue,
    quarantined_by_user,
    staging_queue,
    stream_data_queues,
)
from airflow_provider_amqstream.engine.queue_tools import (
    BROWSE_LIMIT,
    QueueSession,
    copy_headers,
    move_queue,
    take_matching,
)
from airflow_provider_amqstream.engine.records import STATE_DIR_NAME
from airflow_provider_amqstream.exceptions import (
    AccessDenied,
    DestinationFull,
    DiscardRefused,
    LocalProtocolError,
    RedriveRefused,
    RemoteProtocolError,
    StreamError,
)
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.transport.errors import cap_refusal
from airflow_provider_amqstream.transport.link import Link
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

# Out-of-order chunks kept to hash the file in order while its chunks are gathered; past
# this the SHA-256 is left to the receiver (which always checks it).
HASH_REORDER_BYTES = 32 * 2**20


def _offer_selector(sid: str) -> str:
    return f"{p.H_STREAM} = '{p.validate_stream_id(sid)}'"


def _ranges(seqs: list[int]) -> str:
    out, start = [], None
    for i, s in enumerate(seqs):
        if start is None:
            start = s
        if i + 1 == len(seqs) or seqs[i + 1] != s + 1:
            out.append(str(start) if start == s else f"{start}-{s}")
            start = None
    text = ", ".join(out[:8])
    return text + (f" and {len(out) - 8} more ranges" if len(out) > 8 else "")


class ChunkCheck:
    """What the gathered messages of one stream add up to.

    :param spec: the stream, from its offer.
    :param offer_sender: who offered it, where the quarantine copy says (``amqs_first_sender``).
    """

    def __init__(self, spec: p.StreamSpec, offer_sender: str = "") -> None:
        self.spec, self.offer_sender = spec, offer_sender
        self.seen: dict[int, int] = {}
        self.end_sha: str | None = None
        self.senders: set[str] = set()
        self.problems: list[str] = []
        self.messages = 0
        self.bytes = 0
        self.duplicates = 0
        self._hasher: Any = hashlib.sha256()
        self._next = 1
        self._held: dict[int, bytes] = {}
        self._held_bytes = 0
        self.hashing = True
        self._forwarded: set[tuple[str, int, int]] = set()

    def _problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)

    def take(self, frame: Any, *, trust_redrive_header: bool) -> dict[str, str]:
        """Check one gathered message; return the headers its staged copy carries.

        :param frame: the message.
        :param trust_redrive_header: it came from a queue only administrators write, so an
            ``amqs_redrive_sender`` on it (an earlier redrive's record of the stamp) is believed.
        """
        h = frame.headers
        stamp = p.sender_of(h)
        if trust_redrive_header and h.get(H_REDRIVE_SENDER):
            stamp = p.sender_of({p.H_USER_ID: h.get(H_REDRIVE_SENDER)})
        self.senders.add(stamp)
        self.messages += 1
        body = bytes(frame.body or b"")
        self.bytes += len(body)
        sid = self.spec.stream_id
        kind = h.get(p.H_KIND)
        try:
            if h.get(p.H_STREAM) != sid:
                raise RemoteProtocolError(f"a message of stream {str(h.get(p.H_STREAM))[:40]!r} is on its queue")
            if kind == p.Kind.DATA.value:
                self._data(h, body)
            elif kind == p.Kind.END.value:
                self._end(h)
            else:
                raise RemoteProtocolError(f"a message that is not one of its chunks ({p.H_KIND}={str(kind)[:20]!r})")
        except p.ProtocolError as exc:
            self._problem(str(exc))
        return {H_REDRIVE_SENDER: stamp} if stamp else {}

    def _data(self, h: Any, body: bytes) -> None:
        spec, sid = self.spec, self.spec.stream_id
        seq = p.int_header(h, p.H_SEQ, sid, lo=1, hi=max(1, spec.chunks))
        if spec.chunks == 0:
            raise RemoteProtocolError(f"chunk {seq} of an empty stream")
        offset, length = spec.chunk_span(seq)
        if p.int_header(h, p.H_OFFSET, sid) != offset:
            raise RemoteProtocolError(f"chunk {seq}: offset {h.get(p.H_OFFSET)} is not {offset}")
        crc = p.int_header(h, p.H_CRC, sid, hi=0xFFFFFFFF)
        if p.crc32(body) != crc:
            raise RemoteProtocolError(f"chunk {seq} fails its CRC-32 check (corrupt)")
        encoding = h.get(p.H_ENCODING)
        data = p.ChunkCodec.decode(str(encoding), body, length) if encoding else body
        if len(data) != length:
            raise RemoteProtocolError(f"chunk {seq} has {len(data)} bytes, not {length}")
        if seq in self.seen:
            if self.seen[seq] != crc:
                raise RemoteProtocolError(f"two different chunks {seq} (two streams share the id {sid} and its data "
                                      "queue?)")
            self.duplicates += 1
            return
        self.seen[seq] = crc
        self._hash(seq, data)

    def _hash(self, seq: int, data: bytes) -> None:
        if not self.hashing:
            return
        if seq != self._next:
            self._held[seq] = data
            self._held_bytes += len(data)
            if self._held_bytes > HASH_REORDER_BYTES:
                self.hashing, self._held, self._held_bytes = False, {}, 0
            return
        self._hasher.update(data)
        self._next += 1
        while self._next in self._held:
            chunk = self._held.pop(self._next)
            self._held_bytes -= len(chunk)
            self._hasher.update(chunk)
            self._next += 1

    def _end(self, h: Any) -> None:
        spec, sid = self.spec, self.spec.stream_id
        if p.int_header(h, p.H_SIZE, sid) != spec.size or p.int_header(h, p.H_CHUNKS, sid) != spec.chunks:
            raise RemoteProtocolError(f"its end marker says {h.get(p.H_SIZE)} bytes in {h.get(p.H_CHUNKS)} chunks, "
                                  f"the offer {spec.size} in {spec.chunks}")
        sha = str(h.get(p.H_SHA256, ""))
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise RemoteProtocolError("its end marker has no valid SHA-256")
        if self.end_sha is not None and self.end_sha != sha:
            raise RemoteProtocolError("two end markers with different SHA-256 (two streams share its id?)")
        if self.end_sha is not None:
            self.duplicates += 1
        self.end_sha = sha

    @property
    def sender(self) -> str:
        named = sorted(s for s in self.senders if s)
        return named[0] if len(named) == 1 else ""

    @property
    def sha256_checked(self) -> bool:
        return self.hashing and self._next > self.spec.chunks and self.end_sha is not None

    def verdict(self) -> list[str]:
        """Why the gathered messages cannot make the stream arrive (empty: they can)."""
        problems = list(self.problems)
        missing = [s for s in range(1, self.spec.chunks + 1) if s not in self.seen]
        if missing:
            problems.append(f"chunks {_ranges(missing)} of {self.spec.chunks} are missing (consumed by a receiver "
                            "before the quarantine, or never sent)")
        if self.end_sha is None:
            problems.append("its end marker is missing (the sender never finished)")
        named = sorted(s for s in self.senders if s)
        if len(named) > 1:
            problems.append(f"its messages were sent by {len(named)} users ({', '.join(named)}): a redrive re-sends "
                            "every chunk as the redriving user, so it would pass another user's chunks off as the "
                            "stream's")
        if self.offer_sender and named and named != [self.offer_sender]:
            problems.append(f"it was offered by {self.offer_sender!r} but its chunks were sent by "
                            f"{', '.join(named)}")
        if not problems and self.sha256_checked and self._hasher.hexdigest() != self.end_sha:
            problems.append("its chunks do not add up to the SHA-256 of its end marker (corrupt)")
        return problems

    def forward(self, frame: Any) -> dict[str, str] | None:
        """For the final move: the first copy of each chunk and of the end marker goes on
        (with its staged headers); exact repeats stay behind (None)."""
        h = frame.headers
        key = (str(h.get(p.H_KIND)), int(h.get(p.H_SEQ) or 0), int(h.get(p.H_CRC) or 0))
        if key in self._forwarded:
            return None
        self._forwarded.add(key)
        return {}


@dataclass
class RedriveResult:
    """A stream put back on its destination.

    :param sender_before: who had sent it (the stamp its chunks carried).
    :param redriven_by: the user who redrove it, whom receivers now record as its sender.
    :param sha256_checked: the chunks were also checked against the end marker's SHA-256
        (else only the receiver checks it, as it always does).
    :param recovered: messages of an interrupted earlier redrive returned first.
    """

    stream_id: str
    destination: str
    cause: str
    chunks: int
    bytes: int
    duplicates_dropped: int
    sender_before: str
    redriven_by: str
    sha256_checked: bool
    recovered: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _quarantine_copies(link: Link, qq: str, dest: p.Destination, sid: str, *, user: str,
                       quiet: float) -> tuple[list[Any], str | None]:
    def ours(frame: Any) -> bool:
        h = frame.headers
        return h.get(p.H_STREAM) == sid and str(h.get(p.H_QUARANTINED_FROM) or str(dest)) == str(dest)

    return take_matching(link, qq, ours, selector=_offer_selector(sid), sweep=True, quiet=quiet,
                         stamp=lambda f: {H_QUARANTINED_USER: quarantined_by_user(f.headers, sweeper=user)})


def _believed_copies(copies: list[Any], trusted: set[str], *, user: str, sid: str, dest: p.Destination,
                     qq: str) -> list[Any]:
    """The quarantine copies filed by a ``trusted`` user. Every receiving user may write the
    quarantine queue, and a copy's ``amqs_first_sender`` names whose data queue redrive takes
    chunks from: one filed by anyone else is never believed (as a receiver believes a parked
    copy only under its own stamp).

    :param user: the redriving user (whose sweeps keep who filed a copy).
    """
    filers = [quarantined_by_user(f.headers, sweeper=user) for f in copies]
    mine = [f for f, who in zip(copies, filers, strict=True) if who in trusted]
    if mine:
        return mine
    raise RedriveRefused(
        f"stream {sid} on {dest}: its quarantine copy on {qq} was filed by "
        f"{', '.join(sorted({w or 'an unidentified user' for w in filers}))}, not by a receiver redrive believes "
        f"({', '.join(sorted(u for u in trusted if u)) or 'none'}). Any receiving user may write that queue, so the "
        f"sender the copy names ({p.sender_of(copies[0].headers, parked=True) or 'none'}) proves nothing. Nothing "
        "was moved: if that user is one of your receivers, redrive with `--receiver USER`; otherwise discard it "
        f"(`amqstream streams discard {sid} --from {dest}`).")


def _offer_headers(copy: Any) -> dict[str, str]:
    """A quarantine copy's headers as a fresh offer: without what the quarantine and earlier
    yields added."""
    h = copy_headers(copy)
    for k in list(h):
        if k.startswith(("amqs_quarantine", "amqs_redrive")) or k in (
                p.H_NOT_BEFORE, p.H_YIELDS, p.H_YIELD_REASON, p.H_FIRST_SENDER, H_QUARANTINED_USER, H_REDRIVEN_BY,
                H_REDRIVEN_AT, p.H_REOFFER):
            h.pop(k)
    return h


def _require_read(qs: QueueSession, queues: Iterable[str]) -> None:
    """Fail before anything moves if the user may not read one of ``queues`` (a browse needs
    read): a refusal half-way would leave an action half done. A selector that matches
    nothing: no message comes back."""
    for queue in queues:
        browsed = qs.browse(queue, selector=f"{p.H_KIND} = '-'")
        if browsed.denied:
            raise AccessDenied(f"{browsed.denied} Nothing was changed: this needs read and write on {queue} (on the "
                               "embedded broker, the administrator's rights).")
        if browsed.full:
            raise cap_refusal(qs.params, browsed.full)


def _waiting_elsewhere(qs: QueueSession, dest: p.Destination, sid: str) -> str | None:
    """An offer or parked copy of ``sid`` on the destination: another stream under the same id
    (or the same one sent again), whose chunks share the data queue."""
    for queue, read in ((str(dest), lambda b: offered_streams(b, dest)[0]),
                        (dest.parked_queue(), lambda b: parked_streams(b, dest))):
        browsed = qs.browse(queue, keep_body=lambda f: bw.is_pack(f.headers))
        if browsed.denied:
            raise StreamError(browsed.denied)
        for entry in read(browsed):
            if entry.stream_id == sid:
                return queue
    return None


def redrive(params: BrokerParams, destination: str, stream_id: str, *, quarantine: str | None = None,
            quiet: float = 1.0, browse_limit: int = BROWSE_LIMIT, receivers: Iterable[str] = ()) -> RedriveResult:
    """Put quarantined stream ``stream_id`` back on ``destination`` if it can arrive (see the
    module doc); raise :class:`RedriveRefused` saying why not.

    Needs, on the broker, read and write on the quarantine queue and on ``DLQ.NAME.amqs.>``,
    read and write on ``NAME.amqs.<sender>.<id>`` and on the redriving user's own data queue,
    write on ``NAME``, and read on ``NAME`` and its parked queue (the embedded broker: the
    administrator).

    :param params: the broker and the redriving user.
    :param destination: ``/queue/NAME`` the stream was offered on.
    :param stream_id: the stream.
    :param quarantine: the quarantine queue its receiver was given, if not ``DLQ.<name>``.
    :param quiet: seconds without a message that mean a queue has no more of the stream.
    :param browse_limit: how many messages a browser sees at most on this broker.
    :param receivers: users besides the redriving one whose quarantine copies are believed
        (the users your receivers connect as); a copy filed by anyone else is refused.
    """
    t0 = time.monotonic()
    sid = p.validate_stream_id(stream_id)
    dest = p.Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: only streams of queues are quarantined; give /queue/NAME")
    qq = quarantine_queue(dest, quarantine)
    # The redriving user offers it again, so its chunks go to that user's data queue.
    stage_q, target_q = staging_queue(dest, sid), dest.data_queue(sid, params.user)
    where = f"stream {sid} on {dest}"
    with QueueSession(params, client_id="amqstream-redrive", browse_limit=browse_limit) as qs:
        _require_read(qs, (qq, stage_q, target_q))
        busy = _waiting_elsewhere(qs, dest, sid)
        if busy:
            raise RedriveRefused(
                f"{where}: an offer for {sid} waits on {busy} (the stream sent again, or another stream under the "
                f"same id), and receivers keep one record per id. Nothing was moved: redrive once that one is "
                f"received, or discard it (`amqstream streams discard {sid} --from {dest}`).")
        link = qs.link
        copies, sub = _quarantine_copies(link, qq, dest, sid, user=params.user, quiet=quiet)
        if not copies:
            raise StreamError(f"{where}: no quarantine copy of it on {qq}. `amqstream streams ls --from {dest}` "
                              "lists the quarantined streams (give --quarantine if its receiver used another "
                              "queue).")
        try:
            copies = _believed_copies(copies, {params.user, *receivers}, user=params.user, sid=sid, dest=dest, qq=qq)
            copy = max(copies, key=lambda f: str(f.headers.get(p.H_QUARANTINED_AT, "")))
            cause = quarantine_cause(copy.headers)
            if not cause.redrivable:
                raise RedriveRefused(f"{where} cannot be redriven: {cause.advice}. Quarantined because: "
                                     f"{str(copy.headers.get(p.H_QUARANTINE_REASON, ''))[:500]}")
            offer = _offer_headers(copy)
            first = p.sender_of(copy.headers, parked=True)
            try:
                spec, data_q = p.parse_offer(offer, dest, sender=first)
            except p.ProtocolError as exc:
                raise RedriveRefused(f"{where} cannot be redriven: its offer is invalid ({exc})") from None
            dlq_q = dlq_data_queue(data_q)
            _require_read(qs, (dlq_q, data_q))
            # A redrive interrupted after gathering left the chunks in the staging queue: they
            # go back where checked chunks wait, then everything is gathered again.
            recovered = move_queue(link, stage_q, dlq_q, quiet=quiet).messages
            check = ChunkCheck(spec, first)
            move_queue(link, dlq_q, stage_q, quiet=quiet, decide=lambda f: check.take(f, trust_redrive_header=True))
            move_queue(link, data_q, stage_q, quiet=quiet, decide=lambda f: check.take(f, trust_redrive_header=False))
            problems = check.verdict()
            if problems:
                back = move_queue(link, stage_q, dlq_q, quiet=quiet)
                raise RedriveRefused(
                    f"{where} cannot be redriven: {'; '.join(problems)}. Its {back.messages} messages are on {dlq_q} "
                    f"and its offer stays quarantined on {qq}; `amqstream streams discard {sid} --from {dest}` "
                    "removes them, and the sender can send the file again.")
            user = params.user
            at = datetime.now(timezone.utc).isoformat(timespec="seconds")
            sender_before = check.sender
            marks = {H_REDRIVEN_BY: user, H_REDRIVEN_AT: at}
            moved = move_queue(link, stage_q, target_q, quiet=quiet,
                               decide=lambda f: None if check.forward(f) is None else marks)
            link.send_confirmed(str(dest), b"", {**offer, p.H_DATA_DEST: target_q, **marks,
                                                 H_REDRIVE_SENDER: sender_before})
            for frame in copies:
                link.ack(frame)
        finally:
            if sub is not None and link.connected:
                link.unsubscribe(sub)  # copies not acknowledged go back to the quarantine queue
    log.info("%s redriven by %s: %d chunks, %d bytes, sent by %s before", where, user or "?", spec.chunks,
             moved.bytes, sender_before or "an unidentified sender")
    return RedriveResult(sid, str(dest), cause.label, spec.chunks, moved.bytes, moved.dropped, sender_before, user,
                         check.sha256_checked, recovered, time.monotonic() - t0)


# --------------------------------------------------------------------------- discard
@dataclass
class DiscardResult:
    """What a discard removed.

    :param removed: per queue, messages removed.
    :param broker_bytes: bytes of message bodies removed from the broker.
    :param local: partial files removed from receivers' directories.
    :param local_bytes: disk space those took.
    :param notes: what was left, and why.
    """

    stream_id: str
    destination: str
    removed: dict[str, int] = field(default_factory=dict)
    broker_bytes: int = 0
    local: list[str] = field(default_factory=list)
    local_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_freed(self) -> int:
        return self.broker_bytes + self.local_bytes

    @property
    def messages(self) -> int:
        return sum(self.removed.values())

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_freed": self.bytes_freed, "messages": self.messages}


def _partial_files(out_dir: str | os.PathLike[str], sid: str) -> list[Path]:
    sdir = Path(out_dir) / STATE_DIR_NAME
    return [f for f in (sdir / f"{sid}.part", sdir / f"{sid}.json", sdir / f"{sid}.reoffered") if os.path.lexists(f)]


def _check_not_receiving(out_dirs: list[str], sid: str, where: str) -> None:
    """Refuse (nothing removed) while a receiver holds the stream's partial file in one of
    ``out_dirs`` (its lock, read from ``/proc/locks``: looking takes no lock)."""
    held = held_inodes() or set()
    for out_dir in out_dirs:
        part = Path(out_dir) / STATE_DIR_NAME / f"{sid}.part"
        try:
            st = os.stat(part, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held:
            raise DiscardRefused(f"{where} is being received into {out_dir} right now (a receiver holds {part}); "
                             "nothing was removed. Stop that receiver, or wait for the stream to yield.")


def _take_offers(qs: QueueSession, dest: p.Destination, sid: str, result: DiscardResult, quiet: float) -> set[str]:
    """Remove the stream's fresh offers on the destination, with a selector only (a sweep
    would re-send the others with our stamp); refuse while a receiver holds one. Returns
    their senders, and those of the offers seen, which name its data queues."""
    link = qs.link

    def is_offer(frame: Any) -> bool:
        return frame.headers.get(p.H_STREAM) == sid and frame.headers.get(p.H_KIND) == p.Kind.OFFER.value

    offers, sub = take_matching(link, str(dest), is_offer, selector=f"{p.H_KIND} = 'offer' AND {_offer_selector(sid)}",
                                sweep=False, quiet=quiet)
    try:
        # A browser also sees the offers receivers hold: more of ours than we took are held.
        browsed = qs.browse(str(dest), keep_body=lambda f: bw.is_pack(f.headers))
        seen = offered_streams(browsed, dest)[0]
        if len([o for o in seen if o.stream_id == sid and o.pack is None]) > len(offers):
            raise DiscardRefused(f"stream {sid} on {dest}: a receiver holds its offer right now, so its chunks are in "
                             "use; nothing was removed. Stop that receiver, or wait for the stream to finish or yield.")
        for o in seen:
            if o.stream_id == sid and o.pack:
                result.notes.append(f"it also travels in pack {o.pack} on {dest} with other files: the pack was left "
                                    "alone (taking it would take them too)")
        for frame in offers:
            result.broker_bytes += len(frame.body or b"")
            link.ack(frame)
        if offers:
            result.removed[str(dest)] = len(offers)
        if browsed.truncated and not offers:
            result.notes.append(f"{dest} holds more offers than a consumer with a selector sees: an offer of it "
                                "further back, if any, was not reached (run discard again once receivers took "
                                "the ones ahead)")
        return {p.sender_of(f.headers) for f in offers} | {o.sender for o in seen if o.stream_id == sid}
    finally:
        if sub is not None:
            link.unsubscribe(sub)  # what was not acknowledged goes back


def _take_copies(link: Link, queue: str, sid: str, dest: p.Destination, result: DiscardResult, *, quarantine: bool,
                 quiet: float, user: str) -> set[str]:
    """Remove the stream's copies on its parked or quarantine queue (swept: their order means
    nothing; a quarantine copy passed to the tail keeps who filed it). Returns their first
    senders, which name its data queues."""
    def ours(frame: Any) -> bool:
        h = frame.headers
        return h.get(p.H_STREAM) == sid and (not quarantine or str(h.get(p.H_QUARANTINED_FROM) or dest) == str(dest))

    stamp = (lambda f: {H_QUARANTINED_USER: quarantined_by_user(f.headers, sweeper=user)}) if quarantine else None
    frames, sub = take_matching(link, queue, ours, selector=_offer_selector(sid), sweep=True, quiet=quiet, stamp=stamp)
    for frame in frames:
        result.broker_bytes += len(frame.body or b"")
        link.ack(frame)
    if frames:
        result.removed[queue] = len(frames)
    if sub is not None:
        link.unsubscribe(sub)
    return {p.sender_of(f.headers, parked=True) for f in frames}


def _remove_partials(out_dirs: list[str], sid: str, result: DiscardResult) -> None:
    for out_dir in out_dirs:
        for f in _partial_files(out_dir, sid):
            try:
                st = os.stat(f, follow_symlinks=False)
                f.unlink()
            except FileNotFoundError:
                continue
            result.local.append(str(f))
            result.local_bytes += st.st_blocks * 512


def discard(params: BrokerParams, destination: str, stream_id: str, *, quarantine: str | None = None,
            out_dirs: Iterable[str | os.PathLike[str]] = (), quiet: float = 1.0,
            browse_limit: int = BROWSE_LIMIT) -> DiscardResult:
    """Remove every message of ``stream_id`` on ``destination`` and its partial data in
    ``out_dirs`` (see the module doc). A published file and its completion record are never
    touched. Raises :class:`DiscardRefused` (removing nothing) while a receiver holds its offer
    or its partial file.

    Needs read on each of the destination's queues involved (the embedded broker: the
    administrator).

    :param params: the broker and user.
    :param destination: ``/queue/NAME``.
    :param stream_id: the stream.
    :param quarantine: the quarantine queue its receiver was given, if not ``DLQ.<name>``.
    :param out_dirs: receivers' output directories whose partial data of it goes too.
    :param quiet: seconds without a message that mean a queue has no more of the stream.
    :param browse_limit: how many messages a browser sees at most on this broker.
    """
    sid = p.validate_stream_id(stream_id)
    dest = p.Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: streams wait on queues only; give /queue/NAME")
    dirs = [str(d) for d in out_dirs]
    result = DiscardResult(sid, str(dest))
    where = f"stream {sid} on {dest}"
    _check_not_receiving(dirs, sid, where)
    qq = quarantine_queue(dest, quarantine)
    step = min(quiet, 0.5)
    with QueueSession(params, client_id="amqstream-discard", browse_limit=browse_limit) as qs:
        _require_read(qs, (qq, dest.parked_queue(), dlq_data_queue(dest.data_queue(sid, params.user)),
                           staging_queue(dest, sid),
                           dest.control_queue(sid)))
        senders = _take_offers(qs, dest, sid, result, step)
        link = qs.link
        senders |= _take_copies(link, dest.parked_queue(), sid, dest, result, quarantine=False, quiet=step,
                                user=params.user)
        senders |= _take_copies(link, qq, sid, dest, result, quarantine=True, quiet=step, user=params.user)
        for queue in (*stream_data_queues(dest, sid, senders), staging_queue(dest, sid), dest.control_queue(sid),
                      dest.held_queue(sid)):
            try:
                gone = move_queue(qs.link, queue, None, quiet=step)
            except DestinationFull:
                qs.reset()  # it does not exist and its sender's cap forbids making it: nothing there
                continue
            if gone.dropped:
                result.removed[queue] = gone.dropped
                result.broker_bytes += gone.dropped_bytes
    _remove_partials(dirs, sid, result)
    log.info("%s discarded: %d messages (%d bytes) from the broker, %d local files (%d bytes)", where,
             result.messages, result.broker_bytes, len(result.local), result.local_bytes)
    return result
