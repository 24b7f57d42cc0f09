"""The Spark hand-off: a SparkSubmitOperator templated from a StreamCompleteSensor's XCom."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from airflow.providers.apache.spark.hooks.spark_submit import SparkSubmitHook
from airflow.providers.apache.spark.operators.spark_submit import SparkSubmitOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from airflow_provider_amqstream.operators.outlets import directory_asset, with_port

# Every Spark application the operators below start is named so: one scheme in every example
# and in a cluster's UI (SparkSubmitOperator's own default is "arrow-spark"). Templated.
APP_NAME = "amqstream:{{ dag.dag_id }}.{{ task.task_id }}"

# Lines spark-submit prints that no configuration turns off and that say nothing about the
# job: the JVM announces the incubator module Spark 4 adds to every driver.
SUBMIT_NOISE = ("WARNING: Using incubator modules:",)


# The job's last line on a data error (spark/stream_to_parquet.py, DATA_ERROR_MARK): the input's
# content cannot be converted, and a retry would read the same bytes.
DATA_ERROR_MARK = "stream_to_parquet: data error: "
# A driver line of the shipped log4j2 layout: "26/11/28 04:34:39 ERROR Utils: ...".
SPARK_LEVEL = re.compile(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d (ERROR|WARN) ")


def stream_to_parquet_job() -> str:
    """Path of the PySpark job shipped in this package."""
    return str(resources.files("airflow_provider_amqstream") / "spark" / "stream_to_parquet.py")


def quiet_spark_conf(conf: dict[str, Any] | None = None) -> dict[str, Any]:
    """``conf`` plus driver Java options that load the shipped log4j2 configuration (driver at
    WARN), unless the caller set their own ``spark.driver.extraJavaOptions``: Spark's INFO
    lines (about 220 per conversion) would otherwise all land in the task log."""
    log_conf = resources.files("airflow_provider_amqstream") / "spark" / "log4j2.properties"
    out = dict(conf or {})
    out.setdefault("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log_conf}")
    return out


def parquet_extra(output: str | None) -> dict[str, Any]:
    """The extra of a Parquet outlet's event: the dataset directory this run wrote (the job's
    ``--output``), and from its one-dataset summary the rows, columns and bytes; a batch's
    summary (a list as long as the batch) is named, not read."""
    if not output:
        return {}
    out = Path(output)
    extra: dict[str, Any] = {"output": str(out.resolve())}
    batch = out / "_amqstream_batch_summary.json"
    if batch.is_file():
        extra["summary"] = str(batch.resolve())
        return extra
    try:
        summary = json.loads((out / "_amqstream_summary.json").read_text())
    except (OSError, ValueError):
        return extra
    extra.update({k: summary.get(k) for k in ("rows", "parquet_bytes", "source_sha256")})
    extra["columns"] = len(summary.get("columns") or [])
    return extra


class QuietSparkSubmitOperator(SparkSubmitOperator):
    """SparkSubmitOperator whose task log holds the job's own lines and Spark's warnings, not
    Spark's start-up chatter: the driver logs through :func:`quiet_spark_conf`, the lines no
    option turns off (:data:`SUBMIT_NOISE`) are dropped, and the application is named
    :data:`APP_NAME` unless ``name`` is given.

    :param parquet_dir: the directory the job writes its datasets under, as written in the DAG
        (templated is fine): its static root, ``file:///...``, becomes an outlet asset, whose
        event says which dataset this run wrote (``--output``), and its rows and bytes when
        the job's summary has them. None, or a wholly templated directory: no outlet.
    :param kwargs: passed to SparkSubmitOperator.
    """

    def __init__(self, *, parquet_dir: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("name", APP_NAME)
        kwargs["conf"] = quiet_spark_conf(kwargs.get("conf"))
        super().__init__(**kwargs)
        self.parquet_asset = directory_asset(parquet_dir) if parquet_dir is not None else None
        if self.parquet_asset is not None:
            self.outlets = with_port(self.outlets, self.parquet_asset)

    def _arg(self, flag: str) -> str | None:
        args = list(self.application_args or [])
        return str(args[args.index(flag) + 1]) if flag in args[:-1] else None

    def execute(self, context: Any) -> None:
        self._data_error: str | None = None
        try:
            super().execute(context)
        except AirflowException:
            if self._data_error is None:
                raise
            # The same file fails the same way on every try: fail once, naming it and why
            # (spark-submit's command line and output tail, in the chained error, say less).
            raise AirflowFailException(f"{self._data_error} (a data error: not retried; fix or resend the "
                                       "file, then clear this task)") from None
        if self.parquet_asset is not None and hasattr(context, "get") and context.get("outlet_events") is not None:
            context["outlet_events"][self.parquet_asset].extra = parquet_extra(self._arg("--output"))

    def _get_hook(self) -> SparkSubmitHook:
        hook = super()._get_hook()
        # The hook logs every output line as it reads it (_process_spark_submit_log, which
        # also extracts driver and application ids): filtering what it reads keeps all that.
        process = hook._process_spark_submit_log
        hook._process_spark_submit_log = lambda itr: process(self._by_level(itr))  # type: ignore[method-assign]
        return hook

    def _by_level(self, lines: Iterator[Any]) -> Iterator[Any]:
        """Spark's ERROR and WARN lines, and the job's data error, logged at their own level
        (the hook logs every line at INFO); :data:`SUBMIT_NOISE` dropped; the rest passed on."""
        for line in lines:
            text = str(line).rstrip("\n")
            level = SPARK_LEVEL.match(text)
            if text.lstrip().startswith(SUBMIT_NOISE):
                continue
            if text.startswith(DATA_ERROR_MARK):
                self._data_error = text
                self.log.error("%s", text)
            elif level:
                self.log.log(logging.ERROR if level.group(1) == "ERROR" else logging.WARNING, "%s", text)
            else:
                yield line


class StreamToParquetOperator(QuietSparkSubmitOperator):
    """SparkSubmitOperator running the shipped job on the file a sensor received; reports
    that file as its OpenLineage input and the dataset directory as its output. Quiet and
    named as :class:`QuietSparkSubmitOperator`.

    :param sensor_task_id: the StreamCompleteSensor whose XCom names the file.
    """

    def __init__(self, *, sensor_task_id: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sensor_task_id = sensor_task_id

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        from airflow.providers.openlineage.extractors import OperatorLineage

        from airflow_provider_amqstream.operators.lineage import file_dataset

        received = task_instance.xcom_pull(task_ids=self.sensor_task_id) if task_instance is not None else None
        received = received if isinstance(received, dict) else {}
        src, out = self._arg("--input"), self._arg("--output")
        inputs = [file_dataset(src, role="input", size=received.get("bytes"), sha256=received.get("sha256"))] \
            if src else []
        return OperatorLineage(inputs=inputs, outputs=[file_dataset(out, role="output")] if out else [])


def stream_to_parquet_operator(*, task_id: str, sensor_task_id: str, output_dir: str,
                               partition_by: str | list[str] = "", input_format: str = "auto",
                               conn_id: str = "spark_default", **kwargs: Any) -> StreamToParquetOperator:
    """Build a SparkSubmitOperator that converts the file a sensor received into Parquet.

    The input path and SHA-256 are pulled at run time from ``sensor_task_id``'s XCom;
    the dataset goes to ``output_dir/<stream id>`` with a ``_amqstream_summary.json``.
    Runs on whatever master the Spark connection names (``local[*]``, ``spark://host:7077``,
    ``yarn``...), quiet as :class:`QuietSparkSubmitOperator`, with ``file://<output_dir>``
    as its outlet asset.

    :param sensor_task_id: the StreamCompleteSensor whose XCom names the file.
    :param output_dir: parent directory of the Parquet datasets (templated).
    :param partition_by: column(s) to partition the dataset by.
    :param input_format: ``auto`` (by extension), ``csv``, ``json`` or ``parquet``.
    :param conn_id: the Spark connection.
    :param kwargs: passed to SparkSubmitOperator (``conf``, ``executor_memory``, ...).
    """
    pull = f"ti.xcom_pull(task_ids='{sensor_task_id}')"
    args = ["--input", "{{ " + pull + "['path'] }}",
            "--output", output_dir.rstrip("/") + "/{{ " + pull + "['stream_id'] }}",
            "--sha256", "{{ " + pull + "['sha256'] }}", *_format_args(input_format, partition_by)]
    return StreamToParquetOperator(task_id=task_id, sensor_task_id=sensor_task_id,
                                   application=stream_to_parquet_job(), application_args=args,
                                   conn_id=conn_id, parquet_dir=output_dir, **kwargs)


def manifest_to_parquet_operator(*, task_id: str, manifest: str, output_dir: str, partition_by: str | list[str] = "",
                                 input_format: str = "auto", conn_id: str = "spark_default",
                                 **kwargs: Any) -> QuietSparkSubmitOperator:
    """Build a SparkSubmitOperator that converts every file of a batch manifest in one
    application: each to ``output_dir/<its path without extension>``, with a
    ``_amqstream_batch_summary.json`` listing them.

    ``output_dir``, ``partition_by`` (each dataset's), ``input_format`` and ``conn_id`` are as on
    :func:`stream_to_parquet_operator`; ``kwargs`` go to SparkSubmitOperator.

    :param manifest: the ``<batch id>.manifest.jsonl`` (or a directory of them; templated,
        e.g. ``"{{ ti.xcom_pull(task_ids='receive')['manifest'] }}"``).
    """
    args = ["--manifest", manifest, "--output", output_dir, *_format_args(input_format, partition_by)]
    return QuietSparkSubmitOperator(task_id=task_id, application=stream_to_parquet_job(), application_args=args,
                                    conn_id=conn_id, parquet_dir=output_dir, **kwargs)


def _format_args(input_format: str, partition_by: str | list[str]) -> list[str]:
    parts = ",".join(partition_by) if isinstance(partition_by, list) else partition_by
    return ["--format", input_format, *(["--partition-by", parts] if parts else [])]
