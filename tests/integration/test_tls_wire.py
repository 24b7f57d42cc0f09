"""Issue "One URI parser", on the wire: every spelling of TLS, run through the real
``amqstream test-connection`` against a real plaintext STOMP port, fails (a TLS handshake
the port never answers) and never reports success; ``check_hostname`` reaches the TLS
handshake, and switching it off still verifies the certificate chain.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

from airflow_provider_amqstream.broker import config as broker_config
from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import cli, free_port

pytestmark = pytest.mark.broker

# A TLS attempt against a plaintext port waits for a handshake the port never answers:
# measured, it fails only when connect_timeout runs out. Kept short so the tests are quick.
TIMEOUT = 2
OTHER_NAME = "amqs-elsewhere.invalid"


def _cred(broker: EmbeddedBroker) -> str:
    info = broker.info()
    return f"{quote(info.user or '', safe='')}:{quote(info.password or '', safe='')}"


def _tls_spellings(broker: EmbeddedBroker) -> dict[str, str]:
    """Every spelling of "TLS, please" we accept, all pointing at the plaintext port."""
    info = broker.info()
    auth = f"{_cred(broker)}@127.0.0.1:{info.port}"
    t = f"connect_timeout={TIMEOUT}"
    as_json = {"conn_type": "amqstream", "host": "127.0.0.1", "port": info.port, "login": info.user,
               "password": info.password}
    return {
        "stomp+ssl scheme": f"stomp+ssl://{auth}?{t}",
        "amqstream+ssl scheme": f"amqstream+ssl://{auth}?{t}",
        "tls=true": f"amqstream://{auth}?tls=true&{t}",
        "tls=1": f"amqstream://{auth}?tls=1&{t}",
        "stomp with tls=true": f"stomp://{auth}?tls=true&{t}",
        "__extra__": f"amqstream://{auth}?__extra__=" + quote(json.dumps({"tls": True, "connect_timeout": TIMEOUT})),
        "stomp+ssl, check_hostname off": f"stomp+ssl://{auth}?check_hostname=false&{t}",
        "JSON extra object": json.dumps({**as_json, "extra": {"tls": True, "connect_timeout": TIMEOUT}}),
        "JSON extra string": json.dumps({**as_json, "extra": json.dumps({"tls": True, "connect_timeout": TIMEOUT})}),
        "JSON stomp+ssl type": json.dumps({**as_json, "conn_type": "stomp+ssl",
                                           "extra": {"connect_timeout": TIMEOUT}}),
    }


def _refused_spellings(broker: EmbeddedBroker) -> dict[str, tuple[str, str]]:
    """Unclear spellings: refused before any connection, with a fragment of the error."""
    info = broker.info()
    auth = f"{_cred(broker)}@127.0.0.1:{info.port}"
    return {
        "stomp+ssl with tls=false": (f"stomp+ssl://{auth}?tls=false", "the scheme asks for TLS"),
        "tls=maybe": (f"amqstream://{auth}?tls=maybe", "must be true or false, got 'maybe'"),
        "ssl=true": (f"amqstream://{auth}?ssl=true", "'ssl' is not an amqstream setting"),
        "TLS=true": (f"amqstream://{auth}?TLS=true", "'TLS' is not an amqstream setting"),
        "ca_file without tls": (f"amqstream://{auth}?ca_file=%2Ftmp%2Fca.pem", "ca_file given but TLS is off"),
        "stomp+nio+ssl scheme": (f"stomp+nio+ssl://{auth}", "accepted: amqstream://, stomp://"),
        "JSON tls maybe": (json.dumps({"conn_type": "amqstream", "host": "127.0.0.1", "port": info.port,
                                       "password": info.password, "extra": json.dumps({"tls": "maybe"})}),
                           "got 'maybe'"),
    }


def _test_connection(value: str, via: str) -> subprocess.CompletedProcess[str]:
    """``amqstream test-connection`` with the connection as ``--conn`` or as ``AIRFLOW_CONN_*``."""
    if via == "--conn":
        proc = cli("test-connection", "--conn", value)
    else:
        proc = cli("test-connection", "--conn", "amqs_tls_wire", env={"AIRFLOW_CONN_AMQS_TLS_WIRE": value})
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


TLS_NAMES = ["stomp+ssl scheme", "amqstream+ssl scheme", "tls=true", "tls=1", "stomp with tls=true", "__extra__",
             "stomp+ssl, check_hostname off", "JSON extra object", "JSON extra string", "JSON stomp+ssl type"]
REFUSED_NAMES = ["stomp+ssl with tls=false", "tls=maybe", "ssl=true", "TLS=true", "ca_file without tls",
                 "stomp+nio+ssl scheme", "JSON tls maybe"]


def test_the_plaintext_port_answers_plain_stomp(broker: EmbeddedBroker) -> None:
    """The control: the port the other tests aim TLS at does accept a plaintext client."""
    r = _test_connection(f"amqstream://{_cred(broker)}@127.0.0.1:{broker.info().port}", "--conn")
    assert r.returncode == 0 and "ok: connected to stomp://" in r.stdout, r.stderr


@pytest.mark.parametrize("via", ["--conn", "AIRFLOW_CONN_*"])
@pytest.mark.parametrize("name", TLS_NAMES)
def test_every_tls_spelling_fails_against_a_plaintext_port(broker: EmbeddedBroker, name: str, via: str) -> None:
    r = _test_connection(_tls_spellings(broker)[name], via)
    assert r.returncode != 0 and "ok: connected" not in r.stdout, (r.stdout, r.stderr)
    # The failure is a TLS handshake, so TLS was attempted and nothing was sent in plain text.
    assert "amqstream: error: TLS handshake with stomp+ssl://127.0.0.1:" in r.stderr, r.stderr
    assert broker.info().password not in r.stdout + r.stderr


@pytest.mark.parametrize("via", ["--conn", "AIRFLOW_CONN_*"])
@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_every_unclear_spelling_is_refused_before_connecting(broker: EmbeddedBroker, name: str, via: str) -> None:
    value, fragment = _refused_spellings(broker)[name]
    r = _test_connection(value, via)
    assert r.returncode == 1 and "ok: connected" not in r.stdout, (r.stdout, r.stderr)
    assert fragment in r.stderr and "TLS handshake" not in r.stderr, r.stderr
    assert broker.info().password not in r.stdout + r.stderr


@pytest.mark.parametrize("name", ["stomp+ssl scheme", "JSON extra string"])
def test_the_hook_fails_too(broker: EmbeddedBroker, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

    monkeypatch.setenv("AIRFLOW_CONN_AMQS_TLS_HOOK", _tls_spellings(broker)[name])
    ok, message = AmqStreamHook("amqs_tls_hook").test_connection()
    assert not ok and message.startswith("TLS handshake with stomp+ssl://127.0.0.1:"), message
    if "://" in _tls_spellings(broker)[name]:
        ok, message = AmqStreamHook(uri=_tls_spellings(broker)[name]).test_connection()
        assert not ok and message.startswith("TLS handshake"), message


# -- check_hostname on a real TLS port ---------------------------------------------------

@pytest.fixture(scope="module")
def elsewhere_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A broker whose TLS certificate names only OTHER_NAME, not the 127.0.0.1 we dial."""
    b = EmbeddedBroker(tmp_path_factory.mktemp("elsewhere") / "broker", port=free_port(), tls_port=free_port())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(broker_config, "certificate_names", lambda: f"dns:{OTHER_NAME}")
        b.start()
    try:
        yield b
    finally:
        b.stop()


