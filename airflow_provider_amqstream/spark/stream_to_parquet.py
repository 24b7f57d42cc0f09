"""PySpark job: turn a received file (CSV, JSON lines or Parquet) into a Parquet dataset.

Run by ``spark-submit`` (see :func:`airflow_provider_amqstream.operators.spark.stream_to_parquet_operator`):

    spark-submit stream_to_parquet.py --input FILE --output DIR [--partition-by COL]
        [--format auto|csv|json|parquet] [--sha256 HEX]
    spark-submit stream_to_parquet.py --manifest FILE_OR_DIR --output DIR [...]

Writes the dataset to DIR and a summary to DIR/_amqstream_summary.json (rows,
columns, bytes, source SHA-256), and prints one summary line. With ``--manifest`` (a
receiver's ``<batch id>.manifest.jsonl``, or a directory of them) every file it lists is
converted in this one application, each to DIR/<its path without extension>, and
DIR/_amqstream_batch_summary.json lists them all. The input is read once and never cached
(a file larger than the driver's memory converts as well as a small one). Spark itself logs
warnings only. Exits 2 with a clear message on unreadable input, and 3 when the input's
content cannot be converted (a CSV cut mid-line, a corrupt Parquet file): a data error, which
a retry would meet again. Either is said in one last line, ``stream_to_parquet: error: ...``
or ``stream_to_parquet: data error: FILE: [CONDITION] ...``, naming the file and Spark's cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DATA_ERROR_EXIT = 3
DATA_ERROR_MARK = "stream_to_parquet: data error: "
# Spark's error conditions that say the input's bytes cannot be read as its format; SQLSTATE
# class 22 (data exception) says the same of the rest.
DATA_CONDITIONS = ("MALFORMED_", "CANNOT_PARSE_", "CANNOT_READ_FILE_FOOTER", "INVALID_BYTES", "CORRUPTED_")
MAX_CAUSE = 400

FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".ndjson": "json",
           ".parquet": "parquet", ".pq": "parquet"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--input")
    src.add_argument("--manifest", help="a batch manifest (JSON lines: path, bytes, sha256) or a directory of them")
    ap.add_argument("--output", required=True)
    ap.add_argument("--format", default="auto", choices=["auto", "csv", "json", "parquet"])
    ap.add_argument("--partition-by", default="", help="comma-separated columns to partition by")
    ap.add_argument("--sha256", default="", help="SHA-256 of the input, recorded in the summary")
    ap.add_argument("--mode", default="overwrite", choices=["overwrite", "errorifexists"])
    return ap.parse_args(argv)


def fail(msg: str) -> NoReturn:
    print(f"stream_to_parquet: error: {msg}", file=sys.stderr)
    sys.exit(2)


def _causes(exc: BaseException) -> list[str]:
    """The first line of each cause of a Spark failure, outermost first: the Java cause chain
    of a Py4JJavaError, else the exception's own message."""
    java = getattr(exc, "java_exception", None)
    out = []
    for _ in range(32):  # a cause chain is short; a cycle must not hang the job
        if java is None:
            break
        out.append(str(java.toString()).splitlines()[0])
        java = java.getCause()
    return out or [str(exc).splitlines()[0] if str(exc) else type(exc).__name__]


def _data_cause(causes: list[str]) -> str | None:
    """The innermost cause naming a data condition (``[MALFORMED_CSV_RECORD] ...``), or None."""
    for cause in reversed(causes):
        condition = cause.partition("[")[2].partition("]")[0]
        if condition.startswith(DATA_CONDITIONS) or "SQLSTATE: 22" in cause:
            return cause.split(": ", 1)[-1] if cause.startswith(("org.", "java.")) else cause
    return None


def spark_failure(src: Path, fmt: str, exc: BaseException) -> NoReturn:
    """Exit naming ``src`` and Spark's cause: 3 (a data error) when the cause is the
    content, else 2."""
    causes = _causes(exc)
    data = _data_cause(causes)
    if data is not None:
        print(f"{DATA_ERROR_MARK}{src}: {data[:MAX_CAUSE]}", file=sys.stderr, flush=True)
        sys.exit(DATA_ERROR_EXIT)
    fail(f"cannot convert {src} as {fmt}: {causes[-1][:MAX_CAUSE]}")


def _format_of(src: Path, fmt: str) -> str:
    if fmt == "auto":
        fmt = FORMATS.get(src.suffix.lower(), "")
        if not fmt:
            fail(f"cannot tell the format of {src.name} from its extension; pass --format csv|json|parquet")
    return fmt


def _root_of(manifest: Path) -> Path:
    """The output directory a manifest's rows are relative to: a receiver keeps manifests in
    ``<out_dir>/.amqstream/manifests/<sender>/``; one found elsewhere names files beside it."""
    parents = manifest.parents
    if len(parents) > 3 and parents[1].name == "manifests" and parents[2].name == ".amqstream":
        return parents[3]
    return manifest.parent


