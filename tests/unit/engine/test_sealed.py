"""Sealed streams through the engine on the in-memory broker: what waits on the broker is
unreadable, the key holder gets the file byte-exact under its real name, and every bad
case is quarantined with its cause and nothing published."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.engine import (
    ReceiveOptions,
    SendOptions,
    receive_stream,
    receive_streams,
    send_file,
    send_files,
)
from airflow_provider_amqstream.engine.keys import new_key_file
from airflow_provider_amqstream.engine.send import small_files
from airflow_provider_amqstream.exceptions import ConfigurationError, StreamQuarantined
from airflow_provider_amqstream.protocol import bulk as bw
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import seal
from airflow_provider_amqstream.protocol.codec import crc32
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.outcomes import H_QUARANTINE_CAUSE
from airflow_provider_amqstream.transport.memory import MemoryBroker, _queue

Q = "/queue/landing"
DEST = Destination.parse(Q)
FAST = {"wait_timeout": 0.3, "idle_timeout": 0.3, "gap_grace": 0.2}
MARKER = b"TOP-SECRET-MARKER-7f3a"


@pytest.fixture
def key(tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "keys" / "rx.key"
    path.parent.mkdir()
    return str(path), new_key_file(path).recipient


def _file(tmp_path: Path, name: str = "payroll 2026.csv", size: int = 6000) -> tuple[Path, bytes]:
    data = (MARKER + b",1,2,3\n") * (size // 29) + os.urandom(7)
    src = tmp_path / "src" / name
    src.parent.mkdir(exist_ok=True)
    src.write_bytes(data)
    return src, data


def _on_broker(broker: MemoryBroker, sid: str, sender: str = "alice") -> list[tuple[dict[str, Any], bytes]]:
    return broker.messages(Q) + broker.messages(DEST.data_queue(sid, sender))


def _receive(broker: MemoryBroker, out: Path, **opts: Any) -> Any:
    return receive_stream(broker.params("rx"), Q, out, options=ReceiveOptions(**{**FAST, **opts}))


def test_the_broker_holds_nothing_readable_and_the_key_holder_gets_it_whole(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    src, data = _file(tmp_path)
    res = send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    waiting = _on_broker(broker, res.stream_id)
    assert len(waiting) == 1 + res.chunks + 1 and res.chunks == 6
    for headers, body in waiting:
        assert MARKER not in body and "payroll" not in str(headers)
        assert headers.get(hdr.H_SHA256) != res.sha256
    assert "payroll" not in res.stream_id and res.name == "payroll 2026.csv"
    got = _receive(broker, tmp_path / "out", keys=(key[0],))
    assert got.name == "payroll 2026.csv" and got.sha256 == res.sha256
    assert (tmp_path / "out" / "payroll 2026.csv").read_bytes() == data


def test_a_receiver_without_the_key_quarantines_it_and_publishes_nothing(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    src, _ = _file(tmp_path)
    other = tmp_path / "other.key"
    new_key_file(other)
    res = send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    with pytest.raises(StreamQuarantined, match="sealed for keys this receiver does not hold"):
        _receive(broker, tmp_path / "out", keys=(str(other),))
    [(filed, _)] = broker.messages(f"/queue/DLQ.{DEST.name}")
    assert filed[H_QUARANTINE_CAUSE] == "no_key"
    assert [f for f in (tmp_path / "out").iterdir() if not f.name.startswith(".")] == []
    # Its chunks wait for a receiver with the key (no_key is redrivable).
    assert len(broker.messages(DEST.data_queue(res.stream_id, "alice"))) == res.chunks + 1


def _tampered(broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], change: Any) -> tuple[Path, str]:
    src, _ = _file(tmp_path)
    res = send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    q = DEST.data_queue(res.stream_id, "alice")
    chunks = broker.messages(q)
    broker.queues.pop(_queue(q))
    with broker_link(broker) as link:
        for headers, body in change(chunks):
            link.send(q, body, {**headers, hdr.H_CRC: str(crc32(body))} if hdr.H_SEQ in headers else headers)
    return src, res.stream_id


def broker_link(broker: MemoryBroker) -> Any:
    from airflow_provider_amqstream.transport.link import open_link

    return open_link(broker.params("alice"))


def _flip(chunks: list[tuple[dict[str, Any], bytes]]) -> list[tuple[dict[str, Any], bytes]]:
    h, b = chunks[2]
    return chunks[:2] + [(h, b[:10] + bytes([b[10] ^ 1]) + b[11:])] + chunks[3:]


def _swap(chunks: list[tuple[dict[str, Any], bytes]]) -> list[tuple[dict[str, Any], bytes]]:
    (h1, b1), (h2, b2) = chunks[1], chunks[2]
    return [chunks[0], (h1, b2), (h2, b1), *chunks[3:]]


def _truncate(chunks: list[tuple[dict[str, Any], bytes]]) -> list[tuple[dict[str, Any], bytes]]:
    # Drop the last chunk and pass chunk 5 off as the end (as an attacker would have to: the offer counts 6).
    h5, b5 = chunks[4]
    return [*chunks[:4], (h5, b5), ({**chunks[5][0]}, b5), chunks[6]]


@pytest.mark.parametrize("change", [_flip, _swap, _truncate], ids=["tampered", "reordered", "truncated"])
def test_a_chunk_altered_on_the_broker_quarantines_the_stream_as_seal_broken(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], change: Any) -> None:
    _tampered(broker, tmp_path, key, change)
    with pytest.raises(StreamQuarantined, match="does not open"):
        _receive(broker, tmp_path / "out", keys=(key[0],))
    [(filed, _)] = broker.messages(f"/queue/DLQ.{DEST.name}")
    assert filed[H_QUARANTINE_CAUSE] == "seal_broken"
    assert not (tmp_path / "out" / "payroll 2026.csv").exists()


def test_a_chunk_transplanted_from_another_stream_does_not_open(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    a, _ = _file(tmp_path, "a.csv")
    b, _ = _file(tmp_path, "b.csv")
    opts = SendOptions(chunk_size=1000, seal_to=(key[1],))
    ra = send_file(broker.params("alice"), a, Q, opts)
    rb = send_file(broker.params("alice"), b, Q, opts)
    qa, qb = DEST.data_queue(ra.stream_id, "alice"), DEST.data_queue(rb.stream_id, "alice")
    foreign = broker.messages(qb)[1][1]
    chunks = broker.messages(qa)
    broker.queues.pop(_queue(qa))
    with broker_link(broker) as link:
        for i, (h, body) in enumerate(chunks):
            body = foreign if i == 1 else body
            link.send(qa, body, {**h, hdr.H_CRC: str(crc32(body))} if hdr.H_SEQ in h else h)
    with pytest.raises(StreamQuarantined, match="does not open"):
        _receive(broker, tmp_path / "out", keys=(key[0],))
    # The next stream (b) still arrives.
    got = _receive(broker, tmp_path / "out", keys=(key[0],))
    assert got.name == "b.csv" and (tmp_path / "out" / "b.csv").read_bytes() == b.read_bytes()


def test_sealing_required_refuses_an_unsealed_send_and_quarantines_an_unsealed_stream(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    src, _ = _file(tmp_path)
    with pytest.raises(ConfigurationError, match="requires sealed streams"):
        send_file(broker.params("alice", seal_required=True), src, Q)
    assert broker.messages(Q) == []
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000))
    with pytest.raises(StreamQuarantined, match="not sealed"):
        _receive(broker, tmp_path / "out", keys=(key[0],), seal_required=True)
    [(filed, _)] = broker.messages(f"/queue/DLQ.{DEST.name}")
    assert filed[H_QUARANTINE_CAUSE] == "unsealed"


def test_a_malformed_recipient_is_refused_before_anything_is_sent(broker: MemoryBroker, tmp_path: Path,
                                                                  key: tuple[str, str]) -> None:
    src, _ = _file(tmp_path)
    typo = key[1][:-1] + ("a" if key[1][-1] != "a" else "b")
    for send in (lambda: send_file(broker.params("alice"), src, Q, SendOptions(seal_to=(typo,))),
                 lambda: send_files(broker.params("alice"), [src], Q, SendOptions(seal_to=(typo,)))):
        with pytest.raises(ConfigurationError, match="recipient"):
            send()
    assert broker.messages(Q) == []


class _Stop(Exception):
    pass


def test_an_interrupted_sealed_send_resumes_under_the_same_key(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    src, data = _file(tmp_path, size=20_000)

    def stop(done: int, total: int) -> None:
        if 0 < done < total:
            raise _Stop

    opts = SendOptions(chunk_size=1000, window=2, seal_to=(key[1],))
    with pytest.raises(_Stop):
        send_file(broker.params("alice"), src, Q, SendOptions(**{**opts.__dict__, "progress": stop}))
    res = send_file(broker.params("alice"), src, Q, opts)
    assert res.resumed_from > 0
    got = _receive(broker, tmp_path / "out", keys=(key[0],))
    assert got.sha256 == res.sha256 and (tmp_path / "out" / src.name).read_bytes() == data


def test_sealed_files_of_a_few_chunks_go_as_sealed_streams(broker: MemoryBroker, tmp_path: Path,
                                                          key: tuple[str, str]) -> None:
    files = [_file(tmp_path, f"f{i}.csv", 2500)[0] for i in range(3)]
    sent = send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), chunk_size=1000, manifest=True))
    assert len(sent.results) == 3 and not sent.failures
    assert all(seal.H_SEAL in h and MARKER not in b and not bw.is_pack(h) for h, b in broker.messages(Q))
    got = receive_streams(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST, keys=(key[0],)))
    assert len(got) == 3
    assert sorted(f.name for f in (tmp_path / "out").iterdir() if f.is_file()) == ["f0.csv", "f1.csv", "f2.csv"]
    # They went the small-file way (back to back, one receipt for several): no checkpoint per
    # file, only the secret (owner-only) their keys derive from.
    state = Path(os.environ["AMQSTREAM_STATE_DIR"])
    [secret_file] = state.glob("seal@*.json")
    assert secret_file.stat().st_mode & 0o077 == 0 and list(state.glob("sealed-*")) == []


def _packed(broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], count: int = 5,
            **opts: Any) -> tuple[list[Path], Any]:
    """``count`` files of one chunk, each named ``payroll-<i>.csv`` and holding MARKER, sent sealed."""
    files = [_file(tmp_path, f"payroll-{i}.csv", 300 * (i + 1))[0] for i in range(count)]
    sent = send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), manifest=False, **opts))
    assert not sent.failures
    return files, sent


def _receive_all(broker: MemoryBroker, out: Path, **opts: Any) -> tuple[list[Any], list[Any]]:
    failures: list[Any] = []
    got = receive_streams(broker.params("rx"), Q, out, on_failure=failures.append,
                          options=ReceiveOptions(**{**FAST, **opts}))
    return got, failures


def test_small_sealed_files_travel_in_one_sealed_pack_the_broker_cannot_read(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    files, sent = _packed(broker, tmp_path, key)
    [(headers, body)] = broker.messages(Q)
    assert bw.is_sealed_pack(headers) and headers[bw.H_PACK_FILES] == "5"
    assert MARKER not in body and b"payroll" not in body and "payroll" not in str(headers)
    assert not any(r.sha256 in str(headers) or r.sha256.encode() in body for r in sent.results)
    assert bw.H_PACK_INDEX not in headers and hdr.H_CRC not in headers  # a CRC of the plaintext would confirm a guess
    assert bw.sealed_members(headers) == [(r.stream_id, r.bytes) for r in sent.results]
    # The key holder, sealing required, gets each file byte-exact under its real name.
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],), seal_required=True)
    assert failures == [] and sorted(r.name for r in got) == [f.name for f in files]
    assert all((tmp_path / "out" / f.name).read_bytes() == f.read_bytes() for f in files)
    assert broker.messages(Q) == []


def test_a_sealed_pack_without_a_key_is_quarantined_whole_and_nothing_is_published(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    _packed(broker, tmp_path, key)
    other = tmp_path / "keys" / "other.key"
    new_key_file(other)
    got, failures = _receive_all(broker, tmp_path / "out", keys=(str(other),))
    assert got == [] and [f.cause for f in failures] == ["no_key"]
    assert "pack" in failures[0].reason and str(other) in failures[0].reason
    assert not any(f.name.endswith(".csv") for f in (tmp_path / "out").iterdir())
    [(filed, body)] = broker.messages(f"/queue/DLQ.{DEST.name}")
    assert body == b"" and "payroll" not in str(filed) and filed[H_QUARANTINE_CAUSE] == "no_key"


def _flip_body(h: dict[str, Any], b: bytes) -> tuple[dict[str, Any], bytes]:
    return h, b[:40] + bytes([b[40] ^ 1]) + b[41:]


def _reorder_ids(h: dict[str, Any], b: bytes) -> tuple[dict[str, Any], bytes]:
    ids = h[hdr.H_PACK_IDS].strip("|").split("|")
    return {**h, hdr.H_PACK_IDS: "|" + "|".join(reversed(ids)) + "|"}, b


def _grow_size(h: dict[str, Any], b: bytes) -> tuple[dict[str, Any], bytes]:
    sizes = h[bw.H_PACK_SIZES].strip("|").split("|")
    return {**h, bw.H_PACK_SIZES: "|" + "|".join([str(int(sizes[0]) + 1), *sizes[1:]]) + "|"}, b


def _cut(h: dict[str, Any], b: bytes) -> tuple[dict[str, Any], bytes]:
    return h, b[:-1]


@pytest.mark.parametrize("change", [_flip_body, _reorder_ids, _grow_size, _cut])
def test_a_sealed_pack_altered_on_the_broker_is_seal_broken_and_publishes_nothing(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], change: Any) -> None:
    _packed(broker, tmp_path, key)
    [msg] = broker.queues[_queue(Q)]
    msg.headers, msg.body = change(dict(msg.headers), msg.body)
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert got == [] and [f.cause for f in failures] == ["seal_broken"], failures
    assert not any(f.name.endswith(".csv") for f in (tmp_path / "out").iterdir())


def test_a_sealed_pack_moved_under_another_packs_headers_does_not_open(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    _packed(broker, tmp_path, key, count=2)
    first = broker.queues[_queue(Q)][0]
    (tmp_path / "src2").mkdir()
    others = [tmp_path / "src2" / f"o{i}.csv" for i in range(2)]
    for o in others:
        o.write_bytes(os.urandom(300))
    send_files(broker.params("alice"), others, Q, SendOptions(seal_to=(key[1],), manifest=False))
    second = broker.queues[_queue(Q)][1]
    second.body = first.body
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert sorted(r.name for r in got) == ["payroll-0.csv", "payroll-1.csv"]
    assert [f.cause for f in failures] == ["seal_broken"] and not (tmp_path / "out" / "o0.csv").exists()


def test_a_sealed_pack_member_quarantined_alone_shows_the_broker_no_name_or_hash(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    files, sent = _packed(broker, tmp_path, key, count=3)
    # The largest is over this receiver's limit; the other two arrive.
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],), max_bytes=sent.results[1].bytes)
    assert sorted(r.name for r in got) == ["payroll-0.csv", "payroll-1.csv"]
    assert [(f.stream_id, f.cause) for f in failures] == [(sent.results[2].stream_id, "max_bytes")]
    [(filed, body)] = broker.messages(f"/queue/DLQ.{DEST.name}")
    assert body == b"" and filed[hdr.H_NAME] == seal.SEALED_NAME and filed[hdr.H_STREAM] == sent.results[2].stream_id
    assert "payroll" not in str(filed) and sent.results[2].sha256 not in str(filed)
    assert not {hdr.H_SHA256, hdr.H_CRC, hdr.H_DIR} & set(filed)


def test_a_sealed_pack_sent_again_is_a_duplicate_and_the_views_show_its_files_sealed(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine.inventory import take_inventory
    from airflow_provider_amqstream.engine.receive.browse import OfferBrowser

    files, sent = _packed(broker, tmp_path, key, count=3)
    seen = take_inventory(broker.params("admin"), Q)
    pid = broker.messages(Q)[0][0][hdr.H_STREAM]
    assert [(o.stream_id, o.name, o.size, o.kind, o.pack) for o in seen.offered] == [
        (r.stream_id, seal.SEALED_NAME, r.bytes, "inline", pid) for r in sent.results]
    browser = OfferBrowser(broker.params("admin"), Q)
    try:
        assert [(o.stream_id, o.name, o.size, o.sender) for o in browser.look()] == [
            (r.stream_id, seal.SEALED_NAME, r.bytes, "alice") for r in sent.results]
    finally:
        browser.close()
    got, _ = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert len(got) == 3
    # Sent again from scratch: another pack key, the same files under the same ids.
    send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), manifest=False, restart=True))
    again, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert failures == [] and [r.status for r in again] == ["duplicate"] * 3
    assert sorted(f.name for f in (tmp_path / "out").iterdir() if f.is_file()) == [f.name for f in files]


def test_a_small_sealed_file_is_sealed_under_the_key_derived_from_the_senders_secret(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    src, _ = _file(tmp_path, "f.csv", 3000)
    [res] = send_files(broker.params("alice"), [src], Q, SendOptions(seal_to=(key[1],), chunk_size=1000)).results
    secret_file = next(Path(os.environ["AMQSTREAM_STATE_DIR"]).glob("seal@*.json"))
    secret = bytes.fromhex(json.loads(secret_file.read_text())["secret"])
    [(h, body)] = [m for m in broker.messages(DEST.data_queue(res.stream_id, "alice")) if m[0].get(hdr.H_SEQ) == "1"]
    seal.Seal(seal.derived_key(secret, res.stream_id), res.stream_id, "").open_chunk(1, False, body, h)
    with pytest.raises(seal.SealBroken):
        seal.Seal(seal.derived_key(secret, "another-id"), res.stream_id, "").open_chunk(1, False, body, h)


def test_a_sealed_small_file_cut_off_by_a_crash_is_sent_again_under_the_same_key(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The crash falls after a file's chunks reached the broker and before its offer; the re-run
    (over a different set of files) seals it again under the key those chunks were sealed with:
    a new key would make the receiver refuse them as broken and quarantine a file that was fine."""
    files = [_file(tmp_path, f"f{i}.csv", 2500)[0] for i in range(3)]
    opts = SendOptions(seal_to=(key[1],), chunk_size=1000, manifest=False)
    real, offered = small_files.p.offer_headers, []

    def offer_then_crash(spec: Any, *args: Any, **kw: Any) -> Any:
        offered.append(spec.stream_id)
        if len(offered) == 2:
            raise KeyboardInterrupt("the sender's machine went down")
        return real(spec, *args, **kw)

    monkeypatch.setattr(small_files.p, "offer_headers", offer_then_crash)
    with pytest.raises(KeyboardInterrupt):
        send_files(broker.params("alice"), files, Q, opts)
    cut = offered[-1]
    assert len(broker.messages(DEST.data_queue(cut, "alice"))) == 3 + 1  # its chunks and end wait, unoffered
    assert not any(h[hdr.H_STREAM] == cut for h, _ in broker.messages(Q))
    monkeypatch.setattr(small_files.p, "offer_headers", real)
    again = send_files(broker.params("alice"), [*files, _file(tmp_path, "new.csv", 2500)[0]], Q, opts)
    assert not again.failures and len(again.results) == 4
    got = receive_streams(broker.params("rx"), Q, tmp_path / "out",
                          options=ReceiveOptions(**{**FAST, "keys": (key[0],)}))
    assert broker.messages(f"/queue/DLQ.{DEST.name}") == [] and "quarantined" not in {r.status for r in got}
    for src in [*files, tmp_path / "src" / "new.csv"]:
        assert (tmp_path / "out" / src.name).read_bytes() == src.read_bytes()


