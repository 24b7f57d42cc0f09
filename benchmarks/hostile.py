"""``python -m benchmarks.hostile`` (``make bench ARGS="--only hostile"``): each case of issue 36
against the shipped embedded broker, at default settings, with a real receiver.

One user (``mallory``, send-only, raw stomp.py; ``forger`` receive-only) attacks a destination
as the issue did; ``alice`` then sends one good 300 KB file with the engine, and the installed
``amqstream receive`` (connection from ``AIRFLOW_CONN_AMQSTREAM_DEFAULT``, user ``rx``) is started
fresh. Each row gives the case, the attacker's count, the figure (seconds from the receiver's
start until alice's file is written, MiB a sender left on disk, the receiver's peak RSS,
destinations left, files/s) and the bound it is held to. For the disk and memory cases the
receiver starts first and alice sends once it has taken the whole attack (see ``_receive``).
The attack code is the tests' (tests/helpers.py). ``--no-plugins`` renders the broker without
our jar, as an external broker: the "before" of the fair-share cases. Writes nothing but the
table; docs/decisions/fair-share.md quotes it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import amqstream_command, free_port, log, scratch_dir
from benchmarks.probe import merge

# The bounds the tests hold each case to (tests/integration/test_hostile_scale.py,
# test_fair_priority.py): SLACK for start-up and a loaded machine, FIRST_LOOK per stalling user.
SLACK = 10.0
PER_LOOK = 0.12
PER_REFUSED = 0.05
BATCH_RSS_MIB = 56
GOOD = "good.bin"


def queue_of(case: str, n: int) -> str:
    """Each run of a case has its own destination, granted one by one: a family grant
    (``x.>``) carries no cap on a user's data queues, and the cap is one of the cases."""
    return f"/queue/hostile.{case}{n}"


@dataclass
class Ctx:
    broker: Any
    work: Path

    def params(self, user: str | None) -> Any:
        from tests.helpers import params_as

        return params_as(self.broker, user)

    def uri(self, user: str) -> str:
        return str(self.broker.info(user=user).uri)


def _send_good(ctx: Ctx, queue: str, seed: int) -> str:
    from airflow_provider_amqstream.engine import SendOptions, send_file
    from tests.helpers import make_file, sha256_file

    src = make_file(ctx.work / f"src-{seed}" / GOOD, 300_000, seed=seed)
    send_file(ctx.params("alice"), src, queue, SendOptions(chunk_size=64 * 1024))
    return sha256_file(src)


def _receive(ctx: Ctx, queue: str, out: Path, *, follow: bool = True,  # noqa: PLR0913
             until: Callable[[list[dict[str, Any]]], bool] | None = None,
             attack: Callable[[], None] | None = None, seed: int = 0) -> tuple[float, list[dict[str, Any]]]:
    """The installed ``amqstream receive`` as ``rx`` until alice's file (and ``until``) is
    there; seconds until alice's file, and its rows (with the probe's peak RSS when it ends by
    itself, ``follow`` False: ``--count 1``).

    Without ``attack``, the attack was made already and alice's stream sent; the seconds run
    from the receiver's start. With it, the receiver starts first, ``attack()`` runs, and
    alice's stream is sent once the receiver took all of it (the queue of offers is empty):
    what the receiver does with the attack is measured, not how soon alice's high priority
    lets it exit; the seconds run from her send.
    """
    from tests.helpers import JsonRows, browse, wait_for

    mode = ["--follow"] if follow else ["--count", "1", "--wait", "3600"]
    err = (out.parent / f"{out.name}.err").open("w")  # a file: a pipe nobody drains blocks its warnings
    t0 = time.monotonic()
    proc = amqstream_command("receive", "--from", queue, "--out-dir", str(out), "--json", "-q", *mode,
                             env={"AIRFLOW_CONN_AMQSTREAM_DEFAULT": ctx.uri("rx")}, stderr=err)
    rows = JsonRows(proc)
    try:
        if attack:
            attack()
            wait_for(lambda: not browse(ctx.params("rx"), queue), 3600, f"the receiver taking the attack on {queue}",
                     interval=1.0)
            t0 = time.monotonic()
            _send_good(ctx, queue, seed)
        mine = rows.wait(lambda rs: next((r for r in rs if r.get("name") == GOOD), None), 3600, f"{GOOD} on {queue}")
        if until:
            rows.wait(until, 3600, f"the attack's rows on {queue}")
        if not follow:
            proc.wait(600)
            rows.join(60)
    finally:
        proc.kill()
        proc.wait(60)
        err.close()
    if mine.get("status") != "complete":
        raise RuntimeError(f"{queue}: alice's stream did not complete: {mine}")
    return mine["at"] - t0, merge([{k: v for k, v in r.items() if k != "at"} for r in rows.rows])


