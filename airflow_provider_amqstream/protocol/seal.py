"""Sealed streams: a file the broker carries but cannot read (docs/protocol.md, "Sealed streams").

Pure (no I/O): key pairs and recipient strings, the per-stream key wrapped for each recipient
(age's X25519 stanza: ephemeral X25519, HKDF-SHA256, here with AES-256-OCB3, all three from
protocol/crypto.py), the sealed header
that carries the file's real name, and each chunk sealed under the stream key with associated
data binding stream id, chunk index and whether it is the last. The engine reads and writes key
files (see the engine's keys module); the offer shows only what routing needs.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from airflow_provider_amqstream.exceptions import ConfigurationError, RemoteProtocolError
from airflow_provider_amqstream.protocol.crypto import OCB3, TAG, Buffer, hkdf_sha256, x25519_public, x25519_shared
from airflow_provider_amqstream.protocol.headers import H_ENCODING

# On a sealed offer: the wrapped keys and the sealed header (see Seal.header).
H_SEAL = "amqs_seal"
# The name a sealed offer shows: the real one is inside the seal.
SEALED_NAME = "sealed"
RECIPIENT_PREFIX = "amqs1"
KEY_PREFIX = "AMQS-SECRET-KEY-1"
SEAL_VERSION = 2
# On a sealed chunk: the nonce's random tail, 8 hex digits. The body is ciphertext and tag only, so
# sealing copies nothing more (a prefix in the body cost a copy of every chunk on each end).
H_NONCE = "amqs_seal_nonce"
SALT = 4
# Five stanzas, a 255-byte name and a 1,024-byte directory keep amqs_seal under the 4,096
# characters a quarantine copy keeps of it, so a stream quarantined for want of a key can be redriven.
MAX_RECIPIENTS = 5
MAX_SEAL_HEADER = 4096
_STANZA = 32 + 32 + TAG  # ephemeral public key, wrapped stream key and its tag
_B32 = "abcdefghijklmnopqrstuvwxyz234567"


class SealBroken(RemoteProtocolError):
    """A sealed message does not open: tampered, truncated, reordered, replayed or moved
    between streams, or sealed for another key."""


# --------------------------------------------------------------------------- keys
def _b32(data: bytes) -> str:
    return base64.b32encode(data).decode().rstrip("=").lower()


def _check(data: bytes) -> bytes:
    return hashlib.sha256(b"amqs-recipient|" + data).digest()[:4]


# One AEAD for everything: AES-256-OCB3 (RFC 7253, OpenPGP's mandatory AEAD mode), which with
# AES-NI seals a GiB for 0.27 CPU-s on this project's loaded machines where AES-256-GCM took 0.45
# and ChaCha20-Poly1305 0.57: what brings a sealed sender to the 15 % over an unsealed one the
# issue allows (docs/benchmarks.md, "Sealed streams").


@dataclass(frozen=True)
class Identity:
    """A receiver's private key (32 bytes of X25519). ``source`` names where it came from (a
    file), never its bytes."""

    private: bytes = field(repr=False)
    source: str = ""

    @classmethod
    def generate(cls) -> Identity:
        return cls(os.urandom(32))

    @cached_property
    def public(self) -> bytes:
        return x25519_public(self.private)

    @property
    def recipient(self) -> str:
        """The string a sender seals to (``amqs1`` + base32 of the public key and a checksum)."""
        return RECIPIENT_PREFIX + _b32(self.public + _check(self.public))

    def to_text(self) -> str:
        """The key file's content: a comment naming the recipient, then the secret line."""
        return f"# recipient: {self.recipient}\n{KEY_PREFIX}-{_b32(self.private + _check(self.private))}\n"

    @classmethod
    def parse(cls, text: str, source: str) -> Identity:
        """The key in a key file's ``text``; ``source`` (the file) is named on any error."""
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
        raw = b""
        if len(lines) == 1 and lines[0].startswith(KEY_PREFIX + "-"):
            raw = _unb32(lines[0][len(KEY_PREFIX) + 1:])
        if len(raw) != 36 or not hmac.compare_digest(_check(raw[:32]), raw[32:]):
            raise ConfigurationError(f"{source} is not an amqstream key file (expected one line {KEY_PREFIX}-..., "
                                     "as `amqstream keys new` writes it); is it the right file, complete?")
        return cls(raw[:32], source)


def _unb32(text: str) -> bytes:
    text = text.strip().lower()
    if not text or any(c not in _B32 for c in text):
        return b""
    try:
        raw = base64.b32decode(text.upper() + "=" * (-len(text) % 8))
    except ValueError:
        return b""
    # Only the canonical spelling: the last character's spare bits would let a typo there pass.
    return raw if _b32(raw) == text else b""


