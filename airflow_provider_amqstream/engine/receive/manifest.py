"""Batch manifests on the receiving side: once every file a sender's batch message lists
is published in this output directory, write the batch's manifest.

Everything here lives under the state directory (:class:`~airflow_provider_amqstream.engine.state_dir.StateDir`:
``batches/`` and ``manifests/``), where no name a sender chooses can land (a sender's
directories lose their leading dots), and is kept per sender, as the broker names it
(``JMSXUserID``): a second user announcing the same batch id gets a batch of its own, never
a share of another's, and a batch lists only streams its own sender sent.

The parts of a batch still waiting for files are bounded: at most :data:`MAX_PENDING`
batches per directory (the oldest go first), none whose newest part is older than
:data:`MAX_AGE`, and together at most half of the space free above the reserve
(``min_free_bytes``), counting their own; a part that does not fit after its sender's older
batches are forgotten gives way (parked, :class:`StreamNoRoom`). Memory: one part's missing
files per batch waited on, whatever a batch declares. A manifest is written to a temporary
file, fsynced and renamed into place, so a reader sees all of it or none; its rows name
files relative to the output directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.receive.claims import find_received_many
from airflow_provider_amqstream.engine.receive.partial_file import Room
from airflow_provider_amqstream.engine.records import open_private, read_json, write_json
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import StreamError, StreamNoRoom
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol.names import validate_stream_id

log = logging.getLogger(__name__)

# Batches a directory waits on at once; a sender announcing batches whose files never come
# pushes out its own oldest first (and everyone's, past this many: the figure is per directory).
MAX_PENDING = 64
# A batch whose files have not all come in this long is forgotten.
MAX_AGE = 2 * 86400.0
# Where the broker stamps no sender (an external broker without populateJMSXUserID).
UNIDENTIFIED = "_unidentified"
_PLAIN_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_PART = re.compile(r"(.+)\.[0-9]{1,5}\.json")
# A temporary this old was left by a writer that died (a live one renames it within moments).
STALE_TMP = 3600.0


def _batch_of(name: str) -> str | None:
    """The batch a part file in a sender's batch directory belongs to, None for anything else."""
    m = _PART.fullmatch(name)
    return m.group(1) if m else None


