"""The three primitives a seal is made of (X25519, HKDF-SHA256, AES-256-OCB3), taken from the
OpenSSL this Python already has loaded for ``hashlib``.

Why not the ``cryptography`` package: its wheel brings a second OpenSSL and a Rust extension that
cost every sealed process about 8 MiB of resident memory, where issue 38 asks for sealing to leave
RSS unchanged; the libcrypto behind ``_hashlib`` is mapped already, so reaching it through ctypes
costs about 1 MiB (docs/decisions/sealed-memory.md has the figures). The outputs are the same
bytes as ``cryptography``'s for the same inputs, which the unit tests check, so a sealed stream
is the same on the wire either way.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import threading
import weakref
from functools import cache
from typing import Any

from airflow_provider_amqstream.exceptions import ConfigurationError

TAG = 16
NONCE = 12
Buffer = bytes | bytearray | memoryview
_NID_X25519 = 1034
_CTRL_GET_TAG, _CTRL_SET_TAG = 0x10, 0x11

_P, _INT, _SIZE = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
# name: (return type, argument types...), as OpenSSL 1.1.1 and 3.x declare them.
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "EVP_CIPHER_CTX_new": (_P,),
    "EVP_CIPHER_CTX_free": (None, _P),
    "EVP_aes_256_ocb": (_P,),
    "EVP_CipherInit_ex": (_INT, _P, _P, _P, _P, _P, _INT),
    "EVP_CipherUpdate": (_INT, _P, _P, ctypes.POINTER(_INT), _P, _INT),
    "EVP_CipherFinal_ex": (_INT, _P, _P, ctypes.POINTER(_INT)),
    "EVP_CIPHER_CTX_ctrl": (_INT, _P, _INT, _INT, _P),
    "EVP_PKEY_new_raw_private_key": (_P, _INT, _P, _P, _SIZE),
    "EVP_PKEY_new_raw_public_key": (_P, _INT, _P, _P, _SIZE),
    "EVP_PKEY_get_raw_public_key": (_INT, _P, _P, ctypes.POINTER(_SIZE)),
    "EVP_PKEY_free": (None, _P),
    "EVP_PKEY_CTX_new": (_P, _P, _P),
    "EVP_PKEY_CTX_free": (None, _P),
    "EVP_PKEY_derive_init": (_INT, _P),
    "EVP_PKEY_derive_set_peer": (_INT, _P, _P),
    "EVP_PKEY_derive": (_INT, _P, _P, ctypes.POINTER(_SIZE)),
}


def _typed(path: str | None) -> Any:
    """The library at ``path`` with the calls above typed, or None if it lacks one of them."""
    lib = ctypes.CDLL(path) if path else None
    if lib is None or not all(hasattr(lib, name) for name in _SIGNATURES):
        return None
    for name, (restype, *argtypes) in _SIGNATURES.items():
        getattr(lib, name).restype = restype
        getattr(lib, name).argtypes = argtypes
    return lib


@cache
def _libcrypto() -> Any:
    """libcrypto: the one ``_hashlib`` links (dlsym on an extension's handle searches what it
    links), else the system's (looked for only then: ``find_library`` runs ``ldconfig``)."""
    try:
        import _hashlib

        lib = _typed(_hashlib.__file__)
    except (ImportError, AttributeError):
        lib = None  # a Python built without OpenSSL, or with it linked statically: try the system's
    if lib is None:
        import ctypes.util

        lib = _typed(ctypes.util.find_library("crypto"))
    if lib is None:
        raise ConfigurationError("sealed streams need OpenSSL 1.1.1 or later (libcrypto), which neither this "
                                 "Python's hashlib nor the system provides: install the system's OpenSSL "
                                 "library (Debian: `apt-get install libssl3`)")
    return lib


