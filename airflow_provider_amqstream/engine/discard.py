"""``discard``: a stream that can never arrive is removed everywhere on its destination.

It takes a stream's messages everywhere on its destination: offers, parked and
quarantine copies, chunks (data queue, its DLQ, the staging queue), handshake control
messages, and, in the receivers' directories given, its partial data. A stream whose offer
a receiver holds right now is refused: its chunks are in use.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_amqstream.engine.inventory import offered_streams
from airflow_provider_amqstream.engine.queue_tools import (
    BROWSE_LIMIT,
    QueueSession,
    move_queue,
    take_copies,
    take_matching,
)
from airflow_provider_amqstream.engine.receive.partial_file import held_inodes, locked_now
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import DestinationFull, DiscardRefused, LocalProtocolError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import quarantine as qr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue, validate_stream_id
from airflow_provider_amqstream.transport.link import Link, Message
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)


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

    def take(self, link: Link, queue: str, frames: list[Message]) -> None:
        """Acknowledge ``frames``, held from ``queue``: they are removed."""
        for frame in frames:
            self.broker_bytes += len(frame.body or b"")
            link.ack(frame)
        if frames:
            self.removed[queue] = len(frames)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_freed": self.bytes_freed, "messages": self.messages}


def _take_offers(qs: QueueSession, dest: Destination, sid: str, result: DiscardResult, quiet: float) -> set[str]:
    """Remove the stream's fresh offers on the destination, with a selector only (a sweep
    would re-send the others with our stamp); refuse while a receiver holds one. Returns
    their senders, and those of the offers seen, which name its data queues."""
    link = qs.link

    def is_offer(frame: Message) -> bool:
        return frame.headers.get(hdr.H_STREAM) == sid and frame.headers.get(hdr.H_KIND) == hdr.Kind.OFFER.value

    offers, sub = take_matching(link, str(dest), is_offer, sweep=False, quiet=quiet,
                                selector=f"{hdr.H_KIND} = 'offer' AND {qr.copies_selector(sid)}")
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
        result.take(link, str(dest), offers)
        if browsed.truncated and not offers:
            result.notes.append(f"{dest} holds more offers than a consumer with a selector sees: an offer of it "
                                "further back, if any, was not reached (run discard again once receivers took "
                                "the ones ahead)")
        return {p.sender_of(f.headers) for f in offers} | {o.sender for o in seen if o.stream_id == sid}
    finally:
        link.unsubscribe(sub)  # what was not acknowledged goes back


def _remove_partials(out_dirs: list[str], sid: str, result: DiscardResult) -> None:
    for out_dir in out_dirs:
        for f in StateDir(out_dir).stream_files(sid):
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

    :param quarantine: the quarantine queue its receiver was given, if not ``DLQ.<name>``.
    :param out_dirs: receivers' output directories whose partial data of it goes too.
    :param quiet: seconds without a message that mean a queue has no more of the stream.
    :param browse_limit: how many messages a browser sees at most on this broker.
    """
    sid = validate_stream_id(stream_id)
    dest = Destination.parse(destination)
    if dest.kind != "queue":
        raise LocalProtocolError(f"{destination}: streams wait on queues only; give /queue/NAME")
    dirs = [str(d) for d in out_dirs]
    result = DiscardResult(sid, str(dest))
    where = f"stream {sid} on {dest}"
    held = held_inodes() or set()  # receivers' locks, read from /proc/locks: looking takes none
    for out_dir in dirs:
        part = StateDir(out_dir).part(sid)
        try:
            st = os.stat(part, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if locked_now(st, held):
            raise DiscardRefused(f"{where} is being received into {out_dir} right now (a receiver holds {part}); "
                                 "nothing was removed. Stop that receiver, or wait for the stream to yield.")
    qq = dest.quarantine_queue(quarantine)
    step = min(quiet, 0.5)
    with QueueSession(params, client_id="amqstream-discard", browse_limit=browse_limit) as qs:
        qs.require_read((qq, dest.parked_queue(), dead_letter_queue(dest.data_queue(sid, params.user)),
                           dest.staging_queue(sid),
                           dest.control_queue(sid)))
        senders = _take_offers(qs, dest, sid, result, step)
        link = qs.link
        for queue in (dest.parked_queue(), qq):
            frames, sub = take_copies(link, queue, dest, sid, quarantine=queue == qq, quiet=step, user=params.user)
            result.take(link, queue, frames)
            link.unsubscribe(sub)
            # Their first senders name its data queues.
            senders |= {p.sender_of(f.headers, parked=True) for f in frames}
        for queue in (*dest.stream_queues(sid, senders), dest.staging_queue(sid), dest.control_queue(sid),
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
