"""The page of the streams in a real Airflow deployment (``scripts/airflow.sh``, what
``make airflow`` runs), driven through its API and in headless Chromium.

The test broker holds a destination with a stream in every state (``build_scene``); the
deployment knows it as connection ``streams_ui`` (``destinations`` and ``out_dirs`` extras).
The page's test acts on a scene of its own (connection ``streams_page``), plus one stream
being received while the page is looked at, so what it redrives and discards never reaches
the API's test, whatever order they run in. The page lists every stream with
a progress bar for the one in progress, an administrator redrives the stream quarantined
over ``max_bytes`` from the page (it then arrives byte-exact) and discards the corrupt one;
a user without the right to edit connections may neither look nor act; and a broker that
never answers costs the page an error, not the API server its responsiveness. The page's
screenshot is kept in ``build/ui-screenshots`` (never in the checkout's docs: a test run
leaves the tree as it found it; ``docs/ui-streams.png`` is copied from there by hand).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from airflow_provider_amqstream.engine import ReceiveOptions, TransferResult, receive_stream
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination, dead_letter_queue
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.deployment import Deployment
from tests.helpers import ROOT, RawSender, browse
from tests.integration.test_streams_admin import Scene, build_scene

pytestmark = [pytest.mark.deployment, pytest.mark.broker]

LIVE_CHUNK = 8192
LIVE_CHUNKS = 240
# Where screenshots are kept after the run, as tests/system/test_deployment.py keeps its own.
KEEP = os.environ.get("AMQSTREAM_UI_SCREENSHOTS") or str(ROOT / "build" / "ui-screenshots")


def _page_queue() -> str:
    return f"/queue/t.streams_page.{os.getpid()}"


def _chromium() -> str | None:
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium") or "", shutil.which("chromium-browser") or ""):
        if path and os.access(path, os.X_OK):
            return path
    return None


class SilentBroker:
    """A port that accepts TCP connections and never says a word (a hung broker)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(scope="module")
def silent() -> Iterator[SilentBroker]:
    s = SilentBroker()
    yield s
    s.close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, broker: Any, silent: SilentBroker) -> Iterator[
        tuple[Deployment, Scene, BrokerParams]]:
    info = broker.info()
    params = BrokerParams(hosts=((info.host, info.port),), login=info.user, password=info.password,
                          connect_timeout=10.0, receipt_timeout=30.0)
    home = tmp_path_factory.mktemp("streams-ui")
    queue = f"/queue/t.streams_ui.{os.getpid()}"
    out = home / "in"
    dags = home / "dags"
    dags.mkdir()
    env = {
        "AIRFLOW_CONN_STREAMS_UI": json.dumps({
            "conn_type": "amqstream", "host": info.host, "port": info.port, "login": info.user,
            "password": info.password, "extra": {"destinations": queue, "out_dirs": str(out)}}),
        "AIRFLOW_CONN_STREAMS_PAGE": json.dumps({
            "conn_type": "amqstream", "host": info.host, "port": info.port, "login": info.user,
            "password": info.password, "extra": {"destinations": _page_queue(), "out_dirs": str(home / "in-page")}}),
        "AIRFLOW_CONN_STREAMS_SLOW": json.dumps({
            "conn_type": "amqstream", "host": "127.0.0.1", "port": silent.port, "login": "x", "password": "y",
            "extra": {"destinations": "/queue/slow"}}),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,viewer:viewer",
    }
    d = Deployment(home, dags, env)
    try:
        # The deployment starts while the scene is set.
        scene = build_scene(params, queue, out)
        d.wait_ready()
        yield d, scene, params
    finally:
        d.stop()
        d.wait_all_exited(30, "SIGTERM")


@pytest.fixture
def page_scene(setup: tuple[Deployment, Scene, BrokerParams]) -> Scene:
    """The page test's own destination with a stream in every state, set when it runs."""
    d, _, params = setup
    return build_scene(params, _page_queue(), d.home / "in-page")


def _token(d: Deployment, user: str) -> str:
    passwords = json.loads((d.airflow_home / "simple_auth_manager_passwords.json.generated").read_text())
    r = httpx.post(f"{d.base}/auth/token", json={"username": user, "password": passwords[user]}, timeout=30)
    assert r.status_code in (200, 201), r.text
    return r.json()["access_token"]


