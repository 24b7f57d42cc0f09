"""A chunk's body on the wire: its CRC-32 and optional per-chunk zstd compression
(:class:`ChunkCodec`).
"""

from __future__ import annotations

import zlib

from airflow_provider_amqstream.exceptions import LocalProtocolError, RemoteProtocolError

try:
    # The same CRC-32 as zlib's (the wire's amqs_crc), from ISA-L: ~9 GB/s against zlib's ~2 on
    # this project's machines, which is ~0.4 CPU-s less per GiB on each end.
    from isal.isal_zlib import crc32 as _crc32  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # isal is a dependency; a platform without its wheel still works, slower
    _crc32 = zlib.crc32


def crc32(body: bytes | bytearray | memoryview) -> int:
    return int(_crc32(body)) & 0xFFFFFFFF


# What a sender may be asked for: "zstd" (always tried), "auto" (compress what shrinks, stop
# trying on data that does not) or "none".
COMPRESSION_SETTINGS = ("auto", "zstd", "none")
# Compress what shrinks well: each byte not carried is one the network, the broker's journal and
# its CPU (~3.3 CPU-s per GiB) do not see, and data that does not shrink costs one failed attempt
# per 64 chunks. With sender, broker and receivers on one machine it does not pay at any ratio
# measured: zstd -3 costs the sender ~2.4 CPU-s and the receiver ~0.8 per GiB it reads, more than
# the broker saves, and "none" is faster there (docs/decisions/page-reuse.md, README).
DEFAULT_COMPRESSION = "auto"
# Below this saving a chunk goes raw: decompressing it would cost more than it saves.
_MIN_SAVING = 0.95
# "auto" keeps a chunk compressed only if it shrank to half or less. The line was drawn when the
# broker cost ~3x more per GiB carried than now; on one machine no ratio pays any more (above).
_AUTO_SAVING = 0.5
# zstd's level for "auto" on chunks of _AUTO_FAST_FROM bytes or more: -3 shrank 1 GiB of CSV
# in 1 MiB chunks to 0.42 of its size where level 1 reached 0.27, at two thirds of the
# sender's CPU, and moved it end to end 8 % faster with sender, broker and receiver on one
# 2-core machine. Smaller bodies (pack members, small chunk sizes) keep level 1: negative
# levels shrink them too little to pass _AUTO_SAVING (4 KiB of the same CSV: 0.53 at -3,
# 0.32 at 1), and what they cost is per file, not per byte. "zstd" is asked for where bytes
# cost more than CPU (a slow link to the broker), so it is level 1 throughout.
_AUTO_LEVEL = -3
_AUTO_FAST_FROM = 256 * 1024
_ZSTD_LEVEL = 1
# "auto" after a chunk that did not shrink: sends the next 1, 2, 4 ... chunks raw without
# trying, at most this many, so incompressible data costs one failed attempt per 64 chunks
# (zstd gives up on random bytes at ~2 GB/s) and a file whose compressible part comes later
# is still found.
_AUTO_MAX_SKIP = 64


def normalise_compression(setting: str | None) -> str | None:
    """The compression a sender was asked for, checked: ``"auto"``, ``"zstd"``, or None for
    none. ``"none"`` (any case) is None; None stays None (callers that mean "the default"
    pass :data:`DEFAULT_COMPRESSION`)."""
    value = "none" if setting is None else str(setting).strip().lower()
    if value == "none":
        return None
    if value not in COMPRESSION_SETTINGS:
        raise LocalProtocolError(f"compression {setting!r} is not supported; use one of "
                            f"{', '.join(COMPRESSION_SETTINGS)}")
    return value


class ChunkCodec:
    """Optional per-chunk zstd compression on the sending side: ``"zstd"`` tries every chunk
    (``_MIN_SAVING``), ``"auto"`` as ``_AUTO_SAVING``, ``_AUTO_LEVEL`` and ``_AUTO_MAX_SKIP`` say.
    Each chunk says on the wire whether it is compressed (``amqs_encoding``), so receivers need
    no setting, and every receiver since per-chunk zstd decodes both levels."""

    def __init__(self, encoding: str | None) -> None:
        setting = normalise_compression(encoding)
        # The setting, as passed on to send_file (a bulk send does, per large file): "none",
        # not None, which would mean "the connection's" there.
        self.encoding = setting or "none"
        self._auto = setting == "auto"
        self._c = self._fast = None
        self._skip = self._backoff = 0
        if setting is not None:
            import zstandard

            self._c = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
            if self._auto:
                self._fast = zstandard.ZstdCompressor(level=_AUTO_LEVEL)

    def encode(self, body: bytes) -> tuple[bytes, str | None]:
        """The chunk's wire body and its encoding (None: sent as it is)."""
        if self._c is None or len(body) < 512:
            return body, None
        if self._skip:
            self._skip -= 1
            return body, None
        compressor = self._fast if self._fast is not None and len(body) >= _AUTO_FAST_FROM else self._c
        packed = compressor.compress(body)
        if len(packed) > len(body) * (_AUTO_SAVING if self._auto else _MIN_SAVING):
            if self._auto:
                self._backoff = min(max(1, 2 * self._backoff), _AUTO_MAX_SKIP)
                self._skip = self._backoff
            return body, None
        self._backoff = 0
        return packed, "zstd"

    @staticmethod
    def decode(encoding: str, wire: bytes | memoryview, length: int) -> bytes:
        """Decompress one chunk; raises ProtocolError on anything but exactly ``length`` bytes.

        The frame must declare its content size, and it must be ``length``: python-zstandard
        allocates what a frame declares whatever ``max_output_size`` says (a 17-byte frame
        declaring 1 TiB ended in MemoryError), so the declaration is checked first.
        """
        if encoding != "zstd":
            raise RemoteProtocolError(f"unknown chunk encoding {encoding[:20]!r}")
        import zstandard

        data = bytes(wire)
        try:
            declared = zstandard.frame_content_size(data)
        except zstandard.ZstdError as exc:
            raise RemoteProtocolError(f"zstd chunk has no valid frame header: {exc}") from None
        if declared != length:
            what = "no content size" if declared < 0 else f"{declared} bytes"
            raise RemoteProtocolError(f"zstd chunk declares {what}, expected {length}")
        try:
            out = zstandard.ZstdDecompressor().decompress(data, max_output_size=length)
        except zstandard.ZstdError as exc:
            raise RemoteProtocolError(f"zstd chunk does not decompress: {exc}") from None
        if len(out) != length:
            raise RemoteProtocolError(f"zstd chunk decompresses to {len(out)} bytes, expected {length}")
        return out
