"""The streams page loads in a stock Airflow with the provider installed, in either
``[core] lazy_discover_providers`` setting, without a plugin import error of ours, and without
costing OpenLineage its task events (tests/system/test_lineage_spark.py checks those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import distributions
from pathlib import Path

import pytest

from tests.helpers import ROOT

# What `airflow plugins --output json` prints, and what the UI's "Plugin Import Error" badge shows.
PROBE = """
import contextlib, io, json
from airflow.cli import cli_parser
from airflow.plugins_manager import ensure_plugins_loaded, get_import_errors
out = io.StringIO()
with contextlib.redirect_stdout(out):
    args = cli_parser.get_parser().parse_args(["plugins", "--output", "json"])
    args.func(args)
ensure_plugins_loaded()
print(json.dumps({"plugins": json.loads(out.getvalue()), "errors": get_import_errors()}))
"""


def test_the_package_is_found_once_with_the_checkout_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """An egg-info in the checkout made a second copy of the distribution (and of its plugin
    entry point) wherever the checkout is on sys.path; the Task SDK then dropped every plugin
    after ours in task processes, OpenLineage's listener among them (setup.py)."""
    monkeypatch.syspath_prepend(str(ROOT))
    found = [str(d.locate_file("")) for d in distributions() if d.metadata["Name"] == "airflow-provider-amqstream"]
    assert len(found) == 1, found


@pytest.mark.parametrize("lazy", ["True", "False"])
def test_a_stock_airflow_lists_the_streams_page_without_an_import_error(lazy: str, tmp_path: Path) -> None:
    """A fresh AIRFLOW_HOME and nothing but the setting under test: `airflow plugins` lists the
    page with its FastAPI app and its Browse entry. Import errors: none with the default; with
    lazy discovery off, Airflow reports the OpenLineage provider's own plugin twice (it names it
    both as an entry point and in its provider info, ours or not), and nothing else."""
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "AIRFLOW_HOME": str(tmp_path / "airflow"),
           "AIRFLOW__CORE__LAZY_DISCOVER_PROVIDERS": lazy, "PYTHONPATH": str(ROOT)}
    # From the checkout (on sys.path as '' and PYTHONPATH): where the duplicate came from.
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    [ours] = [p for p in got["plugins"] if p["name"] == "amqstream_streams"]
    assert "airflow-provider-amqstream" in ours["source"] and "airflow.plugins" in ours["source"], ours
    assert [a["url_prefix"] for a in ours["fastapi_apps"]] == ["/amqstream"], ours
    assert [(v["href"], v["category"]) for v in ours["external_views"]] == [("amqstream/streams", "browse")], ours
    errors = got["errors"]
    assert not [k for k, v in errors.items() if "amqstream" in k + v], errors
    if lazy == "True":
        assert errors == {}, errors
    else:
        assert set(errors) <= {"OpenLineageProviderPlugin"}, errors
        assert all("already registered" in v for v in errors.values()), errors
