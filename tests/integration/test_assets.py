"""The amqstream:// asset scheme and the received file as an asset."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from airflow_provider_amqstream.assets.amqstream import convert_asset_to_openlineage, create_asset, sanitize_uri
from airflow_provider_amqstream.engine import SendOptions, send_file, send_files
from airflow_provider_amqstream.transport.params import BrokerParams
from tests.conftest import ROOT
from tests.helpers import make_file, sha256_file
from tests.integration.test_airflow import _load


def test_sanitize_uri_normalises_and_names_what_is_wrong() -> None:
    # No port: a connection id, kept as written (Airflow's connection ids are case-sensitive).
    ok = sanitize_uri(urlsplit("amqstream://user@amqstream_Prod/queue/incoming?x=1#f"))
    assert ok.geturl() == "amqstream://amqstream_Prod/queue/incoming"
    # A port: a broker's address, its host lower-cased.
    assert sanitize_uri(urlsplit("amqstream://H:61614/topic/t.1")).geturl() == "amqstream://h:61614/topic/t.1"
    for bad, why in (("amqstream:///queue/x", "connection id"), ("amqstream://h/incoming", "/queue/NAME"),
                     ("amqstream://h/queue/a b", "/queue/NAME"), ("amqstream://h:99999/queue/x", "out of range")):
        with pytest.raises(ValueError, match=why):
            sanitize_uri(urlsplit(bad))


def test_airflow_normalises_amqstream_assets_with_our_handler() -> None:
    from airflow.sdk import Asset

    assert Asset("amqstream://amqstream_default/queue/in").uri == "amqstream://amqstream_default/queue/in"
    assert create_asset(conn_id="amqstream_default", destination="/queue/in").uri == \
        "amqstream://amqstream_default/queue/in"
    made = create_asset(host="mq1.example.com", destination="/queue/in")
    assert made.uri == "amqstream://mq1.example.com:61613/queue/in"
    ds = convert_asset_to_openlineage(made, None)
    assert (ds.namespace, ds.name) == ("amqstream://mq1.example.com:61613", "/queue/in")


def _events(*uris: str) -> list[tuple[str, dict[str, Any], str | None, str | None]]:
    """(asset URI, extra, source DAG, source task) of every event of these assets, oldest first."""
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    with create_session() as session:
        rows = session.execute(select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_dag_id,
                                      AssetEvent.source_task_id).join(AssetEvent.asset)
                               .where(AssetModel.uri.in_(list(uris))).order_by(AssetEvent.id)).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _landing(out: Path) -> str:
    return f"file://{out.resolve()}"


@pytest.mark.broker
def test_sensor_emits_an_asset_event_for_the_received_file(airflow_db: Path, params: BrokerParams, uri: str,
                                                           queue_name: str, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    src = make_file(tmp_path / "asset.bin", 20_000)
    send_file(params, src, queue_name, SendOptions(mode="atomic"), stream_id="asset-1")
    out = tmp_path / "out"
    dag = _load(ROOT / "tests" / "dags", "amqs_test_file_asset")
    dr = dag.test(run_conf={"queue": queue_name, "out_dir": str(out), "stream_id": "asset-1"})
    assert dr.state == "success"
    # The landing directory, with no host part; never one asset per file.
    [(_, extra, _, task)] = _events(_landing(out), f"file://{socket.gethostname()}{(out / 'asset.bin').resolve()}")
    assert task == "receive" and extra["files"] == 1 and extra["path"] == str((out / "asset.bin").resolve())
    assert extra["stream_id"] == "asset-1" and extra["sha256"] == sha256_file(src) and extra["bytes"] == 20_000


@pytest.mark.broker
def test_a_many_file_receive_emits_one_event_for_its_directory(airflow_db: Path, params: BrokerParams, uri: str,
                                                               queue_name: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.models.asset import AssetAliasModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    srcs = [make_file(tmp_path / "landing" / f"batch-{i}.bin", 5_000 + i) for i in range(2)]
    send_files(params, srcs, queue_name, SendOptions(manifest=False))
    out = tmp_path / "out"
    dr = _load(ROOT / "tests" / "dags", "amqs_test_files_asset").test(run_conf={"queue": queue_name,
                                                                            "out_dir": str(out)})
    assert dr.state == "success"
    [(_, extra, _, _)] = _events(_landing(out), *(_landing(out / s.name) for s in srcs))
    assert extra["files"] == 2 and extra["bytes"] == sum(s.stat().st_size for s in srcs)
    assert sorted(extra["stream_ids"]) == sorted(r["stream_id"] for r in dr.get_task_instance("receive_all")
                                                 .xcom_pull(task_ids="receive_all")["files"])
    with create_session() as session:
        alias = session.scalar(select(AssetAliasModel).where(AssetAliasModel.name == "amqs_received_batches"))
        aliased = {a.uri for a in alias.assets} if alias is not None else set()
    assert aliased == {_landing(out)}, aliased


@pytest.mark.broker
def test_a_sensor_that_takes_a_pack_reports_every_file_of_it(airflow_db: Path, params: BrokerParams, uri: str,
                                                             queue_name: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-stream sensor receives a pack whole: it returns the first file, and the others
    are in XCom ``also_received`` and counted in its asset event, so none lands unannounced."""
    import json

    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    srcs = [make_file(tmp_path / "landing" / f"small-{i}.csv", 3_000 + i, seed=i) for i in range(3)]
    sent = send_files(params, srcs, queue_name, SendOptions(manifest=False))
    assert sent.totals()["files_sent"] == 3
    out = tmp_path / "out"
    dr = _load(ROOT / "tests" / "dags", "amqs_test_pack_sensor").test(run_conf={"queue": queue_name,
                                                                           "out_dir": str(out)})
    assert dr.state == "success"
    for s in srcs:
        assert sha256_file(out / s.name) == sha256_file(s)
    [(_, extra, _, _)] = _events(_landing(out))
    assert extra["files"] == 3 and extra["bytes"] == sum(s.stat().st_size for s in srcs)
    with create_session() as session:
        also = session.scalar(select(XComModel.value).where(XComModel.dag_id == "amqs_test_pack_sensor",
                                                            XComModel.run_id == dr.run_id,
                                                            XComModel.key == "also_received"))
    also = json.loads(also) if isinstance(also, str) else also
    assert len(also) == 2 and {Path(r["path"]).name for r in also} < {s.name for s in srcs}


