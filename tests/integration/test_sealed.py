"""Sealed streams and sealed packs against a real ActiveMQ: the broker's store holds no readable
byte, name or directory of a sealed file, the key holder receives it byte-exact, and every bad
case (no key; a chunk or pack a send-only user tampered with, reordered, replayed, transplanted,
resized or cut off, up to 1,000 of them ahead of a good one; a malformed recipient or key file)
is refused with its cause while the next good stream still arrives, and no log holds a key, a
sealed name or plaintext. The views (``streams ls/show``, the page's API), discard, redrive of a
batch list's part and the event triggers see a sealed stream without its name or SHA-256."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, receive_streams, send_file
from airflow_provider_amqstream.engine.inventory import take_inventory
from airflow_provider_amqstream.engine.keys import new_key_file
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import seal
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.helpers import RawSender, Receiver, browse, cli, make_file, running_broker, sha256_file

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """This module's own broker (its store is searched whole), with a send-only user ``rt``."""
    yield from running_broker(tmp_path_factory.mktemp("sealed") / "broker", {"rt": {"send": ["/queue/rt.>"]}})


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> str:
    return f"/queue/rt.{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:12]}"


@pytest.fixture
def key(tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "rx.key"
    return str(path), new_key_file(path).recipient


def _receive(params: BrokerParams, queue: str, out: Path, count: int, **opts: Any) -> tuple[list[Any], list[Any]]:
    got: list[Any] = []
    failed: list[Any] = []
    receive_streams(params, queue, out, count=count, on_result=got.append, on_failure=failed.append,
                    options=ReceiveOptions(wait_timeout=20, idle_timeout=10, **opts))
    return got, failed


def _run_cli(*args: str) -> tuple[int, str, str]:
    proc = cli(*args)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def _in_store(broker: EmbeddedBroker, needle: bytes) -> list[str]:
    """Every file under the broker's directory (KahaDB journal and index, logs) holding ``needle``."""
    found = []
    for root, _, files in os.walk(broker.data_dir):
        for name in files:
            path = Path(root) / name
            try:
                if needle in path.read_bytes():
                    found.append(str(path))
            except OSError:
                continue
    return found


def test_the_broker_store_holds_the_unsealed_marker_and_never_the_sealed_one(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str]) -> None:
    # Two markers, each repeated in a file of random bytes; compression off so an unsealed
    # marker reaches the store as it is (the test must be able to fail).
    plain_marker, sealed_marker = os.urandom(12).hex().encode(), os.urandom(12).hex().encode()

    def marked(name: str, marker: bytes) -> Path:
        path = tmp_path / name
        path.write_bytes(b"".join(os.urandom(4000) + marker for _ in range(20)))
        return path

    plain, secret = marked("plain.csv", plain_marker), marked("secret-payroll.csv", sealed_marker)
    none = SendOptions(chunk_size=16_384, compression="none")
    send_file(params, plain, queue_name, none)
    send_file(params, secret, queue_name, dataclasses.replace(none, seal_to=(key[1],)))
    assert _in_store(broker, plain_marker), "the unsealed marker must be in the store, or this test proves nothing"
    assert _in_store(broker, sealed_marker) == [] and _in_store(broker, b"secret-payroll") == []
    # A receiver without the key takes the plain file and quarantines the sealed one (no_key): its
    # quarantine copy in the DLQ holds nothing readable either.
    other = tmp_path / "other.key"
    new_key_file(other)
    got, failed = _receive(params, queue_name, tmp_path / "nokey", 2, keys=(str(other),))
    assert [r.name for r in got] == ["plain.csv"]
    assert [f.cause for f in failed] == ["no_key"] and not (tmp_path / "nokey" / "secret-payroll.csv").exists()
    assert _in_store(broker, sealed_marker) == [] and _in_store(broker, b"secret-payroll") == []
    # The key holder gets the next sealed stream byte-exact, under its real name.
    again = marked("again.csv", sealed_marker)
    sent = send_file(params, again, queue_name, dataclasses.replace(none, seal_to=(key[1],)))
    got, failed = _receive(params, queue_name, tmp_path / "out", 1, keys=(key[0],))
    assert failed == [] and [r.name for r in got] == ["again.csv"] and got[0].sha256 == sent.sha256
    assert (tmp_path / "out" / "again.csv").read_bytes() == again.read_bytes()
    assert _in_store(broker, sealed_marker) == []


