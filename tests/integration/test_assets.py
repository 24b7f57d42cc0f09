"""The amqstream:// asset scheme and the received file as an asset."""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from airflow_provider_amqstream.assets.amqstream import convert_asset_to_openlineage, create_asset, sanitize_uri
from airflow_provider_amqstream.engine import send_file, send_files
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.conftest import ROOT
from tests.helpers import make_file, sha256_file
from tests.integration.test_airflow import _load


def test_sanitize_uri_normalises_and_names_what_is_wrong() -> None:
    ok = sanitize_uri(urlsplit("amqstream://user@MQ.Example.com/queue/incoming?x=1#f"))
    assert ok.geturl() == "amqstream://mq.example.com:61613/queue/incoming"
    assert sanitize_uri(urlsplit("amqstream://h:61614/topic/t.1")).geturl() == "amqstream://h:61614/topic/t.1"
    for bad, why in (("amqstream:///queue/x", "broker host"), ("amqstream://h/incoming", "/queue/NAME"),
                     ("amqstream://h/queue/a b", "/queue/NAME"), ("amqstream://h:99999/queue/x", "out of range")):
        with pytest.raises(ValueError, match=why):
            sanitize_uri(urlsplit(bad))


def test_airflow_normalises_amqstream_assets_with_our_handler() -> None:
    from airflow.sdk import Asset

    assert Asset("amqstream://MQ1.example.com/queue/in").uri == "amqstream://mq1.example.com:61613/queue/in"
    made = create_asset(host="mq1.example.com", destination="/queue/in")
    assert made.uri == "amqstream://mq1.example.com:61613/queue/in"
    ds = convert_asset_to_openlineage(made, None)
    assert (ds.namespace, ds.name) == ("amqstream://mq1.example.com:61613", "/queue/in")


@pytest.mark.broker
def test_sensor_emits_an_asset_event_for_the_received_file(airflow_db: Path, params: BrokerParams, uri: str,
                                                           queue_name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    src = make_file(tmp_path / "asset.bin", 20_000)
    send_file(params, src, queue_name, stream_id="asset-1", mode="atomic")
    out = tmp_path / "out"
    dag = _load(ROOT / "tests" / "dags", "amqs_test_file_asset")
    dr = dag.test(run_conf={"queue": queue_name, "out_dir": str(out), "stream_id": "asset-1"})
    assert dr.state == "success"
    want = f"file://{socket.gethostname()}{(out / 'asset.bin').resolve()}"
    with create_session() as session:
        rows = session.execute(select(AssetModel.uri, AssetEvent.extra).join(AssetEvent.asset)
                               .where(AssetModel.uri == want)).all()
    assert len(rows) == 1, rows
    extra = rows[0][1]
    assert extra["stream_id"] == "asset-1" and extra["sha256"] == sha256_file(src) and extra["bytes"] == 20_000


@pytest.mark.broker
def test_a_many_file_receive_emits_an_asset_event_per_file(airflow_db: Path, params: BrokerParams, uri: str,
                                                           queue_name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.models.asset import AssetAliasModel, AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    srcs = [make_file(tmp_path / "landing" / f"batch-{i}.bin", 5_000 + i) for i in range(2)]
    send_files(params, srcs, queue_name, manifest=False)
    out = tmp_path / "out"
    dr = _load(ROOT / "tests" / "dags", "amqs_test_files_asset").test(run_conf={"queue": queue_name,
                                                                            "out_dir": str(out)})
    assert dr.state == "success"
    want = {f"file://{socket.gethostname()}{(out / s.name).resolve()}": s for s in srcs}
    with create_session() as session:
        rows = session.execute(select(AssetModel.uri, AssetEvent.extra).join(AssetEvent.asset)
                               .where(AssetModel.uri.in_(list(want)))).all()
        alias = session.scalar(select(AssetAliasModel).where(AssetAliasModel.name == "amqs_received_batches"))
        aliased = {a.uri for a in alias.assets} if alias is not None else set()
    assert sorted(r[0] for r in rows) == sorted(want), rows
    for got_uri, extra in rows:
        assert extra["sha256"] == sha256_file(want[got_uri]) and extra["bytes"] == want[got_uri].stat().st_size
    assert aliased >= set(want), aliased


@pytest.mark.broker
def test_a_sensor_that_takes_a_pack_reports_every_file_of_it(airflow_db: Path, params: BrokerParams, uri: str,
                                                             queue_name: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-stream sensor receives a pack whole: it returns the first file, and the others
    are in XCom ``also_received`` and have asset events, so none lands unannounced."""
    import json

    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    srcs = [make_file(tmp_path / "landing" / f"small-{i}.csv", 3_000 + i, seed=i) for i in range(3)]
    sent = send_files(params, srcs, queue_name, manifest=False)
    assert sent.totals()["files_sent"] == 3
    out = tmp_path / "out"
    dr = _load(ROOT / "tests" / "dags", "amqs_test_pack_sensor").test(run_conf={"queue": queue_name,
                                                                           "out_dir": str(out)})
    assert dr.state == "success"
    for s in srcs:
        assert sha256_file(out / s.name) == sha256_file(s)
    want = {f"file://{socket.gethostname()}{(out / s.name).resolve()}" for s in srcs}
    with create_session() as session:
        uris = session.scalars(select(AssetModel.uri).join(AssetEvent, AssetEvent.asset_id == AssetModel.id)
                               .where(AssetModel.uri.in_(list(want)))).all()
        also = session.scalar(select(XComModel.value).where(XComModel.dag_id == "amqs_test_pack_sensor",
                                                            XComModel.run_id == dr.run_id,
                                                            XComModel.key == "also_received"))
    assert sorted(uris) == sorted(want)
    also = json.loads(also) if isinstance(also, str) else also
    assert len(also) == 2 and {Path(r["path"]).name for r in also} < {s.name for s in srcs}
