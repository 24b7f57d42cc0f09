"""Large files on a real broker: memory must not grow with file size (peak RSS of real sender
and receiver processes), and a sender need not wait for a receiver, compressed or not."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.names import Destination
from benchmarks.common import make_csv
from tests.helpers import browse, cli_json, cli_probed, make_file, sha256_file

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


def test_a_compressed_backlog_does_not_wait_for_a_receiver(private_broker: EmbeddedBroker, tmp_path: Path,
                                                           queue_name: str) -> None:
    """768 MiB of CSV sent with the defaults (compression ``auto``) to a queue no receiver reads:
    every chunk is stored without waiting for one (a backlog of compressed chunks once stalled
    ActiveMQ at the queue's memory limit after ~600 of them), the chunks went compressed, and a
    receiver started afterwards gets the file byte-exact."""
    src = tmp_path / "sales.csv"
    make_csv(src, 768 * 2**20, tmp_path / "seed.csv")
    uri = private_broker.info().uri
    [sent] = cli_json(cli_probed("send", str(src), "--to", queue_name, "--conn", uri, "--json", "-q"), timeout=300)
    assert sent["bytes"] == 768 * 2**20 and sent["chunks"] == 768
    data_q = Destination.parse(queue_name).data_queue(sent["stream_id"], params_from_uri(uri).user)
    first = browse(params_from_uri(uri), data_q)[:4]
    assert first and all(f.headers.get(hdr.H_ENCODING) == "zstd" for f in first), [f.headers for f in first]
    assert all(len(f.body) < 2**19 for f in first), [len(f.body) for f in first]
    out = tmp_path / "out"
    receiver = cli_probed("receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--json", "-q",
                          "--wait", "30")
    [got] = cli_json(receiver, timeout=600)
    assert got["sha256"] == sent["sha256"] == sha256_file(out / "sales.csv")
