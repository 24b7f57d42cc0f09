"""``redrive``: a quarantined stream whose cause was fixed goes back on its destination.

A redrive proves the stream can arrive before it moves it (its cause lies outside the
stream, :func:`quarantine_cause`; its offer is valid; every chunk is there, intact, from
one sender), gathering the chunks through a staging queue because the broker pages in only
a few messages at a time. A redriven stream is the redriving user's; the original sender is
believed only where only administrators write. Steps and queues: docs/protocol.md,
"Streams an operator acts on"; identity: docs/security.md, "Identity of a redriven stream".
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from itertools import groupby
from typing import Any

from airflow_provider_amqstream.engine.inventory import take_inventory
from airflow_provider_amqstream.engine.queue_tools import (
    BROWSE_LIMIT,
    QueueSession,
    copy_headers,
    move_queue,
    take_copies,
)
from airflow_provider_amqstream.exceptions import (
    LocalProtocolError,
    ProtocolError,
    RedriveRefused,
    RemoteProtocolError,
    StreamError,
)
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.crypto import TAG
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue, validate_stream_id
from airflow_provider_amqstream.protocol.quarantine import (
    H_REDRIVE_SENDER,
    H_REDRIVEN_AT,
    H_REDRIVEN_BY,
    quarantine_cause,
    quarantined_by_user,
)
from airflow_provider_amqstream.protocol.seal import H_NONCE, H_SEAL
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

# Out-of-order chunks kept to hash the file in order while its chunks are gathered; past
# this the SHA-256 is left to the receiver (which always checks it).
HASH_REORDER_BYTES = 32 * 2**20


def _ranges(seqs: list[int]) -> str:
    # Consecutive numbers keep the same difference to their index: one group per run.
    runs = [[s for _, s in run] for _, run in groupby(enumerate(seqs), key=lambda t: t[1] - t[0])]
    out = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    text = ", ".join(out[:8])
    return text + (f" and {len(out) - 8} more ranges" if len(out) > 8 else "")


class ChunkCheck:
    """What the gathered messages of one stream add up to.

    :param spec: the stream, from its offer.
    :param offer_sender: who offered it, where the quarantine copy says (``amqs_first_sender``).
    :param sealed: a sealed stream: without its key only the count and that copies of a chunk
        agree (its seal's tag; it carries no CRC-32) can be checked.
    """

    def __init__(self, spec: p.StreamSpec, offer_sender: str = "", *, sealed: bool = False) -> None:
        self.spec, self.offer_sender, self.sealed = spec, offer_sender, sealed
        self.seen: dict[int, int] = {}
        self.end_sha: str | None = None
        self.senders: set[str] = set()
        self.problems: list[str] = []
        self.duplicates = 0
        self._hasher: Any = hashlib.sha256()
        self._next = 1
        self._held: dict[int, bytes] = {}
        self._held_bytes = 0
        self.hashing = not sealed
        self._forwarded: set[tuple[str, int, str]] = set()

    def take(self, frame: Any, *, trust_redrive_header: bool) -> dict[str, str]:
        """Check one gathered message; return the headers its staged copy carries.

        :param trust_redrive_header: it came from a queue only administrators write, so an
            ``amqs_redrive_sender`` on it (an earlier redrive's record of the stamp) is believed.
        """
        h = frame.headers
        stamp = p.sender_of(h)
        if trust_redrive_header and h.get(H_REDRIVE_SENDER):
            stamp = p.sender_of({hdr.H_USER_ID: h.get(H_REDRIVE_SENDER)})
        self.senders.add(stamp)
        body = bytes(frame.body or b"")
        sid = self.spec.stream_id
        kind = h.get(hdr.H_KIND)
        try:
            if h.get(hdr.H_STREAM) != sid:
                raise RemoteProtocolError(f"a message of stream {str(h.get(hdr.H_STREAM))[:40]!r} is on its queue")
            if kind == hdr.Kind.DATA.value:
                self._data(h, body)
            elif kind == hdr.Kind.END.value:
                self._end(h)
            else:
                raise RemoteProtocolError(f"a message that is not one of its chunks ({hdr.H_KIND}={str(kind)[:20]!r})")
        except ProtocolError as exc:
            if len(self.problems) < 20:
                self.problems.append(str(exc))
        return {H_REDRIVE_SENDER: stamp} if stamp else {}

    def _data(self, h: Any, body: bytes) -> None:
        spec, sid = self.spec, self.spec.stream_id
        seq = p.int_header(h, hdr.H_SEQ, sid, lo=1, hi=max(1, spec.chunks))
        if spec.chunks == 0:
            raise RemoteProtocolError(f"chunk {seq} of an empty stream")
        offset, length = spec.chunk_span(seq)
        if p.int_header(h, hdr.H_OFFSET, sid) != offset:
            raise RemoteProtocolError(f"chunk {seq}: offset {h.get(hdr.H_OFFSET)} is not {offset}")
        if self.sealed:
            crc = int.from_bytes(body[-TAG:], "big")
        elif crc32(body) != (crc := p.int_header(h, hdr.H_CRC, sid, hi=0xFFFFFFFF)):
            raise RemoteProtocolError(f"chunk {seq} fails its CRC-32 check (corrupt)")
        encoding = h.get(hdr.H_ENCODING)
        data = ChunkCodec.decode(str(encoding), body, length) if encoding and not self.sealed else body
        if len(data) != length and not self.sealed:
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
        if p.int_header(h, hdr.H_SIZE, sid) != spec.size or p.int_header(h, hdr.H_CHUNKS, sid) != spec.chunks:
            raise RemoteProtocolError(f"its end marker says {h.get(hdr.H_SIZE)} bytes in {h.get(hdr.H_CHUNKS)} chunks, "
                                  f"the offer {spec.size} in {spec.chunks}")
        sha = str(h.get(hdr.H_SHA256, ""))
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

    def forward(self, frame: Any) -> bool:
        """For the final move: the first copy of each chunk and of the end marker goes on;
        exact repeats stay behind."""
        h = frame.headers
        key = (str(h.get(hdr.H_KIND)), int(h.get(hdr.H_SEQ) or 0), str(h.get(hdr.H_CRC) or h.get(H_NONCE) or ""))
        first = key not in self._forwarded
        self._forwarded.add(key)
        return first


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


def _offer_headers(copy: Any) -> dict[str, str]:
    """A quarantine copy's headers as a fresh offer: without what the quarantine and earlier
    yields added."""
    h = copy_headers(copy)
    for k in list(h):
        # The prefixes cover amqs_quarantined_user, amqs_redriven_by/_at and amqs_redrive_sender.
        if k.startswith(("amqs_quarantine", "amqs_redrive")) or k in (
                hdr.H_NOT_BEFORE, hdr.H_YIELDS, hdr.H_YIELD_REASON, hdr.H_FIRST_SENDER, hdr.H_REOFFER):
            h.pop(k)
    return h


def _believed_copies(copies: list[Any], trusted: set[str], *, user: str, sid: str, dest: Destination,
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


def redrive(params: BrokerParams, destination: str, stream_id: str, *, quarantine: str | None = None,
            quiet: float = 1.0, browse_limit: int = BROWSE_LIMIT, receivers: Iterable[str] = ()) -> RedriveResult:
    """Put quarantined stream ``stream_id`` back on ``destination`` if it can arrive (see the
    module doc); raise :class:`RedriveRefused` saying why not.

    Needs, on the broker, read and write on the quarantine queue and on ``DLQ.NAME.amqs.>``,
    read and write on ``NAME.amqs.<sender>.<id>`` and on the redriving user's own data queue,
    write on ``NAME``, and read on ``NAME`` and its parked queue (the embedded broker: the
    administrator).

    :param quarantine: the quarantine queue its receiver was given, if not ``DLQ.<name>``.
    :param quiet: seconds without a message that mean a queue has no more of the stream.
    :param browse_limit: how many messages a browser sees at most on this broker.
    :param receivers: users besides the redriving one whose quarantine copies are believed
        (the users your receivers connect as); a copy filed by anyone else is refused.
    """
    t0 = time.monotonic()
    sid = validate_stream_id(stream_id)
    dest = Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: only streams of queues are quarantined; give /queue/NAME")
    qq = dest.quarantine_queue(quarantine)
    # The redriving user offers it again, so its chunks go to that user's data queue.
    stage_q, target_q = dest.staging_queue(sid), dest.data_queue(sid, params.user)
    where = f"stream {sid} on {dest}"
    with QueueSession(params, client_id="amqstream-redrive", browse_limit=browse_limit) as qs:
        qs.require_read((qq, stage_q, target_q))
        # An offer or parked copy of it is another stream under its id (or the same one sent
        # again), whose chunks share its data queue. A batch list under its id is no offer.
        seen = take_inventory(params, destination, quarantine=quarantine, browse_limit=browse_limit)
        if denied := seen.denied.get("offered") or seen.denied.get("parked"):
            raise StreamError(denied)
        if busy := [seen.queues[k] for k, found in (("offered", seen.offered), ("parked", seen.parked))
                    if any(e.stream_id == sid for e in found)]:
            raise RedriveRefused(
                f"{where}: an offer for {sid} waits on {busy[0]} (the stream sent again, or another stream under the "
                f"same id), and receivers keep one record per id. Nothing was moved: redrive once that one is "
                f"received, or discard it (`amqstream streams discard {sid} --from {dest}`).")
        link = qs.link
        copies, sub = take_copies(link, qq, dest, sid, quarantine=True, quiet=quiet, user=params.user)
        try:
            if not copies:
                raise StreamError(f"{where}: no quarantine copy of it on {qq}. `amqstream streams ls --from {dest}` "
                                  "lists the quarantined streams (give --quarantine if its receiver used another "
                                  "queue).")
            copies = _believed_copies(copies, {params.user, *receivers}, user=params.user, sid=sid, dest=dest, qq=qq)
            copy = max(copies, key=lambda f: str(f.headers.get(hdr.H_QUARANTINED_AT, "")))
            cause = quarantine_cause(copy.headers)
            if not cause.redrivable:
                raise RedriveRefused(f"{where} cannot be redriven: {cause.advice}. Quarantined because: "
                                     f"{str(copy.headers.get(hdr.H_QUARANTINE_REASON, ''))[:500]}")
            offer = _offer_headers(copy)
            first = p.sender_of(copy.headers, parked=True)
            try:
                spec, data_q = p.parse_offer(offer, dest, sender=first)
            except ProtocolError as exc:
                raise RedriveRefused(f"{where} cannot be redriven: its offer is invalid ({exc})") from None
            dlq_q = dead_letter_queue(data_q)
            qs.require_read((dlq_q, data_q))
            # A redrive interrupted after gathering left the chunks in the staging queue: they
            # go back where checked chunks wait, then everything is gathered again.
            recovered = move_queue(link, stage_q, dlq_q, quiet=quiet).messages
            check = ChunkCheck(spec, first, sealed=bool(offer.get(H_SEAL)))
            move_queue(link, dlq_q, stage_q, quiet=quiet, decide=lambda f: check.take(f, trust_redrive_header=True))
            move_queue(link, data_q, stage_q, quiet=quiet, decide=lambda f: check.take(f, trust_redrive_header=False))
            problems = check.verdict()
            if problems:
                back = move_queue(link, stage_q, dlq_q, quiet=quiet)
                raise RedriveRefused(
                    f"{where} cannot be redriven: {'; '.join(problems)}. Its {back.messages} messages are on {dlq_q} "
                    f"and its offer stays quarantined on {qq}; `amqstream streams discard {sid} --from {dest}` "
                    "removes them, and the sender can send the file again.")
            sender_before = check.sender
            marks = {H_REDRIVEN_BY: params.user,
                     H_REDRIVEN_AT: datetime.now(timezone.utc).isoformat(timespec="seconds")}
            moved = move_queue(link, stage_q, target_q, quiet=quiet,
                               decide=lambda f: marks if check.forward(f) else None)
            link.send_confirmed(str(dest), b"", {**offer, hdr.H_DATA_DEST: target_q, **marks,
                                                 H_REDRIVE_SENDER: sender_before})
            for frame in copies:
                link.ack(frame)
        finally:
            if link.connected:
                link.unsubscribe(sub)  # copies not acknowledged go back to the quarantine queue
    log.info("%s redriven by %s: %d chunks, %d bytes, sent by %s before", where, params.user or "?", spec.chunks,
             moved.bytes, sender_before or "an unidentified sender")
    return RedriveResult(sid, str(dest), cause.label, spec.chunks, moved.bytes, moved.dropped, sender_before,
                         params.user, check.sha256_checked, recovered, time.monotonic() - t0)
