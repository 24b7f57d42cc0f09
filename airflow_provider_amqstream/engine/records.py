"""What both ends of a transfer share: results, errors, and files that survive a crash.

Every file the engine writes goes through :func:`write_json` or :func:`open_private`:
replaced atomically, fsynced, and never through a symbolic link someone else planted in
an output directory.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

from airflow_provider_amqstream.engine.state_dir import SendStateDir
from airflow_provider_amqstream.engine.store import (
    SENT,
    RecordStore,
    open_store,
    prune_quietly,
    unlink_missing_ok,
    write_all,
)
from airflow_provider_amqstream.exceptions import StreamError

log = logging.getLogger(__name__)

@dataclass
class TransferResult:
    """What one send or receive did. ``bytes_transferred`` counts only this run (chunks sent
    again after a lost connection included); ``resumed_from`` is the offset this run last
    continued from (an earlier run's checkpoint, or the broker's last confirmation after a
    lost connection), 0 if it never resumed.

    ``status`` is ``complete``, ``duplicate`` (a receiver saw a stream it had published
    before) or ``already_sent`` (a sender found its stream confirmed before; ``finished_at``
    is then when that happened, where the checkpoint recorded it).
    """

    stream_id: str
    destination: str
    name: str
    bytes: int
    chunks: int
    sha256: str
    seconds: float
    mode: str
    resumed_from: int = 0
    bytes_transferred: int = 0
    path: str | None = None
    started_at: float = 0.0
    finished_at: float = 0.0
    duplicates: int = 0
    rerequests: int = 0
    rejected: int = 0
    status: str = "complete"
    chunk_size: int = 0
    origin: str = ""
    broker: str = ""
    # Who sent it, as the broker stamped it ("" where the broker stamps no JMSXUserID).
    sender: str = ""
    # Connections this run lost (or could not open) and tried again.
    retries: int = 0

    def to_json(self) -> dict[str, Any]:
        # Every field is a str or a number: no deep copy (asdict cost 0.2 ms a file in bulk).
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransferResult:
        """Load a stored record, ignoring fields a newer version may have added."""
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


class Checkpoint(Protocol):
    """Where a sender keeps its resume point. The CLI uses a file; Airflow adds the
    task state store so a retry on another worker finds it."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, data: dict[str, Any], *, final: bool = False) -> None: ...


class FileCheckpoint:
    """A stream in flight: a JSON file replaced atomically, fsynced so a crash never leaves
    half a state. A stream the broker confirmed whole (``sent_at`` set): a record in the
    state directory's record store (``records/``, kept ``retention_days``), and the file goes;
    so the directory holds one file per stream in flight, not one per stream ever sent.

    :param path: the checkpoint file; its directory holds the store.
    :param retention_days: days a finished stream's record is kept (None: 30; 0: for ever);
        a stream sent again after that is sent again, and its receivers acknowledge it as a
        duplicate if their own records still have it.
    """

    def __init__(self, path: str | os.PathLike[str], *, retention_days: float | None = None) -> None:
        self.path = Path(path)
        self.retention_days = retention_days

    def _store(self) -> RecordStore:
        return sender_store(self.path.parent, self.retention_days)

    def load(self) -> dict[str, Any] | None:
        try:
            data = read_json(self.path)
            if data is None:
                data = next((v for v in self._store().get_all(SENT, self.path.name) if isinstance(v, dict)), None)
        except (OSError, ValueError) as exc:
            raise StreamError(f"resume state {self.path} is unreadable ({exc}); delete it to start over") from exc
        return data

    def save(self, data: dict[str, Any], *, final: bool = False) -> None:
        if data.get("sent_at"):
            self._store().put_many([(SENT, self.path.name, data)])
            unlink_missing_ok(self.path)
        else:
            # Private: a sealed stream's checkpoint holds its key until the stream is sent.
            write_json(self.path, data, mode=0o600)


_PRUNED_SENDER_DIRS: set[Path] = set()


def sender_store(directory: str | os.PathLike[str], retention_days: float | None) -> RecordStore:
    """The record store of a sender's state directory. The first use in a process prunes it:
    days of records past the retention, and the checkpoints of streams abandoned in flight
    and batch ledgers not touched for as long.

    :param retention_days: days kept (None: 30; 0: for ever).
    """
    sdir = SendStateDir(directory)
    store = open_store(sdir, retention_days)
    if sdir.path not in _PRUNED_SENDER_DIRS:
        _PRUNED_SENDER_DIRS.add(sdir.path)
        prune_quietly(store)
        if store.retention > 0:
            _prune_old_files(sdir, time.time() - store.retention)
    return store


def _prune_old_files(sdir: SendStateDir, before: float) -> None:
    """Checkpoints and ledgers last written before ``before``: their streams and batches are
    as expired as the records (the directory holds only those in flight, so this is short)."""
    for e in sdir.ours():  # AMQSTREAM_STATE_DIR may point where other files live: only ours go
        try:
            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_mtime < before:
                os.unlink(e.path)
        except OSError as exc:
            log.warning("sender state %s: could not prune %s (%s)", sdir.path, e.name, exc)


def open_private(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """``os.open`` that refuses a symbolic link at ``path`` and anything but a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise StreamError(f"{path} is a symbolic link; amqstream writes only files it created there. "
                              "Remove the link and re-run.") from exc
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StreamError(f"{path} is not a regular file; remove it and re-run")
    return fd


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A JSON object from ``path`` (not through a link), or None if there is none."""
    try:
        fd = open_private(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        data = json.loads(fh.read())
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def write_json(path: str | os.PathLike[str], data: dict[str, Any], *, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data``: a fresh temporary file of a new name (never an existing
    file or a link), fsynced, renamed over the old one (a rename replaces a link, never
    follows it); its directory is made if missing.

    Plain strings, not :class:`~pathlib.Path`: a bulk receive writes one record per file, and
    path objects were a tenth of its time.
    """
    path = os.fspath(path)
    # A name of its own per writer: two receivers may share a directory's records.
    tmp = f"{path}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = open_private(tmp, flags, mode)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd = open_private(tmp, flags, mode)
    try:
        try:
            # One dumps (the C encoder) and raw writes: json.dump to a text file takes the pure
            # Python encoder, which was a tenth of a small-file receive.
            write_all(fd, json.dumps(data).encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink_missing_ok(tmp)
        raise


def hash_prefix(fh: Any, hasher: Any, upto: int, block: int = 4 * 1024 * 1024) -> None:
    """Feed the first ``upto`` bytes of an open file to ``hasher`` (resume path)."""
    fh.seek(0)
    left = upto
    view = memoryview(bytearray(block))
    while left > 0:
        n = fh.readinto(view[: min(block, left)])
        if not n:
            raise StreamError(f"{getattr(fh, 'name', 'file')} is shorter than its resume point {upto}")
        hasher.update(view[:n])
        left -= n
