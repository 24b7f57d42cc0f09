"""The embedded broker's login files (administrator, network bridge): made once, owner-only,
and whole even when two brokers of one machine start at the same moment."""

from __future__ import annotations

import json
import os
from pathlib import Path

from airflow_provider_amqstream.broker import config


def test_a_login_file_is_made_once_and_read_back_without_a_new_secret(tmp_path: Path) -> None:
    path = tmp_path / "d" / "credentials.json"
    made: list[int] = []

    def new() -> dict[str, str]:
        made.append(1)
        return {"user": "u", "password": "p"}

    assert config._login_file(path, new) == ({"user": "u", "password": "p"}, True)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert config._login_file(path, new) == ({"user": "u", "password": "p"}, False)
    assert len(made) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == ["credentials.json"]


def test_the_start_that_links_its_login_file_first_wins_whole(tmp_path: Path) -> None:
    path = tmp_path / "credentials.json"

    def new() -> dict[str, str]:
        # Another broker's start finishes its file while this one makes its secret.
        path.write_text(json.dumps({"user": "first", "password": "theirs"}))
        return {"user": "second", "password": "ours"}

    assert config._login_file(path, new) == ({"user": "first", "password": "theirs"}, False)
    assert json.loads(path.read_text())["password"] == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["credentials.json"]
