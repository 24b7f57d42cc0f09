"""Who holds a stream's partial data: notes on the broker, so that a receiver on another
machine can say where a stream's first bytes went instead of dead-lettering the rest.

A receiver acknowledges a stream's chunks as they become durable in its output directory,
so once it has taken some, they are on that directory's disk and nowhere else. If it dies
and a retry runs on another machine (Airflow's CeleryExecutor or Kubernetes: another
worker, another disk), the retry finds the offer but not the partial data: the first chunks
were consumed and cannot come again. Before it takes any chunk, a receiver therefore leaves
a note on :meth:`~airflow_provider_amqstream.protocol.names.Destination.held_queue` naming
its host, output directory and partial file. A receiver that has none of a stream's data
looks there first: a note from elsewhere means the stream's remaining chunks belong with
that data, so it leaves them on the broker, yields its place and says where the data is
and how to finish (:func:`elsewhere_report`).

Notes are removed when the stream is published or quarantined (its chunks are then settled
for every holder), and by ``amqstream streams discard``. One per receiving directory; a
stream that fits in one acknowledgement window needs none (nothing is acknowledged before
it is published).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.link import Link

log = logging.getLogger(__name__)

# Longest header value a note keeps (a path): a note is a label, not a channel.
MAX_VALUE = 1024


@dataclass(frozen=True)
class Holder:
    """Where one receiver keeps a stream's partial data.

    :param out_dir: its output directory (absolute).
    :param since: when it began holding the stream (epoch seconds).
    """

    host: str
    out_dir: str
    part: str
    since: float = 0.0

    def same_place(self, other: Holder) -> bool:
        """The same directory on the same host (a shared directory seen from two hosts is
        two places: only a receiver that finds the partial file can tell they are one)."""
        return (self.host, self.out_dir) == (other.host, other.out_dir)

    def headers(self, stream_id: str) -> dict[str, str]:
        return {hdr.H_KIND: "held", hdr.H_STREAM: stream_id, hdr.H_HELD_HOST: self.host[:MAX_VALUE],
                hdr.H_HELD_DIR: self.out_dir[:MAX_VALUE], hdr.H_HELD_PART: self.part[:MAX_VALUE],
                hdr.H_HELD_SINCE: f"{self.since:.0f}"}

    @classmethod
    def from_headers(cls, headers: Mapping[str, object]) -> Holder | None:
        host, out_dir = str(headers.get(hdr.H_HELD_HOST, "")), str(headers.get(hdr.H_HELD_DIR, ""))
        if not host or not out_dir:
            return None
        try:
            since = float(str(headers.get(hdr.H_HELD_SINCE, "0")))
        except ValueError:
            since = 0.0
        return cls(host[:MAX_VALUE], out_dir[:MAX_VALUE], str(headers.get(hdr.H_HELD_PART, ""))[:MAX_VALUE], since)

    def describe(self) -> str:
        when = datetime.fromtimestamp(self.since, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if self.since \
            else "an unknown time"
        return f"host {self.host}, directory {self.out_dir} (partial file {self.part}, since {when})"


def look(link: Link, dest: Destination, stream_id: str, *, timeout: float = 30.0) -> list[Holder]:
    """The notes left for ``stream_id`` (a queue browser: nothing is consumed)."""
    sub = link.subscribe(dest.held_queue(stream_id), browser=True, prefetch=16)
    found: list[Holder] = []
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            frame = link.get(left, sub)
            if frame is None or frame.headers.get("browser") == "end":
                break
            if frame.headers.get(hdr.H_STREAM) == stream_id and (holder := Holder.from_headers(frame.headers)):
                found.append(holder)
    finally:
        link.unsubscribe(sub)
    return found


def release(link: Link, dest: Destination, stream_id: str, *, only: Holder | None = None, known: int = 1) -> int:
    """Remove the notes of ``stream_id``: every one (the stream was published or quarantined,
    so no partial data of it is worth keeping anywhere), or ``only`` that holder's (it kept
    nothing after all). Waits for the ``known`` notes it expects (up to 5 s), then takes what
    else has already arrived, without waiting for more (a note written after this receiver
    looked is another holder's business, and waiting cost every stream 50 ms here); returns
    how many it removed. Notes it leaves go back to the queue when it unsubscribes (never
    acknowledged)."""
    sub = link.subscribe(dest.held_queue(stream_id), prefetch=16)
    seen = removed = 0
    until = time.monotonic() + 5.0
    try:
        while (left := until - time.monotonic()) > 0:
            frame = link.get(min(left, 1.0) if seen < known else 0.0, sub)
            if frame is None:
                if seen >= known:
                    break
                continue
            seen += 1
            holder = Holder.from_headers(frame.headers)
            if only is None or (holder is not None and holder.same_place(only)):
                link.ack(frame)
                removed += 1
    finally:
        link.unsubscribe(sub)
    return removed


def elsewhere_report(what: str, dest: Destination, stream_id: str, out: Path, others: list[Holder], *,
                     data_q: str, missing: str = "", kept: str = "") -> str:
    """Why a receiver without some of a stream's chunks gives way, where those chunks are
    and how to finish: receive where they are, or (if they are lost) send the file again.

    :param data_q: the stream's data queue.
    :param missing: the chunks it lacks, when it knows (after the end marker).
    :param kept: what this directory keeps (empty: nothing, the chunks stay on the broker).
    """
    where = "; ".join(h.describe() for h in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    first = others[0]
    took = f"took {missing}" if missing else "took its first chunks"
    if kept:
        here = (f"This directory keeps {kept}; the stream yields its place. To finish it, the sender sends the file "
                f"again, `amqstream send PATH --to {dest} --stream-id {stream_id} --restart`: a receiver on this "
                "directory, or on that one, then takes only what it lacks.")
    else:
        here = (f"Its remaining chunks stay on {data_q} for that receiver, and the stream yields "
                f"its place here. To finish it, receive into that directory (on {first.host}: `amqstream receive "
                f"--from {dest} --out-dir {first.out_dir} --stream-id {stream_id}`; in Airflow, share the output "
                "directory between workers or run the receiving task on that worker's queue: README, \"Many "
                f"workers\"). If that data is lost: `amqstream streams discard {stream_id} --from {dest} --yes` "
                f"removes the stream and these notes, then the sender sends the file again: `amqstream send PATH "
                f"--to {dest} --stream-id {stream_id} --restart`.")
    return (f"{what}: another receiver {took} and holds them, not this directory ({out}): {where}. {here} "
            "Nothing was dead-lettered.")


def unknown_report(what: str, dest: Destination, stream_id: str, missing: str, kept: str) -> str:
    """Why a receiver that began a stream without its first chunks keeps what it got: no
    note says who took them (it was removed, e.g. by ``amqstream streams discard``)."""
    return (
        f"{what}: {missing} never came: another receiver most likely took them before this one started (one "
        f"killed after acknowledging them, on a disk this one cannot see), and no receiver noted holding them (on "
        f"{dest.held_queue(stream_id)}), so where they are cannot be known here (look for {stream_id}.part in the "
        f".amqstream directory of the output directories your receivers used). This "
        f"directory keeps {kept}; the stream yields its place. To finish it here, the sender sends the file again: "
        f"`amqstream send PATH --to {dest} --stream-id {stream_id} --restart`; a receiver on this directory then "
        "takes only what is missing. Nothing was dead-lettered.")
