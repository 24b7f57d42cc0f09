"""A second shell with no connection: answered without importing Airflow, pointing at the
local deployment's env.sh when there is one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_provider_amqstream.hooks import connection as c

PROBE = ("import sys; from airflow_provider_amqstream.cli import main; rc = main(['streams', 'ls']); "
         "print(rc, 'airflow' in sys.modules)")


def _bare_shell(cwd: Path) -> subprocess.CompletedProcess[str]:
    # What `env -i PATH=... .venv/bin/amqstream streams ls` leaves: no AIRFLOW_* at all.
    env = {"PATH": os.environ["PATH"], "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("deployed", [True, False])
def test_no_connection_is_said_without_importing_airflow(tmp_path: Path, deployed: bool) -> None:
    if deployed:
        (tmp_path / "airflow-local").mkdir()
        (tmp_path / "airflow-local" / "env.sh").write_text("# written by scripts/airflow.sh\n")
    run = _bare_shell(tmp_path)
    assert run.stdout.split() == ["1", "False"], run.stdout + run.stderr  # failed, and Airflow never imported
    assert "no connection 'amqstream_default'" in run.stderr
    hint = f"`source {tmp_path / 'airflow-local' / 'env.sh'}`"
    assert (hint in run.stderr) is deployed, run.stderr
    assert not (tmp_path / "airflow").exists()  # Airflow's import would have made ~/airflow


def test_airflow_is_asked_only_where_it_may_know(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"AIRFLOW_HOME": str(home)}
    assert not c.airflow_may_know(env)
    assert c.airflow_may_know({**env, "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://db/airflow"})
    assert c.airflow_may_know({**env, "AIRFLOW__SECRETS__BACKEND": "some.Backend"})
    (home / "airflow.cfg").write_text("[database]\nsql_alchemy_conn = postgresql://db/airflow\n")
    assert c.airflow_may_know(env)
    (home / "airflow.cfg").write_text("[core]\nload_examples = False\n")
    assert not c.airflow_may_know(env)
    (home / "airflow.db").touch()
    assert c.airflow_may_know(env)


def test_deciding_whether_airflow_may_know_reads_airflow_cfg_once(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "airflow.cfg").write_text("[core]\nload_examples = False\n")
    reads: list[int] = []
    real = c._airflow_config

    def counted(env: dict[str, str]) -> object:
        reads.append(1)
        return real(env)

    monkeypatch.setattr(c, "_airflow_config", counted)
    assert not c.airflow_may_know({"AIRFLOW_HOME": str(tmp_path)})
    assert len(reads) == 1
