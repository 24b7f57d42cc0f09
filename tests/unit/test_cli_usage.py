"""Arguments that do not go together are bad usage: a one-line reason and exit code 2, as
for argparse's own refusals (README, "Exit codes"), never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_amqstream.cli import main


def test_one_stream_id_for_several_files_is_refused_as_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             ) -> None:
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    rc = main(["send", str(a), str(b), "--to", "/queue/usage", "--stream-id", "s1",
               "--conn", "amqstream://u:p@127.0.0.1:9"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "--stream-id names one stream" in err
    assert "Traceback" not in err


def test_a_users_command_without_a_name_is_refused_as_usage(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            ) -> None:
    rc = main(["users", "remove", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "name the user" in err
