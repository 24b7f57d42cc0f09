"""The one place each state directory's layout is spelled: a receiver's, ``out_dir/.amqstream/``
beside its output (docs/protocol.md, "The output directory" and "Completion records and
repeats"), and a sender's, one per user (:class:`SendStateDir`)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from airflow_provider_amqstream.exceptions import StreamError
from airflow_provider_amqstream.transport.params import BrokerParams


class StateDir:
    """The state directory of one output directory. It is a path (``os.fspath`` gives it), and
    names every file and directory under it; nothing else joins names onto it (the record
    store, ``records/``, is :func:`~airflow_provider_amqstream.engine.store.open_store`'s)."""

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out = Path(out_dir)
        self.path = self.out / ".amqstream"

    @classmethod
    def create(cls, out_dir: str | os.PathLike[str]) -> StateDir:
        """Create (or check) it: a real directory owned by us, never a link."""
        sdir = cls(out_dir)
        sdir.out.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(sdir.path, 0o700)
        st = os.lstat(sdir.path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise StreamError(f"{sdir} is not a directory (a symbolic link or a file); amqstream keeps partial "
                              "data there and will not write through it. Remove it and re-run.")
        if st.st_uid != os.geteuid():
            raise StreamError(f"{sdir} belongs to user id {st.st_uid}, not to this process ({os.geteuid()}); "
                              "amqstream will not write partial data into a directory another user controls.")
        return sdir

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    __str__ = __fspath__

    def part(self, stream_id: str) -> Path:
        """A stream's partial data."""
        return self.path / f"{stream_id}.part"

    def partial_ids(self) -> list[str]:
        """The streams with partial data here, in the order of their files' names (raises
        ``FileNotFoundError`` without a directory)."""
        names = sorted(e.name for e in os.scandir(self.path) if e.name.endswith(".part"))
        return [name[: -len(".part")] for name in names]

    def resume(self, stream_id: str) -> Path:
        """A stream's resume state, beside its partial data."""
        return self.path / f"{stream_id}.json"

    def reoffered(self, stream_id: str) -> Path:
        """The mark of a stream this receiver yielded and offered again."""
        return self.path / f"{stream_id}.reoffered"

    def quarantined(self, stream_id: str) -> Path:
        """The mark of a stream this receiver quarantined."""
        return self.path / f"{stream_id}.quarantined"

    def stream_files(self, stream_id: str) -> tuple[Path, Path, Path]:
        """What a partly received stream leaves here (what discarding it removes)."""
        return self.part(stream_id), self.resume(stream_id), self.reoffered(stream_id)

    @property
    def key(self) -> Path:
        """The secret of the receiver's handshake tokens."""
        return self.path / "receiver.key"

    @property
    def batches(self) -> Path:
        """The parts of batches still waiting for streams, per sender."""
        return self.path / "batches"

    def batch_part(self, owner: str, batch_id: str, part: int) -> Path:
        """One part of a waiting batch, under its sender's directory ``owner``."""
        return self.batches / owner / f"{batch_id}.{part}.json"

    @property
    def manifests(self) -> Path:
        """Complete batches' manifests, per sender."""
        return self.path / "manifests"

    def manifest(self, owner: str, batch_id: str) -> Path:
        """A complete batch's manifest, under its sender's directory ``owner``."""
        return self.manifests / owner / f"{batch_id}.manifest.jsonl"

    @property
    def lists(self) -> Path:
        """The files lists of many-file receives."""
        return self.path / "lists"


def default_state_dir() -> Path:
    """A sender's state directory: ``$AMQSTREAM_STATE_DIR``, else ``amqstream/send`` under
    ``$XDG_STATE_HOME`` (``~/.local/state``)."""
    env = os.environ.get("AMQSTREAM_STATE_DIR")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "amqstream" / "send"


def checkpoint_name(stream_id: str, params: BrokerParams) -> str:
    """A checkpoint file per stream and broker: the same file sent to another broker (or
    as another user) is another transfer, never "already sent"."""
    return f"{stream_id}@{SendStateDir.broker_key(params)}.json"


class SendStateDir:
    """A sender's state directory (default :func:`default_state_dir`): one file per stream or
    batch in flight, each ``<name>@<broker key>``, and the record store (``records/``,
    :func:`~airflow_provider_amqstream.engine.store.open_store`'s). Nothing else joins names onto it."""

    # A checkpoint (``<stream id>@<broker key>.json``, a task's ``amqstream_send_...``), a
    # batch's ledger or files list (``batch-``/``files-<batch id>@<broker key>.jsonl``), the
    # small sealed files' secret (``seal@<broker key>.json``).
    OURS = re.compile(r"[A-Za-z0-9._-]+@[0-9a-f]{12}\.jsonl?")

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_state_dir()

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    @staticmethod
    def broker_key(params: BrokerParams) -> str:
        """Which broker, and as whom: what every file name here ends with."""
        return hashlib.sha256(f"{params.url}|{params.login or ''}".encode()).hexdigest()[:12]

    def checkpoint(self, stream_id: str, params: BrokerParams) -> Path:
        return self.path / checkpoint_name(stream_id, params)

    def task_checkpoint(self, stream_id: str, params: BrokerParams) -> Path:
        """An Airflow task's local copy of a stream's checkpoint (its task state store holds the other)."""
        return self.path / f"amqstream_send_{checkpoint_name(stream_id, params)}"

    def ledger(self, batch_id: str, params: BrokerParams) -> Path:
        """A many-file send's ledger: the files the broker confirmed."""
        return self.path / f"batch-{batch_id}@{self.broker_key(params)}.jsonl"

    def seal_secret(self, params: BrokerParams) -> Path:
        """The secret (0600) each small sealed file's stream key is derived from, one per broker:
        a later run, whatever else it sends, seals a file it sent part of under the same key."""
        return self.path / f"seal@{self.broker_key(params)}.json"

    def files_list(self, batch_id: str, params: BrokerParams) -> Path:
        """Every file's result of a many-file send's last run."""
        return self.path / f"files-{batch_id}@{self.broker_key(params)}.jsonl"

    def ours(self) -> Iterator[os.DirEntry[str]]:
        """The checkpoints, ledgers and files lists here (none without a directory)."""
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return
        yield from (e for e in entries if self.OURS.fullmatch(e.name))