def _stalled_n(n: int) -> Callable[[list[dict[str, Any]]], bool]:
    return lambda rs: sum(1 for r in rs if r.get("status") in ("stalled", "quarantined", "no_room")) >= n


# ------------------------------------------------------------------------------ the cases
def case_cap(ctx: Ctx, n: int) -> dict[str, Any]:
    """One user at its data-queue cap (the default, 1,000) offers one stream more."""
    from airflow_provider_amqstream.protocol.names import Destination
    from tests.helpers import RawSender, offer_many

    q = queue_of("cap", n)
    dest = Destination.parse(q)
    raw = RawSender(ctx.params("mallory"))
    try:
        for i in range(n):
            raw.send(dest.data_queue(f"full-{i}", "mallory"), b"x", {})
    finally:
        raw.close()
    offer_many(ctx.params("mallory"), q, 1, size=2, tag="over")
    _send_good(ctx, q, n)
    secs, _ = _receive(ctx, q, ctx.work / f"out-cap{n}")
    return {"figure": secs, "unit": "s", "bound": SLACK + PER_REFUSED, "before": "never (every receiver exited 1)"}


def case_stalled(ctx: Ctx, n: int) -> dict[str, Any]:
    """n offers whose sender never sends a byte."""
    from airflow_provider_amqstream.engine.receive.stream import FIRST_LOOK
    from tests.helpers import offer_many

    q = queue_of("stalled", n)
    offer_many(ctx.params("mallory"), q, n, size=5_000_000, tag="held", extra={"priority": "9"})
    _send_good(ctx, q, n)
    secs, rows = _receive(ctx, q, ctx.work / f"out-stalled{n}")
    seen = sum(1 for r in rows[:[r.get("name") for r in rows].index(GOOD)] if r.get("status") == "stalled")
    return {"figure": secs, "unit": "s", "bound": 2 * FIRST_LOOK + SLACK,
            "note": f"{seen} of the attacker's seen first",
            "before": "about 2 s each (50: 106.7 s, 200: 567 s)"}


def case_flood(ctx: Ctx, n: int) -> dict[str, Any]:
    """n good, complete streams sent as fast as raw stomp.py goes, then alice's."""
    from airflow_provider_amqstream.engine.receive.stream import FIRST_LOOK
    from tests.helpers import flood

    q = queue_of("flood", n)
    flood(ctx.params("mallory"), q, n)
    _send_good(ctx, q, n)
    secs, rows = _receive(ctx, q, ctx.work / f"out-flood{n}")
    seen = sum(1 for r in rows[:[r.get("name") for r in rows].index(GOOD)] if r.get("status") == "complete")
    return {"figure": secs, "unit": "s", "bound": 2 * FIRST_LOOK + SLACK, "note": f"{seen} of the flood received first",
            "before": "new case: see the row without our jar"}


def case_halfsent(ctx: Ctx, n: int) -> dict[str, Any]:
    """Five streams with one of two one-byte chunks sent and one trickling a byte a second."""
    from airflow_provider_amqstream.engine.receive.stream import FIRST_LOOK
    from tests.helpers import half_sent_and_trickling

    q = queue_of("halfsent", n)
    with half_sent_and_trickling(ctx.params("mallory"), q, n - 1):
        _send_good(ctx, q, 3)
        secs, _ = _receive(ctx, q, ctx.work / "out-halfsent")
    return {"figure": secs, "unit": "s", "bound": SLACK + n * (FIRST_LOOK + PER_LOOK),
            "before": "605 s (5 half-sent), 620 s (a trickle)"}


@contextlib.contextmanager
def _tmpfs(path: Path, mib: int) -> Iterator[bool]:
    path.mkdir(parents=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True,
                         timeout=30)
    try:
        yield res.returncode == 0
    finally:
        if res.returncode == 0:
            subprocess.run(["umount", "-l", str(path)], check=False, timeout=30)


def case_orphans(ctx: Ctx, n: int) -> dict[str, Any]:
    """n batch parts without their first part, to a receiver on a 64 MiB filesystem."""
    from tests.helpers import RawSender, orphan_batch_part

    q = queue_of("orphans", n)
    mnt = ctx.work / f"small{n}"
    with _tmpfs(mnt, 64) as mounted:
        if not mounted:
            return {"figure": None, "unit": "MiB", "bound": None, "note": "no tmpfs (needs root)"}
        def attack() -> None:
            raw = RawSender(ctx.params("mallory"))
            try:
                for k in range(n):  # batches of which only part 2 ever comes
                    headers, body = orphan_batch_part(f"orphan-{k:04d}", 2, 3)
                    raw.send(q, body, headers)
            finally:
                raw.close()

        out = mnt / "out"
        secs, _ = _receive(ctx, q, out, attack=attack, seed=n)
        kept = sum(f.stat().st_blocks * 512 for f in (out / ".amqstream" / "batches").rglob("*.json")) / 2**20
        total = shutil.disk_usage(mnt).total / 2**20
    return {"figure": kept, "unit": "MiB", "bound": (total - total / 50) / 2,
            "note": f"good stream in {secs:.1f} s", "before": "90.6 MiB of 200 parts; on 64 MiB: Errno 28, never"}


