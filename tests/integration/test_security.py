"""Authentication and TLS. A wrong password, plaintext to a TLS port and an
untrusted certificate each give a clear error quickly, never a hang or a stack trace."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import TransportError
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import free_port, make_file, sha256_file, started

pytestmark = pytest.mark.broker


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    yield from started(EmbeddedBroker(tmp_path_factory.mktemp("tls") / "broker", port=free_port(),
                                      tls_port=free_port()))


def test_stream_over_tls(tls_broker: EmbeddedBroker, tmp_path: Path) -> None:
    params = params_from_uri(tls_broker.info().tls_uri or "")
    assert params.tls and params.hosts[0][1] == tls_broker.tls_port
    src = make_file(tmp_path / "f.bin", 3 * 2**20 + 7)
    sent = send_file(params, src, "/queue/tls.1", SendOptions(chunk_size=256 * 1024))
    got = receive_stream(params, "/queue/tls.1", tmp_path / "out", options=ReceiveOptions(wait_timeout=20))
    assert got is not None and got.sha256 == sent.sha256 == sha256_file(src)


def test_plaintext_client_to_tls_port_fails_fast_and_clearly(tls_broker: EmbeddedBroker) -> None:
    info = tls_broker.info()
    params = BrokerParams(hosts=(("127.0.0.1", info.tls_port or 0),), login=info.user, password=info.password,
                          connect_timeout=5)
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="did not complete the STOMP handshake.*TLS"):
        StompLink(params).open()
    assert time.monotonic() - t0 < 30


def test_untrusted_certificate_is_refused(tls_broker: EmbeddedBroker, tmp_path: Path) -> None:
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                    "-keyout", str(tmp_path / "k.pem"), "-out", str(other), "-days", "2"],
                   check=True, capture_output=True)
    info = tls_broker.info()
    params = BrokerParams(hosts=(("127.0.0.1", info.tls_port or 0),), login=info.user, password=info.password,
                          tls=True, ca_file=str(other), connect_timeout=5)
    with pytest.raises(TransportError, match="TLS handshake .* failed"):
        StompLink(params).open()


def test_credentials_file_and_config_are_private(tls_broker: EmbeddedBroker) -> None:
    for f in (tls_broker.creds_file, tls_broker.data_dir / "conf" / "activemq.xml",
              tls_broker.data_dir / "tls" / "keystore.json"):
        assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others"
    assert json.loads(tls_broker.creds_file.read_text())["user"] == "amqstream"


def test_password_never_in_logs_or_errors(tls_broker: EmbeddedBroker, caplog: pytest.LogCaptureFixture) -> None:
    info = tls_broker.info()
    params = BrokerParams(hosts=(("127.0.0.1", tls_broker.port),), login="amqstream", password="s3cret-Wrong")
    with pytest.raises(TransportError) as err:
        StompLink(params).open()
    assert "s3cret-Wrong" not in str(err.value) and "s3cret-Wrong" not in caplog.text
    assert "s3cret-Wrong" not in repr(params) and info.password not in params.url
