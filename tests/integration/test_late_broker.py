"""A broker that is not up yet when a send starts gets the same
patience as one lost mid-transfer; a broker that answers and refuses fails at once; what a
lost or slow connection puts in the log says what happened, and when."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, send_file
from airflow_provider_amqstream.exceptions import BrokerUnreachable, StreamError, TransportError
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import ROOT, free_port, make_file, sha256_file, wait_for

pytestmark = pytest.mark.broker


def _send_cli(args: list[str], stderr: Path, state_dir: Path) -> subprocess.Popen[str]:
    # stderr to a file, so the test can watch it while the command runs.
    return subprocess.Popen([sys.executable, "-m", "airflow_provider_amqstream.cli", "send", *args],
                            stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True, cwd=ROOT,
                            env={**os.environ, "AMQSTREAM_STATE_DIR": str(state_dir)})


def test_a_send_started_before_its_broker_waits_for_it_and_completes(private_broker: EmbeddedBroker,
                                                                       tmp_path: Path) -> None:
    uri = private_broker.info().uri
    private_broker.stop()
    src = make_file(tmp_path / "late.bin", 5 * 2**20 + 17, seed=5)
    err = tmp_path / "send.err"
    t0 = time.monotonic()
    sender = _send_cli([str(src), "--to", "/queue/late.broker", "--conn", uri, "--stream-id", "late-1",
                        "--chunk-size", "262144", "--json"], err, tmp_path / "state")
    # The send has met the missing broker and is waiting for it, not failing.
    wait_for(lambda: "(trying again in" in err.read_text(), 30, "the send to wait for the broker", interval=0.1)
    wait_for(lambda: time.monotonic() - t0 > 8, 10, "a wait longer than the connect timeout", interval=0.2)
    assert sender.poll() is None, err.read_text()
    up = time.monotonic()
    private_broker.start()
    out, _ = sender.communicate(timeout=120)
    done = time.monotonic()
    log = err.read_text()
    assert sender.returncode == 0, log
    print(f"\nsend waited {up - t0:.1f}s for the broker; done {done - up:.1f}s after it was started")
    assert "cannot reach any broker at stomp://127.0.0.1:" in log and "Is it running?" in log
    # Said once, not every 0.5-5 s of the wait.
    assert log.count("cannot reach any broker") == 1, log
    assert "did not complete the STOMP handshake" not in log, log
    got = receive_stream(params_from_uri(uri), "/queue/late.broker", tmp_path / "out", stream_id="late-1",
                         options=ReceiveOptions(wait_timeout=30))
    assert got is not None and got.sha256 == sha256_file(src) == sha256_file(tmp_path / "out" / "late.bin")
    assert '"status": "complete"' in out


def test_a_broker_that_never_comes_fails_with_the_reason_after_the_timeout(tmp_path: Path) -> None:
    src = make_file(tmp_path / "f.bin", 1000)
    params = params_from_uri(f"amqstream://u:p@127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(StreamError) as err:
        send_file(params, src, "/queue/never", SendOptions(reconnect_timeout=3.0))
    took = time.monotonic() - t0
    msg = str(err.value)
    assert 2.0 <= took < 10, took
    assert "gave up after 3s of trying to reach stomp://127.0.0.1:" in msg, msg
    assert "cannot reach any broker at" in msg and "Is it running?" in msg and "Connection refused" in msg, msg
    assert "p@" not in msg  # never the password


def test_a_wrong_password_fails_at_once_despite_the_patience(broker: EmbeddedBroker, tmp_path: Path) -> None:
    src = make_file(tmp_path / "f.bin", 1000)
    params = dataclasses.replace(params_from_uri(broker.info().uri), password="not-the-password")
    t0 = time.monotonic()
    with pytest.raises(TransportError) as err:
        send_file(params, src, "/queue/wrong.password", SendOptions(reconnect_timeout=120.0))
    assert time.monotonic() - t0 < 10
    assert not isinstance(err.value, BrokerUnreachable)
    assert "refused login for user amqstream" in str(err.value) and "not-the-password" not in str(err.value)


def test_a_port_that_never_speaks_stomp_fails_after_the_connect_timeout() -> None:
    # Accepts TCP and says nothing: stomp.py alone waited for its CONNECTED frame for ever.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        params = BrokerParams(hosts=(("127.0.0.1", srv.getsockname()[1]),), login="u", password="p",
                              connect_timeout=2.0)
        t0 = time.monotonic()
        with pytest.raises(TransportError) as err:
            StompLink(params).open()
        took = time.monotonic() - t0
    assert 1.9 <= took < 6, took
    assert not isinstance(err.value, BrokerUnreachable)
    assert "did not complete the STOMP handshake within 2s" in str(err.value), err.value


def test_an_unreachable_broker_is_said_at_once_without_a_probe() -> None:
    params = params_from_uri(f"amqstream://u:p@127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(BrokerUnreachable, match=r"Connection refused"):
        StompLink(params).open()
    # No wait for a refusal that cannot come, no second connect to find out why.
    assert time.monotonic() - t0 < 0.5


def test_stomp_py_error_sending_frame_is_left_to_our_own_report(caplog: pytest.LogCaptureFixture) -> None:
    import airflow_provider_amqstream.transport.connection  # noqa: F401 - installs the filter

    with caplog.at_level(logging.DEBUG, logger="stomp.py"):
        try:
            raise OSError(9, "Bad file descriptor")
        except OSError:
            logging.getLogger("stomp.py").error("error sending frame", exc_info=True)
        logging.getLogger("stomp.py").error("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_a_broker_lost_mid_send_resumes_and_says_where(private_broker: EmbeddedBroker, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    uri = private_broker.info().uri
    params = dataclasses.replace(params_from_uri(uri), connect_timeout=10.0, receipt_timeout=30.0)
    src = make_file(tmp_path / "big.bin", 96 * 2**20 + 5, seed=6)
    confirmed: list[int] = []
    result: list[object] = []

    def run() -> None:
        result.append(send_file(params, src, "/queue/lost.mid.send",
                                SendOptions(chunk_size=256 * 1024, window=4, reconnect_timeout=60,
                                            progress=lambda done, _: confirmed.append(done)),
                                stream_id="lost-1"))

    with caplog.at_level(logging.INFO):
        sender = threading.Thread(target=run)
        sender.start()
        wait_for(lambda: confirmed and confirmed[-1] >= 16 * 2**20, 60, "16 MiB confirmed", interval=0.01)
        private_broker.kill()
        private_broker.start()
        sender.join(120)
    assert not sender.is_alive() and result, "the send did not finish"
    res = result[0]
    at_kill = max(c for c in confirmed if c <= res.resumed_from) if confirmed else 0
    assert res.resumed_from >= 16 * 2**20 and res.resumed_from >= at_kill, res
    assert res.retries >= 1 and res.bytes_transferred >= src.stat().st_size - res.resumed_from, res
    assert res.to_json()["resumed_from"] == res.resumed_from
    assert not [r for r in caplog.records if r.getMessage() == "error sending frame"]
    got = receive_stream(params, "/queue/lost.mid.send", tmp_path / "out", stream_id="lost-1",
                         options=ReceiveOptions(wait_timeout=30))
    assert got is not None and got.sha256 == sha256_file(src)
