"""A really full filesystem (a small tmpfs) under a receiver. The stream stops
with an error naming it, the partial file is kept, nothing unwritten is acknowledged,
and once there is space the same stream completes byte-exact."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import StreamError, StreamNoRoom
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import make_file, sha256_file

pytestmark = pytest.mark.broker


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: needs root (CI runs as root); skipped with the reason otherwise."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                         capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); run as root to test a full disk")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Write zeros until the filesystem refuses."""
    filler = directory / "filler"
    block = b"\0" * 4096
    with open(filler, "wb", buffering=0) as fh:
        try:
            while True:
                fh.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


def test_stream_bigger_than_the_disk_fails_at_once_and_stays_in_the_broker(
        params: BrokerParams, tmp_path: Path, queue_name: str, small_fs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_file(tmp_path / "big.bin", 12 * 2**20)
    send_file(params, src, queue_name)
    free = shutil.disk_usage(small_fs).free
    # Refused before anything is allocated: it would cross the free-space reserve.
    with pytest.raises(StreamNoRoom) as err:
        receive_stream(params, queue_name, small_fs / "out", options=ReceiveOptions(wait_timeout=20))
    text = str(err.value)
    assert "stream big.bin-" in text and "no room for 12582912 more bytes" in text and "reserve" in text
    assert shutil.disk_usage(small_fs).free >= free - 64 * 1024 and not list(small_fs.glob("out/.amqstream/*.part"))
    # An allocation that fills the disk before failing (as posix_fallocate did for a 1 TiB
    # offer) is given back: nothing of it stays.
    assert err.value.failure is not None
    sid = err.value.failure.stream_id
    real = os.posix_fallocate

    def fills_then_fails(fd: int, offset: int, length: int) -> None:
        real(fd, 0, shutil.disk_usage(small_fs).free // 2)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", fills_then_fails)
    with pytest.raises(StreamNoRoom) as err:
        receive_stream(params, queue_name, small_fs / "out2", stream_id=sid,
                       options=ReceiveOptions(wait_timeout=20, min_free_bytes=-2**40))
    monkeypatch.undo()
    assert "cannot reserve 12582912 bytes" in str(err.value) and "No space left" in str(err.value)
    assert shutil.disk_usage(small_fs).free >= free - 64 * 1024 and not list(small_fs.glob("out2/.amqstream/*.part"))
    # Its chunks were never taken and its offer is parked: a receiver with room
    # that asks for it gets the whole stream at once.
    got = receive_stream(params, queue_name, tmp_path / "roomy", stream_id=sid, options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sha256_file(src)


def test_disk_filling_up_mid_stream_stops_it_and_a_rerun_completes(
        params: BrokerParams, tmp_path: Path, queue_name: str, small_fs: Path) -> None:
    src = make_file(tmp_path / "f.bin", 3 * 2**20 + 5)
    send_file(params, src, queue_name, SendOptions(chunk_size=256 * 1024))
    out = small_fs / "out"
    fillers: list[Path] = []

    def fill_once_opened(kind: str, data: dict[str, Any]) -> None:
        # The file's space is reserved by now; another process takes all the rest.
        if kind == "stream_open" and not fillers:
            fillers.append(_fill(small_fs))

    with pytest.raises(StreamError) as err:
        receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=20, events=fill_once_opened))
    text = str(err.value)
    assert "No space left on device" in text and "partial file is kept" in text and "stream f.bin-" in text
    [part] = (out / ".amqstream").glob("*.part")
    assert part.stat().st_size == src.stat().st_size  # reserved, kept
    assert not (out / "f.bin").exists()

    os.unlink(fillers[0])
    got = receive_stream(params, queue_name, out, options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sha256_file(src) == sha256_file(out / "f.bin")


def _tmpfs(mnt: Path, options: str) -> None:
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True,
                         timeout=30)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()}); run as root to test a full disk")


@pytest.mark.parametrize("case", ["inodes", "blocks"])
def test_tiny_files_cannot_exhaust_inodes_or_blocks(params: BrokerParams, tmp_path: Path, queue_name: str,
                                                   case: str) -> None:
    """Empty and one-byte files cost an inode and a block each, and their records as many
    again: the reserve counts that, so a flood of them stops at the reserve (they give way,
    parked) instead of filling the filesystem, and the receiver keeps running."""
    from airflow_provider_amqstream.engine import iter_files, receive_streams, send_files

    # More files than the filesystem has inodes: only the reserve can stop them.
    n = 1200 if case == "inodes" else 600
    src = tmp_path / "tiny"
    src.mkdir()
    for i in range(n):
        (src / f"t{i:04d}.bin").write_bytes(b"" if case == "inodes" else b"x")
    mnt = tmp_path / "fs"
    # inodes: 1,000 inodes and room to spare; blocks: inodes to spare and 1 MiB (256 blocks).
    _tmpfs(mnt, "size=64m,nr_inodes=1000" if case == "inodes" else "size=1m,nr_inodes=100000")
    try:
        send_files(params, iter_files([src], recursive=True), queue_name, SendOptions(manifest=False))
        failures: list[Any] = []
        got = receive_streams(params, queue_name, mnt / "out", on_failure=failures.append,
                              options=ReceiveOptions(wait_timeout=3, min_free_bytes=64 * 1024, yield_backoff=600))
        st = os.statvfs(mnt)
        assert got and failures and {f.status for f in failures} == {"no_room"}, (len(got), failures[:1])
        assert ("inodes" if case == "inodes" else "bytes") in failures[0].reason
        if case == "inodes":
            assert st.f_favail >= 64, st.f_favail
        else:
            assert st.f_bavail * st.f_frsize >= 64 * 1024 - 4096, st.f_bavail
        # Every file published is whole, and no file went missing: the rest wait, parked.
        assert len(got) + len({f.stream_id for f in failures}) <= n
        assert all(Path(r.path or "").stat().st_size == r.bytes for r in got)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True, timeout=30)
