"""Two sites, each with its own embedded broker, joined by a duplex bridge. Senders
use site A's broker, receivers site B's (or both); the brokers forward streams when the link
is up. Every test starts its own pair on loopback."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.broker.network import NetworkConfig, connectors_xml
from airflow_provider_amqstream.engine import ReceiveOptions, SendOptions, receive_stream, receive_streams, send_file
from airflow_provider_amqstream.exceptions import AccessDenied, NetworkError
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.transport.params import BrokerParams
from airflow_provider_amqstream.transport.session import StompLink
from tests.helpers import free_port, make_file, play, sha256_file, started, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.network]
QUEUE = "/queue/net"
CHUNK = 256 * 1024


class Sites:
    """Site A (senders; bridges to B) and site B (receivers), with a user of each that may
    only send to, or receive from, the forwarded queue."""

    def __init__(self, root: Path, *, tls: bool = False) -> None:
        secret = root / "bridge.json"
        self.b_openwire = free_port()
        # TLS: B listens for OpenWire over TLS only; A dials ssl:// and trusts B's certificate.
        self.b = EmbeddedBroker(root / "b", port=free_port(), network=NetworkConfig(
            bridge_secret=secret, queues=(QUEUE,), **({"openwire_tls_port": self.b_openwire} if tls else
                                                      {"openwire_port": self.b_openwire})))
        peer = f"{'ssl' if tls else 'tcp'}://127.0.0.1:{self.b_openwire}"
        self.a = EmbeddedBroker(root / "a", port=free_port(), network=NetworkConfig(
            openwire_port=free_port(), peers=(peer,), bridge_secret=secret, queues=(QUEUE,),
            peer_cas=(self.b.ca_file,) if tls else ()))
        for broker in (self.a, self.b):
            broker.add_user("producer", send=[QUEUE], password="producer-pw")
            broker.add_user("consumer", receive=[QUEUE], password="consumer-pw")

    def start(self) -> None:
        self.b.start()
        self.a.start()
        self.wait_bridged()

    def wait_bridged(self) -> None:
        # The bridge says so in A's log each time it (re)connects.
        def bridged() -> bool:
            try:
                text = self.a.log_file.read_text(errors="replace")
            except OSError:
                return False
            return text.count("has been established") > self.bridges_seen

        self.bridges_seen = getattr(self, "bridges_seen", 0)
        wait_for(bridged, 60, "site A's bridge to site B", interval=0.2)
        self.bridges_seen += 1

    def params(self, broker: EmbeddedBroker, user: str) -> BrokerParams:
        return BrokerParams(hosts=(("127.0.0.1", broker.port),), login=user, password=f"{user}-pw")

    def stop(self) -> None:
        for broker in (self.a, self.b):
            broker.stop()


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    yield from started(Sites(tmp_path / "sites"))


@pytest.fixture
def tls_sites(tmp_path: Path) -> Iterator[Sites]:
    yield from started(Sites(tmp_path / "tls-sites", tls=True))


def _in_thread(fn: Callable[[], Any]) -> Callable[[float], Any]:
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["exc"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()

    def join(timeout: float) -> Any:
        t.join(timeout)
        assert not t.is_alive(), f"still running after {timeout}s"
        if "exc" in box:
            raise box["exc"]
        return box.get("value")

    return join


@pytest.mark.parametrize("mode", ["stream", "atomic", "handshake"])
def test_a_stream_sent_at_site_a_is_received_at_site_b(sites: Sites, tmp_path: Path, mode: str) -> None:
    src = make_file(tmp_path / f"{mode}.bin", 5 * 2**20 + 17, seed=1)
    rx = sites.params(sites.b, "consumer")
    if mode == "handshake":
        # Paced by its receiver: the receiver's hello and acknowledgements cross back to A.
        join = _in_thread(lambda: receive_stream(rx, QUEUE, tmp_path / "out",
                                                 options=ReceiveOptions(wait_timeout=60)))
        sent = send_file(sites.params(sites.a, "producer"), src, QUEUE,
                         SendOptions(mode=mode, chunk_size=CHUNK, request_timeout=60))
        got = join(120)
    else:
        # Stored on A until B has a receiver: store and forward.
        sent = send_file(sites.params(sites.a, "producer"), src, QUEUE, SendOptions(mode=mode, chunk_size=CHUNK))
        got = receive_stream(rx, QUEUE, tmp_path / "out", options=ReceiveOptions(wait_timeout=60))
    assert got is not None and got.stream_id == sent.stream_id
    assert sha256_file(Path(got.path)) == sha256_file(src) == sent.sha256 == got.sha256


def test_the_link_goes_down_mid_stream_and_the_stream_completes(sites: Sites, tmp_path: Path) -> None:
    src = make_file(tmp_path / "big.bin", 48 * 2**20 + 5, seed=2)
    out = tmp_path / "out"
    rx = sites.params(sites.b, "consumer")
    # It waits out the outage on the stream (min_rate 0), rather than giving way after a look.
    receiving = _in_thread(lambda: receive_stream(rx, QUEUE, out, options=ReceiveOptions(
        wait_timeout=60, idle_timeout=300, reconnect_timeout=180, min_rate=0)))
    sending = _in_thread(lambda: send_file(sites.params(sites.a, "producer"), src, QUEUE,
                                           SendOptions(chunk_size=CHUNK, window=4), stream_id="link-1"))
    state = out / ".amqstream" / "link-1.json"
    wait_for(lambda: state.exists(), 120, "site B's receiver to store the first chunks", interval=0.05)
    sites.b.stop()  # the link (site B) goes down mid-stream
    # The sender, at site A, is not held up by the other site being gone.
    sent = sending(180)
    sites.b.start()
    sites.wait_bridged()
    got = receiving(300)
    assert got is not None and got.resumed_from > 0, got
    assert sha256_file(Path(got.path)) == sha256_file(src) == sent.sha256


def test_site_a_killed_before_forwarding_loses_nothing(sites: Sites, tmp_path: Path) -> None:
    files = {i: make_file(tmp_path / f"f{i}.bin", 2**20 + i, seed=10 + i) for i in range(3)}
    tx = sites.params(sites.a, "producer")
    for i, src in files.items():
        send_file(tx, src, QUEUE, SendOptions(mode="atomic" if i % 2 else "stream", chunk_size=CHUNK),
                  stream_id=f"kill-{i}")
    sites.a.kill()  # kill -9: no receiver anywhere yet, so nothing was forwarded
    sites.a.start()
    sites.wait_bridged()
    got = receive_streams(sites.params(sites.b, "consumer"), QUEUE, tmp_path / "out", count=3,
                          options=ReceiveOptions(wait_timeout=60))
    assert sorted(r.stream_id for r in got) == ["kill-0", "kill-1", "kill-2"]
    for r in got:
        assert sha256_file(Path(r.path)) == sha256_file(files[int(r.stream_id[-1])]) == r.sha256


def test_a_watcher_at_site_b_sees_a_stream_waiting_at_site_a_when_told_it_is_networked(sites: Sites,
                                                                                     tmp_path: Path) -> None:
    """Triggers watch with a queue browser, and a bridge forwards nothing to a browser: on a
    connection marked ``network``, each look first draws waiting offers to this broker."""
    from dataclasses import replace

    from airflow_provider_amqstream.engine.receive.browse import OfferBrowser

    src = make_file(tmp_path / "waiting.bin", 200_000, seed=7)
    send_file(sites.params(sites.a, "producer"), src, QUEUE, SendOptions(mode="atomic"), stream_id="waits-at-a")
    at_b = sites.params(sites.b, "consumer")
    plain, networked = OfferBrowser(at_b, QUEUE), OfferBrowser(replace(at_b, network=True), QUEUE)
    try:
        assert plain.look() == [], "a browser alone saw an offer held at the other site"
        seen = wait_for(lambda: networked.look(), 30, "the networked watcher to see the offer waiting at A",
                        interval=0.2)
        assert [o.stream_id for o in seen] == ["waits-at-a"]
        assert [o.stream_id for o in plain.look()] == ["waits-at-a"], "it was drawn to B, not taken"
    finally:
        plain.close()
        networked.close()
    got = receive_stream(at_b, QUEUE, tmp_path / "out", options=ReceiveOptions(wait_timeout=30))
    assert got is not None and sha256_file(Path(got.path)) == sha256_file(src)


def test_receivers_at_both_sites_take_each_stream_once(sites: Sites, tmp_path: Path) -> None:
    files = {f"both-{i}": make_file(tmp_path / f"b{i}.bin", 300_000 + i, seed=20 + i) for i in range(8)}

    def drain(broker: EmbeddedBroker, out: Path) -> Callable[[float], Any]:
        return _in_thread(lambda: receive_streams(sites.params(broker, "consumer"), QUEUE, out,
                                                  options=ReceiveOptions(wait_timeout=15)))

    at_a, at_b = drain(sites.a, tmp_path / "out-a"), drain(sites.b, tmp_path / "out-b")
    tx = sites.params(sites.a, "producer")
    for sid, src in files.items():
        send_file(tx, src, QUEUE, SendOptions(chunk_size=64 * 1024), stream_id=sid)
    got = [*at_a(180), *at_b(180)]
    assert sorted(r.stream_id for r in got) == sorted(files), "a stream was lost or received twice"
    for r in got:
        assert sha256_file(Path(r.path)) == sha256_file(files[r.stream_id]) == r.sha256


def test_network_options_are_checked_and_rendered(tmp_path: Path) -> None:
    with pytest.raises(NetworkError, match="--network-to 'http://x:1'"):
        NetworkConfig(peers=("http://x:1",), bridge_secret=tmp_path / "s.json")
    with pytest.raises(NetworkError, match="--bridge-secret"):
        NetworkConfig(openwire_port=61616)
    with pytest.raises(NetworkError, match="--network-queue '/topic/t'"):
        NetworkConfig(openwire_port=61616, bridge_secret=tmp_path / "s.json", queues=("/topic/t",))
    cfg = NetworkConfig(peers=("tcp://site-b.example:61616",), bridge_secret=tmp_path / "s.json", queues=(QUEUE,))
    xml = connectors_xml(cfg, "amqstream-1", ("amqs-bridge", 'p"w'), lambda v: v.replace('"', "&quot;"))
    assert 'duplex="true"' in xml and 'password="p&quot;w"' in xml and 'conduitSubscriptions="false"' in xml
    for name in ("net", "net.amqs.>", "net.amqs_ctl.>"):
        assert f'<queue physicalName="{name}"/>' in xml


def test_a_plain_jms_consumer_rebuilds_a_stream_over_openwire(sites: Sites, tmp_path: Path) -> None:
    """docs/protocol.md promises a Java team needs nothing of ours: tests/java/StreamConsumer.java,
    compiled here against the ActiveMQ client jars of the Debian package, reads a stream sent
    at site A from site B's OpenWire listener."""
    import shutil
    import subprocess

    from airflow_provider_amqstream.broker.process import activemq_home
    from tests.helpers import ROOT

    javac, java = shutil.which("javac"), shutil.which("java")
    if not javac or not java:
        pytest.skip("no JDK (javac) on this machine")
    lib = activemq_home() / "lib"
    jars = [lib / n for n in ("activemq-client.jar", "geronimo-jms_1.1_spec.jar", "hawtbuf.jar", "slf4j-api.jar",
                              "geronimo-j2ee-management-1.1-spec.jar")]
    classpath = ":".join(str(j) for j in jars if j.exists())
    classes = tmp_path / "classes"
    subprocess.run([javac, "-d", str(classes), "-cp", classpath, str(ROOT / "tests" / "java" / "StreamConsumer.java")],
                   check=True, capture_output=True, timeout=120)
    src = make_file(tmp_path / "for-java.bin", 3 * 2**20 + 7, seed=5)
    sent = send_file(sites.params(sites.a, "producer"), src, QUEUE, SendOptions(chunk_size=CHUNK), stream_id="jms-1")
    out = tmp_path / "java-out.bin"
    # watchTopicAdvisories=false: the JMS client would otherwise subscribe to advisory
    # topics, which only the bridge and the administrator may read.
    url = f"tcp://127.0.0.1:{sites.b_openwire}?jms.watchTopicAdvisories=false"
    # The OpenWire listener authenticates: a wrong password and no user are both refused.
    for user, password in (("consumer", "not-the-password"), ("", "")):
        refused = subprocess.run([java, "-cp", f"{classes}:{classpath}", "StreamConsumer", url, user, password,
                                  QUEUE.removeprefix("/queue/"), str(out)], capture_output=True, text=True,
                                 timeout=180)
        assert refused.returncode != 0 and re.search(r"password is invalid|not authenticated|Security",
                                                     refused.stderr), refused.stderr[-2000:]
        assert not out.exists()
    run = subprocess.run([java, "-cp", f"{classes}:{classpath}", "StreamConsumer", url, "consumer", "consumer-pw",
                          QUEUE.removeprefix("/queue/"), str(out)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["jms-1", str(src.stat().st_size), sent.sha256]
    assert sha256_file(out) == sha256_file(src)
    # A small file of a many-file send travels inside its offer: the same consumer reads it.
    # Unpacked, as docs/java.md tells a sender to Java consumers (it does not read packs).
    from airflow_provider_amqstream.engine import send_files

    small = make_file(tmp_path / "small" / "inline.bin", 40_000, seed=6)
    [one] = send_files(sites.params(sites.a, "producer"), [small], QUEUE,
                       SendOptions(manifest=False, pack=False)).results
    run = subprocess.run([java, "-cp", f"{classes}:{classpath}", "StreamConsumer", url, "consumer", "consumer-pw",
                          QUEUE.removeprefix("/queue/"), str(out)], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [one.stream_id, "40000", one.sha256]
    assert sha256_file(out) == sha256_file(small)


def test_the_cli_joins_two_brokers_and_refuses_bad_network_options(tmp_path: Path) -> None:
    from tests.helpers import cli, cli_json

    secret = tmp_path / "bridge.json"
    bad = cli("broker", "start", "--data-dir", str(tmp_path / "x"), "--port", str(free_port()), "--network-to",
              "http://site-b:1", "--bridge-secret", str(secret))
    _, err = bad.communicate(timeout=60)
    assert bad.returncode != 0 and "--network-to 'http://site-b:1': expected tcp://HOST:PORT" in err, err
    assert "Traceback" not in err
    ow = free_port()
    b = ["broker", "--data-dir", str(tmp_path / "b"), "--port", str(free_port())]
    a = ["broker", "--data-dir", str(tmp_path / "a"), "--port", str(free_port())]
    started = []
    try:
        for args in ([*b, "start", "--openwire-port", str(ow), "--bridge-secret", str(secret)],
                     [*a, "start", "--network-to", f"tcp://127.0.0.1:{ow}", "--bridge-secret", str(secret)]):
            proc = cli(*args)
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            started.append(args[:5])
            if "--openwire-port" in args:
                assert f"OpenWire: tcp://127.0.0.1:{ow}" in out, out
        assert oct(secret.stat().st_mode & 0o777) == "0o600"
        uri_a = cli(*a, "uri").communicate(timeout=60)[0].strip()
        uri_b = cli(*b, "uri").communicate(timeout=60)[0].strip()
        src = make_file(tmp_path / "cli.bin", 2**20 + 3, seed=9)
        # Sent at A before B has a receiver: it waits on A, then crosses when B's receiver asks.
        cli_json(cli("send", str(src), "--to", QUEUE, "--conn", uri_a, "--json", "-q", "--stream-id", "cli-1"))
        [got] = cli_json(cli("receive", "--from", QUEUE, "--out-dir", str(tmp_path / "out"), "--conn", uri_b,
                             "--json", "-q", "--wait", "60"))
        assert got["stream_id"] == "cli-1" and sha256_file(Path(got["path"])) == sha256_file(src)
        # `restart` keeps the network: the data dir remembers it.
        assert cli(*a, "restart").wait(120) == 0
        assert f"tcp://127.0.0.1:{ow}" in (tmp_path / "a" / "conf" / "activemq.xml").read_text()
    finally:
        for args in reversed(started):
            cli(*args[:5], "stop").wait(60)


def test_a_bridge_over_tls_carries_streams_and_refuses_an_untrusted_broker(tls_sites: Sites,
                                                                          tmp_path: Path) -> None:
    """A dials B's OpenWire TLS listener and verifies B's certificate; a handshake stream's
    control messages come back over the same TLS link. A broker that trusts another
    certificate never gets a bridge."""
    sites = tls_sites
    assert "ssl://127.0.0.1" in (sites.a.data_dir / "conf" / "activemq.xml").read_text()
    src = make_file(tmp_path / "tls.bin", 3 * 2**20 + 11, seed=31)
    rx = sites.params(sites.b, "consumer")
    join = _in_thread(lambda: receive_stream(rx, QUEUE, tmp_path / "out", options=ReceiveOptions(wait_timeout=60)))
    sent = send_file(sites.params(sites.a, "producer"), src, QUEUE,
                     SendOptions(mode="handshake", chunk_size=CHUNK, request_timeout=60))
    got = join(120)
    assert got is not None and sha256_file(Path(got.path)) == sha256_file(src) == sent.sha256

    wrong = EmbeddedBroker(tmp_path / "c", port=free_port(), network=NetworkConfig(
        peers=(f"ssl://127.0.0.1:{sites.b_openwire}",), bridge_secret=tmp_path / "tls-sites" / "bridge.json",
        queues=(QUEUE,), peer_cas=(sites.a.ca_file,)))  # trusts A's certificate, not B's
    wrong.start()
    try:
        wait_for(lambda: "PKIX" in wrong.log_file.read_text(errors="replace"), 60,
                 "the untrusting broker to log the certificate it refused", interval=0.2)
        assert "has been established" not in wrong.log_file.read_text(errors="replace")
    finally:
        wrong.stop()
    with pytest.raises(NetworkError, match="--network-ca"):
        NetworkConfig(peers=("ssl://site-b:61617",), bridge_secret=tmp_path / "s.json")


def test_the_sender_killed_at_site_a_reruns_and_site_b_gets_the_file(sites: Sites, tmp_path: Path) -> None:
    """kill -9 of the sending process at site A mid-stream, its re-run resumes from what A's
    broker confirmed, and the receiver waiting at site B gets the file byte-exact."""
    import os
    import signal

    from airflow_provider_amqstream.engine import checkpoint_name
    from tests.helpers import cli, cli_json, read_json

    src = make_file(tmp_path / "rerun.bin", 64 * 2**20 + 9, seed=41)
    out = tmp_path / "out"
    receiving = _in_thread(lambda: receive_stream(sites.params(sites.b, "consumer"), QUEUE, out, options=ReceiveOptions(
        wait_timeout=120, idle_timeout=300, min_rate=0)))  # waits for the sender's re-run on the stream
    tx = sites.params(sites.a, "producer")
    uri = f"amqstream://producer:producer-pw@127.0.0.1:{sites.a.port}"
    state_dir = tmp_path / "send-state"
    args = ["send", str(src), "--to", QUEUE, "--conn", uri, "--stream-id", "rerun-1", "--chunk-size", str(CHUNK),
            "--window", "4", "--json", "-q"]
    first = cli(*args, env={"AMQSTREAM_STATE_DIR": str(state_dir)})
    ckpt = state_dir / checkpoint_name("rerun-1", tx)
    wait_for(lambda: (read_json(ckpt) or {}).get("confirmed_seq", 0) >= 40, 120, "the sender to confirm 40 chunks")
    os.kill(first.pid, signal.SIGKILL)
    first.communicate(timeout=30)
    confirmed = read_json(ckpt)["confirmed_seq"]  # type: ignore[index]
    assert not (out / "rerun.bin").exists()
    [res] = cli_json(cli(*args, env={"AMQSTREAM_STATE_DIR": str(state_dir)}))
    assert res["resumed_from"] == confirmed * CHUNK > 0
    got = receiving(300)
    assert got is not None and got.stream_id == "rerun-1"
    assert sha256_file(Path(got.path)) == sha256_file(src) == res["sha256"] == got.sha256


@pytest.mark.spark
def test_example_three_runs_on_two_bridged_brokers(tmp_path: Path) -> None:
    """`make demo-sites` as users run it: site A's and site B's embedded brokers bridged, the
    producer DAG on A's connection, the consumer DAG (sensor, Spark) on B's, each under
    `airflow dags test` in its own process; the brokers it started are stopped."""
    import os
    import subprocess

    from tests.helpers import ROOT

    env = {**os.environ, "AMQSTREAM_DEMO_DIR": str(tmp_path), "VENV": str(Path(os.sys.prefix))}
    env.pop("AIRFLOW_HOME", None)
    run = subprocess.run(["bash", str(ROOT / "scripts" / "demo_sites.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    sites = tmp_path / "sites"
    [received] = [f for f in (sites / "received" / "site-b").iterdir() if not f.name.startswith(".")]
    # The producer archived what it sent under site A's outbox/sent/<date>/.
    [sent] = [f for f in sites.rglob(received.name) if "sent" in f.parts]
    assert sha256_file(received) == sha256_file(sent)
    assert list((sites / "parquet" / "site-b").glob("*/_amqstream_summary.json"))
    assert "site A's broker bridged to site B's" in run.stdout, run.stdout
    for site in ("broker-a", "broker-b"):  # stopped by the script
        assert not EmbeddedBroker(sites / site).running_pid(), f"{site} left running"


def test_the_bridge_user_may_use_only_the_forwarded_queues(sites: Sites, tmp_path: Path) -> None:
    """docs/security.md: the bridge's credentials open the forwarded queues and their
    streams' queues, and nothing else, on either broker."""
    creds = json.loads((tmp_path / "sites" / "bridge.json").read_text())
    for broker in (sites.a, sites.b):
        bridge = BrokerParams(hosts=(("127.0.0.1", broker.port),), login=creds["user"], password=creds["password"],
                              connect_timeout=10.0, receipt_timeout=15.0)
        with StompLink(bridge) as link:
            link.send_confirmed(QUEUE + ".amqs.bridge-check", b"x", {})  # a forwarded stream's data queue
            with pytest.raises(AccessDenied):
                link.send_confirmed("/queue/elsewhere", b"x", {})
        with StompLink(bridge) as link, pytest.raises(AccessDenied):
            link.subscribe("/queue/elsewhere")
        with StompLink(bridge) as link, pytest.raises(AccessDenied):
            link.send_confirmed("/topic/elsewhere", b"x", {})


def test_chunks_reordered_and_repeated_before_the_bridge_arrive_exact(sites: Sites, tmp_path: Path) -> None:
    """Whatever order and repeats reach the far broker, the stream is rebuilt exactly: chunks
    are placed by number, and repeats are dropped and counted."""
    data = make_file(tmp_path / "mixed.bin", 10 * 65536 - 123, seed=7).read_bytes()
    spec = p.StreamSpec("net-mixed-1", "mixed.bin", len(data), 65536)
    play(sites.params(sites.a, "producer"), QUEUE, spec, data, [3, 1, 2, 2, 5, 4, 4, 7, 6, 8, 10, 9, 1])
    got = receive_stream(sites.params(sites.b, "consumer"), QUEUE, tmp_path / "out",
                         options=ReceiveOptions(wait_timeout=60, idle_timeout=30))
    assert got is not None and Path(got.path or "").read_bytes() == data
    assert got.duplicates == 3
