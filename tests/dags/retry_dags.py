"""DAGs used by tests/integration/test_airflow.py: each ends with a probe that records what the
stream task returned, so a test can assert on XCom after dag.test()."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

from airflow.sdk import DAG, task

from airflow_provider_amqstream.operators.receive import ReceiveStreamsOperator
from airflow_provider_amqstream.operators.stream import SendStreamOperator
from airflow_provider_amqstream.sensors.stream import StreamCompleteSensor

PARAMS = {"path": "", "queue": "", "out_dir": "", "stream_id": "", "record": ""}


@task
def probe(result: dict, params: dict | None = None) -> None:
    Path(params["record"]).write_text(json.dumps(result))


with DAG("amqs_test_send_retry", schedule=None, params=PARAMS,
         default_args={"retries": 3, "retry_delay": timedelta(seconds=0)}) as send_retry:
    s = SendStreamOperator(task_id="send", path="{{ params.path }}", destination="{{ params.queue }}",
                           stream_id="{{ params.stream_id }}", chunk_size=256 * 1024, window=4,
                           reconnect_timeout=4)
    probe(s.output)

with DAG("amqs_test_recv_retry", schedule=None, params=PARAMS,
         default_args={"retries": 3, "retry_delay": timedelta(seconds=0)}) as recv_retry:
    r = StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                             stream_id="{{ params.stream_id }}", idle_timeout=4, window=4, poke_interval=1,
                             timeout=300)
    probe(r.output)

with DAG("amqs_test_deferrable", schedule=None, params=PARAMS) as deferrable:
    d = StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                             deferrable=True, poke_interval=1, timeout=300)
    probe(d.output)


@task
def failures_probe(params: dict | None = None, ti: object = None) -> None:
    found = ti.xcom_pull(task_ids="receive", key="failed_streams")  # type: ignore[attr-defined]
    Path(params["record"] + ".failures").write_text(json.dumps(found))


with DAG("amqs_test_sensor_policy", schedule=None, params=PARAMS) as sensor_policy:
    w = StreamCompleteSensor(task_id="receive", source="{{ params.queue }}", out_dir="{{ params.out_dir }}",
                             idle_timeout=4, poke_interval=1, timeout=120, quarantine="{{ params.queue }}.bad")
    probe(w.output)
    w >> failures_probe()

with DAG("amqs_test_send_many", schedule=None, params=PARAMS) as send_many:
    # A glob pattern in path: every match in one task, over one connection.
    m = SendStreamOperator(task_id="send", path="{{ params.path }}", destination="{{ params.queue }}")
    probe(m.output)


class _SensorLosesItsFirstSuccess(StreamCompleteSensor):
    """Its first try publishes a stream and then dies before Airflow hears of the success
    (a lost worker; or, seen in a real deployment, the scheduler failing a deferred task that
    had just resumed and finished)."""

    def execute(self, context):  # type: ignore[no-untyped-def]
        result = super().execute(context)
        if context["ti"].try_number == 1:
            raise RuntimeError("lost after publishing")
        return result


class _DrainLosesItsFirstSuccess(ReceiveStreamsOperator):
    """Its first try takes two streams, then dies."""

    def execute(self, context):  # type: ignore[no-untyped-def]
        wanted = self.count
        if context["ti"].try_number == 1:
            self.count = 2
        try:
            result = super().execute(context)
        finally:
            self.count = wanted
        if context["ti"].try_number == 1:
            raise RuntimeError("lost after publishing")
        return result


with DAG("amqs_test_lost_success", schedule=None, params=PARAMS,
         default_args={"retries": 1, "retry_delay": timedelta(seconds=0)}) as lost_success:
    one = _SensorLosesItsFirstSuccess(task_id="receive", source="{{ params.queue }}",
                                      out_dir="{{ params.out_dir }}/one", poke_interval=1, offer_wait=2, timeout=20)
    many = _DrainLosesItsFirstSuccess(task_id="drain", source="{{ params.queue }}", out_dir="{{ params.out_dir }}/many",
                                      count=3, wait_timeout=10)
    one >> many

    @task
    def record_both(params: dict | None = None, ti: object = None) -> None:
        got = {t: ti.xcom_pull(task_ids=t) for t in ("receive", "drain")}  # type: ignore[attr-defined]
        Path(params["record"]).write_text(json.dumps(got))

    many >> record_both()