def _tls_uri(broker: EmbeddedBroker, ca_file: Path, extra: str = "") -> str:
    info = broker.info()
    return (f"stomp+ssl://{_cred(broker)}@127.0.0.1:{info.tls_port}?ca_file={quote(str(ca_file), safe='/')}"
            f"&connect_timeout=10{extra}")


def test_check_hostname_on_refuses_a_certificate_for_another_name(elsewhere_broker: EmbeddedBroker) -> None:
    r = _test_connection(_tls_uri(elsewhere_broker, elsewhere_broker.ca_file), "--conn")
    assert r.returncode == 1 and "ok: connected" not in r.stdout, (r.stdout, r.stderr)
    assert "IP address mismatch" in r.stderr and "check_hostname" in r.stderr, r.stderr


def test_check_hostname_off_accepts_it(elsewhere_broker: EmbeddedBroker) -> None:
    r = _test_connection(_tls_uri(elsewhere_broker, elsewhere_broker.ca_file, "&check_hostname=false"), "--conn")
    assert r.returncode == 0, r.stderr
    assert f"ok: connected to stomp+ssl://127.0.0.1:{elsewhere_broker.tls_port}" in r.stdout


def test_check_hostname_off_still_verifies_the_chain(elsewhere_broker: EmbeddedBroker, tmp_path: Path) -> None:
    other = tmp_path / "other.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={OTHER_NAME}",
                    "-keyout", str(tmp_path / "k.pem"), "-out", str(other), "-days", "2"],
                   check=True, capture_output=True)
    r = _test_connection(_tls_uri(elsewhere_broker, other, "&check_hostname=false"), "--conn")
    assert r.returncode == 1 and "ok: connected" not in r.stdout, (r.stdout, r.stderr)
    assert "certificate verify failed" in r.stderr, r.stderr


def test_tls_failover_goes_on_to_the_next_host(elsewhere_broker: EmbeddedBroker) -> None:
    """The TLS handshake is ours (stomp.py's cannot skip the name check alone): it must
    still try the hosts in order, as stomp.py does."""
    info = elsewhere_broker.info()
    params = BrokerParams(hosts=(("127.0.0.1", free_port()), ("127.0.0.1", info.tls_port or 0)),
                          login=info.user, password=info.password, tls=True, ca_file=str(info.ca_file),
                          check_hostname=False, connect_timeout=10)
    with StompLink(params) as link:
        link.round_trip()
