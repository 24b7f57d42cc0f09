"""``python -m benchmarks.page_reuse``: what reusing memory buys end to end, before against
after, with OpenSSH ``sftp put`` in the same alternating rounds.

* ``before``: the broker's heap may shrink (``-Xms256M``, as shipped until 2026-11-29) and the
  receiver keeps every page it wrote in the page cache;
* ``after``: as shipped (the heap starts at its maximum; the receiver hands each synced batch
  back to the kernel, docs/decisions/page-reuse.md);
* ``sftp``: OpenSSH ``sftp put`` of the same file to a local sshd.

Each variant has its own broker, warmed up alike; every round moves the same file once per
variant through the installed ``amqstream`` command (connection from
``AIRFLOW_CONN_AMQSTREAM_DEFAULT``), the first variant rotating per round. Reported per round:
MiB/s, the CPU-seconds of sender, receiver and broker, and the whole machine's busy
CPU-seconds (``/proc/stat``), all per GiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from benchmarks.common import (
    ROOT,
    Bench,
    MiB,
    Sshd,
    free_port,
    log,
    machine_busy,
    make_csv,
    make_random,
    parse_size,
    scratch_dir,
)

VARIANTS = ("before", "after", "sftp")
# The receiver of "before": its page-cache hand-back turned off at start-up.
_KEEP_CACHE = ("import airflow_provider_amqstream.engine.receive.partial_file as pf\n"
               "pf._DONTNEED = None\n")


@contextlib.contextmanager
def _broker(home: Path, java_opts: str) -> Iterator[EmbeddedBroker]:
    saved = os.environ.get("AMQSTREAM_BROKER_JAVA_OPTS")
    os.environ["AMQSTREAM_BROKER_JAVA_OPTS"] = java_opts
    broker = EmbeddedBroker(home, port=free_port())
    try:
        broker.start()
    finally:
        if saved is None:
            os.environ.pop("AMQSTREAM_BROKER_JAVA_OPTS", None)
        else:
            os.environ["AMQSTREAM_BROKER_JAVA_OPTS"] = saved
    try:
        yield broker
    finally:
        broker.stop()


def run(size: int, kinds: list[str], rounds: int, work: Path) -> list[dict[str, Any]]:
    keep = work / "keep-cache"
    keep.mkdir(exist_ok=True)
    # Python imports the module "sitecustomize" from the path at start-up, before the command runs.
    (keep / "sitecustomize").with_suffix(".py").write_text(_KEEP_CACHE)
    paths = {"before": os.pathsep.join([str(ROOT), str(keep)]), "after": str(ROOT)}
    warm = work / "warm.bin"
    make_random(warm, 64 * MiB)
    rows: list[dict[str, Any]] = []
    with Sshd(work) as sshd, _broker(work / "broker-before", "-Xms256M") as before, \
            _broker(work / "broker-after", "") as after:
        benches = {name: Bench(work, b.info().uri, b.running_pid())
                   for name, b in (("before", before), ("after", after))}
        for name, bench in benches.items():
            for _ in range(2):
                bench.ours(warm, installed=True, env={"PYTHONPATH": paths[name]})
        for kind in kinds:
            src = work / f"input-{kind}.{'csv' if kind == 'csv' else 'bin'}"
            (make_csv(src, size, work / "seed.csv") if kind == "csv" else make_random(src, size))
            for k in range(rounds):
                order = VARIANTS[k % 3:] + VARIANTS[:k % 3]
                for name in order:
                    log(f"{kind}: round {k + 1} of {rounds}, {name}")
                    os.sync()
                    m0, t0 = machine_busy(), time.monotonic()
                    if name == "sftp":
                        sshd.sftp_put(src, work / "ssh.out")
                        cpu: list[float] = []
                    else:
                        cpu = benches[name].ours(src, installed=True, env={"PYTHONPATH": paths[name]})["cpu"]
                    secs, busy = time.monotonic() - t0, machine_busy() - m0
                    if name == "sftp":
                        (work / "ssh.out").unlink()
                    gib = size / (1024 * MiB)
                    row = {"kind": kind, "round": k + 1, "variant": name, "mib_s": round(size / MiB / secs, 1),
                           "machine": round(busy / gib, 2), "cpu": [round(c / gib, 2) for c in cpu]}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
            src.unlink()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| data | variant | MiB/s per round | CPU-s per GiB, sender / receiver / broker (median) | "
             "whole machine CPU-s per GiB per round (median) |", "|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for name in VARIANTS:
            rs = [r for r in rows if r["kind"] == kind and r["variant"] == name]
            cpu = " / ".join(f"{statistics.median(r['cpu'][i] for r in rs):.2f}" for i in range(3)) if rs[0]["cpu"] \
                else "-"
            machine = f"{', '.join(str(r['machine']) for r in rs)} ({statistics.median(r['machine'] for r in rs)})"
            lines.append(f"| {kind} | {name} | {', '.join(str(r['mib_s']) for r in rs)} | {cpu} | {machine} |")
    lines += ["", "| data | after / before, MiB/s per round | after / sftp, MiB/s per round | "
              "whole machine CPU, after / before per round | after / sftp per round |", "|---|---|---|---|---|"]
    for kind in dict.fromkeys(r["kind"] for r in rows):
        by = {(r["variant"], r["round"]): r for r in rows if r["kind"] == kind}
        ks = sorted({k for _, k in by})

        def ratio(a: str, b: str, key: str, ks: list[int] = ks, by: dict[Any, Any] = by) -> str:
            return ", ".join(f"{by[(a, k)][key] / by[(b, k)][key]:.2f}" for k in ks)

        lines.append(f"| {kind} | {ratio('after', 'before', 'mib_s')} | {ratio('after', 'sftp', 'mib_s')} | "
                     f"{ratio('after', 'before', 'machine')} | {ratio('after', 'sftp', 'machine')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="100M, 1G, 4G or a byte count")
    ap.add_argument("--data", default="random,csv", help="comma list of random, csv")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", help="scratch space (default a temp dir)")
    args = ap.parse_args(argv)
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        ap.error(f"--size: {exc}")
    with scratch_dir(args.workdir, "amqs-reuse-") as work:
        rows = run(size, args.data.split(","), args.rounds, work)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