@pytest.mark.broker
def test_send_produces_the_destination_and_a_repeat_produces_nothing(airflow_db: Path, params: BrokerParams,
                                                                     uri: str, queue_name: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A send emits ``amqstream://<its connection id>/queue/NAME``, its receive the
    landing directory; the same stream sent again is received as a repeat and emits nothing,
    and the destination's asset and lineage dataset name the same thing (the broker the
    connection names)."""
    from airflow_provider_amqstream.operators.lineage import destination_dataset, file_dataset

    monkeypatch.setenv("AIRFLOW_CONN_AMQSTREAM_DEFAULT", uri)
    src = make_file(tmp_path / "sales.csv", 30_000)
    out = tmp_path / "out"
    dest = f"amqstream://amqstream_default{queue_name}"
    conf = {"queue": queue_name, "path": str(src), "out_dir": str(out), "stream_id": "dest-1"}
    dr = _load(ROOT / "tests" / "dags", "amqs_test_send_receive_assets").test(run_conf=conf)
    assert dr.state == "success"
    assert [(u, e["stream_id"], e["sha256"], t) for u, e, _, t in _events(dest, _landing(out))] == [
        (dest, "dest-1", sha256_file(src), "send"), (_landing(out), "dest-1", sha256_file(src), "receive")]

    # Re-run: the receive finds the stream in out_dir already; a repeat of it on the queue
    # (a sender that started over) is acknowledged and written nowhere. No landing event.
    dr = _load(ROOT / "tests" / "dags", "amqs_test_send_receive_assets").test(run_conf=conf)
    assert dr.state == "success"
    send_file(params, src, queue_name, SendOptions(restart=True), stream_id="dest-1")
    dr = _load(ROOT / "tests" / "dags", "amqs_test_receive_once").test(run_conf={"queue": queue_name,
                                                                            "out_dir": str(out)})
    assert dr.state == "success"
    assert [f["status"] for f in dr.get_task_instance("receive").xcom_pull(task_ids="receive")["files"]] == [
        "duplicate"]
    assert [u for u, *_ in _events(dest, _landing(out))] == [dest, _landing(out), dest]  # the re-run's send only

    # The asset and the lineage dataset are one name: Airflow's conversion of each asset.
    for asset_uri, dataset in ((dest, destination_dataset(params, queue_name, role="input")),
                               (_landing(out), file_dataset(str(out), role="output"))):
        ol = _to_openlineage(asset_uri)
        assert (ol.namespace, ol.name) == (dataset.namespace, dataset.name), asset_uri


def _to_openlineage(uri: str) -> Any:
    """The OpenLineage dataset Airflow makes of an asset URI (its scheme's converter)."""
    from airflow.providers.common.io.assets.file import convert_asset_to_openlineage as file_to_ol
    from airflow.sdk import Asset

    asset = Asset(uri=uri)
    return file_to_ol(asset, None) if uri.startswith("file:") else convert_asset_to_openlineage(asset, None)