def case_bigbatch(ctx: Ctx, n: int) -> dict[str, Any]:
    """One batch of n parts of 2,000 files nobody sends: the receiver's peak RSS."""
    from airflow_provider_amqstream.protocol import bulk as bw
    from airflow_provider_amqstream.protocol import headers as hdr
    from tests.helpers import RawSender

    q = queue_of("bigbatch", n)
    def attack() -> None:
        raw = RawSender(ctx.params("mallory"))
        try:
            for k in range(1, n + 1):
                entries = [{"stream_id": f"never-{k}-{i}-".ljust(hdr.MAX_STREAM_ID, "x"), "dir": "",
                            "name": f"f{i}.csv", "bytes": i, "sha256": f"{i:064x}"} for i in range(bw.BATCH_PART_FILES)]
                [(headers, body)] = list(bw.iter_batch_messages("huge-1", entries, len(entries)))
                raw.send(q, body, {**headers, bw.H_PART: str(k), bw.H_PARTS: str(n)})
        finally:
            raw.close()

    secs, rows = _receive(ctx, q, ctx.work / f"out-bigbatch{n}", follow=False, attack=attack, seed=n)
    return {"figure": rows[-1]["peak_rss_kib"] / 1024, "unit": "MiB RSS", "bound": BATCH_RSS_MIB,
            "note": f"good stream in {secs:.1f} s", "before": "143.7 MiB at 250 parts, 467 MiB at 1,000"}


def case_forged(ctx: Ctx, n: int) -> dict[str, Any]:
    """A receive-only user parks an inline offer and a batch naming alice as their sender."""
    from airflow_provider_amqstream.protocol import bulk as bw
    from airflow_provider_amqstream.protocol import headers as hdr
    from airflow_provider_amqstream.protocol import wire as p
    from airflow_provider_amqstream.protocol.names import Destination
    from tests.helpers import RawSender

    q = queue_of("forged", n)
    dest = Destination.parse(q)
    body = b"name,salary\nforger,1000000\n"
    sha = hashlib.sha256(body).hexdigest()
    spec = p.StreamSpec("payroll-1", "payroll.csv", len(body), 1024 * 1024, hdr.Mode.ATOMIC)
    inline, wire = bw.inline_offer(spec, dest, body, sha, sender="alice")
    entry = {"stream_id": "payroll-1", "dir": "", "name": "payroll.csv", "bytes": len(body), "sha256": sha}
    [(batch, listing)] = list(bw.iter_batch_messages("payroll-batch", [entry], len([entry])))
    raw = RawSender(ctx.params("forger"))
    try:
        for headers, data in ((inline, wire), (batch, listing)):
            raw.send(dest.parked_queue(), data,
                     p.parked_headers(headers, sender="alice", not_before=time.time() - 1, reason="forged"))
    finally:
        raw.close()
    _send_good(ctx, q, 4)
    out = ctx.work / "out-forged"
    secs, _ = _receive(ctx, q, out, until=_stalled_n(2))
    published = int((out / "payroll.csv").exists()) + len(list(out.rglob("*.manifest.jsonl")))
    return {"figure": published, "unit": "published as alice", "bound": 0, "note": f"good stream in {secs:.1f} s",
            "before": "2 (payroll.csv and a manifest in alice's manifests/)"}


def case_quarantine(ctx: Ctx, n: int) -> dict[str, Any]:
    """n streams whose first chunk fails its CRC: quarantine destinations left on the broker."""
    from airflow_provider_amqstream.engine.queue_tools import QueueSession
    from airflow_provider_amqstream.protocol import wire as p
    from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue
    from tests.helpers import RawSender, send_stream

    q = queue_of("quarantine", n)
    dest = Destination.parse(q)
    raw = RawSender(ctx.params("mallory"))
    try:
        for i in range(n):
            spec = p.StreamSpec(f"bad-{i:05d}", "bad.bin", 2000, 1000)
            send_stream(raw.send, q, spec, b"z" * 2000, [1, 2], end=False,
                        tamper=lambda seq, h, b: (h, b"y" * len(b)) if seq == 1 else (h, b))
    finally:
        raw.close()
    _send_good(ctx, q, n)
    secs, _ = _receive(ctx, q, ctx.work / f"out-quarantine{n}", until=_stalled_n(n))
    with QueueSession(ctx.params(None)) as qs:
        left = sum(1 for i in range(n)
                   if qs.browse(dead_letter_queue(dest.data_queue(f"bad-{i:05d}", "mallory"))).frames)
    return {"figure": left, "unit": "destinations", "bound": 1000, "note": f"good stream in {secs:.1f} s",
            "before": "1,350 of 1,350, never purged"}