def _api(d: Deployment, method: str, path: str, token: str | None, *, headers: dict[str, str] | None = None,
         **kw: Any) -> httpx.Response:
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, f"{d.base}/amqstream/streams/api/{path}", headers={**auth, **(headers or {})},
                         timeout=60, **kw)


def test_the_api_answers_only_who_may_read_or_edit_the_connection(setup: tuple[Deployment, Scene, BrokerParams]
                                                                   ) -> None:
    d, scene, _ = setup
    q = {"conn_id": "streams_ui", "destination": scene.queue}
    assert _api(d, "GET", "inventory", None, params=q).status_code == 401
    viewer = _token(d, "viewer")
    r = _api(d, "GET", "inventory", viewer, params=q)
    assert r.status_code == 403 and "streams_ui" in r.json()["detail"], r.text
    body = {"conn_id": "streams_ui", "destination": scene.queue, "stream_id": "big-1"}
    assert _api(d, "POST", "redrive", viewer, json=body).status_code == 403
    assert _api(d, "GET", "connections", viewer).json() == []
    admin = _token(d, "admin")
    # An action must come as JSON: a cross-site form cannot send that.
    r = _api(d, "POST", "discard", admin, content=json.dumps(body), headers={"Content-Type": "text/plain"})
    assert r.status_code == 415, r.text
    conns = {c["conn_id"]: c for c in _api(d, "GET", "connections", admin).json()}
    assert conns["streams_ui"]["destinations"] == [scene.queue] and conns["streams_ui"]["can_edit"]
    view = _api(d, "GET", "inventory", admin, params=q).json()
    assert {o["stream_id"] for o in view["offered"]} == {"wait-1"}
    assert {x["stream_id"] for x in view["quarantined"]} == {"big-1", "bad-1", "cut-1"}
    assert {x["stream_id"] for x in view["parked"]} == {"parked-1"}
    assert view["batches"][0]["batch_id"] == "batch-7"


