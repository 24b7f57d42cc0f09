"""``python -m benchmarks``: throughput and memory of amqstream against what users use instead.

In one run on one machine, for each data kind (incompressible, realistic CSV) and size:

* amqstream end to end (sender and receiver at once, persistent chunks, verified), with and
  without zstd; sender alone (backlog in the broker); receiver alone (draining it);
* the same end to end through the installed ``amqstream`` command with the default
  connection from ``AIRFLOW_CONN_AMQSTREAM_DEFAULT``, as users run it (``--installed-sizes``);
* raw stomp.py through the same broker, same chunk size, no protocol;
* paramiko SFTP put (what Airflow's SFTP provider uses) to a local OpenSSH server started
  on a private port with a throwaway key; OpenSSH's own sftp and scp to the same server;
* the disk itself: dd conv=fsync.

Prints a table with ratios, writes docs/benchmarks.md with plots, and rewrites the figures of
the README's "Why" table from the same rows (``--readme-only`` does that from the last report).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from benchmarks.common import (
    PAIRED_ROUNDS,
    ROOT,
    Bench,
    MiB,
    Sshd,
    free_port,
    log,
    machine_busy,
    make_csv,
    make_random,
    median_run,
    parse_size,
    per_gib,
)
from benchmarks.readme import rows_from_report, update_readme


def broker_peak_kib(broker: EmbeddedBroker) -> int:
    pid = broker.running_pid()
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------------------ report
def mibs(size: int, secs: float) -> float:
    return size / MiB / max(secs, 1e-9)


def run(sizes: list[str], kinds: list[str], work: Path, ssh: bool, warm_mib: int = 64,
        installed_sizes: tuple[str, ...] = ("1G",)) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    sshd = Sshd(work).__enter__() if ssh else None
    warm = work / "warm-up.bin"
    make_random(warm, warm_mib * MiB)
    try:
        for kind in kinds:
            for label in sizes:
                size = parse_size(label)
                src = work / f"input-{kind}-{label}.{'csv' if kind == 'csv' else 'bin'}"
                log(f"{kind} {label}: generating {size / MiB:,.0f} MiB")
                (make_csv(src, size, work / "seed.csv") if kind == "csv" else make_random(src, size))
                broker = EmbeddedBroker(work / f"broker-{kind}-{label}", port=free_port())
                broker.start()
                try:
                    b = Bench(work, broker.info().uri, broker.running_pid())
                    # A broker in use has compiled its hot paths long ago; a fresh JVM spends
                    # ~1.5 CPU-seconds in its JIT first, which would land on whichever
                    # measurement ran first (ours). Warm it up, unmeasured, for all alike.
                    if warm_mib:
                        log(f"{kind} {label}: warming the broker up ({warm_mib} MiB, not measured)")
                        b.ours(warm)
                        b.raw_stomp(warm)
                    row: dict[str, Any] = {"kind": kind, "size": label, "bytes": size}
                    log(f"{kind} {label}: amqstream end to end")
                    e2e = b.ours(src)
                    row.update(ours=mibs(size, e2e["seconds"]), send_rss=e2e["send_rss"], recv_rss=e2e["recv_rss"],
                               cpu_ours=per_gib(e2e["cpu"], size))
                    raws: list[dict[str, Any]] = []
                    if label in installed_sizes:
                        # The goal compares these two, and this machine's speed drifts by more than
                        # the difference within minutes: alternate them, report the medians.
                        envs, sftps, busy_env, busy_sftp = [], [], [], []
                        for k in range(1, PAIRED_ROUNDS + 1):
                            log(f"{kind} {label}: installed command with $AIRFLOW_CONN_AMQSTREAM_DEFAULT, then raw "
                                f"stomp.py{', then OpenSSH sftp' if sshd else ''} (round {k} of {PAIRED_ROUNDS})")
                            # The whole machine's CPU around each transfer: our three processes and
                            # the kernel's writeback, against ssh, sshd and the same writeback.
                            os.sync()
                            c0 = machine_busy()
                            envs.append(b.ours(src, installed=True))
                            busy_env.append(machine_busy() - c0)
                            raws.append(b.raw_stomp(src))
                            if sshd:
                                os.sync()
                                c0 = machine_busy()
                                sftps.append(sshd.sftp_put(src, work / "ssh.out"))
                                busy_sftp.append(machine_busy() - c0)
                                (work / "ssh.out").unlink()
                        env_e2e = median_run(envs)
                        row.update(ours_env=mibs(size, env_e2e["seconds"]), env_send_rss=env_e2e["send_rss"],
                                   env_recv_rss=env_e2e["recv_rss"], cpu_env=per_gib(env_e2e["cpu"], size),
                                   env_vs_raw_rounds=[round(r["seconds"] / e["seconds"], 2)
                                                      for e, r in zip(envs, raws, strict=True)])
                        row.update(machine_env=per_gib(busy_env, size))
                        if sftps:
                            # The goal against OpenSSH, from the same alternating rounds.
                            row.update(sftp_alt=mibs(size, sorted(sftps)[len(sftps) // 2]),
                                       env_vs_sftp_rounds=[round(t / e["seconds"], 2)
                                                           for e, t in zip(envs, sftps, strict=True)],
                                       machine_sftp=per_gib(busy_sftp, size),
                                       machine_vs_sftp_rounds=[round(e / t, 2)
                                                               for e, t in zip(busy_env, busy_sftp, strict=True)])
                    log(f"{kind} {label}: amqstream end to end, zstd")
                    zstd = b.ours(src, compress=True)
                    row.update(ours_zstd=mibs(size, zstd["seconds"]), cpu_zstd=per_gib(zstd["cpu"], size))
                    log(f"{kind} {label}: amqstream sender alone, then receiver alone")
                    s_only, r_only = b.ours_split(src)
                    row.update(send_only=mibs(size, s_only["seconds"]), recv_only=mibs(size, r_only["seconds"]))
                    if not raws:
                        log(f"{kind} {label}: raw stomp.py")
                        raws.append(b.raw_stomp(src))
                    raw = median_run(raws)
                    row.update(raw_stomp=mibs(size, raw["seconds"]), cpu_raw=per_gib(raw["cpu"], size))
                    row["broker_rss"] = broker_peak_kib(broker)
                finally:
                    broker.stop()
                    shutil.rmtree(work / f"broker-{kind}-{label}", ignore_errors=True)
                if sshd:
                    dest = work / "ssh.out"
                    log(f"{kind} {label}: paramiko SFTP, OpenSSH sftp, scp")
                    row["paramiko"] = mibs(size, sshd.paramiko_put(src, dest))
                    row["sftp"] = mibs(size, sshd.sftp_put(src, dest))
                    row["scp"] = mibs(size, sshd.scp_put(src, dest))
                    dest.unlink()
                log(f"{kind} {label}: dd conv=fsync")
                row["dd"] = mibs(size, b.dd(src))
                src.unlink()
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if sshd:
            sshd.__exit__()
    return rows


COLS = [("ours", "amqstream e2e"), ("ours_env", "amqstream e2e, installed, $AIRFLOW_CONN"),
        ("ours_zstd", "amqstream e2e zstd"), ("send_only", "send only"),
        ("recv_only", "receive only"), ("raw_stomp", "raw stomp.py"), ("paramiko", "paramiko SFTP"),
        ("sftp", "OpenSSH sftp"), ("scp", "scp"), ("dd", "dd fsync")]


def table(rows: list[dict[str, Any]]) -> str:
    head = "| data | size | " + " | ".join(c[1] for c in COLS) + " | vs raw stomp | installed vs raw stomp | " \
           "installed vs OpenSSH sftp (alternating) | vs paramiko | zstd vs sftp | RSS send / recv / broker (MiB) |"
    lines = [head, "|" + "---|" * (len(COLS) + 8)]
    def ratio(r: dict[str, Any], a: str, b: str) -> str:
        return f"{r[a] / r[b]:.2f}x" if a in r and b in r else "-"

    for r in rows:
        vals = " | ".join(f"{r[k]:,.0f}" if k in r else "-" for k, _ in COLS)
        rss = f"{r['send_rss'] / 1024:.0f} / {r['recv_rss'] / 1024:.0f} / {r['broker_rss'] / 1024:.0f}"
        lines.append(f"| {r['kind']} | {r['size']} | {vals} | {ratio(r, 'ours', 'raw_stomp')} | "
                     f"{ratio(r, 'ours_env', 'raw_stomp')} | {ratio(r, 'ours_env', 'sftp_alt')} | "
                     f"{ratio(r, 'ours', 'paramiko')} | "
                     f"{ratio(r, 'ours_zstd', 'sftp')} | {rss} |")
    lines += ["", "Where the CPU goes: seconds of CPU per GiB moved end to end, sender / receiver / broker "
              "(user + system, all threads), for the same runs.", "",
              "| data | size | amqstream | amqstream, installed (median round) | amqstream zstd | raw stomp.py |",
              "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [" / ".join(f"{c:.1f}" for c in r[k]) if k in r else "-"
                 for k in ("cpu_ours", "cpu_env", "cpu_zstd", "cpu_raw")]
        lines.append(f"| {r['kind']} | {r['size']} | " + " | ".join(cells) + " |")
    machine = [r for r in rows if "machine_env" in r]
    if machine:
        lines += ["", "The whole machine's CPU-seconds per GiB (`/proc/stat`: every process and kernel thread, "
                  "busy time around each transfer) in the same alternating rounds: the installed command "
                  "against OpenSSH `sftp put`, each round's figures and their ratio.", "",
                  "| data | size | amqstream, installed | OpenSSH sftp | ours / sftp, per round | median ratio |",
                  "|---|---|---|---|---|---|"]
        for r in machine:
            ratios = r.get("machine_vs_sftp_rounds", [])
            med = f"{sorted(ratios)[len(ratios) // 2]:.2f}x" if ratios else "-"
            lines.append(f"| {r['kind']} | {r['size']} | {', '.join(f'{c:.2f}' for c in r['machine_env'])} | "
                         f"{', '.join(f'{c:.2f}' for c in r.get('machine_sftp', [])) or '-'} | "
                         f"{', '.join(f'{x:.2f}' for x in ratios) or '-'} | {med} |")
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], docs: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for kind in sorted({r["kind"] for r in rows}):
        rs = [r for r in rows if r["kind"] == kind]
        xs = [r["bytes"] / MiB for r in rs]
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for key, label in COLS:
            if all(key in r for r in rs):
                ax.plot(xs, [r[key] for r in rs], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("file size (MiB)")
        ax.set_ylabel("MiB/s")
        ax.set_title(f"Throughput, {kind} data")
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        name = f"bench_throughput_{kind}.png"
        fig.tight_layout()
        fig.savefig(docs / name, dpi=110)
        plt.close(fig)
        names.append(name)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rs = [r for r in rows if r["kind"] == rows[0]["kind"]]
    xs = [r["bytes"] / MiB for r in rs]
    for key, label in (("send_rss", "sender"), ("recv_rss", "receiver"), ("broker_rss", "broker (JVM)")):
        ax.plot(xs, [r[key] / 1024 for r in rs], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("file size (MiB)")
    ax.set_ylabel("peak RSS (MiB)")
    ax.set_title("Peak memory vs file size")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(docs / "bench_rss.png", dpi=110)
    plt.close(fig)
    return [*names, "bench_rss.png"]


NOTES_MARKER = "<!-- notes: written by hand, kept by make bench -->"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100M,1G,4G", help="comma list of 100M, 1G, 4G or byte counts")
    ap.add_argument("--data", default="random,csv", help="comma list of random, csv")
    ap.add_argument("--workdir", help="scratch space (default a temp dir; needs ~3x the largest size free)")
    ap.add_argument("--no-ssh", action="store_true", help="skip the SFTP/scp baselines")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="where benchmarks.md and the plots go")
    ap.add_argument("--no-docs", action="store_true", help="print only")
    ap.add_argument("--bulk-sets", default="1000x64K,200x1M,20x50M",
                    help="many-file sets COUNTxSIZE for benchmarks.bulk (empty: skip)")
    ap.add_argument("--network-size", default="1G",
                    help="size sent from site A to site B through a network bridge, against one broker, by "
                         "benchmarks.network (empty: skip)")
    ap.add_argument("--mapped-files", type=int, default=100, help="files in the mapped Airflow bulk run")
    ap.add_argument("--scale", default="1000,10000,100000,300000",
                    help="file counts for benchmarks.scale: files/s and peak RSS of one send and one receive of N "
                         "small files (empty: skip)")
    ap.add_argument("--scale-per-dir", type=int, default=0,
                    help="benchmarks.scale: files to a directory (default 0: all in one, where a walk could hold "
                         "every name of it)")
    ap.add_argument("--records", type=int, default=1_000_000,
                    help="benchmarks.scale: also receive the smallest count into a directory already holding this "
                         "many completion records (0: skip)")
    ap.add_argument("--only", choices=["scale", "seal", "hostile"],
                    help="run only this benchmark; its section of --docs/benchmarks.md is replaced, the rest kept")
    ap.add_argument("--no-startup", action="store_true",
                    help="skip the start-up figures of the installed command (benchmarks.startup)")
    ap.add_argument("--warm-up", type=int, default=64, metavar="MIB",
                    help="MiB sent through each fresh broker, unmeasured, before measuring (default 64)")
    ap.add_argument("--installed-sizes", default="1G",
                    help="sizes (of --sizes) also measured through the installed `amqstream` command with the "
                         "connection in AIRFLOW_CONN_AMQSTREAM_DEFAULT (default 1G; empty for none)")
    ap.add_argument("--readme", default=str(ROOT / "README.md"),
                    help="README whose \"Why\" figures are rewritten from this run (with the docs)")
    ap.add_argument("--readme-only", action="store_true",
                    help="measure nothing: rewrite the README's figures from the rows in --docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.readme_only:
        rows, date, cores, many = rows_from_report(Path(args.docs) / "benchmarks.md")
        update_readme(Path(args.readme), rows, date, cores, many)
        log(f"rewrote the figures in {args.readme} from {len(rows)} rows of {date}")
        return 0
    if args.only == "scale":
        from benchmarks import scale

        return scale.main([f"--scale={args.scale}", f"--records={args.records}", f"--per-dir={args.scale_per_dir}",
                           f"--docs={Path(args.docs) / 'benchmarks.md'}",
                           *([f"--workdir={args.workdir}"] if args.workdir else [])])
    if args.only == "hostile":
        from benchmarks import hostile

        # Prints its table only: docs/decisions/fair-share.md quotes it.
        return hostile.main([*([f"--workdir={args.workdir}"] if args.workdir else [])])
    if args.only == "seal":
        from benchmarks import seal

        # One size: the first of --sizes if given, else the 1 GiB.
        size = args.sizes.split(",")[0] if args.sizes != ap.get_default("sizes") else "1G"
        return seal.main([f"--size={size}", f"--data={args.data}", f"--docs={Path(args.docs) / 'benchmarks.md'}",
                          *([f"--workdir={args.workdir}"] if args.workdir else [])])
    work = Path(args.workdir or tempfile.mkdtemp(prefix="amqs-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    bulk_rows: list[dict[str, Any]] = []
    scale_rows: list[dict[str, Any]] = []
    net_text = startup_text = ""
    try:
        rows = run(args.sizes.split(","), args.data.split(","), work, not args.no_ssh, args.warm_up,
                   tuple(filter(None, args.installed_sizes.split(","))))
        if args.bulk_sets:
            from benchmarks import bulk

            broker = EmbeddedBroker(work / "bulk-broker", port=free_port())
            info, _ = broker.start()
            try:
                bulk_rows = bulk.run_bulk(args.bulk_sets.split(","), work, info.uri, ssh=not args.no_ssh,
                                          mapped_files=args.mapped_files, broker_pid=info.pid)
                if not args.no_startup:
                    from benchmarks import startup

                    startup_text = startup.table(startup.run(work / "startup", info.uri))
                    print(startup_text)
            finally:
                broker.stop()
        if args.scale:
            from benchmarks import scale

            broker = EmbeddedBroker(work / "scale-broker", port=free_port())
            info, _ = broker.start()
            try:
                scale_rows = scale.run_scale(scale.parse_counts(args.scale), work / "scale", info.uri,
                                             records=args.records, per_dir=args.scale_per_dir)
                print(scale.table(scale_rows))
            finally:
                broker.stop()
        if args.network_size:
            from benchmarks import network

            net_size = parse_size(args.network_size)
            net_text = network.table(network.run(net_size, work / "network"), net_size)
            print(net_text)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = table(rows)
    print(text)
    bulk_text = ""
    if bulk_rows:
        from benchmarks import bulk

        bulk_text = bulk.table(bulk_rows)
        print(bulk_text)
    if not args.no_docs:
        from benchmarks import scale

        docs = Path(args.docs)
        docs.mkdir(exist_ok=True)
        report = docs / "benchmarks.md"
        previous = report.read_text() if report.exists() else ""
        scale_text = (scale.section(scale_rows, scale.head_commit(), args.scale_per_dir) if scale_rows
                      else scale.kept_section(previous))
        from benchmarks.seal import SECTION as SEAL_SECTION

        seal_text = scale.kept_section(previous, SEAL_SECTION)  # measured alone (--only seal)
        pngs = plots(rows, docs)
        cpu = os.cpu_count()
        md = ["# Benchmarks", "",
              f"Measured by `make bench` (`python -m benchmarks`) in one run on one machine ({cpu} cores), "
              f"{time.strftime('%Y-%m-%d')}. Throughput in MiB/s of a file of that size, 1 MiB chunks; "
              "end-to-end runs start sender and receiver together and verify the SHA-256; each fresh "
              f"broker first moves {args.warm_up} MiB unmeasured (JIT warm-up). Ratios compare figures "
              "from the same run. Peak RSS is VmHWM of each process.", "",
              "What differs between the paths: OpenSSH moves the file once, encrypted, and does not fsync "
              "it. An amqstream stream is written to disk twice with fsync before it counts as delivered "
              "(the broker's journal, confirmed per window, and the receiver's file, synced per batch) and "
              "passes through the broker's JVM; on two cores the sender, the broker and the receiver share "
              "the CPU, which the second table splits.", "",
              f"At the installed sizes the installed command and raw stomp.py run in {PAIRED_ROUNDS} alternating "
              "rounds; the table shows the median of each, and the JSON rows each round's ratio "
              "(`env_vs_raw_rounds`).", "", text, "",
              *[f"![{p}]({p})" for p in pngs], "",
              *(["## Many files", "", "Files/s and MiB/s of a directory of N files moved end to end and checked "
                 "byte by byte (`python -m benchmarks.bulk`): amqstream's CLI with one send and one receive; "
                 "OpenSSH sftp `put -r`, rsync over ssh and a paramiko SFTP loop to a local sshd; Airflow with "
                 "one SendStreamOperator task for the directory, and with mapped tasks (one per file, capped), "
                 "each under `airflow dags test`. The broker first moves 200 x 64 KiB unmeasured (JIT warm-up); "
                 f"every set is flushed to disk before it is moved; amqstream and sftp alternate, {PAIRED_ROUNDS} "
                 "rounds each, and the table shows each one's median (the JSON rows: `ours_vs_sftp_rounds`).",
                 "", bulk_text, "",
                 f"![many files]({bulk.plot(bulk_rows, docs)})", ""] if bulk_text else []),
              *(["## Start-up of the installed command", "", "How soon `amqstream` works after it is started "
                 "(`python -m benchmarks.startup`), as users run it: the console script, the connection in "
                 "`AIRFLOW_CONN_AMQSTREAM_DEFAULT`. The first-message time runs from starting `amqstream send` "
                 "of a 1,000-byte file until a consumer already subscribed to the destination has the message.",
                 "", startup_text, ""] if startup_text else []),
              *(["## Across a network bridge", "", "One file from a sender on site A's broker to a receiver on "
                 "site B's, A forwarding to B over a duplex bridge on loopback, against the same file through "
                 "one broker (`python -m benchmarks.network`). Both brokers journal every chunk, on the same "
                 "disk here.", "", net_text, ""] if net_text else []),
              *([scale_text, ""] if scale_text else []), *([seal_text, ""] if seal_text else []),
              "Raw rows (JSON):", "", "```", *[json.dumps(r) for r in rows], "```", "",
              *(["Many-file rows (JSON):", "", "```", *[json.dumps(r) for r in bulk_rows], "```", ""]
                if bulk_rows else [])]
        # Prose written by hand below the marker (history, analysis) survives a new run.
        kept = previous.split(NOTES_MARKER, 1)[1] if NOTES_MARKER in previous else ""
        report.write_text("\n".join(md) + (f"\n{NOTES_MARKER}{kept}" if kept else ""))
        log(f"wrote {docs / 'benchmarks.md'}")
        update_readme(Path(args.readme), rows, time.strftime("%Y-%m-%d"), cpu, bulk_rows)
        log(f"rewrote the figures in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