def _manifest_files(arg: str) -> list[tuple[Path, dict[str, Any]]]:
    """(file, manifest row) for every row of the manifest(s); paths are relative to the
    receiver's output directory (see ``_root_of``)."""
    where = Path(arg)
    if where.is_dir():
        manifests = sorted([*where.glob("*.manifest.jsonl"), *where.glob(".amqstream/manifests/*/*.manifest.jsonl")])
    else:
        manifests = [where]
    if not manifests or not all(m.is_file() for m in manifests):
        fail(f"no manifest at {where} (a <batch id>.manifest.jsonl, or an output directory holding some)")
    out = []
    for m in manifests:
        for n, line in enumerate(m.read_text(encoding="utf-8").splitlines(), 1):
            try:
                row = json.loads(line)
                rel = Path(row["path"])
            except (ValueError, KeyError, TypeError):
                fail(f"{m} line {n} is not a manifest row")
            if rel.is_absolute() or ".." in rel.parts:
                fail(f"{m} line {n}: path {row['path']!r} leaves the output directory")
            src = _root_of(m) / rel
            if not src.is_file() or src.stat().st_size != int(row.get("bytes", -1)):
                fail(f"{src} (listed in {m}) is missing or not {row.get('bytes')} bytes")
            out.append((src, row))
    return out


def _convert(spark: SparkSession, src: Path, fmt: str, output: Path, args: argparse.Namespace,
             sha256: str) -> dict[str, Any]:
    from py4j.protocol import Py4JJavaError
    from pyspark.errors import PySparkException

    started = time.monotonic()
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
        # One pass over the input, not cached: caching a large file only to count it spilled
        # ("Not enough space to cache" for every partition past the driver's memory) and left
        # the cleaner rejecting tasks at shutdown. The rows are counted in what was written,
        # which Parquet answers from its footers without reading the data again.
        writer = df.write.mode(args.mode)
        if parts:
            writer = writer.partitionBy(*parts)
        writer.parquet(str(output))
        rows = spark.read.parquet(str(output)).count()
    except (PySparkException, Py4JJavaError) as exc:
        spark_failure(src, fmt, exc)
    size = sum(f.stat().st_size for f in output.rglob("*.parquet"))
    summary = {"input": str(src), "output": str(output), "format": fmt, "rows": rows, "columns": columns,
               "input_bytes": src.stat().st_size, "parquet_bytes": size, "partition_by": parts,
               "source_sha256": sha256 or None}
    _write_json(output / "_amqstream_summary.json", summary)
    print(f"stream_to_parquet: {src} ({fmt}, {summary['input_bytes']} bytes) -> {output}: {rows} rows, "
          f"{len(columns)} columns, {size} bytes of Parquet in {time.monotonic() - started:.1f}s", flush=True)
    return summary


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.manifest:
        jobs = [(src, _format_of(src, args.format), Path(args.output) / Path(row["path"]).with_suffix(""),
                 str(row.get("sha256") or "")) for src, row in _manifest_files(args.manifest)]
        name = f"amqstream:{Path(args.manifest).name}"
    else:
        src = Path(args.input)
        if not src.is_file():
            fail(f"input {src} does not exist or is not a file")
        jobs = [(src, _format_of(src, args.format), Path(args.output), args.sha256)]
        name = f"amqstream:{src.name}"

    # pyspark 4.3 warns on import that it does not fully support pandas 3; this job uses
    # no pandas, and in a task log the warning reads like a problem with the conversion.
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from pyspark import SparkConf
    from pyspark.sql import SparkSession

    builder = SparkSession.builder
    # The name it was submitted with (the operators: amqstream:<dag>.<task>) is kept; run by
    # hand without --name, spark-submit names it after this script, and the input says more.
    if SparkConf().get("spark.app.name", Path(__file__).name) == Path(__file__).name:
        builder = builder.appName(name)
    spark = builder.getOrCreate()
    # As early as the API allows; the launcher's own start-up lines are quieted by the
    # log4j2 configuration that the operators pass to the driver JVM.
    spark.sparkContext.setLogLevel("WARN")
    try:
        summaries = [_convert(spark, src, fmt, out, args, sha) for src, fmt, out, sha in jobs]
    finally:
        spark.stop()
    if args.manifest:
        batch = {"manifest": args.manifest, "files": len(summaries), "rows": sum(s["rows"] for s in summaries),
                 "datasets": summaries}
        Path(args.output).mkdir(parents=True, exist_ok=True)
        _write_json(Path(args.output) / "_amqstream_batch_summary.json", batch)
        print(f"stream_to_parquet: batch {args.manifest}: {batch['files']} files, {batch['rows']} rows",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
