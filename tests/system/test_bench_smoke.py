"""The benchmark code runs (a few MiB, every baseline) so it never rots. Not a timing test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.__main__ import NOTES_MARKER, ROOT, main
from benchmarks.readme import BEGIN, update_readme

pytestmark = pytest.mark.broker


def test_benchmark_smoke_run_writes_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(f"old figures\n{NOTES_MARKER}\n## Notes\n\nhand-written\n")
    assert main(["--sizes", str(3 * 2**20), "--data", "random,csv", "--workdir", str(tmp_path / "w"),
                 "--docs", str(tmp_path / "docs"), "--warm-up", "1", "--installed-sizes", str(3 * 2**20),
                 "--readme", str(readme), "--bulk-sets", "", "--network-size", str(2 * 2**20),
                 "--scale", "200", "--records", "300"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in rows] == ["random", "csv"]
    for r in rows:
        for key in ("ours", "ours_env", "ours_zstd", "send_only", "recv_only", "raw_stomp", "paramiko", "sftp",
                    "scp", "dd"):
            assert r[key] > 0, key
        assert 0 < r["send_rss"] < 150 * 1024 and 0 < r["recv_rss"] < 150 * 1024
        # The installed command with the connection from the environment does not load Airflow.
        assert r["env_send_rss"] < 60 * 1024 and r["env_recv_rss"] < 60 * 1024, r
        for key in ("cpu_ours", "cpu_zstd", "cpu_raw"):
            assert len(r[key]) == 3 and all(c > 0 for c in r[key]), (key, r[key])
    md = (tmp_path / "docs" / "benchmarks.md").read_text()
    assert "| random |" in md and "bench_rss.png" in md and "Where the CPU goes" in md
    # Figures are replaced; the notes written by hand below the marker are kept.
    assert "old figures" not in md and md.endswith(f"{NOTES_MARKER}\n## Notes\n\nhand-written\n")
    net = md.split("## Across a network bridge", 1)[1]
    assert "| one broker |" in net and "| site A -> site B |" in net
    assert (tmp_path / "docs" / "bench_rss.png").stat().st_size > 1000
    # The README's figures now come from this run, and the installed-command row is among them.
    why = readme.read_text().split(BEGIN, 1)[1]
    big = max(rows, key=lambda r: r["ours_env"])
    assert "the installed command with `AIRFLOW_CONN_AMQSTREAM_DEFAULT`" in why
    assert f"{big['ours_env']:.0f}" in why and "3 MiB" in why


def test_readme_figures_come_from_rows(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{BEGIN}\n| | a | b | c |\n|---|---|---|---|\n| kept | x | y | z |\n"
                      "| memory | 43-52 MiB | flat | flat |\n| throughput | 115-140 MiB/s | x | n/a |\n"
                      "<!-- /why-table -->\n\nafter\n")
    row = {"kind": "random", "size": "1G", "bytes": 2**30, "ours": 158.4, "ours_env": 150.2, "raw_stomp": 125.9,
           "paramiko": 142.7, "send_rss": 30376, "recv_rss": 33948, "broker_rss": 658280}
    update_readme(readme, [row], "2026-11-22", 2)
    text = readme.read_text()
    assert "43-52" not in text and "115-140" not in text
    assert "| kept | x | y | z |" in text and text.startswith("intro") and text.endswith("after\n")
    assert "receiver 33 MiB" in text and "158 MiB/s (1.11x paramiko)" in text and "(1.19x raw stomp.py)" in text
    # The many-file row comes from the smallest files' set, only when the run measured it.
    assert "many small" not in text
    bulk = [{"set": "1000x64K", "files": 1000, "bytes": 65536000, "ours": {"files_per_s": 812.0},
             "sftp": {"files_per_s": 650.0}, "paramiko": {"files_per_s": 27.5}, "ours_vs_sftp_rounds": [1.2, 1.3, 1.1]},
            {"set": "20x50M", "files": 20, "bytes": 20 * 50 * 2**20, "ours": {"files_per_s": 3.0},
             "sftp": {"files_per_s": 5.0}, "paramiko": {"files_per_s": 2.0}}]
    with pytest.raises(ValueError, match="many small files"):
        update_readme(readme, [row], "2026-11-22", 2, bulk)
    end = "<!-- /why-table -->"
    readme.write_text(text.replace(end, f"| many small files | old | old | n/a |\n{end}"))
    update_readme(readme, [row], "2026-11-22", 2, bulk)
    many = readme.read_text().split("| many small files", 1)[1].splitlines()[0]
    assert "1,000 x 64 KiB" in many and "812 files/s (1.25x OpenSSH sftp `put -r`, medians" in many
    assert "29.5x paramiko) | 28 files/s" in many and "old" not in many
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers are missing"):
        update_readme(readme, [row], "2026-11-22", 2)


def test_bulk_benchmark_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The many-file rows: every path delivers the set byte-exact (checked inside)."""
    from benchmarks import bulk

    out = tmp_path / "rows.json"
    assert bulk.main(["--sets", "12x4K", "--workdir", str(tmp_path / "w"), "--no-airflow", "--warm-files", "3",
                      "--json", str(out)]) == 0
    [row] = json.loads(out.read_text())
    assert len(row["ours_vs_sftp_rounds"]) == 3 and all(r > 0 for r in row["ours_vs_sftp_rounds"])
    for key in ("ours", "sftp", "paramiko"):
        assert row[key]["files_per_s"] > 0, key
    assert "12x4K" in capsys.readouterr().out
    png = bulk.plot([row], tmp_path)
    assert (tmp_path / png).stat().st_size > 1000


def test_startup_benchmark_smoke_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up figures: the installed command's --version, its first message with the
    connection from the environment, and its peak RSS both ways."""
    from benchmarks import startup

    monkeypatch.setattr(startup, "RUNS", 2)
    assert startup.main([]) == 0
    out = capsys.readouterr().out
    assert "first message of `send`" in out and "Medians of 2 runs" in out
    figures = out.split("|---|---|---|---|", 1)[1].split("\n")[1]
    assert figures.count(" s |") == 2 and figures.count("MiB") == 2, figures


def test_a_run_without_scale_keeps_the_last_scale_section() -> None:
    from benchmarks import scale

    assert scale.kept_section("") == ""
    body = f"{scale.SECTION_START}\n## Scale: many small files\n\n| 1,000 | 0 |\n{scale.SECTION_END}"
    assert scale.kept_section(f"# Benchmarks\n\nold rows\n\n{body}\n\nRaw rows (JSON):\n") == body
    assert scale.kept_section(f"# Benchmarks\n\n{scale.SECTION_START}\nno end marker\n") == ""
