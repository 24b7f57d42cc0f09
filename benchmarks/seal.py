"""``python -m benchmarks.seal`` (``make bench ARGS="--only seal"``): what sealing costs each end.

The installed ``amqstream`` command with the connection in ``AIRFLOW_CONN_AMQSTREAM_DEFAULT``,
sender and receiver as separate processes started together, one fresh embedded broker; for each
data kind, rounds alternate sealed (``send --seal-to``, ``receive --key``) and unsealed, since this
machine's speed drifts within minutes. Each end's CPU-s per GiB is utime + stime of its process
and its children (/proc), its peak RSS is VmHWM; the goal (issue 38) is sealed at most 15 % over
unsealed on each end, RSS unchanged. Then a many-file send of small files (``--files``, 1,000 x
64 KiB by default: they travel in sealed packs), files/s sealed against unsealed, alternating as
well. Writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.bulk import make_set, ours, parse_set
from benchmarks.common import (
    ROOT,
    MiB,
    amqstream_command,
    log,
    make_csv,
    make_random,
    parse_size,
    result,
    scratch_broker,
)
from benchmarks.scale import head_commit, update_report

SECTION = ("<!-- seal: written by make bench -->", "<!-- /seal -->")
BUDGET = 1.15


def transfer(src: Path, work: Path, uri: str, queue: str, key: tuple[Path, str] | None) -> dict[str, Any]:
    """One file end to end (sealed for ``key``, a key file and its recipient, if given);
    CPU-s per GiB and peak RSS (MiB) of each end."""
    env = {"AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri}
    out = work / "out"
    seal_rx = ["--key", str(key[0])] if key else []
    seal_tx = ["--seal-to", key[1]] if key else []
    rx = amqstream_command("receive", "--from", queue, "--out-dir", str(out), "--json", "-q", "--overwrite",
                           "--wait", "300", *seal_rx, env=env)
    tx = amqstream_command("send", str(src), "--to", queue, "--json", "-q", "--stream-id", queue.rsplit("/", 1)[1],
                           *seal_tx, env={**env, "AMQSTREAM_STATE_DIR": str(work / "state")})
    s, r = result(tx), result(rx)
    if s["sha256"] != r["sha256"]:
        raise RuntimeError(f"{queue}: the receiver got a different file")
    (out / src.name).unlink()
    gib = src.stat().st_size / (1024 * MiB)
    return {"sealed": bool(key), "send_cpu": round(s["cpu_seconds"] / gib, 3),
            "recv_cpu": round(r["cpu_seconds"] / gib, 3),
            "send_rss": round(s["peak_rss_kib"] / 1024), "recv_rss": round(r["peak_rss_kib"] / 1024)}


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def new_key(work: Path) -> tuple[Path, str]:
    """A key file and its recipient, as `amqstream keys new` makes them."""
    made = subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", "keys", "new",
                           str(work / "bench.key")], cwd=ROOT, check=True, capture_output=True, text=True)
    return work / "bench.key", made.stdout.strip().splitlines()[-1]


def many_files(count: int, size: int, rounds: int, work: Path, uri: str, key: tuple[Path, str]) -> dict[str, Any]:
    """``count`` files of ``size`` bytes in one send and one receive (benchmarks.bulk's run),
    sealed and unsealed in alternating rounds: files/s and each end's CPU-s (medians)."""
    src = work / "small"
    log(f"seal files: generating {count:,} x {size:,} bytes")
    sums = make_set(src, count, size)
    runs: list[dict[str, Any]] = []
    for i in range(rounds + 1):  # the first pair warms the broker and the bytecode up, unmeasured
        for k in ((key, None) if i % 2 == 0 else (None, key)):
            tag = f"seal-files-{i}-{'sealed' if k else 'plain'}"
            log(f"seal files: {'warm-up' if i == 0 else f'round {i} of {rounds}'}, {'sealed' if k else 'unsealed'}")
            r = ours(src, sums, work, uri, tag, send_args=["--seal-to", k[1]] if k else [],
                     recv_args=["--key", str(k[0])] if k else [])
            shutil.rmtree(work / f"out-{tag}", ignore_errors=True)
            if i:
                runs.append({"sealed": bool(k), "files_s": round(count / r["seconds"], 1), "send_cpu": r["cpu"][0],
                             "recv_cpu": r["cpu"][1], "send_rss": round(r["send_rss"] / 1024),
                             "recv_rss": round(r["recv_rss"] / 1024)})
                print(json.dumps({"kind": "files", **runs[-1]}), flush=True)
    shutil.rmtree(src)
    row: dict[str, Any] = {"files": count, "size": size, "rounds": rounds}
    for name, sealed in (("sealed", True), ("plain", False)):
        for f in ("files_s", "send_cpu", "recv_cpu", "send_rss", "recv_rss"):
            row[f"{name}_{f}"] = median([r[f] for r in runs if r["sealed"] is sealed])
    row["files_s_ratio"] = round(row["sealed_files_s"] / row["plain_files_s"], 3)
    pairs = zip([r for r in runs if r["sealed"]], [r for r in runs if not r["sealed"]], strict=True)
    row["round_ratios"] = [round(s["files_s"] / p["files_s"], 2) for s, p in pairs]
    # The machine drifts within a run (the 1 GiB rounds' writeback lands in later receivers' syncfs):
    # the median of each round's own ratio is the figure a drift moves least.
    row["round_ratio_median"] = median(row["round_ratios"])
    return row


def run(kinds: list[str], size: int, rounds: int, work: Path, uri: str,
        key: tuple[Path, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    n = 0
    for kind in kinds:
        src = work / f"input-{kind}.{'csv' if kind == 'csv' else 'bin'}"
        log(f"seal {kind}: generating {size / MiB:,.0f} MiB")
        (make_csv(src, size, work / "seed.csv") if kind == "csv" else make_random(src, size))
        log(f"seal {kind}: warming the broker up (64 MiB each way, not measured)")
        warm = work / "warm.bin"
        make_random(warm, 64 * MiB)
        for k in (key, None):
            n += 1
            transfer(warm, work, uri, f"/queue/bench.seal.{os.getpid()}.{n}", k)
        runs: list[dict[str, Any]] = []
        for i in range(rounds):
            # Alternate which goes first, so a drift favours neither.
            for k in ((key, None) if i % 2 == 0 else (None, key)):
                n += 1
                log(f"seal {kind}: round {i + 1} of {rounds}, {'sealed' if k else 'unsealed'}")
                runs.append(transfer(src, work, uri, f"/queue/bench.seal.{os.getpid()}.{n}", k))
                print(json.dumps({"kind": kind, **runs[-1]}), flush=True)
        src.unlink()
        rows.append(summary(kind, size, runs))
    return rows


def summary(kind: str, size: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of each end's figures, sealed and not, and their ratio."""
    row: dict[str, Any] = {"kind": kind, "bytes": size, "rounds": len(runs) // 2}
    for name, sealed in (("sealed", True), ("plain", False)):
        rs = [r for r in runs if r["sealed"] is sealed]
        for f in ("send_cpu", "recv_cpu", "send_rss", "recv_rss"):
            row[f"{name}_{f}"] = median([r[f] for r in rs])
    for f in ("send_cpu", "recv_cpu"):
        row[f"{f}_ratio"] = round(row[f"sealed_{f}"] / row[f"plain_{f}"], 3)
    # Pairs in the order they ran: the ratio of each round, for the spread.
    sealed_runs = [r for r in runs if r["sealed"]]
    plain_runs = [r for r in runs if not r["sealed"]]
    row["round_ratios"] = [[round(s["send_cpu"] / p["send_cpu"], 2), round(s["recv_cpu"] / p["recv_cpu"], 2)]
                           for s, p in zip(sealed_runs, plain_runs, strict=True)]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| data | size | CPU-s/GiB send: unsealed / sealed (ratio) | CPU-s/GiB receive: unsealed / sealed (ratio) | "
           "per-round ratios send, receive | peak RSS MiB send / receive: unsealed, sealed | within +15 % |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = r["send_cpu_ratio"] <= BUDGET and r["recv_cpu_ratio"] <= BUDGET
        rounds = "; ".join(f"{a:.2f}, {b:.2f}" for a, b in r["round_ratios"])
        out.append(f"| {r['kind']} | {r['bytes'] / MiB / 1024:g} GiB | {r['plain_send_cpu']:.2f} / "
                   f"{r['sealed_send_cpu']:.2f} ({r['send_cpu_ratio']:.2f}x) | {r['plain_recv_cpu']:.2f} / "
                   f"{r['sealed_recv_cpu']:.2f} "
                   f"({r['recv_cpu_ratio']:.2f}x) | {rounds} | {r['plain_send_rss']} / {r['plain_recv_rss']}, "
                   f"{r['sealed_send_rss']} / {r['sealed_recv_rss']} | {'yes' if ok else 'no'} |")
    return "\n".join(out)


def files_table(row: dict[str, Any]) -> str:
    return "\n".join([
        "| files | files/s: unsealed / sealed (ratio) | per-round ratios (median) | CPU-s send: unsealed / sealed | "
        "CPU-s receive: unsealed / sealed | peak RSS MiB send / receive: unsealed, sealed |",
        "|---|---|---|---|---|---|",
        f"| {row['files']:,} x {row['size'] // 1024} KiB | {row['plain_files_s']:.0f} / {row['sealed_files_s']:.0f} "
        f"({row['files_s_ratio']:.2f}x) | {', '.join(f'{r:.2f}' for r in row['round_ratios'])} "
        f"({row['round_ratio_median']:.2f}x) | "
        f"{row['plain_send_cpu']:.2f} / {row['sealed_send_cpu']:.2f} | {row['plain_recv_cpu']:.2f} / "
        f"{row['sealed_recv_cpu']:.2f} | {row['plain_send_rss']} / {row['plain_recv_rss']}, {row['sealed_send_rss']} / "
        f"{row['sealed_recv_rss']} |"])


def section(rows: list[dict[str, Any]], files: dict[str, Any] | None, store: str | None,
            load: tuple[float, float]) -> str:
    return "\n".join([
        SECTION[0], "## Sealed streams: what sealing costs each end", "",
        "The installed `amqstream send --seal-to` / `receive --key` against the same commands unsealed, connection "
        "from `AIRFLOW_CONN_AMQSTREAM_DEFAULT`, sender and receiver as separate processes started together, rounds "
        "alternating sealed and unsealed on one fresh embedded broker (`python -m benchmarks.seal`, `make bench "
        "ARGS=\"--only seal\"`). CPU-s per GiB is utime + stime of each end's process and its children (medians of "
        f"the rounds); peak RSS is VmHWM. Goal: sealed at most {BUDGET - 1:.0%} over unsealed on each end. "
        + (f"The broker keeps its store on another filesystem ({store}), as where it runs on its own machine: on the "
           "receiver's filesystem, the receiver's `syncfs` would also flush the broker's journal, and that flush, "
           "not sealing, moved the receiver's CPU by up to 0.5 s per GiB between rounds. " if store else "")
        + f"Measured at commit {head_commit()}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, load average "
        f"{load[0]:.2f} at the start and {load[1]:.2f} at the end.",
        "", table(rows), "",
        *(["Many small files in one send and one receive (`amqstream send --recursive`, `receive --count`), sealed "
           "files travelling in sealed packs; files/s is the whole run's, medians of the rounds:", "",
           files_table(files), ""] if files else []),
        "```", *[json.dumps(r) for r in [*rows, *([files] if files else [])]], "```", SECTION[1]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.seal", description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1G", help="1G, 100M, 4G or a byte count")
    ap.add_argument("--data", default="random,csv", help="comma list of random, csv")
    ap.add_argument("--rounds", type=int, default=5, help="alternating pairs of sealed and unsealed runs per kind")
    ap.add_argument("--files", default="1000x64K", help="COUNTxSIZE of the many-file run ('' to skip)")
    ap.add_argument("--workdir", help="scratch space (default a temp dir; needs ~2x the size free)")
    ap.add_argument("--docs", help="put the rows in the sealed-streams section of this benchmarks.md")
    ap.add_argument("--broker-store", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else "",
                    help="where the broker keeps its data, off the receiver's filesystem (default /dev/shm, a "
                         "tmpfs, if writable; '' keeps it in the scratch directory)")
    args = ap.parse_args(argv)
    size = parse_size(args.size)
    start = os.getloadavg()[0]
    with scratch_broker(args.workdir, "amqs-seal-", args.broker_store or None) as (work, uri):
        key = new_key(work)
        rows = run([d for d in args.data.split(",") if d], size, args.rounds, work, uri, key)
        files = many_files(*parse_set(args.files), args.rounds, work, uri, key) if args.files else None
    print(table(rows))
    if files:
        print(files_table(files))
    if args.docs:
        update_report(Path(args.docs), section(rows, files, args.broker_store, (start, os.getloadavg()[0])), SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
