"""Memory must not grow with file size: peak RSS of real sender and receiver processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import cli_json, cli_probed, make_file, sha256_file

pytestmark = [pytest.mark.broker, pytest.mark.large]


def _transfer(uri: str, src: Path, out: Path, queue: str) -> tuple[dict, dict]:
    receiver = cli_probed("receive", "--from", queue, "--out-dir", str(out), "--conn", uri, "--json", "-q",
                          "--wait", "60")
    sender = cli_probed("send", str(src), "--to", queue, "--conn", uri, "--json", "-q")
    [sent] = cli_json(sender, timeout=600)
    [got] = cli_json(receiver, timeout=600)
    assert got["sha256"] == sent["sha256"]
    return sent, got


def test_peak_rss_flat_from_100mib_to_2gib(uri: str, tmp_path: Path, queue_name: str) -> None:
    small = make_file(tmp_path / "small.bin", 100 * 2**20)
    s_sent, s_got = _transfer(uri, small, tmp_path / "out-small", queue_name)
    small.unlink()
    big = make_file(tmp_path / "big.bin", 2 * 2**30)
    b_sent, b_got = _transfer(uri, big, tmp_path / "out-big", queue_name)
    assert sha256_file(tmp_path / "out-big" / "big.bin") == b_sent["sha256"]
    figures = {"send 100MiB": s_sent["peak_rss_kib"], "recv 100MiB": s_got["peak_rss_kib"],
               "send 2GiB": b_sent["peak_rss_kib"], "recv 2GiB": b_got["peak_rss_kib"]}
    print("peak RSS KiB:", figures)
    for name, kib in figures.items():
        assert kib < 150 * 1024, f"{name} peaked at {kib / 1024:.0f} MiB"
    assert b_sent["peak_rss_kib"] <= 1.2 * s_sent["peak_rss_kib"], figures
    assert b_got["peak_rss_kib"] <= 1.2 * s_got["peak_rss_kib"], figures
