"""Everything known about one stream (``amqstream streams show``): its copies on the
destination's queues, whether its data queues hold an end marker (probed with a selector,
so no chunk leaves the broker), where receivers note they hold it, and in each receiver's
directory its partial data, completion record and the batches that list it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_amqstream.engine.inventory import Offered, Parked, Quarantined, take_inventory
from airflow_provider_amqstream.engine.partials import InProgress
from airflow_provider_amqstream.engine.queue_tools import BROWSE_LIMIT, QueueSession
from airflow_provider_amqstream.engine.receive.claims import find_received
from airflow_provider_amqstream.engine.receive.holders import Holder
from airflow_provider_amqstream.engine.records import read_json
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, validate_stream_id
from airflow_provider_amqstream.transport.params import BrokerParams


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
    b = qs.browse(queue, selector=f"{hdr.H_KIND} = '{hdr.Kind.END.value}'")
    if b.denied:
        return QueueProbe(queue, denied=b.denied)
    end = b.frames[0] if b.frames else None
    return QueueProbe(queue, end_marker=end is not None, sender=p.sender_of(end.headers) if end else "")


def show_stream(params: BrokerParams, destination: str, stream_id: str, *,
                out_dirs: Iterable[str | os.PathLike[str]] = (), quarantine: str | None = None,
                browse_limit: int = BROWSE_LIMIT) -> StreamReport:
    """Everything known about ``stream_id`` on ``destination`` (see the module doc).

    :param out_dirs: receivers' output directories.
    :param quarantine: the quarantine queue receivers were given, if not ``DLQ.<name>``.
    :param browse_limit: how many messages a browser sees at most on this broker.
    """
    sid = validate_stream_id(stream_id)
    out_dirs = list(out_dirs)
    inv = take_inventory(params, destination, out_dirs=out_dirs, quarantine=quarantine, browse_limit=browse_limit)
    dest = Destination.parse(destination)
    rep = StreamReport(sid, inv.destination, inv.broker, truncated=inv.truncated, denied=inv.denied)
    rep.offered = [o for o in inv.offered if o.stream_id == sid or o.pack == sid]
    rep.parked = [o for o in inv.parked if o.stream_id == sid or o.pack == sid]
    rep.quarantined = [q for q in inv.quarantined if q.stream_id == sid]
    rep.in_progress = [e for e in inv.in_progress if e.stream_id == sid]
    senders = ({o.sender for o in rep.offered} | {o.first_sender for o in rep.parked}
               | {q.sender for q in rep.quarantined} | {e.sender for e in rep.in_progress})
    queues = dest.stream_queues(sid, senders)
    with QueueSession(params, browse_limit=browse_limit) as qs:
        rep.queues = [_probe(qs, q) for q in (*queues, dest.staging_queue(sid))]
        notes = qs.browse(dest.held_queue(sid))
        if notes.denied:
            rep.denied[dest.held_queue(sid)] = notes.denied
        rep.held = [asdict(h) for f in notes.frames if (h := Holder.from_headers(f.headers)) is not None]
    for out_dir in out_dirs:
        try:
            done = find_received(out_dir, sid)
        except (StreamError, OSError, ValueError) as exc:
            done = {"error": f"completion record unreadable: {exc}"}
        if done is not None:
            rep.received.append({"out_dir": str(out_dir), **done})
        # The waiting batches whose parts list it.
        for part in sorted(StateDir(out_dir).batches.glob("*/*.json")):
            try:
                data = read_json(part) or {}
            except (OSError, ValueError):
                continue
            if any(e.get("stream_id") == sid for e in data.get("entries", [])):
                rep.in_batches.append({"out_dir": str(out_dir),
                                       **{k: data.get(k) for k in ("batch_id", "part", "parts", "sender")}})
    return rep
