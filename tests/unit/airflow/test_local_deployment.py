"""What `make airflow` takes from local_deployment.py: the connection it writes, the host name
each component records, and the task log handler that reads served logs on loopback."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from airflow_provider_amqstream import local_deployment as ld
from airflow_provider_amqstream.hooks.connection import parse_uri


def test_the_default_connection_names_the_examples_destinations() -> None:
    uri = ld.with_destinations("amqstream://amqstream:p%40ss%2Fw@127.0.0.1:61613", ["/queue/a.one", "/queue/a.bulk"])
    fields = parse_uri(uri, "amqstream_default")
    assert fields.password == "p@ss/w" and fields.port == 61613
    assert fields.extra == {"destinations": "/queue/a.one,/queue/a.bulk"}


def test_a_celery_worker_records_its_own_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AMQSTREAM_HOSTNAME", raising=False)
    assert ld.hostname() == "127.0.0.1"
    monkeypatch.setenv("AMQSTREAM_HOSTNAME", "worker2")
    assert ld.hostname() == "worker2"


def test_served_logs_are_fetched_from_loopback_whatever_name_a_worker_recorded(tmp_path: Path) -> None:
    config = ld.LOGGING_CONFIG
    assert config["handlers"]["task"]["class"] == "airflow_provider_amqstream.local_deployment.LoopbackTaskHandler"
    handler = ld.LoopbackTaskHandler(base_log_folder=str(tmp_path))
    url, rel = handler._get_log_retrieval_url(SimpleNamespace(hostname="worker1"), "dag_id=d/run_id=r/task_id=t/1.log")
    assert url.startswith("http://127.0.0.1:") and url.endswith("/log/dag_id=d/run_id=r/task_id=t/1.log"), url
    assert rel == "dag_id=d/run_id=r/task_id=t/1.log"
