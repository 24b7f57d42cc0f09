"""One stream's messages on their way out: its chunks (:class:`ChunkReader`, the one reader
every send path uses: a stream, a batch's file of a few chunks, a handshake with rewinds; each
chunk read once, added to the file's running hash in file order, encoded and checksummed by
:func:`protocol.wire.data_message`), and :class:`Outbound`, what one send of one stream carries
through its attempts, stream/atomic (:mod:`.stream`) or handshake (:mod:`.handshake`)."""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.seal import Seal
from airflow_provider_amqstream.protocol.state import SenderState
from airflow_provider_amqstream.transport.params import BrokerParams


class Chunk(NamedTuple):
    """One chunk ready to send: its headers, its wire body and its length in the file."""

    seq: int
    headers: dict[str, str]
    wire: bytes | bytearray  # bytearray: sealed, as the cipher wrote it
    length: int


class ChunkReader:
    """Chunks of ``spec``'s file from ``fh``.

    :param hasher: a hashlib object the chunks read in order are added to (None: no hash).
    :param seal: a sealed stream's seal (each encoded chunk sealed under it).
    """

    def __init__(self, fh: BinaryIO, spec: p.StreamSpec, codec: ChunkCodec, hasher: Any = None,
                 seal: Seal | None = None) -> None:
        self.fh, self.spec, self.codec, self.hasher, self.seal = fh, spec, codec, hasher, seal

    def next(self, seq: int) -> Chunk:
        """Chunk ``seq``, read from where the file stands (the caller keeps the order)."""
        body = self.fh.read(self.spec.chunk_span(seq)[1])
        if self.hasher is not None:
            self.hasher.update(body)
        headers, wire = p.data_message(self.spec, seq, body, self.codec, self.seal)
        return Chunk(seq, headers, wire, len(body))

    def at(self, seq: int) -> Chunk:
        """Chunk ``seq`` read at its offset, out of order (a receiver asked for it again);
        not hashed, and the file's position is left alone."""
        offset, length = self.spec.chunk_span(seq)
        body = os.pread(self.fh.fileno(), length, offset)
        headers, wire = p.data_message(self.spec, seq, body, self.codec, self.seal)
        return Chunk(seq, headers, wire, len(body))

    def ahead(self, first: int) -> Generator[Chunk, None, None]:
        """Chunks ``first`` to the last, in order, each prepared on a worker thread while the
        one before it goes out: hashlib, zstd and the CRC release the GIL, so that work (zstd
        alone is ~5 CPU-s per GiB of CSV) runs beside the socket writes instead of before
        each one. One worker keeps the hash and the codec's state in file order; two chunks
        are held at most. Close the iterator (``contextlib.closing``) if you stop early.
        """
        last = self.spec.chunks
        if first > last:
            return
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="amqs-chunk") as pool:
            nxt = pool.submit(self.next, first)
            for seq in range(first, last + 1):
                chunk = nxt.result()
                if seq < last:
                    nxt = pool.submit(self.next, seq + 1)
                yield chunk


Progress = Callable[[int, int], None]


@dataclass
class Outbound:
    """One file on its way to one destination, across reconnects.

    :param progress: called with (bytes confirmed, total bytes).
    :param origin: the offer's ``amqs_origin`` (which file went where).
    :param subdir: the receiver-side directory (offer header ``amqs_dir``).
    """

    params: BrokerParams
    src: Path
    dest: Destination
    state: SenderState
    save: Callable[[], None]
    window: int
    progress: Progress | None
    codec: ChunkCodec
    origin: str
    subdir: str = ""
    seal: Seal | None = None
    sent: int = 0  # bytes this run sent, chunks sent again included
    rerequests: int = 0

    def offer(self, window: int = hdr.DEFAULT_WINDOW, **kw: Any) -> dict[str, str]:
        """The stream's offer (``kw``: offer_headers' keywords), with its seal if sealed."""
        kw.setdefault("subdir", self.subdir)
        return p.offer_headers(self.state.spec, self.dest, window, sender=self.params.user, origin=self.origin,
                               seal=self.seal, **kw)

    def end(self) -> dict[str, str]:
        """The end marker: the file's SHA-256, under the seal's HMAC if sealed."""
        return p.end_headers(self.state.spec, self.state.sha256 or "", self.seal)
