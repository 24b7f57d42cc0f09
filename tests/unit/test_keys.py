"""Key files: private to their owner, never replaced, and named when refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airflow_provider_amqstream.engine import keys
from airflow_provider_amqstream.exceptions import ConfigurationError


def test_a_new_key_file_is_owner_only_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "r.key"
    ident = keys.new_key_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert keys.read_key_file(path).recipient == ident.recipient
    with pytest.raises(ConfigurationError, match="exists already"):
        keys.new_key_file(path)
    assert keys.read_key_file(path).recipient == ident.recipient


def test_a_key_file_others_can_read_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "r.key"
    keys.new_key_file(path)
    path.chmod(0o644)
    with pytest.raises(ConfigurationError, match=f"{path}.*chmod 600"):
        keys.read_key_file(path)


def test_a_missing_or_binary_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="nope.key"):
        keys.read_key_file(tmp_path / "nope.key")
    bad = tmp_path / "bin.key"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    bad.chmod(0o600)
    with pytest.raises(ConfigurationError, match="bin.key"):
        keys.read_key_file(bad)
