"""What receivers' output directories show of the streams they have not finished, read
only, for ``amqstream streams`` and the Airflow page: partial data (``<id>.part`` and its
resume state, whether a receiver holds it now, a rate between two looks) and the batches
waiting for files (``batches/<sender>/<batch>.<part>.json``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from airflow_provider_amqstream.engine.receive.claims import find_received_many
from airflow_provider_amqstream.engine.receive.partial_file import held_inodes, locked_now
from airflow_provider_amqstream.engine.records import read_json
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import ProtocolError, StreamError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol.names import validate_stream_id
from airflow_provider_amqstream.protocol.state import ReceiverState

log = logging.getLogger(__name__)


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


def partial_streams(out_dir: str | os.PathLike[str], *, previous: Mapping[str, tuple[int, float]] | None = None,
                    ) -> list[InProgress]:
    """The streams partly received into ``out_dir``, from its state directory, read only.

    :param previous: an earlier look's ``{stream id: (durable bytes, monotonic time)}``, to
        measure a rate (see :func:`progress_marks`).
    """
    sdir = StateDir(out_dir)
    try:
        ids = sdir.partial_ids()
    except (FileNotFoundError, NotADirectoryError):
        return []
    held = held_inodes()
    out = []
    for sid in ids:
        try:
            validate_stream_id(sid)
            st = os.stat(sdir.part(sid), follow_symlinks=False)
        except (ProtocolError, OSError):
            continue
        entry = InProgress(sid, str(out_dir), last_progress_at=st.st_mtime)
        try:
            state = read_json(sdir.resume(sid))
        except (OSError, ValueError) as exc:
            log.warning("stream %s in %s: resume state unreadable (%s)", sid, out_dir, exc)
            state = None
        if state is not None:
            try:
                rs = ReceiverState.from_json(state)
                entry.name, entry.size, entry.durable_bytes = rs.spec.name, rs.spec.size, rs.received_bytes
            except (ProtocolError, KeyError, TypeError, ValueError) as exc:
                log.warning("stream %s in %s: resume state not understood (%s)", sid, out_dir, exc)
            entry.sender = str(state.get("sender") or "")
            if isinstance(state.get("started_at"), (int, float)):
                entry.since = float(state["started_at"])
        if held is not None:
            entry.receiving_now = locked_now(st, held)
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
        validate_stream_id(sid)
    except ProtocolError:
        return False
    return True


def batch_progress(out_dir: str | os.PathLike[str]) -> list[BatchProgress]:
    """The batches ``out_dir`` waits on: parts that arrived, files listed, files in."""
    sdir = StateDir(out_dir)
    out: list[BatchProgress] = []
    try:
        owners = sorted(d for d in sdir.batches.iterdir() if d.is_dir() and not d.is_symlink())
    except (FileNotFoundError, NotADirectoryError):
        return out
    for owner in owners:
        for first in sorted(owner.glob("*.1.json")):
            batch_id = first.name[: -len(".1.json")]
            try:
                head = read_json(first) or {}
                parts = int(head.get("parts", 1))
                seen: list[int] = []
                listed: list[str] = []
                for k in range(1, min(parts, bw.MAX_BATCH_PARTS) + 1):
                    part = head if k == 1 else read_json(sdir.batch_part(owner.name, batch_id, k))
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