def test_sealing_required_quarantines_small_files_sent_inline_and_in_packs(broker: MemoryBroker, tmp_path: Path,
                                                                            key: tuple[str, str]) -> None:
    files = [_file(tmp_path, f"p{i}.csv", 300)[0] for i in range(3)]
    send_files(broker.params("alice"), files, Q, SendOptions(pack=True))
    failures: list[Any] = []
    from airflow_provider_amqstream.engine import receive_streams

    got = receive_streams(broker.params("rx"), Q, tmp_path / "out", on_failure=failures.append,
                          options=ReceiveOptions(**FAST, keys=(key[0],), seal_required=True))
    assert got == [] and [f.cause for f in failures] == ["unsealed"] * 3
    assert not any(f.name.endswith(".csv") for f in (tmp_path / "out").iterdir())


def test_both_ends_resume_a_sealed_stream(broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.exceptions import StreamStalled

    src, data = _file(tmp_path, size=20_000)

    def stop(done: int, total: int) -> None:
        if done >= 8000:
            raise _Stop

    opts = SendOptions(chunk_size=1000, window=2, seal_to=(key[1],))
    with pytest.raises(_Stop):
        send_file(broker.params("alice"), src, Q, SendOptions(**{**opts.__dict__, "progress": stop}))
    # The receiver takes what is there, then gives way with its partial data kept.
    with pytest.raises(StreamStalled, match=r"at byte [1-9][0-9]* of"):
        _receive(broker, tmp_path / "out", keys=(key[0],), yield_backoff=600)
    res = send_file(broker.params("alice"), src, Q, opts)
    got = receive_stream(broker.params("rx"), Q, tmp_path / "out", stream_id=res.stream_id,
                         options=ReceiveOptions(**FAST, keys=(key[0],)))
    assert got.resumed_from >= 8000 and got.sha256 == res.sha256
    assert (tmp_path / "out" / src.name).read_bytes() == data


def test_a_stream_quarantined_for_want_of_a_key_is_redriven_to_the_key_holder(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine.redrive import redrive

    src, data = _file(tmp_path)
    res = send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, seal_to=(key[1],)))
    with pytest.raises(StreamQuarantined, match="does not hold"):
        _receive(broker, tmp_path / "out")
    redrive(broker.params("admin"), Q, res.stream_id, quiet=0.05, receivers=["rx"])
    got = _receive(broker, tmp_path / "out", keys=(key[0],))
    assert got.name == src.name and (tmp_path / "out" / src.name).read_bytes() == data


