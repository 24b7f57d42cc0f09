"""A connection saved from Airflow's form, read by the command line through the metadata
database: no masking warning, the settings intact (needs Airflow's database and the broker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from airflow_provider_amqstream.hooks import connection as c


@pytest.mark.broker
def test_a_connection_saved_from_the_form_is_read_without_a_masking_warning(airflow_db: Path, uri: str) -> None:
    """What the connection form saves (every extra field, none as null now;
    zstd is four characters too) through the CLI's metadata-database lookup: no "Skipping
    masking for a secret as it's too short" on any call."""
    import os
    import subprocess
    import sys
    import time

    from airflow_provider_amqstream.provider_info import CONN_FIELDS

    p = c.params_from_uri(uri)
    (host, port), = p.hosts
    saved = {name: field["schema"].get("default") for name, field in CONN_FIELDS.items()}  # the form's values
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    for conn_id, compression in (("amqs_form_none", None), ("amqs_form_zstd", "zstd")):
        extra = {**saved, "compression": compression}
        subprocess.run([sys.executable, "-m", "airflow", "connections", "add", conn_id, "--conn-json", json.dumps(
            {"conn_type": "amqstream", "host": host, "port": port, "login": p.login, "password": p.password,
             "extra": extra})], check=True, capture_output=True, env=env, timeout=120)
        t0 = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "airflow_provider_amqstream.cli", "test-connection", "--conn",
                              conn_id], capture_output=True, text=True, env=env, timeout=120)
        took = time.monotonic() - t0
        assert run.returncode == 0, run.stderr
        assert "ok: connected to" in run.stdout
        assert "Skipping masking" not in run.stdout + run.stderr, run.stdout + run.stderr
        print(f"\n{conn_id}: test-connection through the metadata database in {took:.1f}s")


def test_the_form_has_fields_for_what_the_streams_page_and_the_network_read() -> None:
    """Airflow's own ProvidersManager (what the UI's form is built from) gives the amqstream form
    a field for each extra a user had to type as JSON: the destinations, receivers' directories,
    quarantine and receiving users the streams page and `streams ls` read, and the network settings."""
    import subprocess
    import sys

    probe = ("import json; from airflow.providers_manager import ProvidersManager; "
             "w = ProvidersManager().connection_form_widgets; "
             "print(json.dumps({k: v.field for k, v in w.items() if k.startswith('extra__amqstream__')}))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    fields = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("destinations", "out_dirs", "quarantine", "receivers", "network", "vhost", "hosts", "tls"):
        assert f"extra__amqstream__{name}" in fields, sorted(fields)
    assert "/queue/" in json.dumps(fields["extra__amqstream__destinations"]), fields["extra__amqstream__destinations"]
    assert "comma-separated" in json.dumps(fields["extra__amqstream__receivers"]), fields["extra__amqstream__receivers"]
