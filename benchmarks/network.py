"""``python -m benchmarks.network``: one file from site A to site B through a network bridge,
against the same file through one broker, in the same run.

Both cases run the installed ``amqstream`` command with the connection in
``AIRFLOW_CONN_AMQSTREAM_DEFAULT`` (the path users take): a receiver started first, then the
sender, timed from the sender's start to the receiver's verified file. Cross-site, the sender
uses site A's broker and the receiver site B's; A forwards to B over a duplex bridge on
loopback. Prints a Markdown table (``--json`` also writes the rows).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.broker.network import NetworkConfig
from benchmarks.common import amqstream_command, free_port, make_random, parse_size, result, scratch_dir

QUEUE = "/queue/bench.net"


def transfer(src: Path, send_uri: str, recv_uri: str, out: Path, tag: str) -> dict[str, Any]:
    """Receiver on ``recv_uri``, sender on ``send_uri``: seconds until the file is verified."""
    rx = amqstream_command("receive", "--from", QUEUE, "--out-dir", str(out), "--json", "-q", "--wait", "120",
                           env={"AIRFLOW_CONN_AMQSTREAM_DEFAULT": recv_uri})
    time.sleep(1.0)  # a benchmark, not a test: let the receiver subscribe before the clock starts
    sid = "net-" + "".join(c if c.isalnum() else "-" for c in tag)
    t0 = time.monotonic()
    tx = amqstream_command("send", str(src), "--to", QUEUE, "--json", "-q", "--stream-id", sid,
                           env={"AIRFLOW_CONN_AMQSTREAM_DEFAULT": send_uri,
                                "AMQSTREAM_STATE_DIR": str(out.parent / f"state-{tag}")})
    sent = result(tx)
    got = result(rx)
    secs = time.monotonic() - t0
    if got["sha256"] != sent["sha256"]:
        raise RuntimeError(f"{tag}: the received file differs from the sent one")
    shutil.rmtree(out)
    return {"case": tag, "seconds": round(secs, 2), "mib_s": round(src.stat().st_size / 2**20 / secs, 1),
            "recv_rss_kib": got.get("peak_rss_kib"), "send_rss_kib": sent.get("peak_rss_kib")}


def run(size: int, work: Path) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    src = work / "net.bin"
    make_random(src, size)
    secret = work / "bridge.json"
    ow = free_port()
    b = EmbeddedBroker(work / "b", port=free_port(), network=NetworkConfig(openwire_port=ow, bridge_secret=secret))
    a = EmbeddedBroker(work / "a", port=free_port(), network=NetworkConfig(
        openwire_port=free_port(), peers=(f"tcp://127.0.0.1:{ow}",), bridge_secret=secret))
    single = EmbeddedBroker(work / "single", port=free_port())
    brokers = [b, a, single]
    try:
        infos = [x.start()[0] for x in brokers]
        time.sleep(3.0)  # the bridge connects within a second or two
        rows = [transfer(src, infos[2].uri, infos[2].uri, work / "out-single", "one broker"),
                transfer(src, infos[1].uri, infos[0].uri, work / "out-net", "site A -> site B")]
    finally:
        for x in reversed(brokers):
            x.stop()
    return rows


def table(rows: list[dict[str, Any]], size: int) -> str:
    base = rows[0]["mib_s"]
    lines = [f"{size / 2**20:.0f} MiB, installed `amqstream` command, connection from `AIRFLOW_CONN_AMQSTREAM_DEFAULT`",
             "", "| path | seconds | MiB/s | vs one broker | receiver peak RSS |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['seconds']} | {r['mib_s']} | {r['mib_s'] / base:.2f}x | "
                     f"{(r['recv_rss_kib'] or 0) / 1024:.0f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.network", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="e.g. 256M, 1G or a byte count (default 1G)")
    ap.add_argument("--workdir", help="scratch space (default a temp dir; needs ~4x the size free)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        ap.error(f"--size: {exc}")
    with scratch_dir(args.workdir, "amqs-net-") as work:
        rows = run(size, work)
    print(table(rows, size))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
