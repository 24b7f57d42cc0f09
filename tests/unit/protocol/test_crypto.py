"""The seal's primitives (protocol/crypto.py, OpenSSL through ctypes) give the same bytes as the
`cryptography` package, which Airflow installs: a stream sealed by either opens with the other,
and a key file or recipient made before the switch means the same key after it."""

from __future__ import annotations

import os
import threading

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESOCB3
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_provider_amqstream.protocol import crypto as c

KEY = bytes(range(32))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), ad=st.binary(max_size=100), nonce=st.binary(min_size=12, max_size=12))
def test_ocb3_seals_as_cryptography_does_and_opens_what_it_sealed(data: bytes, ad: bytes, nonce: bytes) -> None:
    ours = c.OCB3(KEY)
    sealed = ours.encrypt(nonce, data, ad)
    assert bytes(sealed) == AESOCB3(KEY).encrypt(nonce, data, ad)
    for wire in (bytes(sealed), sealed, memoryview(sealed), memoryview(bytes(sealed))):
        assert ours.decrypt(nonce, wire, ad) == data
    into = bytearray(len(data) + 2)
    assert ours.decrypt_into(nonce, sealed, ad, memoryview(into)[1:-1]) and into[1:-1] == data


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=3000), cuts=st.lists(st.integers(0, 3000), max_size=5))
def test_buffers_sealed_one_after_another_are_their_concatenation_sealed(data: bytes, cuts: list[int]) -> None:
    # Cut anywhere, mid-block included (OCB keeps a partial block between updates).
    bounds = [0, *sorted(min(x, len(data)) for x in cuts), len(data)]
    parts: list[c.Buffer] = [data[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    parts = [p if i % 2 else bytearray(p) for i, p in enumerate(parts)]
    nonce = bytes(12)
    assert bytes(c.OCB3(KEY).encrypt(nonce, parts, b"ad")) == AESOCB3(KEY).encrypt(nonce, data, b"ad")


def test_one_cipher_seals_one_mib_chunks_in_turn_like_a_fresh_one() -> None:
    ours, chunks = c.OCB3(KEY), [os.urandom(1 << 20) for _ in range(3)]
    for i, chunk in enumerate(chunks):
        nonce = i.to_bytes(12, "big")
        sealed = ours.encrypt(nonce, chunk, b"ad")
        assert bytes(sealed) == AESOCB3(KEY).encrypt(nonce, chunk, b"ad")
        assert ours.decrypt(nonce, sealed, b"ad") == chunk  # the decrypting context is another


@pytest.mark.parametrize("change", ["ciphertext", "tag", "nonce", "ad", "cut", "key"])
def test_anything_changed_does_not_open_and_leaves_no_plaintext_behind(change: str) -> None:
    data, nonce, ad = b"marker " * 100, bytes(12), b"stream|1"
    wire = bytearray(c.OCB3(KEY).encrypt(nonce, data, ad))
    key = KEY
    if change == "ciphertext":
        wire[10] ^= 1
    elif change == "tag":
        wire[-1] ^= 1
    elif change == "nonce":
        nonce = b"\x01" + nonce[1:]
    elif change == "ad":
        ad = b"stream|2"
    elif change == "cut":
        wire = wire[:-1]
    else:
        key = bytes(31) + b"\x01"
    assert c.OCB3(key).decrypt(nonce, wire, ad) is None
    into = bytearray(b"\xff" * (len(wire) - c.TAG))
    assert c.OCB3(key).decrypt_into(nonce, wire, ad, into) is False
    assert into == bytearray(len(into))


def test_a_short_or_misfitting_buffer_is_refused_not_overrun() -> None:
    sealed = c.OCB3(KEY).encrypt(bytes(12), b"abc", b"")
    assert c.OCB3(KEY).decrypt(bytes(12), sealed[:c.TAG - 1], b"") is None
    assert c.OCB3(KEY).decrypt_into(bytes(12), sealed, b"", bytearray(2)) is False
    with pytest.raises(TypeError, match="read-only"):
        c.OCB3(KEY).decrypt_into(bytes(12), sealed, b"", memoryview(b"xyz"))
    with pytest.raises(ValueError, match="32 bytes"):
        c.OCB3(b"short")
    with pytest.raises(ValueError, match="nonce"):
        c.OCB3(KEY).encrypt(bytes(8), b"abc", b"")


def test_threads_sharing_one_cipher_each_get_their_own_message() -> None:
    ours, wrong = c.OCB3(KEY), []

    def work(n: int) -> None:
        body = bytes([n]) * 200_000
        for i in range(20):
            nonce = bytes([n, i]) + bytes(10)
            if ours.decrypt(nonce, ours.encrypt(nonce, body, b""), b"") != body:
                wrong.append((n, i))

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and wrong == []


@settings(max_examples=30, deadline=None)
@given(private=st.binary(min_size=32, max_size=32), peer=st.binary(min_size=32, max_size=32))
def test_x25519_gives_cryptography_s_public_keys_and_shared_secrets(private: bytes, peer: bytes) -> None:
    theirs = X25519PrivateKey.from_private_bytes(private)
    assert c.x25519_public(private) == theirs.public_key().public_bytes_raw()
    peer_public = c.x25519_public(peer)
    assert c.x25519_shared(private, peer_public) == theirs.exchange(X25519PublicKey.from_public_bytes(peer_public))


def test_a_low_order_peer_key_gives_no_shared_secret() -> None:
    # All zero and one: points of small order, whose shared secret is all zero (RFC 7748, 6.1).
    for point in (bytes(32), b"\x01" + bytes(31)):
        assert c.x25519_shared(os.urandom(32), point) is None


def test_hkdf_matches_rfc_5869_and_cryptography() -> None:
    # RFC 5869, test case 1.
    ikm, salt, info = bytes([0x0B] * 22), bytes(range(13)), bytes(range(0xF0, 0xFA))
    assert c.hkdf_sha256(ikm, salt, info)[:32].hex() == (
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf")
    secret, salt = os.urandom(32), os.urandom(64)
    assert c.hkdf_sha256(secret, salt, b"info") == HKDF(hashes.SHA256(), 32, salt, b"info").derive(secret)