def _hostile_stream(case: str, sealed: seal.Seal, other: seal.Seal, data: bytes) -> tuple[p.StreamSpec, list[bytes]]:
    """What a send-only user puts on the broker for ``case``: the offer's spec and the wire body
    sent as chunk 1, 2, 3 (each is then given a CRC-32 that matches, so only the seal can tell)."""
    spec = p.StreamSpec(sealed.stream_id, seal.SEALED_NAME, len(data), 1000)
    wires = [bytes(p.data_message(spec, seq, data[(seq - 1) * 1000:seq * 1000], None, sealed)[1]) for seq in (1, 2, 3)]
    if case == "tampered":
        wires[1] = wires[1][:5] + bytes([wires[1][5] ^ 1]) + wires[1][6:]
    elif case == "reordered":
        wires[1], wires[2] = wires[2], wires[1]
    elif case == "replayed":
        wires[1] = wires[0]
    elif case == "transplanted":  # chunk 2 of another sealed stream to the same receiver
        wires[1] = bytes(p.data_message(spec, 2, data[1000:2000], None, other)[1])
    elif case == "truncated":  # the offer claims two chunks, so chunk 2 would pass as the last
        spec, wires = dataclasses.replace(spec, size=2000), wires[:2]
    return spec, wires


@pytest.mark.parametrize("case", ["tampered", "reordered", "replayed", "transplanted", "truncated"])
def test_a_sealed_stream_altered_by_a_send_only_user_is_refused_and_the_next_stream_arrives(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str],
        case: str) -> None:
    rt = dataclasses.replace(params_from_uri(broker.info(user="rt").uri), connect_timeout=10.0)
    data = os.urandom(3000)
    recipients = [seal.parse_recipient(key[1])]
    sealed, other = (seal.Seal.create(sid, recipients, name="x.bin", size=len(data), chunk_size=1000)
                     for sid in (f"hostile-sealed-{case}", "hostile-sealed-other"))
    spec, wires = _hostile_stream(case, sealed, other, data)
    dest = Destination.parse(queue_name)
    raw = RawSender(rt)
    raw.send(str(dest), b"", {**p.offer_headers(spec, dest, sender="rt"), seal.H_SEAL: sealed.header})
    for seq, wire in enumerate(wires, 1):
        headers = p.data_message(spec, seq, data[(seq - 1) * 1000:seq * 1000], None, sealed)[0]
        raw.send(dest.data_queue(spec.stream_id, "rt"), wire, {**headers, hdr.H_CRC: str(crc32(wire))})
    raw.send(dest.data_queue(spec.stream_id, "rt"), b"", p.end_headers(spec, sealed.digest("0" * 64)))
    raw.close()
    good = make_file(tmp_path / "good.bin", 5000)
    sent = send_file(rt, good, queue_name, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    got, failed = _receive(params, queue_name, tmp_path / "out", 1, keys=(key[0],))
    assert [f.cause for f in failed] == ["seal_broken"] and "does not open" in failed[0].reason
    assert not (tmp_path / "out" / "x.bin").exists()
    assert [r.sha256 for r in got] == [sent.sha256]
    assert (tmp_path / "out" / "good.bin").read_bytes() == good.read_bytes()


def _hostile_pack(case: str, recipients: list[bytes], tag: str, dest: Destination) -> tuple[dict[str, str], bytes]:
    """A sealed pack of two files as a send-only user ``rt`` puts it on the broker for ``case``."""
    def members(prefix: str) -> list[tuple[dict[str, str], bytes]]:
        out = []
        for i in range(2):
            body = f"{tag} row {i}\n".encode() * 50
            spec = p.StreamSpec(f"{prefix}-{i}", f"{prefix}-{i}.csv", len(body), 1024 * 1024, hdr.Mode.ATOMIC)
            out.append(bw.inline_offer(spec, dest, body, hashlib.sha256(body).hexdigest(), sender="rt"))
        return out

    headers, wire = bw.pack_message(members(f"hostile-pack-{case}"), recipients)
    body = bytes(wire)
    if case == "tampered":
        body = body[:30] + bytes([body[30] ^ 1]) + body[31:]
    elif case == "reordered":  # the files it shows, swapped in the clear
        first, second = headers[hdr.H_PACK_IDS].strip("|").split("|")
        headers = {**headers, hdr.H_PACK_IDS: f"|{second}|{first}|"}
    elif case == "resized":
        headers = {**headers, bw.H_PACK_SIZES: "|1|1|"}
    elif case == "transplanted":  # another sealed pack's body under these headers
        body = bytes(bw.pack_message(members("hostile-pack-other"), recipients)[1])
    elif case == "truncated":
        body = body[:-1]
    return headers, body


@pytest.mark.parametrize("case", ["tampered", "reordered", "resized", "transplanted", "truncated"])
def test_a_sealed_pack_altered_by_a_send_only_user_is_refused_whole_and_the_next_pack_arrives(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str],
        case: str) -> None:
    from airflow_provider_amqstream.engine import send_files

    rt = dataclasses.replace(params_from_uri(broker.info(user="rt").uri), connect_timeout=10.0)
    tag = f"HOSTILE-{os.urandom(4).hex()}"
    dest = Destination.parse(queue_name)
    headers, body = _hostile_pack(case, [seal.parse_recipient(key[1])], tag, dest)
    raw = RawSender(rt)
    raw.send(str(dest), body, headers)
    raw.close()
    good = _secret_files(tmp_path, "good", 3)
    sent = send_files(rt, good, queue_name, SendOptions(seal_to=(key[1],), manifest=False))
    got, failed = _receive(params, queue_name, tmp_path / "out", 3, keys=(key[0],))
    assert [f.cause for f in failed] == ["seal_broken"] and failed[0].stream_id.startswith("pk-"), failed
    assert not [f for f in (tmp_path / "out").iterdir() if f.name.startswith("hostile-pack")]
    assert sorted(r.sha256 for r in got) == sorted(r.sha256 for r in sent.results)
    assert all((tmp_path / "out" / f.name).read_bytes() == f.read_bytes() for f in good)
    assert _in_store(broker, tag.encode()) == []


