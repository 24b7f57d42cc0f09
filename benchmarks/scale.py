"""Scale: files/s and peak RSS of one send and one receive of many small files.

``python -m benchmarks.scale --scale 1000,10000,100000,300000 [--records 1000000]`` (``make bench``
runs it too; ``make bench ARGS="--only scale --scale 1000,10000"`` runs only this). For each count
N: N files of 512 B to 4 KiB (random sizes, 1,000 to a directory) sent by one installed
``amqstream send DIR --recursive`` while one ``amqstream receive --count N`` drains them
(connection from ``AIRFLOW_CONN_AMQSTREAM_DEFAULT``, the real embedded broker), each under
:mod:`benchmarks.probe` (peak RSS is VmHWM). Reported per count: files/s of the sender (its
totals) and of the receiver (first start to last finish of its rows), both peak RSS, and
what the output directory's ``.amqstream`` records take after the run. ``--records M`` adds a
row of the smallest count received into an output directory that already holds M completion
records (written beforehand by :func:`seed_records`).

The goal it checks: peak RSS flat in N (300,000 within 10 % of 1,000, both ends), and files/s
at 100,000 not below 1,000.

``--records M --records-days D --rounds R`` compares instead: M completion records spread over
the D days before today (as a receiver writing every day would leave them, merged as its start
merges past days), and R rounds of the smallest count received into that directory and into
an empty one, alternating which goes first (the machine may be shared). It reports each pair's
ratio of receive files/s and of receiver CPU-seconds per file; the goal is within 2x.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, installed_command, log, scratch_broker

PER_DIR = 1000


def make_tree(root: Path, count: int, seed: int = 7, per_dir: int = PER_DIR) -> int:
    """``count`` files of 512 B to 4 KiB under ``root``, ``per_dir`` to a directory (0: all in
    one); returns their bytes."""
    rng = random.Random(seed)
    total = 0
    block = os.urandom(4096 + 65536)
    for i in range(count):
        d = root / f"d{i // (per_dir or count):04d}"
        if i % (per_dir or count) == 0:
            d.mkdir(parents=True, exist_ok=True)
        size = rng.randint(512, 4096)
        off = rng.randrange(65536)
        # Distinct contents (offset and index), so no two files share a SHA-256.
        body = i.to_bytes(8, "big") + block[off: off + size - 8]
        (d / f"f{i:07d}.bin").write_bytes(body)
        total += size
    os.sync()
    return total


def seed_past_records(out_dir: Path, count: int, days: int, *, merge: bool = True) -> tuple[float, float]:
    """Put ``count`` completion records in ``out_dir``'s store, an equal share on each of the
    ``days`` days before today, then merge them as a receiver's start does; returns the
    seconds each step took."""
    from airflow_provider_amqstream.engine import store as st
    from airflow_provider_amqstream.engine.receive.claims import pack_done
    from airflow_provider_amqstream.engine.records import TransferResult
    from airflow_provider_amqstream.engine.state_dir import StateDir

    t0 = time.monotonic()
    root = StateDir.create(out_dir).path / st.STORE_DIR_NAME
    now = time.time()
    per_day = -(-count // days)
    for d in range(days):
        store = st.RecordStore(root, clock=lambda d=d: now - (d + 1) * st.DAY)
        for lo in range(d * per_day, min(count, (d + 1) * per_day), 10_000):
            hi = min(count, (d + 1) * per_day, lo + 10_000)
            store.put_many([(st.DONE, f"seed-{i:08d}", pack_done(TransferResult(
                f"seed-{i:08d}", "/queue/seed", f"seed{i}.bin", 1024, 1, "0" * 64, 0.001, "atomic",
                path=str(out_dir / f"seed{i}.bin"), finished_at=now), str(out_dir))) for i in range(lo, hi)],
                sync=False)
        store.close()
    os.sync()
    t1 = time.monotonic()
    if merge:
        st.prune_quietly(st.RecordStore(root))
    return t1 - t0, time.monotonic() - t1


def compare_records(n: int, records: int, days: int, rounds: int, work: Path, uri: str, *,  # noqa: PLR0913
                    code: Path | None = None) -> list[dict[str, Any]]:
    """``rounds`` pairs of runs of ``n`` files: into a directory holding ``records`` records
    over ``days`` past days and into an empty one, alternating which goes first. ``code``: an
    older checkout's package runs the transfers (the records are then left unmerged)."""
    env = {**os.environ, "AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri, "PYTHONPATH": str(code or ROOT)}
    src = work / "src"
    make_tree(src, n)
    seeded = work / "out-seeded"
    log(f"scale: writing {records} completion records over {days} past days into {seeded}")
    seed_s, merge_s = seed_past_records(seeded, records, days, merge=code is None)
    log(f"scale: written in {seed_s:.0f}s, merged in {merge_s:.0f}s")
    one_run(n, src, work / "warm-out", {**env, "AMQSTREAM_STATE_DIR": str(work / "state-warm")}, "warm")
    rows = []
    for r in range(rounds):
        pair = {}
        for kind in (("none", "seeded") if r % 2 else ("seeded", "none")):
            out = seeded if kind == "seeded" else work / f"out-none-{r}"
            run_env = {**env, "AMQSTREAM_STATE_DIR": str(work / f"state-{kind}-{r}")}
            pair[kind] = one_run(n, src, out, run_env, f"{kind}-{r}", seeded=records if kind == "seeded" else 0)
            for e in os.scandir(out):  # the files received go; the records stay
                if e.name != ".amqstream":
                    shutil.rmtree(e.path) if e.is_dir(follow_symlinks=False) else os.unlink(e.path)
        row = {"round": r, "files": n, "records": records, "days": days,
               "none_files_per_s": pair["none"]["recv_files_per_s"],
               "seeded_files_per_s": pair["seeded"]["recv_files_per_s"],
               "none_cpu_s": pair["none"]["recv_cpu_s"], "seeded_cpu_s": pair["seeded"]["recv_cpu_s"],
               "files_per_s_ratio": round(pair["none"]["recv_files_per_s"] / pair["seeded"]["recv_files_per_s"], 2),
               "cpu_ratio": round(pair["seeded"]["recv_cpu_s"] / max(pair["none"]["recv_cpu_s"], 1e-3), 2)}
        log(f"scale: {json.dumps(row)}")
        rows.append(row)
    return rows


def seed_records(out_dir: Path, count: int) -> float:
    """Put ``count`` completion records of earlier streams in ``out_dir``'s state directory, as
    the receiving engine writes them (its record API: a TransferResult per stream), without
    moving any data; returns the seconds it took. Not synced one by one (one sync at the end):
    only their presence matters here."""
    from airflow_provider_amqstream.engine.receive.claims import done_records
    from airflow_provider_amqstream.engine.records import TransferResult
    from airflow_provider_amqstream.engine.state_dir import StateDir

    t0 = time.monotonic()
    sdir = StateDir.create(out_dir)
    now = time.time()

    def results(lo: int, hi: int) -> Any:
        for i in range(lo, hi):
            sid = f"seed-{i:08d}"
            yield TransferResult(sid, "/queue/seed", f"seed{i}.bin", 1024, 1, "0" * 64, 0.001, "atomic", 0, 1024,
                                 str(out_dir / f"seed{i}.bin"), now, now, status="complete", chunk_size=1 << 20)

    # Into the record store, as receivers write them, in slices: its writes are one per bucket.
    for lo in range(0, count, 10_000):
        done_records(sdir, str(out_dir), results(lo, min(count, lo + 10_000)), sync=False)
    os.sync()
    return time.monotonic() - t0


def usage(path: Path) -> dict[str, int]:
    """Files, bytes and disk blocks (bytes) under ``path``."""
    files = size = disk = 0
    stack = [path]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except FileNotFoundError:
            continue
        with it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                    continue
                st = e.stat(follow_symlinks=False)
                files += 1
                size += st.st_size
                disk += st.st_blocks * 512
    return {"files": files, "bytes": size, "disk_bytes": disk}


def _cmd(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([*installed_command(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)


class _Rows:
    """A probed receiver's JSON lines, read as they come (never all kept): count, first start,
    last finish, and the probe's figures."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.count, self.first, self.last = proc, 0, float("inf"), 0.0
        self.probe: dict[str, Any] = {}
        self.totals: dict[str, Any] = {}
        self.err = ""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        self.err_thread = threading.Thread(target=self._read_err, daemon=True)
        self.err_thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if "probe" in row:
                self.probe = row["probe"]
            elif row.get("status") == "totals":
                self.totals = row
            elif row.get("status") in ("complete", "duplicate", "already_sent"):
                self.count += 1
                self.first = min(self.first, float(row.get("started_at") or self.first))
                self.last = max(self.last, float(row.get("finished_at") or 0.0))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.err = self.proc.stderr.read()[-2000:]

    def wait(self, timeout: float) -> int:
        rc = self.proc.wait(timeout)
        self.thread.join(60)
        self.err_thread.join(60)
        return rc


def one_run(n: int, src: Path, out: Path, env: dict[str, str], tag: str, *, seeded: int = 0) -> dict[str, Any]:
    """One send of ``src`` and one receive of its ``n`` files into ``out``, started together."""
    q = f"/queue/bench.scale.{os.getpid()}.{tag}"
    before = usage(out / ".amqstream")
    t0 = time.monotonic()
    rx = _Rows(_cmd("receive", "--from", q, "--out-dir", str(out), "--count", str(n), "--json", "-q", "--wait",
                    "300", env=env))
    tx = _Rows(_cmd("send", str(src), "--recursive", "--to", q, "--json", "-q", env=env))
    if tx.wait(7200) or rx.wait(7200):
        raise RuntimeError(f"scale {tag}: amqstream failed: send: {tx.err} receive: {rx.err}")
    secs = time.monotonic() - t0
    if rx.count < n:
        raise RuntimeError(f"scale {tag}: {rx.count} of {n} files received")
    rec = usage(out / ".amqstream")
    recv_secs = max(rx.last - rx.first, 1e-6)
    return {"files": n, "seeded_records": seeded, "seconds": round(secs, 2),
            "send_files_per_s": tx.totals.get("files_per_second"),
            "recv_files_per_s": round(n / recv_secs, 1), "send_rss_kib": tx.probe.get("peak_rss_kib"),
            "recv_rss_kib": rx.probe.get("peak_rss_kib"), "recv_cpu_s": rx.probe.get("cpu_seconds"),
            "records_files": rec["files"] - before["files"],
            "records_bytes": rec["bytes"] - before["bytes"],
            "records_disk_bytes": rec["disk_bytes"] - before["disk_bytes"]}


def run_scale(counts: list[int], work: Path, uri: str, *, records: int = 0, code: Path | None = None,
              warm_files: int = 2000, per_dir: int = PER_DIR) -> list[dict[str, Any]]:
    """Rows for each count (and one into ``records`` existing records when given)."""
    env = {**os.environ, "AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri, "AMQSTREAM_STATE_DIR": str(work / "state"),
           # Measure the package of this checkout (or --code), not whichever one is installed.
           "PYTHONPATH": str(code or ROOT)}
    rows = []
    if warm_files:
        log(f"scale: warming the broker up ({warm_files} files, not measured)")
        make_tree(work / "warm", warm_files, seed=1)
        one_run(warm_files, work / "warm", work / "warm-out", env, "warm")
        shutil.rmtree(work / "warm", ignore_errors=True)
        shutil.rmtree(work / "warm-out", ignore_errors=True)
    for n in counts:
        src = work / f"src-{n}"
        log(f"scale: making {n} files of 512 B to 4 KiB")
        make_tree(src, n, per_dir=per_dir)
        log(f"scale: {n} files, one send and one receive")
        row = one_run(n, src, work / f"out-{n}", env, str(n))
        log(f"scale: {json.dumps(row)}")
        rows.append(row)
        shutil.rmtree(work / f"out-{n}", ignore_errors=True)
        if not (records and n == min(counts)):
            shutil.rmtree(src, ignore_errors=True)
    if records:
        n = min(counts)
        out = work / f"out-seeded-{n}"
        log(f"scale: writing {records} completion records into {out}")
        secs = seed_records(out, records)
        log(f"scale: {records} records in {secs:.0f}s; {n} files into that directory")
        row = {**one_run(n, work / f"src-{n}", out, env, f"seeded-{n}", seeded=records),
               "seed_seconds": round(secs, 1)}
        log(f"scale: {json.dumps(row)}")
        rows.append(row)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(work / f"src-{n}", ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def mib(kib: Any) -> str:
        return f"{kib / 1024:.0f}" if isinstance(kib, int) else "-"

    out = ["| files | existing records | send files/s | receive files/s | sender / receiver peak RSS (MiB) | "
           "`.amqstream` after: files, MiB (on disk) |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['files']:,} | {r['seeded_records']:,} | {r['send_files_per_s'] or '-'} | "
                   f"{r['recv_files_per_s']} | {mib(r['send_rss_kib'])} / {mib(r['recv_rss_kib'])} | "
                   f"+{r['records_files']:,}, {r['records_bytes'] / 2**20:.1f} "
                   f"({r['records_disk_bytes'] / 2**20:.1f}) |")
    return "\n".join(out)


SECTION_START, SECTION_END = "<!-- scale: written by make bench -->", "<!-- /scale -->"


def section(rows: list[dict[str, Any]], commit: str, per_dir: int = PER_DIR) -> str:
    """The "Scale" section of docs/benchmarks.md for ``rows``, between its markers.

    :param per_dir: the files to a directory the rows were measured with (0: all in one).
    """
    layout = f"{per_dir:,} to a directory" if per_dir else "all in one directory"
    # The load when the section is written, not a fixed phrase: the same code measured idle and
    # beside other work differs by 2-3x here.
    load = os.getloadavg()[1]
    return "\n".join([
        SECTION_START, "## Scale: many small files", "",
        "One installed `amqstream send DIR --recursive` and one `amqstream receive --count N` started together "
        "(connection from `AIRFLOW_CONN_AMQSTREAM_DEFAULT`, the embedded broker), N files of 512 B to 4 KiB, "
        f"{layout} (`python -m benchmarks.scale`, `make bench ARGS=\"--only scale --scale "
        "1000,10000\"`). Send files/s from the sender's totals, receive files/s from its first start to its last "
        "finish; peak RSS is VmHWM; `.amqstream` is what the receiver's records take after the run. "
        f"Measured at commit {commit}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, load average "
        f"{load:.1f} over the last 5 minutes as it finished.",
        "", table(rows), "", "```", *[json.dumps(r) for r in rows], "```", SECTION_END])


def kept_section(report: str, markers: tuple[str, str] = (SECTION_START, SECTION_END)) -> str:
    """The "Scale" section (or another between its ``markers``) in the text of an earlier
    ``report``, markers included ("" if none): a run that does not measure it keeps the last
    figures instead of dropping them."""
    start, end = markers
    if start not in report or end not in report:
        return ""
    return start + report.split(start, 1)[1].split(end, 1)[0] + end


def update_report(report: Path, text: str, markers: tuple[str, str] = (SECTION_START, SECTION_END)) -> None:
    """Put ``text`` (a :func:`section`, or another benchmark's between its ``markers``) in
    ``report``, replacing the one there, else before its raw rows (or at its end)."""
    old = report.read_text() if report.exists() else "# Benchmarks\n"
    start, end = markers
    if start in old and end in old:
        head, rest = old.split(start, 1)
        new = head + text + rest.split(end, 1)[1]
    elif "Raw rows (JSON):" in old:
        head, rest = old.split("Raw rows (JSON):", 1)
        new = head + text + "\n\nRaw rows (JSON):" + rest
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    report.write_text(new)


def head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_counts(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:

    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    ap.add_argument("--scale", default="1000,10000,100000,300000", help="comma list of file counts")
    ap.add_argument("--records", type=int, default=0,
                    help="also receive the smallest count into a directory already holding this many records")
    ap.add_argument("--records-days", type=int, default=30,
                    help="with --rounds: spread the records over this many past days")
    ap.add_argument("--rounds", type=int, default=0,
                    help="compare: this many alternating pairs of runs with and without --records records")
    ap.add_argument("--workdir", help="scratch space (default a temp dir)")
    ap.add_argument("--code", help="measure the package in this directory (an older checkout) instead of this one")
    ap.add_argument("--warm-files", type=int, default=2000, help="files through the fresh broker first, unmeasured")
    ap.add_argument("--per-dir", type=int, default=PER_DIR, help="files to a directory (0: all in one)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--docs", help="put the rows in the Scale section of this benchmarks.md")
    args = ap.parse_args(argv)
    if args.rounds:
        with scratch_broker(args.workdir, "amqs-scale-") as (work, uri):
            rows = compare_records(min(parse_counts(args.scale)), args.records, args.records_days, args.rounds,
                                   work, uri, code=Path(args.code).resolve() if args.code else None)
        print(json.dumps(rows, indent=1))
        return 0
    with scratch_broker(args.workdir, "amqs-scale-") as (work, uri):
        rows = run_scale(parse_counts(args.scale), work, uri, records=args.records,
                         code=Path(args.code).resolve() if args.code else None, warm_files=args.warm_files,
                         per_dir=args.per_dir)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.docs:
        update_report(Path(args.docs), section(rows, args.code and f"(the code in {args.code})" or head_commit(),
                                               args.per_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
