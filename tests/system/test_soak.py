"""Soak: many streams, random kills of senders, receivers and the broker. Opt-in:

    make test ARGS="-m soak -s"

Bounded: a fixed number of streams and kills, loopback only, a deadline on every wait.
Every stream must end byte-exact in the output directory or be reported failed with a
reason; none may vanish; the broker must hold no message of ours at the end. Poisoned
streams (a corrupt chunk), abandoned ones (the sender gone after a few chunks), 200 stalled
ones (an offer and nothing else) and 100 offers of 1 TiB, played with raw stomp.py before
the good ones, must hold nothing up: the poisoned end in DLQ.soak with their reason, the
others are parked (the abandoned with their partial data), and the broker's old
generation ends where it began, give or take 64 MiB.

Longer runs: ``AMQSTREAM_SOAK_STREAMS`` (200), ``AMQSTREAM_SOAK_MAX_BYTES`` (6 MiB, the
largest file), ``AMQSTREAM_SOAK_HEAP_EVERY`` (300 s between looks at the broker's heap).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import ROOT, RawSender, browse, cli, free_port, make_file, old_gen_mib, play, sha256_file, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.soak]

STREAMS = int(os.environ.get("AMQSTREAM_SOAK_STREAMS", "200"))
# The largest file; smaller ones let a long run's files fit on the disk (each is kept twice).
MAX_BYTES = int(os.environ.get("AMQSTREAM_SOAK_MAX_BYTES", str(6 * 2**20)))
# Each wait's deadline grows with the streams: 200 took under 6 minutes on 2 cores.
DEADLINE = max(1200.0, 6.0 * STREAMS)
# Seconds between two looks at the broker's old generation (after a full collection).
HEAP_EVERY = float(os.environ.get("AMQSTREAM_SOAK_HEAP_EVERY", "300"))
PRODUCERS, RECEIVERS = 4, 2
QUEUE = "/queue/soak"
POISONED, ABANDONED, STALLED, TOO_LARGE = 5, 3, 200, 100


def _hostile_streams(params: BrokerParams, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Poisoned and abandoned streams at the head of the queue."""
    data = make_file(tmp_path / "hostile.bin", 40_000).read_bytes()

    def flip(seq: int, headers: dict[str, str], body: bytes) -> tuple[dict[str, str], bytes]:
        return headers, (bytes([body[0] ^ 1]) + body[1:]) if seq == 3 else body

    poisoned, abandoned = [f"poison-{i}" for i in range(POISONED)], [f"gone-{i}" for i in range(ABANDONED)]
    for sid in poisoned:
        play(params, QUEUE, p.StreamSpec(sid, f"{sid}.bin", len(data), 4000), data, list(range(1, 11)), tamper=flip)
    for sid in abandoned:
        play(params, QUEUE, p.StreamSpec(sid, f"{sid}.bin", len(data), 4000), data, [1, 2], end=False)
    dest = Destination.parse(QUEUE)
    raw = RawSender(params)
    for i in range(STALLED):
        raw.send(QUEUE, b"", p.offer_headers(p.StreamSpec(f"stalled-{i}", "s.bin", 10**6, 2**20), dest,
                                                 sender=params.user))
    for i in range(TOO_LARGE):
        raw.send(QUEUE, b"", p.offer_headers(p.StreamSpec(f"tib-{i}", "t.bin", 2**40, 2**20), dest, sender=params.user))
    raw.close()
    return poisoned, abandoned


class Chaos:
    def __init__(self) -> None:
        self.kills = {"sender": 0, "receiver": 0, "broker": 0}
        self.lock = threading.Lock()

    def count(self, what: str) -> None:
        with self.lock:
            self.kills[what] += 1


def _producer(files: list[Path], uri: str, env: dict[str, str], rnd: random.Random, chaos: Chaos,
              failed: dict[str, str]) -> None:
    for f in files:
        # The first run picks a chunk size; re-runs name none and continue the checkpoint.
        size = ["--chunk-size", str(rnd.choice([64 * 1024, 256 * 1024, 1024 * 1024]))]
        for _attempt in range(8):
            proc = cli("send", str(f), "--to", QUEUE, "--conn", uri, "--stream-id", f.stem, *size, "--json", "-q",
                       env=env)
            size = []
            if rnd.random() < 0.15:
                time.sleep(rnd.uniform(0.05, 0.4))  # when to strike: chaos, not synchronisation
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                    chaos.count("sender")
            out, err = proc.communicate(timeout=300)
            if proc.returncode == 0:
                break
        else:
            failed[f.stem] = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"