def test_a_sealed_batch_list_gives_the_key_holder_its_manifest_and_the_broker_no_name(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine import receive_streams
    from airflow_provider_amqstream.engine.receive.manifest import manifest_path

    files = [_file(tmp_path, f"ledger-{i}.csv", 300)[0] for i in range(3)]
    sent = send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), manifest=True))
    [(headers, body)] = [(h, b) for h, b in broker.messages(Q) if h.get(hdr.H_KIND) == hdr.Kind.BATCH.value]
    assert seal.H_SEAL in headers and b"ledger" not in body and sent.results[0].sha256.encode() not in body
    got = receive_streams(broker.params("rx"), Q, tmp_path / "out", options=ReceiveOptions(**FAST, keys=(key[0],)))
    assert len(got) == 3
    manifest = manifest_path(tmp_path / "out", sent.batch_id, "alice").read_text()
    assert all(f"ledger-{i}.csv" in manifest for i in range(3))
    assert all(r.sha256 in manifest for r in sent.results)


@pytest.mark.parametrize("change", ["no key", "altered", "moved"])
def test_a_sealed_batch_list_that_does_not_open_is_quarantined_and_records_nothing(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str], change: str) -> None:
    from airflow_provider_amqstream.engine import receive_streams
    from airflow_provider_amqstream.engine.receive.manifest import manifest_path

    files = [_file(tmp_path, f"ledger-{i}.csv", 300)[0] for i in range(2)]
    sent = send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), manifest=True))
    keys = (key[0],)
    if change == "no key":
        other = tmp_path / "keys" / "other.key"
        new_key_file(other)
        keys = (str(other),)
    else:
        msgs = broker.queues[_queue(Q)]
        [batch] = [m for m in msgs if m.headers.get(hdr.H_KIND) == hdr.Kind.BATCH.value]
        if change == "altered":
            batch.body = bytes([batch.body[0] ^ 1]) + batch.body[1:]
        else:  # the same sealed list claimed as part 1 of 2: its seal is bound to "1 of 1"
            batch.headers = {**batch.headers, "amqs_parts": "2"}
    failures: list[Any] = []
    receive_streams(broker.params("rx"), Q, tmp_path / "out", on_failure=failures.append,
                    options=ReceiveOptions(**FAST, keys=keys))
    expected = "no_key" if change == "no key" else "seal_broken"
    assert expected in [f.cause for f in failures], failures
    assert not manifest_path(tmp_path / "out", sent.batch_id, "alice").exists()


