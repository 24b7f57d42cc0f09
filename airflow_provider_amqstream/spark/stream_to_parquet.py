"""PySpark job: turn a received file (CSV, JSON lines or Parquet) into a Parquet dataset.

Run by ``spark-submit`` (see :func:`airflow_provider_amqstream.operators.spark.stream_to_parquet_operator`):

    spark-submit stream_to_parquet.py --input FILE --output DIR [--partition-by COL]
        [--format auto|csv|json|parquet] [--sha256 HEX]

Writes the dataset to DIR and a summary to DIR/_amqstream_summary.json (rows,
columns, bytes, source SHA-256), and prints one summary line. Spark itself logs
warnings only. Exits 2 with a clear message on unreadable input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
           ".parquet": "parquet", ".pq": "parquet"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--format", default="auto", choices=["auto", "csv", "json", "parquet"])
    ap.add_argument("--partition-by", default="", help="comma-separated columns to partition by")
    ap.add_argument("--sha256", default="", help="SHA-256 of the input, recorded in the summary")
    ap.add_argument("--mode", default="overwrite", choices=["overwrite", "errorifexists"])
    return ap.parse_args(argv)


def fail(msg: str) -> None:
    print(f"stream_to_parquet: error: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    src = Path(args.input)
    if not src.is_file():
        fail(f"input {src} does not exist or is not a file")
    fmt = args.format
    if fmt == "auto":
        fmt = FORMATS.get(src.suffix.lower(), "")
        if not fmt:
            fail(f"cannot tell the format of {src.name} from its extension; pass --format csv|json|parquet")

    from pyspark.errors import PySparkException
    from pyspark.sql import SparkSession

    started = time.monotonic()
    spark = SparkSession.builder.appName(f"amqstream:{src.name}").getOrCreate()
    # As early as the API allows; the launcher's own start-up lines are quieted by the
    # log4j2 configuration that stream_to_parquet_operator passes to the driver JVM.
    spark.sparkContext.setLogLevel("WARN")
    try:
        reader = spark.read
        if fmt == "csv":
            sep = "\t" if src.suffix.lower() == ".tsv" else ","
            df = reader.options(header=True, inferSchema=True, sep=sep, mode="FAILFAST").csv(str(src))
        elif fmt == "json":
            df = reader.options(mode="FAILFAST").json(str(src))
        else:
            df = reader.parquet(str(src))
        columns = df.columns
        if not columns or columns == ["_corrupt_record"]:
            fail(f"{src} has no readable {fmt} columns")
        parts = [c.strip() for c in args.partition_by.split(",") if c.strip()]
        missing = [c for c in parts if c not in columns]
        if missing:
            fail(f"partition column(s) {missing} are not in {src.name}; it has {columns}")
        df = df.cache()
        rows = df.count()
        writer = df.write.mode(args.mode)
        if parts:
            writer = writer.partitionBy(*parts)
        writer.parquet(args.output)
    except PySparkException as exc:
        fail(f"cannot convert {src} as {fmt}: {str(exc).splitlines()[0]}")
    finally:
        spark.stop()
    out = Path(args.output)
    size = sum(f.stat().st_size for f in out.rglob("*.parquet"))
    summary = {"input": str(src), "output": str(out), "format": fmt, "rows": rows, "columns": columns,
               "input_bytes": src.stat().st_size, "parquet_bytes": size, "partition_by": parts,
               "source_sha256": args.sha256 or None}
    tmp = out / "_amqstream_summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    os.replace(tmp, out / "_amqstream_summary.json")
    print(f"stream_to_parquet: {src} ({fmt}, {summary['input_bytes']} bytes) -> {out}: {rows} rows, "
          f"{len(columns)} columns, {size} bytes of Parquet in {time.monotonic() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
