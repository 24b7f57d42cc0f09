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


def _assets(d: Deployment) -> dict[str, tuple[list[str], list[str]]]:
    """uri -> (producing tasks, consuming tasks) of every asset the API lists."""
    return {a["uri"]: (sorted(f"{t['dag_id']}.{t['task_id']}" for t in a["producing_tasks"]),
                       sorted(f"{t['dag_id']}.{t['task_id']}" for t in a["consuming_tasks"]))
            for a in d.api("GET", "/assets", params={"limit": 1000})["assets"]}


def _linked(d: Deployment, want: dict[str, tuple[list[str], list[str]]]) -> dict[str, tuple[list[str], list[str]]]:
    """Every asset, once those of ``want`` have the tasks it says (the DAG processor parses first)."""
    def ready() -> dict[str, tuple[list[str], list[str]]] | None:
        got = _assets(d)
        return got if all(got.get(u) == w for u, w in want.items()) else None

    return wait_for(ready, 180, f"the assets, with producing and consuming tasks, in /api/v2/assets: {want}",
                    interval=2)


def test_sigint_to_make_alone_stops_everything_and_a_restart_keeps_the_assets(small_deployment: Deployment) -> None:
    """A SIGINT to make's pid alone (``kill -INT <make>``: make keeps it to itself and waits
    for the script) stops the deployment, with no "Error" from make. Started again on the same
    directory, the broker has its port back and the API lists the very same assets: the
    destination, produced by ``send`` and consumed by ``receive``, and the landing directory,
    produced by ``receive`` and consumed by ``to_parquet`` (declared by the DAG: no run needed)."""
    d = small_deployment
    d.wait_ready()
    examples = d.home / "examples"
    want = {"amqstream://amqstream_default/queue/amqstream.examples.one":
            (["amqstream_one_file.send"], ["amqstream_one_file.receive"]),
            f"file://{(examples / 'received' / 'one').resolve()}":
            (["amqstream_one_file.receive"], ["amqstream_one_file.to_parquet"]),
            f"file://{(examples / 'parquet' / 'one').resolve()}": (["amqstream_one_file.to_parquet"], [])}
    before = _linked(d, want)
    port = (d.home / "broker" / "broker.port").read_text()

    os.kill(d.proc.pid, signal.SIGINT)  # to make alone, not to its group
    d.proc.wait(120)
    d.wait_stopped(90, "SIGINT to make's pid")
    assert "was told to stop" in d.text() and "Error" not in d.text(), d.text()[-2000:]
    # The script exits 0; make then ends by the signal it was sent (it re-raises it).
    assert d.proc.returncode == -signal.SIGINT, d.proc.returncode

    again = Deployment(d.home, d.dags)
    try:
        again.wait_ready()
        assert (d.home / "broker" / "broker.port").read_text() == port
        after = _linked(again, want)
        assert after == before, (before, after)
    finally:
        again.stop()
    again.wait_all_exited(60, "SIGTERM to the restarted make")
