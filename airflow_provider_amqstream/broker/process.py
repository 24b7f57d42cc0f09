"""The embedded broker's Java process: finding ActiveMQ and Java, starting, watching and
stopping it."""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from airflow_provider_amqstream.exceptions import BrokerError

log = logging.getLogger(__name__)

JAVA_OPENS = [
    "--add-reads=java.xml=java.logging",
    "--add-opens", "java.base/java.security=ALL-UNNAMED",
    "--add-opens", "java.base/java.net=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang=ALL-UNNAMED",
    "--add-opens", "java.base/java.util=ALL-UNNAMED",
    "--add-opens", "java.naming/javax.naming.spi=ALL-UNNAMED",
    "--add-opens", "java.rmi/sun.rmi.transport.tcp=ALL-UNNAMED",
    "--add-opens", "java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens", "java.base/java.util.concurrent.atomic=ALL-UNNAMED",
]


# C1 only (no C2). The broker's hot paths are mostly copies and system calls, so C2's code is
# only ~7 % cheaper per GiB once compiled, and compiling it costs ~6.5 CPU-s over the first
# 10 GiB after a start: it pays back only after ~25-35 GiB.
# What C1 risks: CPU-bound Java code (TLS ciphers, many small messages) runs less optimised;
# docs/decisions/broker-tuning.md. $AMQSTREAM_BROKER_JAVA_OPTS comes after and can turn C2 back
# on (-XX:TieredStopAtLevel=4: for a broker that runs for weeks), or change the heap (-Xms2g
# -Xmx2g: the last of each wins).
JIT_OPTIONS = ["-XX:TieredStopAtLevel=1"]

# The heap starts at its maximum, so G1 never gives memory back between bursts. A heap that
# shrank after a transfer had its pages taken again for the next one, and taking a page the
# kernel had handed back costs far more than reusing one (under KVM with free page reporting
# the host backs it anew): 3.3-3.7 broker CPU-s per GiB against 4.2-5.5 with -Xms256M, in 4
# alternating rounds (docs/decisions/page-reuse.md). The pages are touched only as used.
# Regions of 4 MiB: a 1 MiB body is then an ordinary young object, not a humongous one (half a
# region or more). Humongous arrays, several per chunk, started a concurrent cycle every
# ~80 ms, and that cost grew with every stream the broker had carried: 20 files of 50 MB, six
# rounds alternating on two brokers, 3.4-3.6 broker CPU-s a round against 4.0-6.0 with 1 MiB.
HEAP_OPTIONS = ["-Xms512M", "-Xmx512M", "-XX:G1HeapRegionSize=4m"]


# Our store plugin (java/, built by scripts/broker_jar.sh, named in the configuration by
# config.py): KahaDB marshals a large message into one buffer of its size. Without the jar the
# broker runs as ActiveMQ ships, with the same journal format (docs/decisions/broker-copies.md).
BROKER_JAR = Path(__file__).with_name("java") / "amqstream-broker.jar"


def broker_jar() -> Path | None:
    return BROKER_JAR if BROKER_JAR.is_file() else None


def activemq_home() -> Path:
    candidates = [os.environ.get("ACTIVEMQ_HOME"), "/usr/share/activemq"]
    for cand in candidates:
        if cand and (Path(cand) / "bin" / "activemq.jar").is_file():
            return Path(cand)
    raise BrokerError(
        "ActiveMQ Classic is not installed (looked for bin/activemq.jar in "
        f"{', '.join(c for c in candidates if c)}). Install it with "
        "`sudo apt-get install activemq` or set ACTIVEMQ_HOME to an unpacked ActiveMQ 5.17+."
    )


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            "Java is not on PATH; ActiveMQ needs Java 11+. Install it with "
            "`sudo apt-get install default-jre-headless`."
        )
    return java


def keytool_binary() -> str:
    return shutil.which("keytool") or str(Path(java_binary()).resolve().parent / "keytool")


def java_command(java: str, home: Path, data_dir: Path, conf: Path) -> list[str]:
    """The command line that runs ActiveMQ in the foreground on ``conf/activemq.xml``."""
    data = data_dir / "data"
    jar = broker_jar()
    if jar is None:
        log.info("%s is missing (`make setup` builds it): the broker at %s marshals its store as ActiveMQ ships",
                 BROKER_JAR, data_dir)
    classpath = f"{conf}:{jar}" if jar else str(conf)
    return [
        java, *HEAP_OPTIONS,
        "-XX:+ExitOnOutOfMemoryError",
        *JIT_OPTIONS,
        *JAVA_OPENS,
        *shlex.split(os.environ.get("AMQSTREAM_BROKER_JAVA_OPTS", "")),
        f"-Djava.io.tmpdir={data_dir / 'tmp'}",
        f"-Dactivemq.classpath={classpath}",
        f"-Dactivemq.home={home}", f"-Dactivemq.base={data_dir}",
        f"-Dactivemq.conf={conf}", f"-Dactivemq.data={data}",
        f"-Dlog4j.configuration=file:{conf / 'log4j.properties'}",
        "-Dorg.apache.activemq.UseDedicatedTaskRunner=false",
        "-jar", str(home / "bin" / "activemq.jar"),
        "start", f"xbean:file:{conf / 'activemq.xml'}",
    ]


def spawn(cmd: list[str], data_dir: Path) -> subprocess.Popen[bytes]:
    with open(data_dir / "data" / "broker.out", "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                cwd=data_dir)


def wait_ready(proc: subprocess.Popen[bytes], ready: Callable[[], bool], timeout: float, out_file: Path,
               log_file: Path) -> bool:
    """Wait until ``ready()``; False if ``timeout`` seconds pass first, :class:`BrokerError`
    with the end of its logs if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(
                f"ActiveMQ exited with code {proc.returncode} while starting; "
                f"see {out_file} and {log_file}:\n{tail((out_file, log_file))}"
            )
        if ready():
            return True
        time.sleep(0.2)
    return False


def running_pid(pid_file: Path, data_dir: Path) -> int | None:
    """The pid recorded in ``pid_file`` if that process is still alive (and names ``data_dir``)."""
    try:
        pid = int(pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    # A pid can be reused after a reboot; only trust it if it is our java.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    return pid if str(data_dir).encode() in cmdline else None


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # Reap it if it is our child, so it does not linger as a zombie.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def terminate(pid: int, timeout: float) -> None:
    os.kill(pid, signal.SIGTERM)
    if not wait_gone(pid, timeout):
        sigkill(pid)


def sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    wait_gone(pid, 10)


def tail(files: Iterable[Path], lines: int = 15) -> str:
    texts = []
    for f in files:
        try:
            texts.extend(f.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            continue
    return "\n".join(texts)