def parse_recipient(text: str) -> bytes:
    """The X25519 public key a recipient string names; a typo fails its checksum."""
    raw = _unb32(text[len(RECIPIENT_PREFIX):]) if text.strip().lower().startswith(RECIPIENT_PREFIX) else b""
    if len(raw) != 36 or not hmac.compare_digest(_check(raw[:32]), raw[32:]):
        raise ConfigurationError(f"recipient {text[:80]!r} is not valid: expected {RECIPIENT_PREFIX} and 58 more "
                                 "characters as `amqstream keys show KEYFILE` prints them (a typo fails its checksum)")
    return raw[:32]


# --------------------------------------------------------------------------- wrapping
def _wrap_key(shared: bytes, eph: bytes, public: bytes) -> bytes:
    return hkdf_sha256(shared, eph + public, b"amqstream seal v2 X25519")


def wrap(stream_key: bytes, public: bytes) -> bytes:
    """One stanza: ``stream_key`` wrapped for the holder of ``public``'s private key."""
    eph = os.urandom(32)
    eph_pub = x25519_public(eph)
    shared = x25519_shared(eph, public)
    if shared is None:
        raise ConfigurationError(f"recipient {RECIPIENT_PREFIX}{_b32(public + _check(public))} is no usable "
                                 "X25519 key (a low-order point, which no `amqstream keys new` makes): "
                                 "check the seal_to values")
    return eph_pub + OCB3(_wrap_key(shared, eph_pub, public)).encrypt(bytes(12), stream_key, b"")


def unwrap(stanza: bytes, identity: Identity) -> bytes | None:
    """The stream key if ``stanza`` was wrapped for ``identity``, else None."""
    eph_pub = stanza[:32]
    shared = x25519_shared(identity.private, eph_pub)
    if shared is None:
        return None
    key = OCB3(_wrap_key(shared, eph_pub, identity.public)).decrypt(bytes(12), stanza[32:], b"")
    return bytes(key) if key is not None and len(key) == 32 else None


