"""A class-data-sharing archive for the Spark drivers the tests start.

A Spark driver of a test converts a few thousand rows; most of its ~23 CPU-seconds go to
loading and verifying ~20,000 JVM classes. With those classes mapped from an archive made by
an earlier driver (JDK 17's dynamic CDS), the same job took 11 s and 13 CPU-s instead of
21 s and 24 (docs/decisions/test-suite-time.md). The tests start about 25 drivers, on two
cores, beside deployments: the system part is CPU-bound.

A JVM uses an archive only if its class path is the one the archive was made with, and the
class path may hold no directory with files in it. Spark puts its configuration directory
first on the class path, so the tests give every driver one empty configuration directory,
and the setting a deployment would write there (no Spark UI) as a system property instead.

``python -m tests.spark_cds`` makes the archive once per machine and Spark/JDK install (in the
user's cache directory, like pip's), in the background of the first part of ``make test``. A
driver started before it exists, or that cannot use it, runs as it would without: the JVM's
CDS messages are off, and nothing else changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "amqstream-tests"
# Compile with C1 only and collect with the serial collector: half the CPU of a short job.
BASE_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
# What a deployment's spark-defaults.conf would say, and the archive's messages silenced (a
# missing or stale archive is a slower driver, not a line in a task log some test reads).
EXTRA_OPTS = "-Dspark.ui.enabled=false -Xlog:cds=off,cds+dynamic=off"


def _key() -> str:
    """Names the archive after what it depends on: the JDK, and the Spark jars of this venv
    (their paths are part of the class path the archive is only good for)."""
    java = os.path.realpath(shutil.which("java") or "java")
    try:
        spark = importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        spark = "none"
    return hashlib.sha256(f"{java}\0{spark}\0{sys.prefix}".encode()).hexdigest()[:16]


def archive() -> Path:
    """Where this machine's archive is (or will be)."""
    return CACHE / f"spark-{_key()}.jsa"


def conf_dir() -> Path:
    """The empty Spark configuration directory every test driver gets (see the module doc)."""
    path = CACHE / "spark-conf-empty"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _driver_env(archive_option: str) -> dict[str, str]:
    """The environment of a test driver: the empty configuration directory and our options,
    with ``archive_option`` (use the archive, or make it)."""
    return {"SPARK_CONF_DIR": str(conf_dir()), "SPARK_SUBMIT_OPTS": f"{BASE_OPTS} {EXTRA_OPTS} {archive_option}"}


def configure(environ: MutableMapping[str, str] = os.environ) -> None:
    """Point the Spark drivers started from this process (and its children) at the archive,
    unless the environment already chose its own driver options."""
    if "SPARK_SUBMIT_OPTS" not in environ:
        environ.update(_driver_env(f"-XX:SharedArchiveFile={archive()}"))


def build(timeout: float = 600.0) -> Path | None:
    """Make the archive if this machine has none: run the shipped job once on a small CSV with
    ``-XX:ArchiveClassesAtExit``. Returns the archive, or None when it could not be made."""
    target = archive()
    if target.exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "spark-archive.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run on this machine may be making it
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            made = Path(tmp) / "new.jsa"
            # The examples' CSV (dates, decimals, text), the columns the tests' conversions read.
            sys.path.insert(0, str(ROOT / "dags" / "examples"))
            from example_support import write_sample_csv

            sample = write_sample_csv(Path(tmp) / "sample.csv", rows=5_000, seed=1)
            # The job's path as operators.spark.stream_to_parquet_job() gives it, without importing
            # Airflow here: this runs beside the test sessions, and an Airflow imported in another
            # process can write a config with a Fernet key of its own into their Airflow home.
            job = ROOT / "airflow_provider_amqstream" / "spark" / "stream_to_parquet.py"
            env = {**os.environ, **_driver_env(f"-XX:ArchiveClassesAtExit={made}")}
            t0 = time.monotonic()
            run = subprocess.run(["spark-submit", "--master", "local[2]", str(job), "--input", str(sample),
                                  "--output", str(Path(tmp) / "out")], env=env, capture_output=True, text=True,
                                 timeout=timeout, check=False)
            if run.returncode != 0 or not made.exists():
                print(f"spark_cds: no archive made (spark-submit exited {run.returncode}); the tests' Spark "
                      f"drivers run without one. Its last output:\n{run.stdout[-1500:]}{run.stderr[-1500:]}",
                      file=sys.stderr)
                return None
            os.replace(made, target)
            print(f"spark_cds: made {target} ({target.stat().st_size / 2**20:.0f} MiB) in "
                  f"{time.monotonic() - t0:.0f}s", file=sys.stderr)
    _prune(keep=target)
    return target


def _prune(keep: Path) -> None:
    """Bound the cache: each clean clone has a venv, hence an archive, of its own (177 MiB), and
    a day of CI runs once left six. Keeps ``keep`` and the two newest others; a driver that
    has one of the others mapped keeps its copy (the file goes only when the last map does)."""
    with contextlib.suppress(OSError):
        rest = sorted((p for p in CACHE.glob("spark-*.jsa") if p != keep), key=lambda p: p.stat().st_mtime)
        for old in rest[:-2]:
            old.unlink()


if __name__ == "__main__":
    sys.exit(0 if build() else 1)