def test_a_sealed_stream_sent_again_under_its_id_is_a_duplicate(broker: MemoryBroker, tmp_path: Path,
                                                                 key: tuple[str, str]) -> None:
    src, data = _file(tmp_path)
    opts = SendOptions(chunk_size=1000, seal_to=(key[1],))
    send_file(broker.params("alice"), src, Q, opts, stream_id="sealed-daily")
    assert _receive(broker, tmp_path / "out", keys=(key[0],)).status == "complete"
    # Sent again from scratch: a new stream key, the same file under the same id.
    send_file(broker.params("alice"), src, Q, SendOptions(chunk_size=1000, seal_to=(key[1],), restart=True),
              stream_id="sealed-daily")
    again = _receive(broker, tmp_path / "out", keys=(key[0],))
    assert again.status == "duplicate" and again.bytes_transferred == 0
    assert sorted(f.name for f in (tmp_path / "out").iterdir()) == [".amqstream", "payroll 2026.csv"]
    assert (tmp_path / "out" / "payroll 2026.csv").read_bytes() == data


def test_the_small_files_secret_is_made_once_kept_private_and_replaced_only_when_not_ours(tmp_path: Path) -> None:
    from airflow_provider_amqstream.engine.send.bulk import _seal_secret

    path = tmp_path / "seal@0123456789ab.json"
    first = _seal_secret(path)
    assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert _seal_secret(path) == first and list(tmp_path.iterdir()) == [path]  # read back, no temporary left
    path.write_text("not json")
    replaced = _seal_secret(path)
    assert replaced != first and _seal_secret(path) == replaced


