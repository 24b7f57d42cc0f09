"""A many-file send's small files as messages: inline offers, packs of them, and files of
a few chunks in atomic order. Reading a file and building (or sending) its messages is
here; which receipt confirms which file, and resuming, is ``bulk.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from airflow_provider_amqstream.engine.records import TransferResult
from airflow_provider_amqstream.engine.send.outbound import ChunkReader
from airflow_provider_amqstream.engine.send.stream import stream_origin
from airflow_provider_amqstream.exceptions import StreamError, TransportError
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.seal import SEALED_NAME, Seal
from airflow_provider_amqstream.transport.link import Link
from airflow_provider_amqstream.transport.params import BrokerParams

# A pack's files, their wire bytes and its index (see protocol.bulk.pack_message). A pack asks
# for its own receipt, so these also bound what one receipt confirms. The bytes stay at a
# chunk's default, the size of the largest inline offer: what a stopped receiver can hold of
# a queue's memory limit is counted in messages (engine/receive/inline.py, PREFETCH); 2 MiB packs
# filled it and senders to the queue failed after a 30 s flow-control wait.
PACK_FILES = bw.MAX_PACK_FILES
PACK_BYTES = 2**20
PACK_INDEX_BYTES = 64 * 1024


@dataclass
class Outgoing:
    """One file of a batch, as the sender found it."""

    src: Path
    subdir: str
    stream_id: str
    size: int
    identity: str
    # Sent again to carry the receipt that confirms the files sent before it.
    seal: bool = False


def changed(e: Outgoing) -> StreamError:
    return StreamError(f"stream {e.stream_id}: {e.src} changed while it was being sent; not offered. "
                       "Send it again once it is stable.")


def _pending(e: Outgoing, dest: Destination, chunk: int, params: BrokerParams,
             sealed: bool = False) -> tuple[p.StreamSpec, TransferResult]:
    """A small file's spec (named ``sealed`` if it is), and its result until it is confirmed:
    ``seconds`` holds the monotonic start until the confirmation turns it into a duration,
    ``sha256`` is set once read."""
    spec = p.StreamSpec(e.stream_id, SEALED_NAME if sealed else e.src.name, e.size, chunk, hdr.Mode.ATOMIC)
    return spec, TransferResult(e.stream_id, str(dest), e.src.name, e.size, spec.chunks, "", time.monotonic(),
                                spec.mode.value, 0, e.size, str(e.src), time.time(), 0.0, chunk_size=spec.chunk_size,
                                origin=stream_origin(e.identity, dest), broker=params.url)


def inline_member(e: Outgoing, dest: Destination, chunk: int, codec: ChunkCodec,
                  params: BrokerParams) -> tuple[dict[str, str], bytes, TransferResult]:
    """A file of one chunk or less read, hashed and encoded as its inline offer (sent as
    ``params.login``, to ``params.url``)."""
    spec, res = _pending(e, dest, chunk, params)
    with open(e.src, "rb") as fh:
        body = fh.read(e.size + 1)
    if len(body) != e.size:
        raise changed(e)
    res.sha256 = hashlib.sha256(body).hexdigest()
    headers, wire = bw.inline_offer(spec, dest, body, res.sha256, sender=params.user, codec=codec, origin=res.origin,
                                   subdir=e.subdir)
    return headers, wire, res


def send_few(link: Link, e: Outgoing, dest: Destination, chunk: int, codec: ChunkCodec, *, receipt: bool,
             seal: Callable[[p.StreamSpec, str, str], Seal] | None = None) -> tuple[str | None, TransferResult]:
    """A file of a few chunks: its chunks and end marker, then its offer, asking for a receipt
    with ``receipt`` (the id returned with the file's result); sealed with ``seal(spec, name, subdir)``
    if given, as a sealed stream of its own."""
    spec, res = _pending(e, dest, chunk, link.params, sealed=seal is not None)
    sealed = seal(spec, e.src.name, e.subdir) if seal is not None else None
    data_q = dest.data_queue(e.stream_id, link.params.user)
    hasher = hashlib.sha256()
    with open(e.src, "rb") as fh:
        reader = ChunkReader(fh, spec, codec, hasher, sealed)
        for seq in range(1, spec.chunks + 1):
            message = reader.next(seq)
            link.send(data_q, message.wire, message.headers)
        if os.fstat(fh.fileno()).st_size != e.size:
            raise changed(e)
    res.sha256 = hasher.hexdigest()
    link.send(data_q, b"", p.end_headers(spec, res.sha256, sealed))
    offer = p.offer_headers(spec, dest, sender=link.params.user, origin=res.origin, subdir=e.subdir, seal=sealed)
    return link.send(str(dest), b"", offer, receipt=receipt), res


def index_bytes(headers: dict[str, str]) -> int:
    """What a member's headers take in a pack's index (computed once per file: it is JSON)."""
    return len(json.dumps(headers, separators=(",", ":"), ensure_ascii=False).encode()) + 24


class Pack:
    """Inline offers gathered until a pack is full, then sent as one message (sealed for
    ``recipients``, if any)."""

    def __init__(self, recipients: list[bytes]) -> None:
        self.recipients = recipients
        self.files: list[tuple[Outgoing, dict[str, str], bytes, TransferResult]] = []
        self.bytes = self.index = 0

    def fits(self, index: int, wire: bytes) -> bool:
        """Whether one more file (its :func:`index_bytes` and wire body) keeps the pack within
        its bounds (any file fits an empty one)."""
        return not self.files or (len(self.files) < PACK_FILES and self.bytes + len(wire) <= PACK_BYTES
                                  and self.index + index <= PACK_INDEX_BYTES)

    def add(self, e: Outgoing, headers: dict[str, str], wire: bytes, res: TransferResult, index: int) -> None:
        self.files.append((e, headers, wire, res))
        self.bytes += len(wire)
        self.index += index

    def send(self, link: Link, dest: Destination, sent: Callable[[str | None, Outgoing, TransferResult], None]) -> None:
        """Send the pack with a receipt (confirming it and everything before it on the
        connection) and empty it; each file it carried goes to ``sent``, the last with the receipt id."""
        headers, body = bw.pack_message([(h, w) for _, h, w, _ in self.files], self.recipients)
        rid = link.send(str(dest), body, headers, receipt=True)
        if rid is None:
            raise TransportError(f"no receipt id for pack {headers[hdr.H_STREAM]} on {link.params.url}")
        for n, (e, _, _, res) in enumerate(self.files, 1):
            sent(rid if n == len(self.files) else None, e, res)
        self.files, self.bytes, self.index = [], 0, 0
