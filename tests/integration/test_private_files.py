"""What the command line writes that holds a secret is its owner's only."""

from __future__ import annotations

import json
import os
from pathlib import Path

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker


def test_the_broker_data_dir_and_its_secrets_are_the_owners_only(tmp_path: Path) -> None:
    data_dir = tmp_path / "broker"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)  # as mkdir under the usual umask leaves it
    old = os.umask(0o022)
    try:
        EmbeddedBroker(data_dir, port=61999).render_config()
    finally:
        os.umask(old)
    # The KahaDB journal (every stored message) and the logs live below it too.
    assert data_dir.stat().st_mode & 0o777 == 0o700
    password = json.loads((data_dir / "credentials.json").read_text())["password"]
    holders = [p for p in data_dir.rglob("*") if p.is_file() and password.encode() in p.read_bytes()]
    assert {p.name for p in holders} == {"credentials.json", "activemq.xml"}, holders
    for p in holders:
        assert p.stat().st_mode & 0o777 == 0o600, p