def sender_dir(sender: str) -> str:
    """The directory name a sender's batches and manifests are kept under: its user name
    when that is a plain name, else a digest of it."""
    if not sender:
        return UNIDENTIFIED
    if _PLAIN_USER.fullmatch(sender):
        return sender
    return "u-" + hashlib.sha256(sender.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def manifest_path(out_dir: str | os.PathLike[str], batch_id: str, sender: str = "") -> Path:
    """Where the manifest of ``batch_id`` sent by ``sender`` appears once the batch is
    complete in ``out_dir``.

    :param batch_id: the batch (a sender's ``totals["batch_id"]``).
    :param sender: the sending user as the broker knows it ("" where the broker stamps none).
    """
    return StateDir(out_dir).manifest(sender_dir(sender), validate_stream_id(batch_id))


def find_manifest(out_dir: str | os.PathLike[str], batch_id: str, sender: str | None = None) -> Path | None:
    """The manifest of ``batch_id`` in ``out_dir`` if it is complete, else None.

    Without ``sender``, the batch id must have been completed by one sender only: two users
    completing batches under the same id raise :class:`StreamError` naming them, since
    picking one would hand a job the wrong files.

    :param sender: the sending user; None for whoever sent it.
    """
    if sender is not None:
        path = manifest_path(out_dir, batch_id, sender)
        return path if path.is_file() else None
    sdir, batch_id = StateDir(out_dir), validate_stream_id(batch_id)
    try:
        found = sorted(m for d in sdir.manifests.iterdir() if (m := sdir.manifest(d.name, batch_id)).is_file())
    except FileNotFoundError:
        return None
    if len(found) > 1:
        raise StreamError(f"batch {batch_id} in {out_dir} was completed by {len(found)} senders "
                          f"({', '.join(f.parent.name for f in found)}); name the one you expect (batch_sender, "
                          "--batch-sender)")
    return found[0] if found else None


class Batches:
    """The batches this output directory waits on, and which of their streams are missing.

    :param retention_days: the directory's record retention (None: the default).
    :param min_free: the free-space reserve (None: :class:`Room`'s default).
    """

    def __init__(self, out: Path, sdir: StateDir, *, retention_days: float | None = None,
                 min_free: int | None = None) -> None:
        self.out, self.sdir, self.root = out, sdir, sdir.batches
        self.retention_days = retention_days
        self.min_free = min_free
        # (sender dir, batch id) -> (the first part with streams still missing, those
        # streams): a part's worth at most, however many parts the batch declares.
        self.missing: dict[tuple[str, str], tuple[int, set[str]]] = {}
        # (sender dir, batch id) -> [newest part's mtime, bytes on disk, parts here] of every
        # batch with any part here: at most MAX_PENDING entries.
        self.held: dict[tuple[str, str], list[float]] = {}

    def load(self) -> None:
        """Count what senders left here and forget what is past the bounds (once, before
        :meth:`record` or :meth:`published`, at a receiver's start, so the room it frees is
        there before any stream); then look at each batch."""
        try:
            self._scan()
        except OSError as exc:
            log.warning("batches in %s: could not count them (%s); counted from now on", self.root, exc)
        self._prune()
        over = self._total() - self._budget()
        for key in sorted(self.held, key=lambda k: self.held[k][0]):
            if over <= 0:
                break
            over -= int(self.held[key][1])
            self._drop(key, "they held more than half of the space free above the reserve")
        for key in list(self.held):
            self._check(*key)

    def _scan(self) -> None:
        """Every part on disk, by batch: what a sender can leave is counted whether or not
        its batch's first part ever came."""
        try:
            owners = [d for d in self.root.iterdir() if d.is_dir() and not d.is_symlink()]
        except FileNotFoundError:
            return
        stale = time.time() - STALE_TMP
        for d in owners:
            for f in d.iterdir():
                try:
                    st = f.lstat()
                except FileNotFoundError:
                    continue
                batch_id = _batch_of(f.name)
                if batch_id is None:
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < stale:
                        f.unlink(missing_ok=True)  # a dead writer's temporary
                    continue
                h = self.held.setdefault((d.name, batch_id), [0.0, 0, 0])
                h[0], h[1], h[2] = max(h[0], st.st_mtime), h[1] + _on_disk(st), h[2] + 1

    def _prune(self) -> None:
        """Forget the batches past the age or count bound, oldest first."""
        cutoff = time.time() - MAX_AGE
        order = sorted(self.held, key=lambda k: self.held[k][0])
        over = len(order) - MAX_PENDING
        for n, key in enumerate(order):
            if n < over or self.held[key][0] < cutoff:
                self._drop(key, f"its files did not all come (kept at most {MAX_PENDING} batches for at most "
                                f"{MAX_AGE / 3600:.0f} h)")

    def _drop(self, key: tuple[str, str], why: str) -> None:
        log.warning("batch %s of %s in %s: forgotten, %s", key[1], key[0], self.out, why)
        self._forget(*key)

    def _total(self) -> int:
        return int(sum(h[1] for h in self.held.values()))

    def _budget(self) -> int:
        """Bytes the batches may hold: half of what is free above the reserve, counting
        their own, so what senders list never takes the room their streams need."""
        try:
            room = Room(self.sdir, self.min_free)
        except OSError:
            return 0
        return max(0, (room.free + self._total() - room.min_free) // 2)

    def _make_room(self, key: tuple[str, str], size: int) -> str | None:
        """Why ``size`` more bytes of ``key``'s batch do not fit once its sender's older
        batches are forgotten (never another sender's), or None if they fit."""
        budget = self._budget()
        total = self._total()
        for other in sorted((k for k in self.held if k[0] == key[0] and k != key), key=lambda k: self.held[k][0]):
            if total + size <= budget:
                break
            total -= int(self.held[other][1])
            self._drop(other, f"a newer batch of its sender needed the room ({budget} bytes for batch lists here)")
        if total + size <= budget:
            return None
        return (f"its list needs {size} bytes and the batches waiting here hold {total} of the {budget} they may "
                "(half of the space free above the reserve)")

    def record(self, batch_id: str, part: int, parts: int, entries: list[bw.BatchEntry],
               sender: str = "") -> Path | None:
        """Keep one part of ``sender``'s batch; return the manifest's path if the batch is
        now complete. Raises :class:`StreamNoRoom` (the part gives way) when it does not fit."""
        owner = sender_dir(sender)
        key = (owner, batch_id)
        data = {"batch_id": batch_id, "part": part, "parts": parts, "sender": sender,
                "entries": [{"stream_id": e.stream_id, "bytes": e.size, "sha256": e.sha256} for e in entries]}
        path = self.sdir.batch_part(owner, batch_id, part)
        try:
            old = _on_disk(path.lstat())
        except FileNotFoundError:
            old = -1
        size = -(-len(json.dumps(data)) // 4096) * 4096
        short = self._make_room(key, size - max(old, 0))
        try:
            if short is not None:
                raise OSError(errno.ENOSPC, short)
            write_json(path, data)
            now = path.lstat()
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise StreamNoRoom(f"batch {batch_id} of {sender or 'an unidentified sender'}: no room for part {part} of "
                               f"{parts} in {self.root} ({exc.strerror}); it gives way and is tried again later. Free "
                               "space, lower the reserve (min_free_bytes, --min-free) or receive into another "
                               "directory.") from None
        h = self.held.setdefault(key, [0.0, 0, 0])
        h[0], h[1], h[2] = now.st_mtime, h[1] + _on_disk(now) - max(old, 0), h[2] + (old < 0)
        self._prune()
        if key not in self.held or h[2] < parts:
            return None
        return self._check(owner, batch_id, self.missing.get(key, (1, set()))[0])

    def published(self, stream_id: str) -> list[Path]:
        """A stream was published here; return the manifests this completed."""
        done = []
        for key, (at, missing) in list(self.missing.items()):
            missing.discard(stream_id)
            if not missing:
                path = self._check(*key, at)
                if path is not None:
                    done.append(path)
        return done

    def _part_records(self, owner: str, batch_id: str, k: int,
                      nparts: int) -> Iterator[tuple[dict[str, Any], dict[str, Any] | None]]:
        """Each entry of part ``k`` with its stream's completion record (None if not received
        here), the part's records looked up together."""
        data = read_json(self.sdir.batch_part(owner, batch_id, k))
        if data is None:
            raise ValueError(f"part {k} of {nparts} went missing")
        entries = list(data["entries"])
        known = find_received_many(self.out, [e["stream_id"] for e in entries],
                                   retention_days=self.retention_days) if entries else {}
        for e in entries:
            yield e, known.get(e["stream_id"])

    def _check(self, owner: str, batch_id: str, start: int = 1) -> Path | None:
        """Look at the batch from part ``start`` on (the parts before it were whole): note
        the first part with streams still missing, or write the manifest if none is."""
        key = (owner, batch_id)
        try:
            first = read_json(self.sdir.batch_part(owner, batch_id, 1))
            if first is None or not all(self.sdir.batch_part(owner, batch_id, k).is_file()
                                        for k in range(2, int(first["parts"]) + 1)):
                self.missing.pop(key, None)  # not every part is here yet
                return None
            sender = str(first.get("sender") or "")
            nparts = int(first["parts"])
            for k in range(start, nparts + 1):
                missing = set()
                for e, rec in self._part_records(owner, batch_id, k, nparts):
                    if rec is None:
                        missing.add(e["stream_id"])
                    elif str(rec.get("sender") or "") != sender:
                        log.warning("batch %s of %s lists stream %s, which %s sent: a batch lists only its own "
                                    "sender's files; the batch is dropped", batch_id, owner, e["stream_id"],
                                    rec.get("sender") or "an unidentified sender")
                        self._forget(owner, batch_id)
                        return None
                if missing:
                    self.missing[key] = (k, missing)
                    return None
            self.missing.pop(key, None)
            return self._write(owner, batch_id, sender, nparts)
        except (OSError, ValueError, KeyError) as exc:
            log.warning("batch %s of %s: its recorded list in %s is unreadable (%s); no manifest", batch_id, owner,
                        self.root, exc)
            return None

    def _forget(self, owner: str, batch_id: str) -> None:
        self.missing.pop((owner, batch_id), None)
        self.held.pop((owner, batch_id), None)
        for f in (self.root / owner).glob(f"{batch_id}.*.json"):
            if _batch_of(f.name) == batch_id:  # not batch "<id>.x"'s
                f.unlink(missing_ok=True)

    def _write(self, owner: str, batch_id: str, sender: str, nparts: int) -> Path:
        """Write the manifest a row at a time, each from the stream's completion record."""
        final = manifest_path(self.out, batch_id, sender)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.root / owner / f"{batch_id}.manifest.tmp"
        tmp.unlink(missing_ok=True)
        fd = open_private(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        rows = 0
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            # One part's entries and their records at a time (a part lists at most
            # BATCH_PART_FILES): a batch of a million files is never one list.
            entries = (row for k in range(1, nparts + 1) for row in self._part_records(owner, batch_id, k, nparts))
            for e, rec in entries:
                if rec is None:
                    raise ValueError(f"the completion record of stream {e['stream_id']} went missing")
                if rec.get("sha256") != e["sha256"] or int(rec.get("bytes", -1)) != int(e["bytes"]):
                    log.warning("batch %s: stream %s was published with sha256 %s, the batch lists %s", batch_id,
                                e["stream_id"], rec.get("sha256"), e["sha256"])
                rel = os.path.relpath(str(rec["path"]), self.out)
                fh.write(json.dumps({"path": rel, "bytes": rec["bytes"], "sha256": rec["sha256"],
                                     "stream_id": e["stream_id"]}, ensure_ascii=False) + "\n")
                rows += 1
            fh.flush()
            os.fsync(fh.fileno())
        # A rename replaces whatever holds the name (a link included), never follows it.
        os.replace(tmp, final)
        for k in range(1, nparts + 1):
            self.sdir.batch_part(owner, batch_id, k).unlink(missing_ok=True)
        self.held.pop((owner, batch_id), None)
        log.info("batch %s of %s complete: %d files; manifest %s", batch_id, owner, rows, final)
        return final


def _on_disk(st: os.stat_result) -> int:
    """Bytes a file takes on disk (whole blocks)."""
    return st.st_blocks * 512 if st.st_blocks else -(-st.st_size // 4096) * 4096
