"""Which streams a receiving task took.

A receiver that publishes a stream acknowledges its offer, so the offer is gone. If the
task that asked for it then fails to report success (its worker dies after publishing, or
the scheduler loses track of it), the retry would wait for a new stream and the file it
already received would never reach the task's downstream. A claim names the taker (an
Airflow task instance: DAG, run, task, map index); the receiver records the claim beside
the completion record, before the offer is acknowledged, and a retry of the same task
instance reads it back instead of waiting.

Layout: ``out_dir/.amqstream/claims/<sha256(claim)[:32]>/<stream id>.json``, one small
file per stream, so recording a claim costs the same for the thousandth stream as for
the first.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.engine.records import STATE_DIR_NAME, read_json, write_json
from airflow_provider_amqstream.exceptions import ConfigurationError, StreamError
from airflow_provider_amqstream.protocol import wire as p

# A claim is a label we wrote ourselves; a bound keeps a misused one from filling records.
MAX_CLAIM_LENGTH = 1024


def check_claim(claim: str) -> str:
    """``claim`` if usable as a claim label, else ValueError naming the problem."""
    if not claim or len(claim) > MAX_CLAIM_LENGTH or not claim.isprintable():
        raise ConfigurationError(f"a claim must be 1-{MAX_CLAIM_LENGTH} printable characters, got {claim[:80]!r}")
    return claim


def _claim_dir(sdir: Path, claim: str) -> Path:
    return sdir / "claims" / hashlib.sha256(claim.encode()).hexdigest()[:32]


def record_claim(sdir: Path, claim: str, stream_id: str, *, sync: bool = True) -> None:
    """Note that ``claim`` took ``stream_id`` (called before the stream's offer is acknowledged).

    :param sdir: the output directory's state directory (``out_dir/.amqstream``).
    :param claim: who took it.
    :param stream_id: the stream.
    :param sync: flush it now (False: the caller flushes a whole group).
    """
    write_json(_claim_dir(sdir, claim) / f"{stream_id}.json",
               {"claim": claim, "stream_id": stream_id, "at": time.time()}, sync=sync)


def find_claimed(out_dir: str | os.PathLike[str], claim: str) -> list[dict[str, Any]]:
    """Completion records of the streams ``claim`` took in ``out_dir``, oldest first.

    A stream whose completion record is gone (the state directory was cleaned) is left out.

    :param out_dir: the receiver's output directory.
    :param claim: the taker, as given to the receiver.
    """
    sdir = Path(out_dir) / STATE_DIR_NAME
    cdir = _claim_dir(sdir, check_claim(claim))
    try:
        names = sorted(f.name for f in os.scandir(cdir) if f.name.endswith(".json"))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        try:
            mark = read_json(cdir / name) or {}
            sid = mark.get("stream_id")
            # Two labels sharing a hash prefix would be a collision, not a claim of ours.
            if mark.get("claim") != claim or not isinstance(sid, str):
                continue
            p.validate_stream_id(sid)
            done = read_json(sdir / f"{sid}.done")
        except (OSError, ValueError) as exc:
            raise StreamError(f"claim record {cdir / name} of {claim!r} in {out_dir} is unreadable ({exc}); "
                              "delete it to receive afresh") from exc
        if done is not None:
            found.append(done)
    return sorted(found, key=lambda d: (d.get("finished_at", 0), d.get("stream_id", "")))