def test_a_broker_that_never_answers_does_not_hold_up_the_api_server(setup: tuple[Deployment, Scene, BrokerParams]
                                                                     ) -> None:
    d, _, _ = setup
    admin = _token(d, "admin")
    answer: dict[str, Any] = {}

    def look() -> None:
        t0 = time.monotonic()
        answer["r"] = _api(d, "GET", "inventory", admin,
                           params={"conn_id": "streams_slow", "destination": "/queue/slow"})
        answer["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=look)
    t.start()
    slowest = 0.0
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{d.base}/api/v2/monitor/health", timeout=10).status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        t.join(0.2)
    assert slowest < 2.0, f"the API server took {slowest:.1f}s to answer while a broker hung"
    r = answer["r"]
    assert r.status_code in (502, 504), r.text
    assert "stomp://127.0.0.1" in r.json()["detail"] or "no answer within" in r.json()["detail"], r.text
    assert answer["seconds"] < 30


def _live_sender(params: BrokerParams, queue: str, data: bytes, stop: threading.Event,
                 looked: threading.Event) -> None:
    """A slow sender, one chunk every 0.25 s as on a slow line (a minute for all 240), until
    the page has been looked at (``looked``); the rest then goes at full speed."""
    spec = p.StreamSpec("live-1", "live.bin", len(data), LIVE_CHUNK)
    dest = Destination.parse(queue)
    raw = RawSender(params)
    raw.send(str(dest), b"", p.offer_headers(spec, dest, sender=params.user))
    for seq in range(1, spec.chunks + 1):
        if stop.is_set():  # the test failed: no need to go on
            break
        looked.wait(0.25)  # pacing, not synchronisation: the stream must be in progress while looked at
        off, n = spec.chunk_span(seq)
        raw.send(dest.data_queue("live-1", params.user), data[off:off + n],
                 p.data_message(spec, seq, data[off:off + n])[0])
    raw.send(dest.data_queue("live-1", params.user), b"", p.end_headers(spec, hashlib.sha256(data).hexdigest()))
    raw.close()


def test_the_page_lists_the_streams_and_redrives_and_discards(setup: tuple[Deployment, Scene, BrokerParams],
                                                              page_scene: Scene, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[dev])")
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium: apt-get install chromium (scripts/setup.sh does)")
    d, _, params = setup
    scene = page_scene
    live = os.urandom(LIVE_CHUNK * LIVE_CHUNKS)
    stop, looked = threading.Event(), threading.Event()
    sender = threading.Thread(target=_live_sender, args=(params, scene.queue, live, stop, looked), daemon=True)
    got: dict[str, TransferResult | None] = {}
    receiver = threading.Thread(target=lambda: got.update(r=receive_stream(
        params, scene.queue, scene.out, stream_id="live-1", options=ReceiveOptions(wait_timeout=60, idle_timeout=60,
                                                                                  window=4))), daemon=True)
    sender.start()
    receiver.start()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        pg = browser.new_context(viewport={"width": 1500, "height": 1150}).new_page()
        pg.set_default_timeout(60_000)
        expect = sync_api.expect
        expect.set_options(timeout=60_000)
        try:
            pg.goto(d.base + "/")
            pg.get_by_label("Username").fill("admin")
            pg.get_by_label("Password").fill(d.password)
            pg.get_by_role("button", name="Sign in").click()
            pg.wait_for_url(d.base + "/")
            # Through the UI's own menu entry: the page in its frame.
            pg.goto(d.base + "/plugin/amqstream-streams")
            frame = pg.frame_locator("iframe")
            # Four amqstream connections (the deployment's default, the API test's, this one, a
            # hung one): choose.
            frame.get_by_test_id("conn").select_option("streams_page")
            expect(frame.get_by_test_id("dest")).to_have_value(scene.queue)
            expect(frame.get_by_test_id("offered")).to_contain_text("wait-1")
            expect(frame.get_by_test_id("parked")).to_contain_text("parked-1")
            for sid in ("big-1", "bad-1", "cut-1"):
                expect(frame.get_by_test_id("quarantined")).to_contain_text(sid)
            expect(frame.get_by_test_id("batches")).to_contain_text("1 of 2 files in")
            # The stream being received: a bar that grows, and its rate once the page looked twice.
            row = frame.locator("[data-testid=progress] tr[data-stream=live-1]")
            expect(row).to_contain_text("receiving now")
            expect(frame.get_by_test_id("rate-live-1")).to_have_text(re.compile(r"^[0-9.]+ (B|KiB|MiB)/s$"))
            expect(frame.locator("[data-testid=offered] tr[data-stream=live-1]")).to_contain_text(
                "being received now")
            width = row.locator(".progress > div").evaluate("e => parseFloat(e.style.width)")
            assert 0 < width < 100, width
            expect(frame.get_by_test_id("redrive-bad-1")).to_have_count(0)  # corrupt: no redrive offered
            shot = tmp_path / "ui-streams.png"
            pg.screenshot(path=str(shot))
            Path(KEEP).mkdir(parents=True, exist_ok=True)
            (Path(KEEP) / "ui-streams.png").write_bytes(shot.read_bytes())
            looked.set()

            # Redrive from the page: the stream quarantined over max_bytes goes back.
            frame.get_by_test_id("redrive-big-1").click()
            expect(frame.get_by_test_id("message")).to_contain_text("Redrove big-1")
            expect(frame.get_by_test_id("offered")).to_contain_text("big-1")
            expect(frame.get_by_test_id("quarantined")).not_to_contain_text("big-1")
            # Discard, which asks for a second click.
            frame.get_by_test_id("discard-bad-1").click()
            expect(frame.get_by_test_id("discard-bad-1")).to_have_text("Confirm discard")
            frame.get_by_test_id("discard-bad-1").click()
            expect(frame.get_by_test_id("message")).to_contain_text("Discarded bad-1")
            expect(frame.get_by_test_id("quarantined")).not_to_contain_text("bad-1")
        except BaseException:
            stop.set()  # the sender need not go on
            looked.set()
            raise
        finally:
            pg.screenshot(path=str(tmp_path / "last.png"))
            browser.close()
    sender.join(90)
    receiver.join(90)
    assert got.get("r") is not None and Path(got["r"].path).read_bytes() == live
    # The redriven stream arrives byte for byte with a higher limit, as the redriving user's.
    res = receive_stream(params, scene.queue, tmp_path / "again", stream_id="big-1",
                         options=ReceiveOptions(wait_timeout=30, max_bytes=1 << 20))
    assert res is not None and Path(res.path).read_bytes() == scene.data["big-1"] and res.sender == params.login
    dest = Destination.parse(scene.queue)
    assert not [f for f in browse(params, f"/queue/DLQ.{dest.name}") if f.headers.get(hdr.H_STREAM) == "bad-1"]
    assert not browse(params, dead_letter_queue(dest.data_queue("bad-1", params.user)))
