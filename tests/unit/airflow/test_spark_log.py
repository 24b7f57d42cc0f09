"""The Spark hand-off's task log: Spark's ERROR and WARN lines at their own level (the Spark
provider logs every spark-submit line at INFO), and the job's data-error line kept for the
task's final error."""

from __future__ import annotations

import pytest

from airflow_provider_amqstream.operators.spark import stream_to_parquet_operator


def test_spark_lines_keep_their_level_and_the_data_error_is_kept(capsys: pytest.CaptureFixture[str]) -> None:
    op = stream_to_parquet_operator(task_id="to_parquet", sensor_task_id="receive", output_dir="/tmp/pq")
    op._data_error = None
    lines = ["26/11/28 04:37:57 ERROR Utils: Aborting task ([MALFORMED_CSV_RECORD] ...)\n",
             "26/11/28 04:37:59 WARN TaskSetManager: Lost task 0.0 in stage 2.0\n",
             "Using Spark's default log4j profile\n",
             "stream_to_parquet: data error: /in/cut.csv: [MALFORMED_CSV_RECORD] Malformed CSV record: 1011,2026-12\n"]
    passed = list(op._by_level(iter(lines)))
    assert passed == ["Using Spark's default log4j profile\n"]  # the rest: logged here, not by the hook at INFO
    logged = [line for line in capsys.readouterr().out.splitlines() if "StreamToParquetOperator" in line]
    assert [(line.split("[")[1].split("]")[0].strip(), line.split("] ")[1].split(" ")[0]) for line in logged] == [
        ("error", "26/11/28"), ("warning", "26/11/28"), ("error", "stream_to_parquet:")], logged
    assert op._data_error == lines[-1].rstrip("\n")