def test_sealed_packs_and_directories_leave_no_name_or_byte_in_the_store_and_without_the_key_go_whole(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine import BatchFile, send_files

    tag, marker = os.urandom(6).hex(), os.urandom(12).hex().encode()
    files = _secret_files(tmp_path, tag, 71, size=1000)  # two packs (at most 64 files each) and a stream
    for path in files[:70]:
        path.write_bytes(os.urandom(500) + marker + os.urandom(500))
    files[70].write_bytes(os.urandom(1_500_000) + marker + os.urandom(1_500_000))
    subdir = f"secret-{tag}-dir/2026"  # a directory is no less telling than a name
    opts = SendOptions(seal_to=(key[1],), manifest=False, compression="none")
    sent = send_files(params, [BatchFile(f, subdir) for f in files], queue_name, opts)
    waiting = browse(params, queue_name)
    assert [f.headers.get(bw.H_PACK_FILES) for f in waiting] == ["64", "6", None]
    assert all(f.headers.get(seal.H_SEAL) for f in waiting) and hdr.H_DIR not in waiting[2].headers
    assert _in_store(broker, marker) == [] and _in_store(broker, f"secret-{tag}".encode()) == []
    assert _in_store(broker, sent.results[0].sha256.encode()) == []
    other = tmp_path / "other.key"
    new_key_file(other)
    got, failed = _receive(params, queue_name, tmp_path / "nokey", 71, keys=(str(other),))
    assert got == [] and [f.cause for f in failed] == ["no_key"] * 3
    assert not [f for f in (tmp_path / "nokey").rglob("*") if f.is_file() and ".amqstream" not in f.parts]
    filed = browse(params, Destination.parse(queue_name).quarantine_queue(None))
    assert [f.headers.get(seal.H_SEAL) is not None for f in filed] == [True] * 3
    assert _in_store(broker, marker) == [] and _in_store(broker, f"secret-{tag}".encode()) == []
    # Sent again (the receiver now has the key): byte-exact under the real names and directory,
    # sealing required.
    send_files(params, [BatchFile(f, subdir) for f in files], queue_name, dataclasses.replace(opts, restart=True))
    got, failed = _receive(params, queue_name, tmp_path / "out", 71, keys=(key[0],), seal_required=True)
    assert failed == [] and sorted(r.name for r in got) == sorted(f.name for f in files)
    assert all((tmp_path / "out" / subdir / f.name).read_bytes() == f.read_bytes() for f in files)


def _bad_sealed_pack(shape: str, i: int, recipients: list[bytes], dest: Destination) -> tuple[dict[str, str], bytes]:
    """One of the bad sealed packs a send-only user floods a queue with (ids unique per ``i``)."""
    body = b"x" * 100
    spec = p.StreamSpec(f"flood-{shape}-{i}", "f.csv", len(body), 1024 * 1024, hdr.Mode.ATOMIC)
    member = bw.inline_offer(spec, dest, body, hashlib.sha256(body).hexdigest(), sender="rt")
    headers, wire = bw.pack_message([member], recipients)
    wire = bytes(wire)
    if shape == "tampered":
        wire = wire[:20] + bytes([wire[20] ^ 1]) + wire[21:]
    elif shape == "resized":
        headers = {**headers, bw.H_PACK_SIZES: "|101|"}
    elif shape == "garbled":
        headers = {**headers, seal.H_SEAL: "!" * 3000}
    elif shape == "nonce":
        headers = {**headers, seal.H_NONCE: "zz" * 4000}
    elif shape == "bad-index":  # sealed by its sender, so it opens: what is inside is wrong
        sealed = seal.Seal.create(headers[hdr.H_STREAM], recipients, name="pack", size=1,
                                  chunk_size=bw.shown_digest(headers))
        wire, nonce = sealed.chunk(1, True, (2**31).to_bytes(4, "big") + b"[]", None)
        headers, wire = {**headers, seal.H_SEAL: sealed.header, **nonce}, bytes(wire)
    return headers, wire


@pytest.mark.parametrize("n", [10, 100, 1000])
def test_a_good_sealed_pack_passes_any_number_of_bad_ones_and_the_broker_heap_stays_flat(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str],
        n: int) -> None:
    from airflow_provider_amqstream.engine import send_files
    from tests.helpers import assert_old_gen_bounded

    rt = dataclasses.replace(params_from_uri(broker.info(user="rt").uri), connect_timeout=10.0)
    dest = Destination.parse(queue_name)
    mine = [seal.parse_recipient(key[1])]
    someone_else = [seal.parse_recipient(seal.Identity.generate().recipient)]
    shapes = {"tampered": "seal_broken", "resized": "seal_broken", "garbled": "seal_broken", "nonce": "seal_broken",
              "no-key": "no_key",
              "bad-index": "invalid"}
    raw = RawSender(rt)
    try:
        for i in range(n):
            shape = list(shapes)[i % len(shapes)]
            headers, wire = _bad_sealed_pack(shape, i, someone_else if shape == "no-key" else mine, dest)
            raw.send(str(dest), wire, headers)
    finally:
        raw.close()
    good = _secret_files(tmp_path, "good", 3)
    sent = send_files(rt, good, queue_name, SendOptions(seal_to=(key[1],), manifest=False))
    started = time.monotonic()
    got, failed = _receive(params, queue_name, tmp_path / "out", 3, keys=(key[0],))
    took = time.monotonic() - started
    assert sorted(r.sha256 for r in got) == sorted(r.sha256 for r in sent.results)
    expected: dict[str, int] = {}
    for i in range(n):
        cause = shapes[list(shapes)[i % len(shapes)]]
        expected[cause] = expected.get(cause, 0) + 1
    seen: dict[str, int] = {}
    for f in failed:
        seen[f.cause] = seen.get(f.cause, 0) + 1
    assert seen == expected
    assert not [f for f in (tmp_path / "out").iterdir() if f.name.startswith("flood-")]
    # Each bad pack costs a confirmed copy to the quarantine and an acknowledgement.
    assert took <= 10.0 + 0.05 * n, f"{took:.1f}s behind {n} bad sealed packs"
    heap = assert_old_gen_bounded(broker, f"{n} bad sealed packs")
    print(f"\nbehind {n} bad sealed packs: the good pack arrived in {took:.2f}s; broker old generation {heap:.0f} MiB")


