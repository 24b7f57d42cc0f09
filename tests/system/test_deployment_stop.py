"""However ``make airflow`` ends, nothing it started is left running. A
SIGTERM to ``make`` is the teardown of every test in test_deployment.py; here ``make`` is
killed with SIGKILL (a CI job cancelled, an OOM kill), which nothing can catch: the script,
orphaned, notices and stops everything it started; and a signal goes to the whole process
group while the deployment is still starting."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deployment import Deployment
from tests.helpers import ROOT, wait_for

pytestmark = [pytest.mark.deployment, pytest.mark.broker]


@pytest.fixture
def small_deployment(tmp_path: Path) -> Iterator[Deployment]:
    dags = tmp_path / "dags"
    dags.mkdir()
    for name in ("amqstream_one_file.py", "example_support.py", ".airflowignore"):  # nothing scheduled
        (dags / name).symlink_to(ROOT / "dags" / "examples" / name)
    d = Deployment(tmp_path / "home", dags)
    try:
        yield d
    finally:
        d.stop()


def test_make_killed_with_sigkill_still_stops_everything(small_deployment: Deployment) -> None:
    d = small_deployment
    d.wait_ready()
    assert d.own_processes() and d.broker_pid()
    os.kill(d.proc.pid, signal.SIGKILL)  # make: no trap, no forwarding
    d.proc.wait(10)
    d.wait_stopped(90, "make was killed")
    assert "airflow.sh: stopped the broker" in d.text(), d.text()[-2000:]


def test_a_signal_to_the_whole_group_while_it_starts_stops_everything(small_deployment: Deployment) -> None:
    """A CI job cancelled, or a service manager's stop, as the components come up: every
    process of ``make``'s group gets SIGTERM at once, the script's orphan watcher too. The
    script once died of its own `set -e` (its `kill` of the watcher, already gone, failed)
    before stopping anything, and left the whole deployment running. Only start-up had that
    window: once ready, the script runs without `set -e`."""
    d = small_deployment
    pids = d.home / "pids"
    wait_for(lambda: pids.exists() and len(pids.read_text().splitlines()) >= 5, 120,
             "the script to start the five components")
    assert d.broker_pid()
    os.killpg(d.proc.pid, signal.SIGTERM)
    d.proc.wait(90)
    d.wait_stopped(90, "SIGTERM to make's process group during start-up")
    assert "airflow.sh: stopping api-server scheduler dag-processor triggerer log-server" in d.text(), d.text()
    assert "airflow.sh: stopped the broker" in d.text(), d.text()[-2000:]