def case_records(ctx: Ctx, n: int) -> dict[str, Any]:
    """Another user's 500 files received into a directory holding n completion records (30 days)."""
    from benchmarks import scale

    [row] = scale.compare_records(500, n, 30, 1, ctx.work / f"records{n}",
                                   ctx.broker.info().uri)
    return {"figure": row["seeded_files_per_s"], "unit": "files/s", "bound": row["none_files_per_s"] / 2,
            "note": f"{row['none_files_per_s']:.0f} files/s with none",
            "before": "820 -> 495 files/s at 50,000; about 52 at 1.5 M"}


CASES: dict[str, tuple[Callable[[Ctx, int], dict[str, Any]], str]] = {
    "cap": (case_cap, "1000"), "stalled": (case_stalled, "10,100,1000"), "flood": (case_flood, "10,100,1000"),
    "halfsent": (case_halfsent, "6"), "orphans": (case_orphans, "10,100,200"),
    "bigbatch": (case_bigbatch, "10,100,1000"), "forged": (case_forged, "2"),
    "quarantine": (case_quarantine, "10,100,1100"), "records": (case_records, "50000,1500000"),
}
TITLES = {"cap": "one user at its data-queue cap (1,000) offers one more: good stream after",
          "stalled": "stalled offers ahead (never a byte sent): good stream after",
          "flood": "good streams flooded ahead by one user: good stream after",
          "halfsent": "5 half-sent streams and a trickle ahead: good stream after",
          "orphans": "batch parts without their first, 64 MiB disk: kept on disk",
          "bigbatch": "one batch of N parts x 2,000 files: receiver peak RSS",
          "forged": "receive-only user parks an inline offer and a batch as alice: files published",
          "quarantine": "streams with a corrupt chunk: quarantine destinations left",
          "records": "records in retention: another user's 500 files received at"}


def run(cases: dict[str, list[int]], work: Path, *, plugins: bool = True) -> list[dict[str, Any]]:
    from airflow_provider_amqstream.broker import config as broker_config
    from airflow_provider_amqstream.broker.embedded import EmbeddedBroker

    if not plugins:  # as an external broker without our jar: offers in queue order (the "before")
        broker_config.broker_jar = lambda: None  # type: ignore[assignment]

    grants = [queue_of(case, n) for case, counts in cases.items() for n in counts]
    broker = EmbeddedBroker(work / "broker", port=free_port())
    for user, g in {"mallory": {"send": grants}, "alice": {"send": grants}, "rx": {"receive": grants},
                    "forger": {"receive": grants}}.items():
        broker.add_user(user, **g)
    broker.start()
    rows = []
    ctx = Ctx(broker, work)
    try:
        for case, counts in cases.items():
            for n in counts:
                log(f"hostile {case} {n}")
                t0 = time.monotonic()
                row = {"case": case, "count": n, **CASES[case][0](ctx, n), "took": round(time.monotonic() - t0, 1),
                       "plugins": plugins}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        broker.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:,.2f}" if isinstance(v, float) else f"{v:,}"

    out = ["| case | count | figure | bound | met | note | before (issue 36) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        fig, bound = r["figure"], r["bound"]
        higher_is_better = r["unit"] == "files/s"
        met = "-" if fig is None or bound is None else (
            "yes" if (fig >= bound if higher_is_better else fig <= bound) else "no")
        title = TITLES[r["case"]] + ("" if r.get("plugins", True) else " (broker without our jar)")
        out.append(f"| {title} | {r['count']:,} | {fmt(fig)} {r['unit']} | "
                   f"{'>=' if higher_is_better else '<='} {fmt(bound)} | {met} | {r.get('note', '')} | "
                   f"{r.get('before', '')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hostile", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--counts", action="append", default=[], metavar="CASE=N,N",
                    help="the attacker's counts of a case (default: " + "; ".join(
                        f"{c}={d}" for c, (_, d) in CASES.items()) + ")")
    ap.add_argument("--workdir", help="scratch space (kept if given)")
    ap.add_argument("--no-plugins", action="store_true",
                    help="render the broker without our jar (FairOfferPlugin): the receiver's own bounds")
    args = ap.parse_args(argv)
    counts = {c: d for c, (_, d) in CASES.items()} | dict(kv.split("=", 1) for kv in args.counts)
    cases = {c: [int(n) for n in counts[c].split(",")] for c in args.cases.split(",")}
    with scratch_dir(args.workdir, "amqs-hostile-") as work:
        rows = run(cases, work, plugins=not args.no_plugins)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
