"""``python -m benchmarks.broker_path``: what the broker spends per GiB under configurations
side by side, in alternating rounds (the machine's speed drifts more than the differences).

One embedded broker per variant, all running at once and warmed up alike; each round moves
the same file end to end through the installed ``amqstream`` command to every variant in
turn, and reads each broker's CPU-seconds (user + system, ``/proc/<pid>/stat``) around it,
and the part of them its collector threads (GC, G1, VM Thread) used.
Variants (``--variants``, comma list):

* ``activemq``: the broker started without our jar (KahaDB marshals as ActiveMQ ships);
* ``shipped``: the configuration as shipped (with the store plugin, broker/java/);
* ``cache``: shipped with ``useCache="true"`` on queues;
* ``no-reduce``: shipped with ``reduceMemoryFootprint="false"``;
* ``async-index``: shipped with KahaDB's ``enableIndexWriteAsync="true"``.

``--jfr DIR`` records each broker with JFR (``settings=profile``) and prints, per variant, the
share of Java samples in the frames that copy bodies, the index, and so on. JFR's profiling
roughly doubled this broker's CPU per GiB here, so compare CPU-seconds from runs without it;
and it samples threads in Java code only (not system calls, and seldom inside an array copy).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.broker import process
from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from benchmarks.common import Bench, MiB, free_port, log, make_csv, make_random, parse_size, per_gib

# Variant -> (with our jar, replacements in the rendered activemq.xml).
VARIANTS: dict[str, tuple[bool, list[tuple[str, str]]]] = {
    "activemq": (False, []),
    "shipped": (True, []),
    "cache": (True, [('useCache="false"', 'useCache="true"')]),
    "no-reduce": (True, [('reduceMemoryFootprint="true"', 'reduceMemoryFootprint="false"')]),
    "async-index": (True, [('journalMaxFileLength="32mb"',
                             'journalMaxFileLength="32mb" enableIndexWriteAsync="true"')]),
}

# Java frames by what they do: a sample counts for the first group one of its frames matches.
FRAME_GROUPS = [
    ("STOMP -> JMS body copy (writeBytes)", ("ActiveMQBytesMessage.writeBytes",)),
    ("OpenWire marshalling for the store", ("OpenWireFormat.marshal",)),
    ("KahaDB index and page file", ("BTreeIndex", "PageFile", "MessageDatabase.updateIndex", "Transaction.store",
                                    "MessageDatabase.checkpoint")),
    ("KahaDB journal read (page-in)", ("Journal.read", "DataFileAccessor", "KahaDBMessageStore.loadMessage")),
    ("OpenWire unmarshalling (page-in)", ("OpenWireFormat.unmarshal",)),
    ("JMS -> STOMP (LegacyFrameTranslator.convertMessage)", ("LegacyFrameTranslator.convertMessage",)),
    ("STOMP parsing", ("StompWireFormat.unmarshal",)),
    ("STOMP writing", ("StompWireFormat.marshal",)),
    ("journal write", ("DataFileAppender",)),
]


class TunedBroker(EmbeddedBroker):
    """The embedded broker with text replaced in its rendered configuration."""

    def __init__(self, data_dir: Path, edits: list[tuple[str, str]]) -> None:
        super().__init__(data_dir, port=free_port())
        self.edits = edits

    def render_config(self) -> tuple[Path, bool]:
        conf, created = super().render_config()
        xml = conf / "activemq.xml"
        text = xml.read_text()
        for old, new in self.edits:
            if old not in text:
                raise RuntimeError(f"{old!r} is not in {xml}: the variant no longer applies")
            text = text.replace(old, new)
        xml.write_text(text)
        return conf, created


@contextlib.contextmanager
def brokers(work: Path, names: list[str], jfr: Path | None) -> Iterator[dict[str, TunedBroker]]:
    started: dict[str, TunedBroker] = {}
    jar, opts = process.BROKER_JAR, os.environ.get("AMQSTREAM_BROKER_JAVA_OPTS")
    try:
        for name in names:
            with_jar, edits = VARIANTS[name]
            process.BROKER_JAR = jar if with_jar else work / "absent.jar"
            if jfr:
                os.environ["AMQSTREAM_BROKER_JAVA_OPTS"] = (
                    f"{opts or ''} -XX:StartFlightRecording=settings=profile,dumponexit=true,"
                    f"filename={jfr / (name + '.jfr')}")
            b = TunedBroker(work / f"broker-{name}", edits)
            b.start()
            started[name] = b
        yield started
    finally:
        process.BROKER_JAR = jar
        if opts is None:
            os.environ.pop("AMQSTREAM_BROKER_JAVA_OPTS", None)
        else:
            os.environ["AMQSTREAM_BROKER_JAVA_OPTS"] = opts
        for b in started.values():
            b.stop()


def gc_cpu(pid: int | None) -> float:
    """CPU-seconds so far of the JVM's collector threads (they live as long as the broker; the
    per-connection transport threads do not, so the rest is taken from the process total)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if name.startswith(("GC Thread", "G1 ", "VM Thread")):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def frame_shares(recording: Path) -> dict[str, float]:
    """Share of the recording's Java execution samples in each of FRAME_GROUPS."""
    out = subprocess.run(["jfr", "print", "--json", "--stack-depth", "64", "--events", "jdk.ExecutionSample",
                          str(recording)], check=True, capture_output=True, text=True).stdout
    events = json.loads(out)["recording"]["events"]
    counts: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    for ev in events:
        # JFR names types with slashes (org/apache/...); keep the class's simple name.
        names = [f"{f['method']['type']['name'].replace('/', '.').rsplit('.', 1)[-1]}.{f['method']['name']}"
                 for f in ev["values"]["stackTrace"]["frames"]]
        group = next((g for g, keys in FRAME_GROUPS if any(k in n for n in names for k in keys)), "other")
        counts[group] += 1
        leaves[names[0] if names else "?"] += 1
    total = sum(counts.values()) or 1
    return {"samples": total, **{g: round(100 * c / total, 1) for g, c in counts.most_common()},
            "top frames": {f: round(100 * c / total, 1) for f, c in leaves.most_common(8)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="1G", help="100M, 1G, 4G or a byte count")
    ap.add_argument("--data", default="random,csv", help="comma list of random, csv")
    ap.add_argument("--variants", default="activemq,shipped", help="comma list of " + ", ".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-up", type=int, default=64, metavar="MIB", help="moved through each broker first")
    ap.add_argument("--jfr", help="record each broker with JFR into this directory and print its frame shares")
    ap.add_argument("--workdir", help="scratch space (default a temp dir)")
    args = ap.parse_args()
    names = args.variants.split(",")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="amqs-brokerpath-"))
    jfr = Path(args.jfr).resolve() if args.jfr else None
    if jfr:
        jfr.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.size)
    rows: list[dict[str, Any]] = []
    with brokers(work, names, jfr) as running:
        benches = {n: Bench(work, b.info().uri, b.running_pid()) for n, b in running.items()}
        warm = work / "warm.bin"
        make_random(warm, args.warm_up * MiB)
        for n, bench in benches.items():
            log(f"warming {n} up ({args.warm_up} MiB)")
            bench.ours(warm, installed=True)
        for kind in args.data.split(","):
            src = work / f"input-{kind}.{'csv' if kind == 'csv' else 'bin'}"
            (make_csv(src, size, work / "seed.csv") if kind == "csv" else make_random(src, size))
            for k in range(args.rounds):
                # Alternate which variant goes first, so none always meets the same neighbours.
                order = names[k % len(names):] + names[:k % len(names)]
                for n in order:
                    log(f"{kind} round {k + 1}: {n}")
                    gc0 = gc_cpu(benches[n].broker_pid)
                    run = benches[n].ours(src, installed=True)
                    gc = gc_cpu(benches[n].broker_pid) - gc0
                    row = {"kind": kind, "round": k + 1, "variant": n, "mib_s": round(size / MiB / run["seconds"], 1),
                           "cpu_per_gib": per_gib(run["cpu"], size), "broker_gc_per_gib": per_gib([gc], size)[0],
                           "load": os.getloadavg()[0]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            src.unlink()
    if jfr:
        for n in names:
            print(json.dumps({"variant": n, "jfr": frame_shares(jfr / f"{n}.jfr")}), flush=True)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