def test_a_malformed_key_file_is_refused_by_name_before_anything_is_taken(
        broker: EmbeddedBroker, params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
        key: tuple[str, str]) -> None:
    send_file(params, make_file(tmp_path / "f.bin", 3000), queue_name, SendOptions(seal_to=(key[1],)))
    bad = tmp_path / "bad.key"
    bad.write_text(Path(key[0]).read_text()[:-5] + "\n")
    bad.chmod(0o600)
    code, _, err = _run_cli("receive", "--from", queue_name, "--out-dir", str(tmp_path / "out"), "--key", str(bad),
                            "--conn", uri, "--wait", "5")
    assert code == 1 and str(bad) in err and "not an amqstream key file" in err
    assert Path(key[0]).read_text().splitlines()[1][:40] not in err
    assert len(browse(params, queue_name, timeout=5)) == 1  # the offer still waits for a key holder


def test_no_key_no_file_name_and_no_plaintext_in_the_logs_of_a_sealed_transfer(
        broker: EmbeddedBroker, uri: str, tmp_path: Path, queue_name: str, key: tuple[str, str]) -> None:
    src = tmp_path / "payroll-secret-name.csv"
    src.write_bytes(b"PLAINTEXT-MARKER-91c2," * 500)
    code, sent_out, sent_err = _run_cli("-v", "send", str(src), "--to", queue_name, "--seal-to", key[1],
                                        "--conn", uri, "--chunk-size", "4096")
    assert code == 0, sent_err[-2000:]
    code, got_out, got_err = _run_cli("-v", "receive", "--from", queue_name, "--out-dir", str(tmp_path / "out"),
                                      "--key", key[0], "--conn", uri, "--wait", "30")
    assert code == 0, got_err[-2000:]
    assert (tmp_path / "out" / src.name).read_bytes() == src.read_bytes()
    assert "connection from" in sent_err and "connection from" in got_err  # -v: there is a log to search
    secret = Path(key[0]).read_text().splitlines()[1]
    for text in (sent_out, sent_err, got_out, got_err):
        assert secret not in text and secret.rsplit("-", 1)[1][:20] not in text
        assert "PLAINTEXT-MARKER" not in text
    # The broker's own log (its data directory) never sees the name either: only the key holder's output does.
    assert _in_store(broker, b"payroll-secret-name") == []


