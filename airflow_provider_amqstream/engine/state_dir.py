"""``out_dir/.amqstream/``, a receiver's state beside its output: the one place its layout is
spelled (docs/protocol.md, "The output directory" and "Completion records and repeats")."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from airflow_provider_amqstream.exceptions import StreamError

STATE_DIR_NAME = ".amqstream"


class StateDir:
    """The state directory of one output directory. It is a path (``os.fspath`` gives it), and
    names every file and directory under it; nothing else joins names onto it (the record
    store, ``records/``, is :func:`~airflow_provider_amqstream.engine.store.store_path`'s).

    :param out_dir: the receiver's output directory.
    """

    def __init__(self, out_dir: str | os.PathLike[str]) -> None:
        self.out = Path(out_dir)
        self.path = self.out / STATE_DIR_NAME

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

    def __str__(self) -> str:
        return str(self.path)

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