def test_a_sealed_files_directory_travels_inside_the_seal_and_the_broker_cannot_move_it(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    from airflow_provider_amqstream.engine import BatchFile

    big, _ = _file(tmp_path, "big.csv", 2500)
    small, _ = _file(tmp_path, "small.csv", 300)
    files = [BatchFile(big, "payroll/2026"), BatchFile(small, "payroll/2026")]
    send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), chunk_size=1000, manifest=False))
    waiting = broker.messages(Q)
    assert len(waiting) == 2 and not any("payroll" in str(h) or b"payroll" in b for h, b in waiting)
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert failures == [] and len(got) == 2
    for src in (big, small):
        assert (tmp_path / "out" / "payroll" / "2026" / src.name).read_bytes() == src.read_bytes()
    # A directory the broker writes next to a sealed offer would choose where the file lands: refused.
    send_file(broker.params("alice"), big, Q, SendOptions(chunk_size=1000, seal_to=(key[1],)), stream_id="moved")
    [offer] = [m for m in broker.queues[_queue(Q)] if m.headers.get(hdr.H_KIND) == hdr.Kind.OFFER.value]
    offer.headers = {**offer.headers, hdr.H_DIR: "elsewhere"}
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],))
    assert got == [] and [(f.stream_id, f.cause) for f in failures] == [("moved", "seal_broken")]
    assert not (tmp_path / "out" / "elsewhere").exists()


def test_with_packs_off_a_sealed_small_file_goes_as_a_sealed_stream_never_inline(
        broker: MemoryBroker, tmp_path: Path, key: tuple[str, str]) -> None:
    files = [_file(tmp_path, f"payroll-{i}.csv", 300)[0] for i in range(2)]
    send_files(broker.params("alice"), files, Q, SendOptions(seal_to=(key[1],), pack=False, manifest=False))
    offers = broker.messages(Q)
    assert len(offers) == 2 and all(seal.H_SEAL in h and not bw.is_inline(h) and b == b"" for h, b in offers)
    got, failures = _receive_all(broker, tmp_path / "out", keys=(key[0],), seal_required=True)
    assert failures == [] and sorted(r.name for r in got) == [f.name for f in files]
