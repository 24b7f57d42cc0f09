"""Records against the real broker, each receive its own process: a stream received, the
receiver restarted, the same stream sent again is a duplicate; once its record has
expired it is received again, and the expired day is pruned."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import cli, cli_json, make_file, records_in

pytestmark = pytest.mark.broker


def test_a_restarted_receiver_knows_its_streams_until_their_records_expire(tmp_path: Path, uri: str,
                                                                           queue_name: str) -> None:
    src = make_file(tmp_path / "in" / "daily.csv", 300_000)
    out = tmp_path / "out"
    env = {"AMQSTREAM_STATE_DIR": str(tmp_path / "send-state")}

    def send(*extra: str) -> None:
        [row] = cli_json(cli("send", str(src), "--to", queue_name, "--conn", uri, "--stream-id", "daily-1",
                             "--chunk-size", "65536", "--json", "-q", *extra, env=env))
        assert row["status"] == "complete"

    def receive(*extra: str) -> dict[str, object]:
        rows = cli_json(cli("receive", "--from", queue_name, "--out-dir", str(out), "--conn", uri, "--count", "1",
                            "--wait", "20", "--json", "-q", *extra))
        assert len(rows) == 1, rows
        return rows[0]

    send()
    first = receive()
    assert first["status"] == "complete" and Path(str(first["path"])).read_bytes() == src.read_bytes()
    assert records_in(out) == 1 and not list((out / ".amqstream").glob("*.done"))

    send("--restart")  # the same stream again, as a sender's re-run after a lost receipt
    again = receive()
    assert again["status"] == "duplicate" and again["path"] == first["path"]
    assert sorted(f.name for f in out.iterdir() if not f.name.startswith(".")) == ["daily.csv"]

    # Forty days later (the record's day renamed back in time), the record has expired.
    root = out / ".amqstream" / "records"
    [day] = list(root.iterdir())
    expired = time.strftime("%Y%m%d", time.gmtime(time.time() - 40 * 86400))
    os.rename(day, root / expired)
    send("--restart")
    late = receive("--records-retention-days", "30")
    assert late["status"] == "complete" and late["path"] != first["path"], "received again, beside the first"
    assert Path(str(late["path"])).read_bytes() == src.read_bytes()
    assert expired not in {d.name for d in root.iterdir()}, "the expired day was pruned by the receiver"