# --------------------------------------------------------------------------- the seal
@dataclass(frozen=True)
class Seal:
    """One stream's key and what its offer carries about it.

    :param key: the random 32-byte stream key.
    :param stream_id: the stream it is bound to.
    :param header: the offer's ``amqs_seal`` value (stanzas and sealed header).
    """

    key: bytes = field(repr=False)
    stream_id: str
    header: str

    @classmethod
    def create(cls, stream_id: str, recipients: list[bytes], *, name: str, size: int, chunk_size: int,
               subdir: str = "", key: bytes | None = None) -> Seal:
        """A stream key (``key``, else a new random one) wrapped for each recipient, with ``name``
        and ``subdir`` (the receiver-side directory, if any) sealed in the header, bound to the
        stream's id, size and chunk size (which the offer shows in clear)."""
        if not 1 <= len(recipients) <= MAX_RECIPIENTS:
            raise ConfigurationError(f"stream {stream_id}: seal to 1 to {MAX_RECIPIENTS} recipients, "
                                     f"got {len(recipients)}")
        key = key or os.urandom(32)
        inside = {"name": name, **({"dir": subdir} if subdir else {})}
        sealed = OCB3(key).encrypt(bytes(12), json.dumps(inside, ensure_ascii=False).encode(),
                                    _header_ad(stream_id, size, chunk_size))
        blob = bytes([SEAL_VERSION, len(recipients)]) + b"".join(wrap(key, r) for r in recipients) + sealed
        return cls(key, stream_id, base64.urlsafe_b64encode(blob).decode().rstrip("="))

    @classmethod
    def open(cls, header: str, identities: list[Identity], *, stream_id: str, size: int,
             chunk_size: int) -> tuple[Seal, str, str] | None:
        """The seal, the real file name and its directory ("" for none), or None when no identity
        holds a key for it. Raises :class:`SealBroken` on a header that is malformed or was altered."""
        try:
            blob = base64.urlsafe_b64decode(header + "=" * (-len(header) % 4))
        except ValueError:
            raise SealBroken(f"stream {stream_id}: {H_SEAL} is not base64") from None
        if len(blob) < 2 or blob[0] != SEAL_VERSION or not 1 <= blob[1] <= MAX_RECIPIENTS:
            raise SealBroken(f"stream {stream_id}: {H_SEAL} is not a version {SEAL_VERSION} seal")
        end = 2 + blob[1] * _STANZA
        if len(blob) < end + TAG:
            raise SealBroken(f"stream {stream_id}: {H_SEAL} is cut short")
        key = next((k for i in range(blob[1]) for ident in identities
                    if (k := unwrap(blob[2 + i * _STANZA:2 + (i + 1) * _STANZA], ident)) is not None), None)
        if key is None:
            return None
        opened = OCB3(key).decrypt(bytes(12), blob[end:], _header_ad(stream_id, size, chunk_size))
        if opened is None:
            raise SealBroken(f"stream {stream_id}: the sealed header does not open (altered, or moved from "
                             "another stream)")
        try:
            inside = json.loads(opened)
            name, subdir = inside["name"], inside.get("dir", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            name = subdir = None
        if not isinstance(name, str) or not isinstance(subdir, str):
            raise SealBroken(f"stream {stream_id}: the sealed header names no file")
        return cls(key, stream_id, header), name, subdir

    def chunk(self, seq: int, last: bool, body: Buffer | list[Buffer],
              encoding: str | None) -> tuple[bytearray, dict[str, str]]:
        """Chunk ``seq``'s wire body (``body``, encoded as ``encoding``, sealed; a list of buffers is
        sealed as their concatenation) and its nonce header."""
        salt = os.urandom(SALT)
        sealed = self._cipher.encrypt(_nonce(seq, salt), body, self._ad(seq, last, encoding))
        return sealed, {H_NONCE: salt.hex()}

    def opener(self, chunks: int) -> Callable[[int, bytes | memoryview, Mapping[str, Any]], memoryview]:
        """Opens chunk ``seq`` of a stream of ``chunks`` from body and headers (for
        state.ReceiverState) into one buffer, reused: the receiver writes and hashes each chunk
        before it takes the next, and a fresh plaintext per chunk cost its allocation and zeroing."""
        buf = bytearray()

        def open_into(seq: int, wire: bytes | memoryview, headers: Mapping[str, Any]) -> memoryview:
            nonlocal buf
            size = max(len(wire) - TAG, 0)
            if len(buf) < size:
                buf = bytearray(size)
            view = memoryview(buf)[:size]
            self.open_chunk(seq, seq == chunks, wire, headers, into=view)
            return view

        return open_into

    def open_chunk(self, seq: int, last: bool, wire: bytes | memoryview, headers: Mapping[str, Any],
                   into: memoryview | None = None) -> bytearray | memoryview:
        """Chunk ``seq``'s body, still encoded as its ``amqs_encoding`` header says (which the seal
        covers), in ``into`` if given; :class:`SealBroken` if it was not sealed as chunk ``seq``
        (last or not) of this stream with that encoding, or was altered."""
        salt = str(headers.get(H_NONCE) or "")
        if len(salt) != 2 * SALT or any(c not in "0123456789abcdef" for c in salt) or len(wire) < TAG:
            raise SealBroken(f"stream {self.stream_id}: sealed chunk {seq} has no valid {H_NONCE} or is too short")
        nonce, ad = _nonce(seq, bytes.fromhex(salt)), self._ad(seq, last, headers.get(H_ENCODING))
        opened = self._cipher.decrypt(nonce, wire, ad) if into is None else (
            into if self._cipher.decrypt_into(nonce, wire, ad, into) else None)
        if opened is None:
            raise SealBroken(f"stream {self.stream_id}: chunk {seq} does not open under the stream's seal "
                             "(altered, truncated, reordered or from another stream)")
        return opened

    @cached_property
    def _cipher(self) -> OCB3:
        # One cipher for the stream, keyed once, not one per chunk.
        return OCB3(self.key)

    def digest(self, sha256_hex: str) -> str:
        """What the end marker carries for the file's SHA-256: an HMAC of it under the stream
        key, which only a key holder can compute or check (the broker cannot confirm a guess)."""
        return hmac.new(self.key, b"amqs-sha256|" + sha256_hex.encode(), hashlib.sha256).hexdigest()

    def _ad(self, seq: int, last: bool, encoding: Any) -> bytes:
        enc = str(encoding or "").encode("utf-8", "surrogatepass")[:64]
        return b"amqs-chunk|" + self.stream_id.encode() + struct.pack(">QB", seq, int(last)) + b"|" + enc


def derived_key(secret: bytes, stream_id: str) -> bytes:
    """Stream ``stream_id``'s key derived from a batch's ``secret``: the same on every run that
    holds the secret, different for every stream."""
    return hkdf_sha256(secret, b"", b"amqstream small-file stream key|" + stream_id.encode())


def _nonce(seq: int, salt: bytes) -> bytes:
    # The index in the nonce keeps chunks apart; the random tail keeps a chunk sealed again on
    # resume (perhaps encoded otherwise) from reusing a nonce under the same key.
    return struct.pack(">Q", seq) + salt


def _header_ad(stream_id: str, size: int, chunk_size: int) -> bytes:
    return b"amqs-header|" + stream_id.encode() + struct.pack(">QQ", size, chunk_size)