def _address(buf: bytes | bytearray | memoryview, *, writable: bool = False) -> Any:
    """What ctypes passes for ``buf``: bytes as they are, any other buffer by its address (a
    read-only one, which no caller here passes, as a copy unless it is to be written)."""
    if isinstance(buf, bytes) and not writable:
        return buf
    view = memoryview(buf).cast("B")
    if view.readonly:
        if writable:
            raise TypeError("OpenSSL cannot write into a read-only buffer")
        return view.tobytes()
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) if view.nbytes else ctypes.create_string_buffer(1)


def hkdf_sha256(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """RFC 5869 with SHA-256 (``length`` at most 32, one block)."""
    prk = hmac.new(salt, secret, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()[:length]


def _pkey(raw: bytes, private: bool) -> Any:
    if len(raw) != 32:
        raise ValueError(f"an X25519 key is 32 bytes, not {len(raw)}")
    lib = _libcrypto()
    make = lib.EVP_PKEY_new_raw_private_key if private else lib.EVP_PKEY_new_raw_public_key
    key = make(_NID_X25519, None, raw, 32)
    if not key:
        raise ConfigurationError("this OpenSSL refused an X25519 key (is it built without X25519?)")
    return key


def x25519_public(private: bytes) -> bytes:
    """The public key of the 32-byte X25519 ``private`` key."""
    lib = _libcrypto()
    key = _pkey(private, True)
    try:
        out, size = ctypes.create_string_buffer(32), _SIZE(32)
        if lib.EVP_PKEY_get_raw_public_key(key, out, ctypes.byref(size)) != 1 or size.value != 32:
            raise ConfigurationError("this OpenSSL gave no X25519 public key")
        return out.raw
    finally:
        lib.EVP_PKEY_free(key)


def x25519_shared(private: bytes, public: bytes) -> bytes | None:
    """The X25519 shared secret, or None for a peer key that gives none (a low-order point,
    whose secret is all zero: OpenSSL refuses it, as RFC 7748 allows)."""
    lib = _libcrypto()
    key = _pkey(private, True)
    peer = ctx = None  # OpenSSL's free functions take NULL
    try:
        peer = _pkey(public, False)
        ctx = lib.EVP_PKEY_CTX_new(key, None)
        out, size = ctypes.create_string_buffer(32), _SIZE(32)
        ok = (ctx and lib.EVP_PKEY_derive_init(ctx) == 1 and lib.EVP_PKEY_derive_set_peer(ctx, peer) == 1
              and lib.EVP_PKEY_derive(ctx, out, ctypes.byref(size)) == 1 and size.value == 32)
        return out.raw if ok else None
    finally:
        lib.EVP_PKEY_CTX_free(ctx)
        lib.EVP_PKEY_free(peer)
        lib.EVP_PKEY_free(key)


class OCB3:
    """AES-256-OCB3 (RFC 7253), 12-byte nonces and 16-byte tags appended to the ciphertext.

    One OpenSSL context per direction, keyed once and given a new nonce per message (a context
    keyed to encrypt cannot decrypt: OCB decrypts with the inverse key schedule). A lock keeps
    two threads off one context; ctypes lets go of the GIL for each call.
    """

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError(f"an AES-256 key is 32 bytes, not {len(key)}")
        self._key = key
        self._contexts: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _context(self, encrypt: int) -> Any:
        ctx = self._contexts.get(encrypt)
        if ctx is None:
            lib = _libcrypto()
            ctx = lib.EVP_CIPHER_CTX_new()
            if not ctx:
                raise MemoryError("OpenSSL could not allocate a cipher context")
            weakref.finalize(self, lib.EVP_CIPHER_CTX_free, ctx)
            if lib.EVP_CipherInit_ex(ctx, lib.EVP_aes_256_ocb(), None, self._key, None, encrypt) != 1:
                raise ConfigurationError("sealed streams use AES-256-OCB3, which this OpenSSL does not offer "
                                         "(OpenSSL in FIPS mode lacks it): run the receiver and sender with "
                                         "OpenSSL's default provider")
            self._contexts[encrypt] = ctx
        return ctx

    def _run(self, encrypt: int, nonce: bytes, ad: bytes, *, src: list[tuple[Any, int]], dst: int,
             tag: Any) -> bool:
        """One message through the context: each ``(buffer, size)`` of ``src`` in turn, to ``dst``
        (an address); the tag is read into ``tag`` (encrypting) or checked against it (decrypting)."""
        if len(nonce) != NONCE:
            raise ValueError(f"an OCB3 nonce here is {NONCE} bytes, not {len(nonce)}")
        lib, n = _libcrypto(), _INT()
        with self._lock:
            ctx = self._context(encrypt)
            ok = lib.EVP_CipherInit_ex(ctx, None, None, None, nonce, encrypt) == 1
            if ok and not encrypt:
                ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_SET_TAG, TAG, tag) == 1
            # A null output pointer means "associated data" to OpenSSL.
            ok = ok and lib.EVP_CipherUpdate(ctx, None, ctypes.byref(n), ad, len(ad)) == 1
            done = 0
            for buf, size in src:
                # OCB keeps a partial block between updates: what each writes is counted, not assumed.
                if ok and size:
                    ok = lib.EVP_CipherUpdate(ctx, dst + done, ctypes.byref(n), buf, size) == 1
                    done += n.value
            total = sum(size for _, size in src)
            ok = ok and lib.EVP_CipherFinal_ex(ctx, dst + done, ctypes.byref(n)) == 1 and done + n.value == total
            if ok and encrypt:
                ok = lib.EVP_CIPHER_CTX_ctrl(ctx, _CTRL_GET_TAG, TAG, tag) == 1
        return bool(ok)

    def encrypt(self, nonce: bytes, data: Buffer | list[Buffer], ad: bytes) -> bytearray:
        """Ciphertext and tag of ``data`` (or of a list of buffers one after the other, with no
        copy to join them), in one new buffer (no copy after sealing)."""
        src = [(_address(b), memoryview(b).nbytes) for b in (data if isinstance(data, list) else [data])]
        size = sum(n for _, n in src)
        out = bytearray(size + TAG)
        view = (ctypes.c_char * len(out)).from_buffer(out)
        start = ctypes.addressof(view)
        if not self._run(1, nonce, ad, src=src, dst=start, tag=start + size):
            raise ConfigurationError("OpenSSL failed to seal with AES-256-OCB3")
        del view
        return out

    def decrypt_into(self, nonce: bytes, data: bytes | bytearray | memoryview, ad: bytes,
                     into: bytearray | memoryview) -> bool:
        """Open ``data`` (ciphertext and tag) into ``into`` (exactly its plaintext's size).
        False, with ``into`` zeroed, if the tag does not match: altered, or another key, nonce
        or associated data."""
        wire = memoryview(data).cast("B")
        size = wire.nbytes - TAG
        if size < 0 or memoryview(into).nbytes != size:
            return False
        held = _address(into, writable=True)  # an empty buffer's stand-in lives while OpenSSL may write
        dst = held if isinstance(held, int) else ctypes.addressof(held)
        # OpenSSL reads only ``size`` bytes, so the whole buffer can be passed: no slice, no copy.
        src = _address(data if isinstance(data, bytes) else wire)
        if self._run(0, nonce, ad, src=[(src, size)], dst=dst, tag=wire[size:].tobytes()):
            return True
        if size:
            ctypes.memset(dst, 0, size)  # what OpenSSL wrote before the tag failed is no plaintext to keep
        return False

    def decrypt(self, nonce: bytes, data: bytes | bytearray | memoryview, ad: bytes) -> bytearray | None:
        """The plaintext of ``data`` in a new buffer, or None if its tag does not match."""
        out = bytearray(max(memoryview(data).nbytes - TAG, 0))
        return out if self.decrypt_into(nonce, data, ad, out) else None
