"""Many files: files/s and MiB/s of a directory moved end to end, byte-exact.

``python -m benchmarks.bulk --sets 1000x64K,200x1M,20x50M`` (``make bench`` runs it too).
For each set of N files of one size:

* amqstream, one ``send DIR --recursive`` and one ``receive --count N`` started together
  (CLI, URI connection), every file checked against its SHA-256;
* OpenSSH ``sftp -b`` with ``put -r``, ``rsync -a`` over ssh, and a paramiko SFTP loop (one
  connection, one ``put`` per file: what Airflow's SFTP provider does), all to a local sshd;
* Airflow: the same files sent by one ``SendStreamOperator`` task (the whole directory)
  and by mapped ``SendStreamOperator`` tasks (one per file), each run timed under
  ``airflow dags test`` with one receiver draining beside it. The mapped run is capped
  (``--mapped-files``, default 100) and reported in files/s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    PAIRED_ROUNDS,
    Sshd,
    cli_module,
    json_rows,
    log,
    make_random,
    median_run,
    parse_size,
    process_cpu,
    py,
    scratch_broker,
)

KiB, MiB = 1024, 2**20


def parse_set(text: str) -> tuple[int, int]:
    count, _, size = text.lower().partition("x")
    return int(count), parse_size(size)


def make_set(root: Path, count: int, size: int) -> dict[str, str]:
    """``count`` random files of ``size`` bytes; returns relative path -> SHA-256."""
    root.mkdir(parents=True, exist_ok=True)
    sums = {}
    for i in range(count):
        f = root / f"f{i:05d}.bin"
        make_random(f, size)
        sums[f.name] = _sha(f)
    # Whoever runs first would otherwise pay for writing the new set back to disk: the
    # receiver's syncfs flushes the whole filesystem, OpenSSH never syncs.
    os.sync()
    return sums


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(4 * MiB), b""):
            h.update(block)
    return h.hexdigest()


def check_tree(dest: Path, sums: dict[str, str], what: str) -> None:
    for name, digest in sums.items():
        if _sha(dest / name) != digest:
            raise RuntimeError(f"{what} delivered {name} wrong")


def _collect(proc: subprocess.Popen[str]) -> Callable[[], tuple[str, str]]:
    """Read a receiver's output while it runs (a full pipe would stop it, holding every
    message the broker handed it); the returned call waits for it to end."""
    box: dict[str, tuple[str, str]] = {}
    reader = threading.Thread(target=lambda: box.update(out=proc.communicate(timeout=7200)), daemon=True)
    reader.start()

    def wait() -> tuple[str, str]:
        reader.join(7300)
        return box["out"]

    return wait


def ours(src: Path, sums: dict[str, str], work: Path, uri: str, tag: str,
         broker_pid: int | None = None, *, send_args: Sequence[str] = (),
         recv_args: Sequence[str] = ()) -> dict[str, Any]:
    """One send + one receive of the set ``src`` (``send_args`` and ``recv_args`` added to each
    command line): seconds, each end's peak RSS (KiB) and CPU-s, the broker's CPU-s."""
    q, out = f"/queue/bench.bulk.{os.getpid()}.{tag}", work / f"out-{tag}"
    # An installed package has its bytecode (pip compiles it); this tree run with -m has
    # none where PYTHONDONTWRITEBYTECODE is set, and each process would compile its modules
    # again (0.17 CPU-s, a fifth of a 1,000 x 64 KiB run). The unmeasured warm-up writes it.
    env = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": str(work / "pycache")}
    cpu0, t0 = process_cpu(broker_pid), time.monotonic()
    rx = cli_module("receive", "--from", q, "--out-dir", str(out), "--conn", uri, "--count", str(len(sums)), "--json",
                    "-q", "--wait", "120", *recv_args, env=env)
    received = _collect(rx)
    tx = cli_module("send", str(src), "--recursive", "--to", q, "--conn", uri, "--json", "-q", *send_args,
                    env={**env, "AMQSTREAM_STATE_DIR": str(work / f"state-{tag}")})
    s_out, s_err = tx.communicate(timeout=7200)
    r_out, r_err = received()
    secs, broker_cpu = time.monotonic() - t0, process_cpu(broker_pid) - cpu0
    if tx.returncode or rx.returncode:
        raise RuntimeError(f"amqstream failed: {s_err[-800:]} {r_err[-800:]}")
    sent, got = json_rows(s_out), json_rows(r_out)
    if {Path(r["path"]).name: r["sha256"] for r in got if r.get("status") == "complete"} != sums:
        raise RuntimeError("amqstream delivered a different set of files")
    check_tree(out, sums, "amqstream")
    os.sync()
    return {"seconds": secs, "send_rss": sent[-1]["peak_rss_kib"], "recv_rss": max(r["peak_rss_kib"] for r in got),
            "cpu": [sent[-1]["cpu_seconds"], max(r["cpu_seconds"] for r in got), round(broker_cpu, 2)],
            "system": [sent[-1]["system_seconds"], max(r["system_seconds"] for r in got)]}


def sftp_put_r(sshd: Sshd, src: Path, dest: Path) -> float:
    t0 = time.monotonic()
    subprocess.run(["sftp", "-q", *sshd._opts(), "-P", str(sshd.port), "-b", "-", f"{sshd.user}@127.0.0.1"],
                   input=f"put -r {src} {dest}\n".encode(), check=True, capture_output=True)
    return time.monotonic() - t0


def rsync_ssh(sshd: Sshd, src: Path, dest: Path) -> float | None:
    if not shutil.which("rsync"):
        log("rsync is not installed: skipped (apt-get install rsync)")
        return None
    ssh = " ".join(["ssh", *sshd._opts(), "-p", str(sshd.port)])
    t0 = time.monotonic()
    subprocess.run(["rsync", "-a", "-e", ssh, f"{src}/", f"{sshd.user}@127.0.0.1:{dest}/"], check=True,
                   capture_output=True)
    return time.monotonic() - t0


def paramiko_loop(sshd: Sshd, src: Path, dest: Path) -> float:
    t0 = time.monotonic()  # the connection is part of what a transfer costs
    with sshd.paramiko_sftp() as sftp:
        sftp.mkdir(str(dest))
        for f in sorted(src.iterdir()):
            sftp.put(str(f), str(dest / f.name))
    return time.monotonic() - t0


_DAG = '''
from airflow.sdk import DAG
from airflow_provider_amqstream.operators.stream import SendStreamOperator

with DAG("bench_bulk_one_task", schedule=None):
    SendStreamOperator(task_id="send", path={src!r}, recursive=True, destination={q1!r}, manifest=False)

with DAG("bench_bulk_mapped", schedule=None):
    SendStreamOperator.partial(task_id="send", destination={q2!r}).expand(path={files!r})
'''


def airflow_runs(src: Path, sums: dict[str, str], work: Path, uri: str, mapped_files: int) -> dict[str, Any]:
    """files/s of one task for the whole directory, and of mapped tasks (capped), each
    timed under ``airflow dags test`` with a receiver draining beside it."""
    home = work / "airflow"
    dags = home / "dags"
    dags.mkdir(parents=True, exist_ok=True)
    q1, q2 = f"/queue/bench.af1.{os.getpid()}", f"/queue/bench.af2.{os.getpid()}"
    mapped = sorted(str(f) for f in src.iterdir())[:mapped_files]
    (dags / "bench_bulk.py").write_text(textwrap.dedent(_DAG.format(src=str(src), q1=q1, q2=q2, files=mapped)))
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
           "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW_CONN_AMQSTREAM_DEFAULT": uri,
           "AMQSTREAM_STATE_DIR": str(work / "af-state"), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], env=env, check=True, capture_output=True)
    rows = {}
    for dag_id, q, n in (("bench_bulk_one_task", q1, len(sums)), ("bench_bulk_mapped", q2, len(mapped))):
        out = work / f"af-out-{dag_id}"
        t0 = time.monotonic()
        rx = py("airflow_provider_amqstream.cli", "receive", "--from", q, "--out-dir", str(out), "--conn", uri,
                "--count", str(n), "--json", "-q", "--wait", "600")
        received = _collect(rx)
        run = subprocess.run([sys.executable, "-m", "airflow", "dags", "test", dag_id], env=env, capture_output=True,
                             text=True, timeout=7200)
        r_out, r_err = received()
        secs = time.monotonic() - t0
        if run.returncode or rx.returncode:
            raise RuntimeError(f"{dag_id} failed: {run.stderr[-1500:]} {r_err[-800:]}")
        check_tree(out, {Path(f).name: sums[Path(f).name] for f in (mapped if n < len(sums) else sums)}, dag_id)
        shutil.rmtree(out)
        rows[dag_id] = {"files": n, "seconds": secs}
    return rows


def run_bulk(sets: list[str], work: Path, uri: str, *, ssh: bool = True, airflow: bool = True,  # noqa: PLR0913
             mapped_files: int = 100, warm_files: int = 200, peers: tuple[str, ...] = ("rsync", "paramiko"),
             broker_pid: int | None = None) -> list[dict[str, Any]]:
    """Each set's rows; ``peers``: the copies run once beside sftp's rounds; ``broker_pid``:
    whose CPU-seconds each amqstream round reports with the sender's and the receiver's."""
    rows = []
    work = work / "bulk"
    work.mkdir(parents=True, exist_ok=True)
    sshd = Sshd(work).__enter__() if ssh else None
    try:
        if warm_files:
            # A fresh broker JVM compiles its hot paths during the first thousand messages,
            # which would land on the first set's amqstream run alone.
            log(f"warming the broker up ({warm_files} x 64 KiB through amqstream, not measured)")
            warm = work / "set-warm-up"
            ours(warm, make_set(warm, warm_files, 64 * KiB), work, uri, "warm-up", broker_pid)
            _drop_outputs(work, "warm-up")
            shutil.rmtree(warm)
        for text in sets:
            count, size = parse_set(text)
            src = work / f"set-{text}"
            log(f"{text}: making {count} files of {size} bytes")
            sums = make_set(src, count, size)
            total = count * size
            row: dict[str, Any] = {"set": text, "files": count, "bytes": total}

            def rate(secs: float | None, n: int = count, size: int = size) -> dict[str, float] | None:
                if secs is None:
                    return None
                return {"seconds": round(secs, 3), "files_per_s": round(n / secs, 1),
                        "mib_per_s": round(n * size / MiB / secs, 1)}

            # The goal compares amqstream with OpenSSH sftp, whose speed here moves by 2x
            # between two runs a minute apart: they alternate, and each reports its median.
            runs: list[dict[str, Any]] = []
            sftp_secs: list[float] = []
            for k in range(1, PAIRED_ROUNDS + 1):
                log(f"{text}: amqstream CLI, one send and one receive (round {k} of {PAIRED_ROUNDS})")
                runs.append(ours(src, sums, work, uri, f"{text}-{k}", broker_pid))
                if sshd:
                    log(f"{text}: sftp (round {k} of {PAIRED_ROUNDS})")
                    sftp_secs.append(_ssh_run(sshd, sftp_put_r, src, sums, work / f"ssh-sftp-{text}-{k}", "sftp"))
            o = median_run(runs)
            row["ours"] = {**rate(o["seconds"]), "send_rss_kib": max(r["send_rss"] for r in runs),
                           "recv_rss_kib": max(r["recv_rss"] for r in runs),
                           "cpu_rounds": [r["cpu"] for r in runs], "system_rounds": [r["system"] for r in runs]}
            if sshd:
                row["sftp"] = rate(sorted(sftp_secs)[len(sftp_secs) // 2])
                row["ours_vs_sftp_rounds"] = [round(s / r["seconds"], 2) for r, s in zip(runs, sftp_secs, strict=True)]
                for key, fn in (("rsync", rsync_ssh), ("paramiko", paramiko_loop)):
                    if key not in peers:
                        continue
                    log(f"{text}: {key}")
                    row[key] = rate(_ssh_run(sshd, fn, src, sums, work / f"ssh-{key}-{text}", key))
            if airflow:
                log(f"{text}: Airflow, one task for the directory vs mapped tasks (dags test)")
                af = airflow_runs(src, sums, work, uri, mapped_files)
                row["airflow_one_task"] = rate(af["bench_bulk_one_task"]["seconds"])
                m = af["bench_bulk_mapped"]
                row["airflow_mapped"] = rate(m["seconds"], m["files"]) | {"files": m["files"]}
            _drop_outputs(work, text)
            shutil.rmtree(src)
            rows.append(row)
            log(json.dumps(row))
    finally:
        if sshd:
            sshd.__exit__()
    return rows


def _ssh_run(sshd: Sshd, fn: Callable[[Sshd, Path, Path], float | None], src: Path, sums: dict[str, str],
             dest: Path, what: str) -> float | None:
    """One timed copy to the local sshd, checked byte by byte, its destination kept (see
    :func:`_drop_outputs`)."""
    secs = fn(sshd, src, dest)
    if secs is not None:
        check_tree(dest, sums, what)
    # Its files were written without a sync; do not leave their write-back to the next run.
    os.sync()
    return secs


def _drop_outputs(work: Path, text: str) -> None:
    """Remove every round's copies of set ``text`` once the set is done, not after each round.

    This machine's root filesystem is ext4 without a journal, where a new inode skips any
    freed within the last 5 s (300 s while its inode-table block is dirty) and reads the
    block to find out: deleting 1,000 files after each round made every later round's
    creates slower, a receiver's system time growing from 0.3 to 1.5 CPU-s by round 8 (perf:
    ``recently_deleted``, ``find_inode_bit``), and whichever side ran later paid more.
    """
    for d in [*work.glob(f"out-{text}*"), *work.glob(f"ssh-*-{text}*")]:
        shutil.rmtree(d, ignore_errors=True)
    os.sync()


COLS = [("ours", "amqstream CLI"), ("sftp", "OpenSSH sftp put -r"), ("rsync", "rsync over ssh"),
        ("paramiko", "paramiko SFTP loop"), ("airflow_one_task", "Airflow, one task"),
        ("airflow_mapped", "Airflow, mapped tasks")]


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| set | " + " | ".join(c[1] for c in COLS) +
            " | ours vs paramiko | ours vs sftp | one task vs mapped | sender / receiver RSS MiB |")
    lines = [head, "|" + "---|" * (len(COLS) + 5)]

    def cell(r: dict[str, Any], k: str) -> str:
        v = r.get(k)
        if not v:
            return "-"
        extra = f" ({v['files']} files)" if "files" in v else ""
        return f"{v['files_per_s']:,.0f} files/s, {v['mib_per_s']:,.1f} MiB/s{extra}"

    def ratio(r: dict[str, Any], a: str, b: str) -> str:
        x, y = r.get(a), r.get(b)
        return f"{x['files_per_s'] / y['files_per_s']:.2f}x" if x and y else "-"

    for r in rows:
        o = r["ours"]
        lines.append(f"| {r['set']} | " + " | ".join(cell(r, k) for k, _ in COLS) +
                     f" | {ratio(r, 'ours', 'paramiko')} | {ratio(r, 'ours', 'sftp')} | "
                     f"{ratio(r, 'airflow_one_task', 'airflow_mapped')} | "
                     f"{o['send_rss_kib'] / 1024:.0f} / {o['recv_rss_kib'] / 1024:.0f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], docs: Path) -> str:
    """Files/s of each path for each set, log scale, as ``docs/bench_many_files.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, label) for k, label in COLS if any(r.get(k) for r in rows)]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(1, len(keys))
    for i, (key, label) in enumerate(keys):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [(r.get(key) or {}).get("files_per_s", 0) for r in rows], width, label=label)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))], [r["set"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("files per second (log)")
    ax.set_title("Many files end to end, byte-exact (one run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    name = "bench_many_files.png"
    fig.savefig(docs / name, dpi=110)
    plt.close(fig)
    return name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bulk", description=__doc__.splitlines()[0])
    ap.add_argument("--sets", default="1000x64K,200x1M,20x50M", help="comma list of COUNTxSIZE (K, M, G)")
    ap.add_argument("--workdir", help="scratch space (default a temp dir)")
    ap.add_argument("--no-ssh", action="store_true", help="skip sftp, rsync and paramiko")
    ap.add_argument("--no-airflow", action="store_true", help="skip the Airflow one-task and mapped runs")
    ap.add_argument("--mapped-files", type=int, default=100, help="files in the mapped Airflow run (default 100)")
    ap.add_argument("--warm-files", type=int, default=200,
                    help="64 KiB files moved through the fresh broker, unmeasured, first (default 200)")
    ap.add_argument("--peers", default="rsync,paramiko",
                    help="copies over ssh run once each besides sftp's rounds (comma list; empty: sftp alone)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    with scratch_broker(args.workdir, "amqs-bulk-") as (work, uri):
        pid = int((work / "broker" / "broker.pid").read_text())
        rows = run_bulk(args.sets.split(","), work, uri, ssh=not args.no_ssh, airflow=not args.no_airflow,
                        mapped_files=args.mapped_files, warm_files=args.warm_files,
                        peers=tuple(args.peers.split(",")), broker_pid=pid)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
