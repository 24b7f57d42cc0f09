"""What a receiving directory remembers: the streams it published and who took them, in
its record store (docs/protocol.md, "Completion records and repeats").

* A **completion record** (kind ``d``, key = stream id) says the stream was published, as
  what, from whom: an offer of it again is a duplicate (acknowledged, nothing written), and
  another stream under its id is refused. Written after the file is durable and before the
  offer is acknowledged.
* A **claim** (kind ``c``, key = the taker's label) says which stream a receiving task took.
  A receiver that publishes a stream acknowledges its offer, so the offer is gone; if the
  task then fails to report success (its worker dies after publishing, or the scheduler
  loses track of it), its retry would wait for a new stream and the file already received
  would never reach the task's downstream. The claim names the taker (an Airflow task
  instance: DAG, run, task, map index) and a retry of the same task instance reads it back.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time
from collections.abc import Iterable
from typing import Any

from airflow_provider_amqstream.engine import store as st
from airflow_provider_amqstream.engine.records import TransferResult
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import ConfigurationError, StreamError
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.names import validate_stream_id

# A claim is a label we wrote ourselves; a bound keeps a misused one from filling records.
MAX_CLAIM_LENGTH = 1024


def check_claim(claim: str) -> None:
    """Raise ConfigurationError, naming the problem, unless ``claim`` is usable as a claim label."""
    if not claim or len(claim) > MAX_CLAIM_LENGTH or not claim.isprintable():
        raise ConfigurationError(f"a claim must be 1-{MAX_CLAIM_LENGTH} printable characters, got {claim[:80]!r}")


def claim_key(claim: str) -> str:
    """A claim's key in the store: its digest (a label may be 1 KiB; 96 bits tell labels apart)."""
    return hashlib.sha256(claim.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def _b64(hexdigest: str) -> str:
    return base64.b64encode(bytes.fromhex(hexdigest)).decode().rstrip("=") if hexdigest else ""


def _hex(b64: str) -> str:
    return base64.b64decode(b64 + "=" * (-len(b64) % 4)).hex() if b64 else ""


_QUEUE = "/queue/"
_MODES = {m.value[0]: m.value for m in hdr.Mode}


def pack_done(result: TransferResult, out: str) -> list[Any]:
    """A completion record, compact (~190 bytes a line instead of ~600 as a JSON object):
    positional; the path relative to ``out``, and "" when it is the stream id less its
    ``-<hash>`` tail (a default id's readable stem: the usual case); digests in base64; the
    destination without ``/queue/``; the mode's initial; 0 for the default chunk size; the name
    only if the file got another."""
    path = result.path or ""
    rel = path.removeprefix(out.rstrip("/") + "/")
    if rel and result.stream_id.rpartition("-")[0] == rel:
        rel = ""
    name = "" if os.path.basename(path) == result.name else result.name
    dest = result.destination.removeprefix(_QUEUE)
    chunk_size = 0 if result.chunk_size == hdr.DEFAULT_CHUNK_SIZE else result.chunk_size
    value = [rel, _b64(result.sha256), result.bytes, result.chunks, chunk_size,
             _b64(result.origin), result.sender, int(result.finished_at), dest, result.mode[:1], name]
    return value[:-1] if not name else value


def unpack_done(value: Any, sid: str, out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The completion record of ``sid`` as a :class:`TransferResult`'s JSON object (None if
    malformed)."""
    if not isinstance(value, list) or len(value) < 10:
        return None
    rel, sha, size, chunks, chunk_size, origin, sender, at, dest, mode = value[:10]
    name = value[10] if len(value) > 10 else ""
    rel = rel or sid.rpartition("-")[0]
    path = rel if os.path.isabs(rel) else os.path.join(os.fspath(out_dir), rel)
    return {"stream_id": sid, "destination": dest if dest.startswith("/") else _QUEUE + dest,
            "name": name or os.path.basename(path), "bytes": size, "chunks": chunks, "sha256": _hex(sha),
            "seconds": 0.0, "mode": _MODES.get(mode, mode), "path": path, "started_at": at, "finished_at": at,
            "status": "complete", "chunk_size": chunk_size or hdr.DEFAULT_CHUNK_SIZE, "origin": _hex(origin),
            "sender": sender}


def done_records(sdir: StateDir, out: str, results: Iterable[TransferResult], *, claim: str | None = None,
                 sync: bool = True, retention_days: float | None = None) -> None:
    """Record streams published into ``out`` (and the ``claim`` on each), in one write per
    bucket. Called after the files are durable and before their offers are acknowledged.

    :param out: the output directory as the receiver names it.
    :param sync: fsync now (False: the caller flushes the filesystem).
    """
    now = round(time.time(), 1)
    items: list[tuple[str, str, Any]] = []
    for res in results:
        if claim:
            items.append((st.CLAIM, claim_key(claim), [res.stream_id, now]))
        items.append((st.DONE, res.stream_id, pack_done(res, out)))
    st.open_store(sdir, retention_days).put_many(items, sync=sync)


def find_received(out_dir: str | os.PathLike[str], stream_id: str, *,
                  retention_days: float | None = None) -> dict[str, Any] | None:
    """The completion record of ``stream_id`` if it was received into ``out_dir`` (within
    the retention), else None.
    """
    validate_stream_id(stream_id)
    try:
        value = st.open_store(StateDir(out_dir), retention_days).get(st.DONE, stream_id)
        return None if value is None else unpack_done(value, stream_id, out_dir)
    except (OSError, ValueError) as exc:
        raise StreamError(f"completion record of stream {stream_id} in {out_dir} is unreadable ({exc}); "
                          "check the directory's permissions and disk") from exc


def find_received_many(out_dir: str | os.PathLike[str], stream_ids: Iterable[str], *,
                       retention_days: float | None = None) -> dict[str, dict[str, Any]]:
    """The completion records of those of ``stream_ids`` received into ``out_dir``: one pass
    over their buckets for all of them (a batch's manifest checks thousands at once).
    """
    ids = [validate_stream_id(sid) for sid in stream_ids]
    try:
        values = st.open_store(StateDir(out_dir), retention_days).get_many(st.DONE, ids)
        return {sid: rec for sid, v in values.items() if (rec := unpack_done(v, sid, out_dir)) is not None}
    except (OSError, ValueError) as exc:
        raise StreamError(f"completion records in {out_dir} are unreadable ({exc}); check the directory's "
                          "permissions and disk") from exc


def find_claimed(out_dir: str | os.PathLike[str], claim: str, *,
                 retention_days: float | None = None) -> list[dict[str, Any]]:
    """Completion records of the streams ``claim`` took in ``out_dir``, oldest first.

    A stream whose completion record is gone (pruned, or the state directory was cleaned)
    is left out.

    :param claim: the taker, as given to the receiver.
    """
    check_claim(claim)
    try:
        ids = [v[0] for v in st.open_store(StateDir(out_dir), retention_days).get_all(st.CLAIM, claim_key(claim))
               if isinstance(v, list) and v and isinstance(v[0], str)]
    except OSError as exc:
        raise StreamError(f"the claims of {claim!r} in {out_dir} are unreadable ({exc}); check the directory's "
                          "permissions and disk") from exc
    found = find_received_many(out_dir, dict.fromkeys(ids), retention_days=retention_days)
    return sorted(found.values(), key=lambda d: (d.get("finished_at", 0), d.get("stream_id", "")))