def _browse_empty(params: BrokerParams, dest: str) -> bool:
    with StompLink(params) as link:
        link._live().subscribe(dest, id="b", ack="auto", headers={"browser": "true"})
        frame = link.get(10)
        return frame is not None and frame.headers.get("browser") == "end"


# One randomized scenario read top to bottom (start, kill, check); split up, it would hide the plot.
def test_soak(tmp_path: Path) -> None:  # noqa: C901
    rnd = random.Random(int(os.environ.get("AMQSTREAM_SOAK_SEED", "20261122")))
    broker = EmbeddedBroker(tmp_path / "broker", port=free_port())
    broker.start()
    params = params_from_uri(broker.info().uri)
    heap_before = old_gen_mib(broker.running_pid() or 0)
    t0 = time.monotonic()
    try:
        uri = broker.info().uri
        files = [make_file(tmp_path / "in" / f"s{i:03d}.bin", rnd.choice([0, 1, 777, 65536]) if i % 10 == 0
                           else rnd.randrange(1, MAX_BYTES), seed=i) for i in range(STREAMS)]
        out = tmp_path / "out"
        poisoned, abandoned = _hostile_streams(params, tmp_path)
        env = {"AMQSTREAM_STATE_DIR": str(tmp_path / "send-state")}
        chaos = Chaos()
        failed: dict[str, str] = {}
        stop = threading.Event()

        logs = tmp_path / "receiver-logs"
        logs.mkdir()
        exits: list[str] = []

        def receiver() -> subprocess.Popen[str]:
            # Output to files: a pipe nobody reads would fill and block the receiver.
            path = logs / f"r{len(list(logs.iterdir()))}.log"
            log = open(path, "w")  # noqa: SIM115 - closed by the process end
            proc = subprocess.Popen([sys.executable, "-m", "airflow_provider_amqstream.cli", "receive", "--from",
                                     QUEUE, "--out-dir", str(out), "--conn", uri, "--follow", "--wait", "600",
                                     "--idle-timeout", "30", "--json", "-q"], stdout=log, stderr=log, text=True,
                                    cwd=ROOT)
            proc.log_path = path  # type: ignore[attr-defined]
            return proc

        def reap(proc: subprocess.Popen[str]) -> None:
            if proc.returncode not in (0, -signal.SIGKILL, -signal.SIGTERM):
                last = [line for line in proc.log_path.read_text().splitlines() if not line.startswith("{")][-3:]
                exits.append(f"receiver exited {proc.returncode}: {' | '.join(last)[-600:]}")

        receivers = [receiver() for _ in range(RECEIVERS)]

        chaos_errors: list[BaseException] = []

        def chaos_loop() -> None:
            broker_kills = 0
            try:
                while not stop.wait(rnd.uniform(1.0, 3.0)):
                    i = rnd.randrange(RECEIVERS)
                    if rnd.random() < 0.5:
                        receivers[i].send_signal(signal.SIGKILL)
                        receivers[i].wait(30)
                        chaos.count("receiver")
                    for j, proc in enumerate(receivers):  # killed, or gave up on a stalled sender
                        if proc.poll() is not None:
                            reap(proc)
                            receivers[j] = receiver()
                    if broker_kills < 2 and rnd.random() < 0.15:
                        broker.kill()
                        broker.start()
                        broker_kills += 1
                        chaos.count("broker")
            except BaseException as exc:  # handed to the test thread
                chaos_errors.append(exc)

        heap: list[tuple[int, float | str]] = []

        def heap_loop() -> None:
            # The old generation now and then, so an hour's run shows whether it grows,
            # not just where it ends (the broker's kills come early: see chaos_loop).
            while not stop.wait(HEAP_EVERY):
                try:
                    heap.append((round(time.monotonic() - t0), round(old_gen_mib(broker.running_pid() or 0))))
                except (subprocess.SubprocessError, OSError, KeyError, ValueError) as exc:
                    heap.append((round(time.monotonic() - t0), f"not measured: {exc}"))
                done = sum((out / f.name).exists() for f in files)
                print(f"SOAK at {heap[-1][0]}s: old generation {heap[-1][1]} MiB, {done} of {len(files)} published",
                      flush=True)

        chaos_thread = threading.Thread(target=chaos_loop, daemon=True)
        chaos_thread.start()
        heap_thread = threading.Thread(target=heap_loop, daemon=True)
        heap_thread.start()
        shares = [files[i::PRODUCERS] for i in range(PRODUCERS)]
        producers = [threading.Thread(target=_producer, args=(s, uri, env, random.Random(rnd.random()), chaos, failed))
                     for s in shares]
        for t in producers:
            t.start()
        for t in producers:
            t.join(DEADLINE)

        def delivered() -> bool:
            return all((out / f.name).exists() for f in files if f.stem not in failed)

        def delivered_or_broken() -> bool:
            return delivered() or bool(chaos_errors)

        wait_for(delivered_or_broken, DEADLINE, "every sent stream to be published", interval=0.5)
        stop.set()
        chaos_thread.join(30)
        heap_thread.join(90)
        if chaos_errors:
            raise chaos_errors[0]
        for i, proc in enumerate(receivers):  # chaos may have left one stopped
            if proc.poll() is not None:
                reap(proc)
                receivers[i] = receiver()
        # Re-offers and repeated offers from re-run senders are handled after the last file;
        # what stays is parked: the abandoned, stalled and too large streams, waiting for
        # senders (or room) that never come.
        seen: list[list[str]] = [[]]

        def all_taken() -> bool:
            seen[0] = sorted(f"{f.headers[hdr.H_STREAM]}{'(re)' if f.headers.get(hdr.H_REOFFER) else ''}"
                             for f in browse(params, QUEUE))
            return seen[0] == []

        try:
            wait_for(all_taken, 600, "the receivers to handle every offer", interval=1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; offers on {QUEUE}: {seen[0]}; receiver logs in {logs}") from None
        for proc in receivers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

        bad = [f.name for f in files if f.stem not in failed and sha256_file(out / f.name) != sha256_file(f)]
        total = sum(f.stat().st_size for f in files)
        summary: dict[str, Any] = {"streams": STREAMS, "bytes": total, "failed": failed, "corrupt": bad,
                                   "kills": chaos.kills, "receiver_exits": exits,
                                   "seconds": round(time.monotonic() - t0, 1)}
        print("SOAK " + json.dumps(summary))
        assert not bad
        assert not failed, f"streams reported failed: {failed}"
        assert sum(chaos.kills.values()) > 0
        # The heap first: browsing every stream's data queue below makes each queue again. Each
        # data queue costs the broker ~55 KiB until it has been empty for 60 s and is purged, so
        # the heap holds the last minute's streams (2,000 in it: ~110 MiB) and must come back.
        pid = broker.running_pid() or 0

        def heap_back() -> float | None:
            mib = old_gen_mib(pid)
            return mib if mib <= heap_before + 64 else None

        heap_after = wait_for(heap_back, 180, "the broker's old generation to come back once the last minute's data "
                              "queues are purged", interval=10)
        dest = Destination.parse(QUEUE)
        leftovers = [f.stem for f in files if not _browse_empty(params, dest.data_queue(f.stem, params.user))]
        assert not leftovers, f"chunks left in the broker for {leftovers[:5]}"
        filed = browse(params, "/queue/DLQ.soak")
        assert sorted(f.headers[hdr.H_STREAM] for f in filed) == poisoned
        assert all("CRC-32" in f.headers[hdr.H_QUARANTINE_REASON] for f in filed)
        assert all((out / ".amqstream" / f"{sid}.part").exists() for sid in abandoned)
        summary.update(poisoned=len(poisoned), abandoned=len(abandoned), stalled=STALLED, too_large=TOO_LARGE,
                       old_gen_mib=[round(heap_before), round(heap_after)], old_gen_samples=heap)
        assert heap_after <= heap_before + 64, (heap_before, heap_after)
        print("SOAK hostile " + json.dumps(summary))
    finally:
        broker.stop()
