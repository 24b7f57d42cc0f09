"""What each end of a stream knows for sure, and the checks a data message must pass.

The sender's :class:`SenderState` is its checkpoint: the chunks the broker has confirmed.
The receiver's :class:`ReceiverState` decides what to do with each message of a
stream's data queue (:meth:`ReceiverState.decide`) and tracks which chunks are on disk;
both are saved as JSON so a re-run of either end continues where it stopped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from airflow_provider_amqstream.exceptions import LocalProtocolError, ProtocolError
from airflow_provider_amqstream.protocol.codec import ChunkCodec, crc32
from airflow_provider_amqstream.protocol.headers import (
    H_CHUNKS,
    H_CRC,
    H_ENCODING,
    H_OFFSET,
    H_SEQ,
    H_SHA256,
    H_SIZE,
    H_STREAM,
    MAX_AHEAD,
    MAX_STREAM_ID,
    Kind,
    Mode,
)
from airflow_provider_amqstream.protocol.outcomes import Outcome
from airflow_provider_amqstream.protocol.seal import SealBroken
from airflow_provider_amqstream.protocol.wire import StreamSpec, from_the_wire, int_header, kind_of


# --------------------------------------------------------------------------- sender
@dataclass
class SenderState:
    """What the sender knows for sure: the broker has stored chunks ``1..confirmed_seq``.

    Serialised to JSON after every confirmed window; a re-run continues at
    ``confirmed_seq + 1`` instead of at the start of the file.
    """

    spec: StreamSpec
    destination: str
    identity: str
    confirmed_seq: int = 0
    offer_sent: bool = False
    end_sent: bool = False
    sha256: str | None = None

    @property
    def confirmed_offset(self) -> int:
        return self.spec.offset_of(self.confirmed_seq + 1)

    @property
    def done(self) -> bool:
        return self.end_sent and (self.offer_sent or self.spec.mode is Mode.STREAM)

    def confirm(self, seq: int) -> None:
        if seq < self.confirmed_seq or seq > self.spec.chunks:
            raise ProtocolError(
                f"stream {self.spec.stream_id}: confirmation for chunk {seq} is out of order "
                f"(confirmed {self.confirmed_seq} of {self.spec.chunks})"
            )
        self.confirmed_seq = seq

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "destination": self.destination, "identity": self.identity,
                "confirmed_seq": self.confirmed_seq, "offer_sent": self.offer_sent,
                "end_sent": self.end_sent, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SenderState:
        st = cls(StreamSpec.from_json(data), data["destination"], data["identity"])
        st.confirm(int(data["confirmed_seq"]))
        st.offer_sent, st.end_sent = bool(data["offer_sent"]), bool(data["end_sent"])
        st.sha256 = data.get("sha256")
        return st


# --------------------------------------------------------------------------- receiver
class Verdict(str, Enum):
    WRITE = "write"          # new chunk: write it at its offset, then acknowledge
    DUPLICATE = "duplicate"  # already have it: acknowledge, write nothing
    CORRUPT = "corrupt"      # CRC mismatch: never write; the file cannot be published
    END = "end"              # end marker: remember the SHA-256


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    seq: int = 0
    offset: int = 0
    reason: str = ""
    data: bytes | memoryview | None = None  # the chunk's bytes to write (decompressed)
    cause: Outcome = Outcome.CORRUPT  # what a CORRUPT verdict quarantines the stream as


@dataclass
class ReceiverState:
    """Which chunks of one stream are on disk, and whether the stream can be published.

    ``next_seq`` is the first chunk not yet durable; every chunk below it is on disk.
    ``ahead`` holds durable chunks past a gap (out-of-order delivery). ``written``
    holds chunks written but not yet fsynced; it is never saved, so a crash never
    claims data that may not be on disk.
    """

    spec: StreamSpec
    next_seq: int = 1
    ahead: set[int] = field(default_factory=set)
    expected_sha256: str | None = None
    duplicates: int = 0
    written: set[int] = field(default_factory=set)
    # A sealed stream's chunk opener (seal.Seal.opener); never saved: the key comes from the offer.
    opener: Callable[[int, bytes | memoryview, Mapping[str, Any]], bytes | memoryview] | None = field(
        default=None, compare=False, repr=False)

    @from_the_wire
    def decide(self, headers: Mapping[str, Any], body: bytes | memoryview) -> Decision:
        """Classify one message of this stream's data queue. Raises ProtocolError on
        a message that cannot belong to the stream (wrong id, bad offsets, wrong length)."""
        sid = self.spec.stream_id
        if headers.get(H_STREAM) != sid:
            raise ProtocolError(
                f"stream {sid}: message for stream {str(headers.get(H_STREAM))[:MAX_STREAM_ID]!r} "
                "arrived on its data queue"
            )
        kind = kind_of(headers)
        if kind is Kind.END:
            return self._end(headers)
        if kind is not Kind.DATA:
            raise ProtocolError(f"stream {sid}: unexpected {kind.value} message on the data queue")
        seq = int_header(headers, H_SEQ, sid, lo=1, hi=max(self.spec.chunks, 1))
        if seq > self.spec.chunks:
            raise ProtocolError(f"stream {sid}: chunk {seq} is past the last chunk {self.spec.chunks}")
        if seq >= self.next_seq + MAX_AHEAD:
            raise ProtocolError(f"stream {sid}: chunk {seq} is {seq - self.next_seq} chunks past the first missing "
                                f"chunk {self.next_seq} (at most {MAX_AHEAD} are accepted ahead of a gap)")
        offset, length = self.spec.chunk_span(seq)
        claimed = int_header(headers, H_OFFSET, sid)
        if claimed != offset:
            raise ProtocolError(f"stream {sid}: chunk {seq} claims offset {claimed}, expected {offset}")
        if self.has(seq) or seq in self.written:
            self.duplicates += 1
            return Decision(Verdict.DUPLICATE, seq, offset)
        # A sealed chunk carries no CRC-32: its seal's tag refuses what the CRC would.
        if self.opener is None and crc32(body) != int_header(headers, H_CRC, sid, hi=0xFFFFFFFF):
            return Decision(Verdict.CORRUPT, seq, offset,
                            f"chunk {seq} at offset {offset} failed its CRC-32 check")
        return self._opened(seq, offset, length, headers, body)

    def _opened(self, seq: int, offset: int, length: int, headers: Mapping[str, Any],
                body: bytes | memoryview) -> Decision:
        encoding = headers.get(H_ENCODING)
        if self.opener is not None:
            try:
                body = self.opener(seq, body, headers)
            except SealBroken as exc:
                return Decision(Verdict.CORRUPT, seq, offset, f"chunk {seq} at offset {offset}: {exc}",
                                cause=Outcome.SEAL_BROKEN)
        if encoding:
            try:
                body = ChunkCodec.decode(str(encoding), body, length)
            except ProtocolError as exc:
                return Decision(Verdict.CORRUPT, seq, offset, f"chunk {seq} at offset {offset}: {exc}")
        if len(body) != length:
            return Decision(Verdict.CORRUPT, seq, offset,
                            f"chunk {seq} at offset {offset} has {len(body)} bytes, expected {length}")
        return Decision(Verdict.WRITE, seq, offset, data=body)

    def _end(self, headers: Mapping[str, Any]) -> Decision:
        """The end marker: it must agree with the offer and carry the file's SHA-256."""
        sid = self.spec.stream_id
        size = int_header(headers, H_SIZE, sid)
        chunks = int_header(headers, H_CHUNKS, sid)
        sha = str(headers.get(H_SHA256, ""))
        if size != self.spec.size or chunks != self.spec.chunks:
            raise ProtocolError(
                f"stream {sid}: end marker says {size} bytes in {chunks} chunks, the offer "
                f"said {self.spec.size} in {self.spec.chunks}"
            )
        if not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise ProtocolError(f"stream {sid}: end marker has no valid {H_SHA256}")
        self.expected_sha256 = sha
        return Decision(Verdict.END)

    def has(self, seq: int) -> bool:
        return seq < self.next_seq or seq in self.ahead

    def mark_durable(self, seq: int) -> list[int]:
        """Record chunk ``seq`` as on disk; return the chunks that became contiguous
        with the durable prefix, in order."""
        self.written.discard(seq)
        if self.has(seq):
            return []
        if seq != self.next_seq:
            self.ahead.add(seq)
            return []
        advanced = [seq]
        self.next_seq += 1
        while self.next_seq in self.ahead:
            self.ahead.discard(self.next_seq)
            advanced.append(self.next_seq)
            self.next_seq += 1
        return advanced

    @property
    def contiguous_bytes(self) -> int:
        return self.spec.offset_of(self.next_seq)

    @property
    def received_bytes(self) -> int:
        return self.contiguous_bytes + sum(self.spec.chunk_span(s)[1] for s in self.ahead)

    @property
    def all_written(self) -> bool:
        """Every chunk is durable or written (``written`` never overlaps the durable set)."""
        return self.next_seq - 1 + len(self.ahead) + len(self.written) >= self.spec.chunks

    @property
    def complete(self) -> bool:
        return self.next_seq > self.spec.chunks and self.expected_sha256 is not None

    def missing_ranges(self) -> list[tuple[int, int]]:
        """Missing chunk ranges as inclusive (first, last) pairs."""
        ranges: list[tuple[int, int]] = []
        seq = self.next_seq
        for have in sorted(self.ahead) + [self.spec.chunks + 1]:
            if have > seq:
                ranges.append((seq, have - 1))
            seq = have + 1
        return ranges

    def describe_missing(self) -> str:
        ranges = self.missing_ranges()
        parts = [f"chunks {first}-{last} (bytes {self.spec.offset_of(first)}-{self.spec.offset_of(last + 1) - 1})"
                 for first, last in ranges[:5]]
        more = len(ranges) - 5
        return ", ".join(parts) + (f" and {more} more ranges" if more > 0 else "")

    @from_the_wire
    def verify(self, actual_sha256: str) -> None:
        if not self.complete:
            raise LocalProtocolError(f"stream {self.spec.stream_id}: cannot verify an incomplete stream")
        if actual_sha256 != self.expected_sha256:
            raise ProtocolError(
                f"stream {self.spec.stream_id}: SHA-256 mismatch: received {actual_sha256}, "
                f"sender reported {self.expected_sha256}; the file was not published"
            )

    def to_json(self) -> dict[str, Any]:
        return {**self.spec.to_json(), "next_seq": self.next_seq, "ahead": sorted(self.ahead),
                "expected_sha256": self.expected_sha256}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ReceiverState:
        spec = StreamSpec.from_json(data)
        st = cls(spec, int(data["next_seq"]), set(int(x) for x in data["ahead"]),
                 data.get("expected_sha256"))
        if not 1 <= st.next_seq <= spec.chunks + 1 or any(not st.next_seq < a <= spec.chunks for a in st.ahead):
            raise ProtocolError(f"stream {spec.stream_id}: resume state is inconsistent")
        return st
