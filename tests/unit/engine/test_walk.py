"""A directory walk holds a run of names, not a directory's: every file once, in an order
that is the same on every walk, and a traced peak that does not grow with the directory."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import iter_files
from airflow_provider_amqstream.engine.send import batch

RUN = 16


@pytest.fixture(autouse=True)
def small_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(batch, "WALK_RUN", RUN)


def flat(root: Path, count: int) -> Path:
    root.mkdir()
    for i in range(count):
        (root / f"f{(i * 7919) % count:06d}").write_bytes(b"x")
    return root


def walk_peak(top: Path) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = sum(1 for _ in iter_files([top], recursive=True))
        assert n > 0
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_every_file_once_in_the_same_order_each_walk(tmp_path: Path) -> None:
    top = flat(tmp_path / "top", 5 * RUN + 3)
    # More subdirectories than a run: read in runs too, each walked whole before the next.
    for i in range(RUN + 5):
        sub = top / f"d{i:03d}"
        sub.mkdir()
        (sub / "a").write_bytes(b"a")
        (sub / "b").write_bytes(b"b")
    first = [(f.path.name, f.subdir) for f in iter_files([top], recursive=True)]
    again = [(f.path.name, f.subdir) for f in iter_files([top], recursive=True)]
    assert first == again
    assert len(first) == len(set(first)) == 5 * RUN + 3 + 2 * (RUN + 5)
    files = [name for name, subdir in first if not subdir]
    assert files == [name for name, _ in first[:len(files)]]  # a directory's files before its subdirectories
    for k in range(0, len(files), RUN):
        assert files[k:k + RUN] == sorted(files[k:k + RUN])
    subdirs = [subdir for _, subdir in first[len(files):]]
    assert subdirs[::2] == subdirs[1::2]  # each subdirectory's files together


def test_a_small_directory_comes_in_name_order(tmp_path: Path) -> None:
    top = flat(tmp_path / "top", RUN)
    names = [f.path.name for f in iter_files([top], recursive=True)]
    assert names == sorted(names)


def test_walk_memory_does_not_grow_with_one_directory(tmp_path: Path) -> None:
    small, large = flat(tmp_path / "small", 4 * RUN), flat(tmp_path / "large", 60 * RUN)
    walk_peak(small)
    # Holding the large directory's names whole would take ~56 runs x 16 names x ~130 B more (~115 KB).
    assert walk_peak(large) - walk_peak(small) < 40_000