def test_a_malformed_recipient_is_refused_before_anything_is_sent(
        broker: EmbeddedBroker, params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
        key: tuple[str, str]) -> None:
    src = make_file(tmp_path / "f.bin", 3000)
    typo = key[1][:-1] + ("a" if key[1][-1] != "a" else "b")
    proc = cli("send", str(src), "--to", queue_name, "--seal-to", typo, "--conn", uri)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "recipient" in err and "checksum" in err
    assert browse(params, queue_name, timeout=2) == []


def test_sealing_required_quarantines_an_unsealed_stream_and_takes_the_next_sealed_one(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str]) -> None:
    plain = make_file(tmp_path / "plain.bin", 3000)
    good = make_file(tmp_path / "good.bin", 3000, seed=1)
    send_file(params, plain, queue_name, SendOptions(chunk_size=1000))
    sent = send_file(params, good, queue_name, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    got, failed = _receive(params, queue_name, tmp_path / "out", 1, keys=(key[0],), seal_required=True)
    assert [f.cause for f in failed] == ["unsealed"] and not (tmp_path / "out" / "plain.bin").exists()
    assert [r.sha256 for r in got] == [sent.sha256]


def test_pub_sub_fan_out_to_two_key_holders_each_with_its_own_key(params: BrokerParams, tmp_path: Path) -> None:
    topic = f"/topic/t.sealed.{os.getpid()}"
    keys = [tmp_path / "a.key", tmp_path / "b.key"]
    recipients = tuple(new_key_file(k).recipient for k in keys)
    src = make_file(tmp_path / "f.bin", 300_000)
    receivers = [Receiver(params, topic, tmp_path / f"out{i}", keys=(str(k),)) for i, k in enumerate(keys)]
    for rx in receivers:
        assert rx.waiting.wait(30)
    sent = send_file(params, src, topic, SendOptions(mode="handshake", chunk_size=64 * 1024, window=8,
                                                     seal_to=recipients))
    for rx in receivers:
        got = rx.finish()
        assert got.name == "f.bin" and got.sha256 == sent.sha256 == sha256_file(Path(got.path or ""))


def test_a_sealed_many_file_send_writes_its_manifest_at_the_key_holder_and_no_name_in_the_store(
        broker: EmbeddedBroker, params: BrokerParams, tmp_path: Path, queue_name: str, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine import send_files
    from airflow_provider_amqstream.engine.receive.manifest import manifest_path

    tag = os.urandom(6).hex()
    files = []
    for i in range(3):
        path = tmp_path / "src" / f"secret-{tag}-{i}.csv"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(2000))
        files.append(path)
    sent = send_files(params, files, queue_name, SendOptions(seal_to=(key[1],), manifest=True, compression="none"))
    assert not sent.failures
    # The batch list names every file and its SHA-256: sealed, neither is in the broker's store.
    assert _in_store(broker, f"secret-{tag}".encode()) == []
    assert _in_store(broker, sent.results[0].sha256.encode()) == []
    # One sealed pack for the three files (packs are on by default), then the sealed batch list.
    waiting = browse(params, queue_name)
    assert len(waiting) == 2 and all(f.headers.get(seal.H_SEAL) for f in waiting)
    assert bw.is_sealed_pack(waiting[0].headers) and waiting[0].headers[bw.H_PACK_FILES] == "3"
    # No count: the receiver goes on past the three files to the batch list, until 3 s pass with no offer.
    failed: list[Any] = []
    got = receive_streams(params, queue_name, tmp_path / "out", on_failure=failed.append,
                          options=ReceiveOptions(wait_timeout=3, idle_timeout=10, keys=(key[0],)))
    assert failed == [] and sorted(r.name for r in got) == [f.name for f in files]
    assert all((tmp_path / "out" / f.name).read_bytes() == f.read_bytes() for f in files)
    manifest = manifest_path(tmp_path / "out", sent.batch_id, params.login or "").read_text()
    assert all(f.name in manifest for f in files) and all(r.sha256 in manifest for r in sent.results)


def _secret_files(tmp_path: Path, tag: str, count: int, size: int = 2000) -> list[Path]:
    """Files whose names carry ``tag`` (which the broker's side must never show)."""
    (tmp_path / "src").mkdir(exist_ok=True)
    files = [tmp_path / "src" / f"secret-{tag}-{i}.csv" for i in range(count)]
    for path in files:
        path.write_bytes(os.urandom(size))
    return files


def test_streams_ls_show_the_page_and_discard_see_a_sealed_stream_but_never_its_name_or_sha256(
        broker: EmbeddedBroker, params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
        key: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from airflow_provider_amqstream.plugins import streams as page

    tag = os.urandom(6).hex()
    files = _secret_files(tmp_path, tag, 2)
    opts = SendOptions(chunk_size=1000, seal_to=(key[1],))
    sent = [send_file(params, files[0], queue_name, opts)]
    # A receiver without the key quarantines the first (no_key); the second is left offered.
    other = tmp_path / "other.key"
    new_key_file(other)
    failed: list[Any] = []
    receive_streams(params, queue_name, tmp_path / "nokey", on_failure=failed.append,
                    options=ReceiveOptions(wait_timeout=3, keys=(str(other),)))
    assert [f.cause for f in failed] == ["no_key"]
    sent.append(send_file(params, files[1], queue_name, opts))
    secrets = [tag, *(s.sha256 for s in sent)]
    quarantined, offered = sent[0].stream_id, sent[1].stream_id

    def run(*args: str) -> str:
        code, out, err = _run_cli(*args, "--conn", uri, "--from", queue_name)
        assert code == 0, err
        assert not [s for s in secrets if s in out or s in err], out + err
        return out

    view = json.loads(run("streams", "ls", "--json"))
    assert [(o["stream_id"], o["name"], o["kind"]) for o in view["offered"]] == [(offered, seal.SEALED_NAME, "stream")]
    assert [(q["stream_id"], q["name"], q["cause"], q["redrivable"]) for q in view["quarantined"]] == [
        (quarantined, seal.SEALED_NAME, "no_key", True)]
    text = run("streams", "ls")
    assert f"{offered}  {seal.SEALED_NAME}" in text and "[no_key]" in text, text
    rep = json.loads(run("streams", "show", quarantined, "--json"))
    assert [(q["name"], q["cause"]) for q in rep["quarantined"]] == [(seal.SEALED_NAME, "no_key")]
    assert any(q["end_marker"] for q in rep["queues"]), rep["queues"]  # its chunks wait for a key holder
    assert "[no_key]" in run("streams", "show", quarantined)
    # The streams page's API, on this broker through an Airflow connection (its auth stood in for).
    monkeypatch.setenv("AIRFLOW_CONN_SEALED_OPS", uri)

    async def anyone(request: Any) -> str:
        return "someone"

    monkeypatch.setattr(page, "_user", anyone)
    monkeypatch.setattr(page, "_may", lambda user, conn_id, method: True)
    with TestClient(page.app) as client:
        got = client.get("/streams/api/inventory", params={"conn_id": "sealed_ops", "destination": queue_name})
    assert got.status_code == 200, got.text
    assert [o["name"] for o in got.json()["offered"]] == [seal.SEALED_NAME]
    assert [q["name"] for q in got.json()["quarantined"]] == [seal.SEALED_NAME]
    assert not [s for s in secrets if s in got.text]
    # Discard removes the quarantined stream everywhere: its copy and its chunks.
    assert f"discarded stream {quarantined}" in run("streams", "discard", quarantined, "--yes")
    dest = Destination.parse(queue_name)
    for queue in (dest.quarantine_queue(None), dest.data_queue(quarantined, params.user)):
        assert not [f for f in browse(params, queue, timeout=2) if f.headers.get(hdr.H_STREAM) == quarantined], queue
    # The key holder still gets the other, under its real name.
    got_files, failed = _receive(params, queue_name, tmp_path / "out", 1, keys=(key[0],))
    assert failed == [] and [r.name for r in got_files] == [files[1].name]
    assert (tmp_path / "out" / files[1].name).read_bytes() == files[1].read_bytes()


def test_a_batch_list_part_quarantined_for_want_of_a_key_is_re_sent_not_redriven(
        broker: EmbeddedBroker, params: BrokerParams, uri: str, tmp_path: Path, queue_name: str,
        key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine import send_files
    from airflow_provider_amqstream.engine.discard import discard
    from airflow_provider_amqstream.engine.receive.manifest import manifest_path

    files = _secret_files(tmp_path, os.urandom(6).hex(), 2)
    opts = SendOptions(seal_to=(key[1],), manifest=True)
    sent = send_files(params, files, queue_name, opts)
    other = tmp_path / "other.key"
    new_key_file(other)
    failed: list[Any] = []
    receive_streams(params, queue_name, tmp_path / "nokey", on_failure=failed.append,
                    options=ReceiveOptions(wait_timeout=3, keys=(str(other),)))
    # The two files went in one sealed pack: it and the batch list are each quarantined whole.
    [pack_id] = [f.stream_id for f in failed if f.stream_id != sent.batch_id]
    assert sorted((f.stream_id, f.cause) for f in failed) == sorted([(sent.batch_id, "no_key"), (pack_id, "no_key")])
    # The part's copy keeps only its headers: redrive refuses it, saying what to do instead.
    code, _, err = _run_cli("streams", "redrive", sent.batch_id, "--conn", uri, "--from", queue_name)
    assert code == 1 and "batch list" in err and "re-run the send" in err, err
    # So does the pack's: its files are sent again.
    code, _, err = _run_cli("streams", "redrive", pack_id, "--conn", uri, "--from", queue_name)
    assert code == 1 and "send it again" in err, err
    view = take_inventory(params, queue_name)
    assert {(q.stream_id, q.cause, q.redrivable) for q in view.quarantined} == {
        (sent.batch_id, "batch_list", False), (pack_id, "inline", False)}
    # As the advice says: the send re-run from scratch (its ledger counts the files as sent) announces
    # files and list again, and the copies are discarded.
    again = send_files(params, files, queue_name, dataclasses.replace(opts, restart=True))
    assert again.batch_id == sent.batch_id and not again.failures
    assert discard(params, queue_name, sent.batch_id).messages == 1
    assert discard(params, queue_name, pack_id).messages == 1
    got = receive_streams(params, queue_name, tmp_path / "out", options=ReceiveOptions(wait_timeout=3, keys=(key[0],)))
    assert sorted(r.name for r in got) == [f.name for f in files]
    assert all((tmp_path / "out" / f.name).read_bytes() == f.read_bytes() for f in files)
    manifest = manifest_path(tmp_path / "out", sent.batch_id, params.login or "").read_text()
    assert all(r.sha256 in manifest for r in sent.results)


def test_the_event_trigger_fires_for_a_sealed_offer_and_only_the_key_holder_learns_the_name(
        params: BrokerParams, uri: str, tmp_path: Path, queue_name: str, key: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger
    from airflow_provider_amqstream.triggers.stream import StreamOfferTrigger

    monkeypatch.setenv("AIRFLOW_CONN_SEALED_EVT", uri)
    [src] = _secret_files(tmp_path, tag := os.urandom(6).hex(), 1)
    sent = send_file(params, src, queue_name, SendOptions(chunk_size=1000, seal_to=(key[1],)))

    async def first(trigger: Any) -> Any:
        events = trigger.run()
        try:
            return await asyncio.wait_for(anext(events), 60)
        finally:
            await events.aclose()

    event = asyncio.run(first(StreamOfferedTrigger(destination=queue_name, amqstream_conn_id="sealed_evt",
                                                   poll_interval=0.2)))
    assert event.payload["stream_id"] == sent.stream_id and event.payload["name"] == seal.SEALED_NAME
    assert event.payload["size"] == src.stat().st_size  # what routing needs, in clear
    assert tag not in json.dumps(event.payload) and sent.sha256 not in json.dumps(event.payload)
    # The deferred sensor's trigger too, waiting for that stream id.
    woke = asyncio.run(first(StreamOfferTrigger(source=queue_name, stream_id=sent.stream_id,
                                                amqstream_conn_id="sealed_evt", poll_interval=0.2)))
    assert woke.payload["status"] == "success" and tag not in json.dumps(woke.payload)
    # The run the event starts receives that stream id with the key: the real name arrives with it.
    got = receive_stream(params, queue_name, tmp_path / "out", stream_id=event.payload["stream_id"],
                         options=ReceiveOptions(wait_timeout=10, keys=(key[0],)))
    assert got is not None and got.name == src.name and got.sha256 == sent.sha256
    assert (tmp_path / "out" / src.name).read_bytes() == src.read_bytes()


def test_the_event_trigger_fires_for_each_file_of_a_sealed_pack_and_a_receiver_asking_for_one_gets_the_pack(
        params: BrokerParams, uri: str, tmp_path: Path, queue_name: str, key: tuple[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from airflow_provider_amqstream.engine import send_files
    from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger

    monkeypatch.setenv("AIRFLOW_CONN_SEALED_EVT", uri)
    files = _secret_files(tmp_path, tag := os.urandom(6).hex(), 3)
    sent = send_files(params, files, queue_name, SendOptions(seal_to=(key[1],), manifest=False))
    [waiting] = browse(params, queue_name)
    assert bw.is_sealed_pack(waiting.headers)

    async def events(trigger: Any, n: int) -> list[Any]:
        it = trigger.run()
        try:
            return [await asyncio.wait_for(anext(it), 60) for _ in range(n)]
        finally:
            await it.aclose()

    # pace=0: an event per file at once (no run started here takes any of them).
    seen = asyncio.run(events(StreamOfferedTrigger(destination=queue_name, amqstream_conn_id="sealed_evt",
                                                   poll_interval=0.2, pace=0), 3))
    assert sorted((e.payload["stream_id"], e.payload["name"], e.payload["size"]) for e in seen) == sorted(
        (r.stream_id, seal.SEALED_NAME, r.bytes) for r in sent.results)
    assert not [e for e in seen if tag in json.dumps(e.payload)]
    # Asked for by one id, the whole pack is received, under the real names.
    got = receive_stream(params, queue_name, tmp_path / "out", stream_id=sent.results[1].stream_id,
                         options=ReceiveOptions(wait_timeout=10, keys=(key[0],)))
    assert got is not None and got.name == files[1].name
    assert all((tmp_path / "out" / f.name).read_bytes() == f.read_bytes() for f in files)
