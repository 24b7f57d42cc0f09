"""The streams page's app and its hook without a deployment: the routes, who may do
what, and the hook reading its connection. The API server's own authentication is replaced
by a stand-in here; tests/system/test_streams_ui.py runs the real one in a real deployment."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from airflow_provider_amqstream.engine import ReceiveOptions, receive_stream
from airflow_provider_amqstream.exceptions import ConnectionNotFound, StreamQuarantined
from airflow_provider_amqstream.hooks.streams import AmqStreamAdminHook
from airflow_provider_amqstream.plugins import streams
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.transport.link import open_link
from airflow_provider_amqstream.transport.memory import MemoryBroker
from tests.helpers import send_stream

Q = "/queue/landing"


def test_the_hook_reads_its_connection_and_touches_no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_STREAMS_T", json.dumps({
        "conn_type": "amqstream", "host": "mq.invalid", "port": 61613, "login": "ops", "password": "secret-1",
        "extra": {"destinations": "/queue/a, b", "out_dirs": ["/data/in"], "quarantine": "/queue/dead"}}))
    hook = AmqStreamAdminHook("streams_t", connect_timeout=5)
    assert hook.destinations() == ["/queue/a", "/queue/b"] and hook.out_dirs() == ["/data/in"]
    assert hook.quarantine() == "/queue/dead"
    params = hook.broker_params()
    assert (params.connect_timeout, params.receipt_timeout, params.login) == (5, 60.0, "ops")
    with pytest.raises(ConnectionNotFound, match="no connection 'nowhere'"):
        AmqStreamAdminHook("nowhere").broker_params()


@pytest.fixture
def client(broker: MemoryBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """The app, on the in-memory broker, for a user who may read every connection and edit
    ``ops`` only."""

    class Hook(AmqStreamAdminHook):
        def broker_params(self) -> Any:
            return broker.params("admin")

        def destinations(self) -> list[str]:
            return [Q]

        def out_dirs(self) -> list[str]:
            return [str(tmp_path / "in")]

        def receivers(self) -> list[str]:
            return ["spark"]  # the user its receivers connect as

        def quarantine(self) -> str | None:
            return None

    async def user(request: Any) -> str:
        return "someone"

    monkeypatch.setattr(streams, "_hook", lambda conn_id: Hook(conn_id))
    monkeypatch.setattr(streams, "_user", user)
    monkeypatch.setattr(streams, "_may", lambda u, conn_id, method: method == "GET" or conn_id == "ops")
    monkeypatch.setattr(streams, "connection_ids", lambda: ["ops", "other"])
    with TestClient(streams.app) as c:
        yield c


def _quarantined(broker: MemoryBroker, tmp_path: Path) -> bytes:
    data = hashlib.sha256(b"x").digest() * 100
    spec = p.StreamSpec("big", "big.bin", len(data), 1000)
    with open_link(broker.params("site-a")) as link:
        send_stream(link.send, Q, spec, data, range(1, spec.chunks + 1))
    with pytest.raises(StreamQuarantined):
        receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(wait_timeout=0.3,
                                                                                         max_bytes=10))
    return data


def test_the_page_and_its_listing(client: TestClient, broker: MemoryBroker, tmp_path: Path) -> None:
    _quarantined(broker, tmp_path)
    page = client.get("/streams")
    assert page.status_code == 200 and "ActiveMQ streams" in page.text and "textContent" in page.text
    assert client.get("/streams/api/connections").json() == [
        {"conn_id": "ops", "can_edit": True, "destinations": [Q], "out_dirs": [str(tmp_path / "in")]},
        {"conn_id": "other", "can_edit": False, "destinations": [Q], "out_dirs": [str(tmp_path / "in")]}]
    view = client.get("/streams/api/inventory", params={"conn_id": "ops", "destination": Q}).json()
    assert [(q["stream_id"], q["cause"], q["redrivable"]) for q in view["quarantined"]] == [("big", "max_bytes", True)]
    rep = client.get("/streams/api/show", params={"conn_id": "ops", "destination": Q, "stream_id": "big"}).json()
    assert rep["quarantined"][0]["by_user"] == "spark"
    bad = client.get("/streams/api/inventory", params={"conn_id": "ops", "destination": "/topic/x"})
    assert bad.status_code == 400 and "queues only" in bad.json()["detail"]


def test_actions_need_edit_rights_and_json(client: TestClient, broker: MemoryBroker, tmp_path: Path) -> None:
    data = _quarantined(broker, tmp_path)
    body = {"conn_id": "other", "destination": Q, "stream_id": "big"}
    refused = client.post("/streams/api/redrive", json=body)
    assert refused.status_code == 403 and "edit connection 'other'" in refused.json()["detail"]
    form = client.post("/streams/api/redrive", content=json.dumps({**body, "conn_id": "ops"}),
                       headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415
    assert client.post("/streams/api/redrive", json={"conn_id": "ops"}).status_code == 422
    done = client.post("/streams/api/redrive", json={**body, "conn_id": "ops"})
    assert done.status_code == 200 and done.json()["redriven_by"] == "admin", done.text
    got = receive_stream(broker.params("spark"), Q, tmp_path / "in", options=ReceiveOptions(wait_timeout=1))
    assert got is not None and Path(got.path).read_bytes() == data
    again = client.post("/streams/api/redrive", json={**body, "conn_id": "ops"})
    assert again.status_code == 409 and "no quarantine copy" in again.json()["detail"]
    gone = client.post("/streams/api/discard", json={**body, "conn_id": "ops", "stream_id": "nothing"})
    assert gone.status_code == 200 and gone.json()["messages"] == 0
