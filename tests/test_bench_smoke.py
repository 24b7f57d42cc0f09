"""The benchmark code runs (a few MiB, every baseline) so it never rots. Not a timing test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import main

pytestmark = pytest.mark.broker


def test_benchmark_smoke_run_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--sizes", str(3 * 2**20), "--data", "random,csv", "--workdir", str(tmp_path / "w"),
                 "--docs", str(tmp_path / "docs"), "--warm-up", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in rows] == ["random", "csv"]
    for r in rows:
        for key in ("ours", "ours_zstd", "send_only", "recv_only", "raw_stomp", "paramiko", "sftp", "scp", "dd"):
            assert r[key] > 0, key
        assert 0 < r["send_rss"] < 150 * 1024 and 0 < r["recv_rss"] < 150 * 1024
        for key in ("cpu_ours", "cpu_zstd", "cpu_raw"):
            assert len(r[key]) == 3 and all(c > 0 for c in r[key]), (key, r[key])
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| random |" in md and "bench_rss.png" in md and "Where the CPU goes" in md
    assert (tmp_path / "docs" / "bench_rss.png").stat().st_size > 1000
