"""Memory taken once and reused: the broker's heap starts at its maximum (G1 never hands pages
back to take them again), and a receiver gives each synced batch of a stream back to the
kernel's free pages (docs/decisions/page-reuse.md)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import SendOptions, send_file
from tests.helpers import Receiver, make_file, page_cache_droppable, params_as, resident_pages, sha256_file

pytestmark = pytest.mark.broker


def _flags(pid: int) -> dict[str, str]:
    jcmd = shutil.which("jcmd")
    if jcmd is None:
        pytest.fail("jcmd is missing: `make setup` installs the JDK (default-jdk-headless)")
    out = subprocess.run([jcmd, str(pid), "VM.flags"], capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(f[4:].split("=", 1) for f in out.split() if f.startswith("-XX:") and "=" in f)


def test_the_broker_heap_starts_at_its_maximum_in_regions_a_chunk_fits(broker: EmbeddedBroker) -> None:
    pid = broker.running_pid()
    assert pid is not None
    flags = _flags(pid)
    assert flags["InitialHeapSize"] == flags["MaxHeapSize"] == str(512 * 2**20)
    # A chunk's 1 MiB body is below half a region: a young object, not a humongous one.
    assert flags["G1HeapRegionSize"] == str(4 * 2**20)


def test_a_file_through_the_broker_leaves_no_pages_in_the_receivers_cache(broker: EmbeddedBroker,
                                                                          tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    if not page_cache_droppable(out):
        pytest.skip(f"{out} is on a filesystem whose pages are the file (tmpfs)")
    params = params_as(broker, None)
    src = make_file(tmp_path / "big.bin", 12 * 2**20 + 7, seed=5)
    rx = Receiver(params, "/queue/pages.cold", out)
    sent = send_file(params, src, "/queue/pages.cold", SendOptions(chunk_size=256 * 1024, compression="none"))
    got = rx.finish()
    path = Path(got.path or "")
    assert resident_pages(path) == 0
    assert got.sha256 == sent.sha256 == sha256_file(src) == sha256_file(path)
