"""The Spark hand-off: a SparkSubmitOperator templated from a StreamCompleteSensor's XCom."""

from __future__ import annotations

from importlib import resources
from typing import Any

from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator


def stream_to_parquet_job() -> str:
    """Path of the PySpark job shipped in this package."""
    return str(resources.files("airflow_provider_amqstream") / "spark" / "stream_to_parquet.py")


def stream_to_parquet_operator(*, task_id: str, sensor_task_id: str, output_dir: str,
                               partition_by: str | list[str] = "", input_format: str = "auto",
                               conn_id: str = "spark_default", **kwargs: Any) -> SparkSubmitOperator:
    """Build a SparkSubmitOperator that converts the file a sensor received into Parquet.

    The input path and SHA-256 are pulled at run time from ``sensor_task_id``'s XCom;
    the dataset goes to ``output_dir/<stream id>`` with a ``_amqstream_summary.json``.
    Runs on whatever master the Spark connection names (``local[*]``, ``spark://host:7077``,
    ``yarn``...).

    :param task_id: this task's id.
    :param sensor_task_id: the StreamCompleteSensor whose XCom names the file.
    :param output_dir: parent directory of the Parquet datasets (templated).
    :param partition_by: column(s) to partition the dataset by.
    :param input_format: ``auto`` (by extension), ``csv``, ``json`` or ``parquet``.
    :param conn_id: the Spark connection.
    :param kwargs: passed to SparkSubmitOperator (``conf``, ``executor_memory``, ...).
    """
    parts = ",".join(partition_by) if isinstance(partition_by, list) else partition_by
    pull = f"ti.xcom_pull(task_ids='{sensor_task_id}')"
    args = ["--input", "{{ " + pull + "['path'] }}",
            "--output", output_dir.rstrip("/") + "/{{ " + pull + "['stream_id'] }}",
            "--sha256", "{{ " + pull + "['sha256'] }}",
            "--format", input_format]
    if parts:
        args += ["--partition-by", parts]
    kwargs.setdefault("name", f"amqstream-{task_id}")
    return SparkSubmitOperator(task_id=task_id, application=stream_to_parquet_job(), application_args=args,
                               conn_id=conn_id, **kwargs)


def manifest_to_parquet_operator(*, task_id: str, manifest: str, output_dir: str, partition_by: str | list[str] = "",
                                 input_format: str = "auto", conn_id: str = "spark_default",
                                 **kwargs: Any) -> SparkSubmitOperator:
    """Build a SparkSubmitOperator that converts every file of a batch manifest in one
    application: each to ``output_dir/<its path without extension>``, with a
    ``_amqstream_batch_summary.json`` listing them.

    :param task_id: this task's id.
    :param manifest: the ``<batch id>.manifest.jsonl`` (or a directory of them; templated,
        e.g. ``"{{ ti.xcom_pull(task_ids='receive')['manifest'] }}"``).
    :param output_dir: parent directory of the Parquet datasets (templated).
    :param partition_by: column(s) to partition each dataset by.
    :param input_format: ``auto`` (by extension), ``csv``, ``json`` or ``parquet``.
    :param conn_id: the Spark connection.
    :param kwargs: passed to SparkSubmitOperator.
    """
    parts = ",".join(partition_by) if isinstance(partition_by, list) else partition_by
    args = ["--manifest", manifest, "--output", output_dir, "--format", input_format]
    if parts:
        args += ["--partition-by", parts]
    kwargs.setdefault("name", f"amqstream-{task_id}")
    return SparkSubmitOperator(task_id=task_id, application=stream_to_parquet_job(), application_args=args,
                               conn_id=conn_id, **kwargs)
