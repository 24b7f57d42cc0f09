"""A sealed stream and a sealed pack of small files forwarded through a network of brokers: the
forwarded copies at site B hold no readable byte or name of them (an unsealed one's marker is
there, so the search can fail), and the key holder at site B receives them byte-exact."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_streams, send_file, send_files
from airflow_provider_amqstream.engine.keys import new_key_file
from tests.helpers import started
from tests.integration.test_sealed import _in_store
from tests.system.test_network import QUEUE, Sites

pytestmark = [pytest.mark.broker, pytest.mark.network]


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    yield from started(Sites(tmp_path / "sites"))


def test_the_forwarded_copy_of_a_sealed_stream_is_unreadable_at_the_other_site(sites: Sites, tmp_path: Path) -> None:
    key = tmp_path / "b.key"
    recipient = new_key_file(key).recipient
    plain_marker, sealed_marker = os.urandom(12).hex().encode(), os.urandom(12).hex().encode()
    files = []
    for name, marker in (("plain.csv", plain_marker), ("secret.csv", sealed_marker)):
        path = tmp_path / name
        path.write_bytes(b"".join(os.urandom(4000) + marker for _ in range(20)))
        files.append(path)
    tx = sites.params(sites.a, "producer")
    opts = SendOptions(chunk_size=16_384, compression="none")
    send_file(tx, files[0], QUEUE, opts)
    send_file(tx, files[1], QUEUE, SendOptions(chunk_size=16_384, compression="none", seal_to=(recipient,)))
    (tmp_path / "small").mkdir()
    smalls = [tmp_path / "small" / f"payroll-small-{i}.csv" for i in range(3)]
    for path in smalls:
        path.write_bytes(os.urandom(300) + sealed_marker + os.urandom(300))
    send_files(tx, smalls, QUEUE, SendOptions(compression="none", seal_to=(recipient,), manifest=False))
    got: list = []
    failed: list = []
    receive_streams(sites.params(sites.b, "consumer"), QUEUE, tmp_path / "out", count=5, on_result=got.append,
                    on_failure=failed.append, options=ReceiveOptions(wait_timeout=60, keys=(str(key),)))
    names = ["plain.csv", "secret.csv", *(p.name for p in smalls)]
    assert failed == [] and sorted(r.name for r in got) == sorted(names)
    for path in (files[1], *smalls):
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes()
    assert _in_store(sites.b, plain_marker), "the forwarded unsealed marker must be at site B, or this proves nothing"
    assert _in_store(sites.a, sealed_marker) == [] and _in_store(sites.b, sealed_marker) == []
    assert _in_store(sites.a, b"payroll-small") == [] and _in_store(sites.b, b"payroll-small") == []
