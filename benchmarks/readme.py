"""The figures in the README's "Why" table, written from benchmark rows, never by hand.

The table sits between two marker comments in README.md; its prose rows stay as they
are, and the rows whose first cell starts with ``memory``, ``throughput`` or ``many small
files`` are replaced with figures from one ``make bench`` run (the rows of
docs/benchmarks.md).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

BEGIN = "<!-- why-table: figures written by `make bench` (benchmarks/readme.py); do not edit them by hand -->"
END = "<!-- /why-table -->"
MiB = 2**20


def _span(values: list[float], fmt: str = "{:.0f}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}-{hi}"


def _size(row: dict[str, Any]) -> str:
    n = row["bytes"]
    return f"{n / 2**30:g} GiB" if n >= 2**30 and n % 2**28 == 0 else f"{n / MiB:.0f} MiB"


def why_rows(rows: list[dict[str, Any]], date: str, cores: int | None,
             bulk: list[dict[str, Any]] | None = None) -> dict[str, str]:
    """The generated table rows, keyed by the start of their first cell.

    :param rows: benchmark rows (as in docs/benchmarks.md's raw JSON).
    :param date: the day they were measured.
    :param cores: CPU cores of the machine that measured them.
    :param bulk: the many-file rows of the same run, if it measured them.
    """
    if not rows:
        raise ValueError("no benchmark rows to write the README's figures from")
    link = f"[`make bench`, {date}](docs/benchmarks.md)"
    sizes = ", ".join(dict.fromkeys(_size(r) for r in rows))
    memory = (f"| memory, peak RSS ({link}) | sender {_span([r['send_rss'] / 1024 for r in rows])} MiB, receiver "
              f"{_span([r['recv_rss'] / 1024 for r in rows])} MiB at every size measured ({sizes}); broker "
              f"bounded (JVM peak {max(r['broker_rss'] for r in rows) / 1024:.0f} MiB) | flat | flat |")
    big = [r for r in rows if r["size"] == "1G"] or [r for r in rows if r["bytes"] == max(x["bytes"] for x in rows)]
    label = _size(big[0])
    kinds = " and ".join(dict.fromkeys(r["kind"] for r in big))
    ours = _span([r["ours"] for r in big]) + " MiB/s"
    if all("paramiko" in r for r in big):
        ours += f" ({_span([r['ours'] / r['paramiko'] for r in big], '{:.2f}')}x paramiko)"
    env = [r for r in big if "ours_env" in r and "raw_stomp" in r]
    if env:
        ours += (f"; the installed command with `AIRFLOW_CONN_AMQSTREAM_DEFAULT`: {_span([r['ours_env'] for r in env])}"
                 f" MiB/s ({_span([r['ours_env'] / r['raw_stomp'] for r in env], '{:.2f}')}x raw stomp.py"
                 + (", medians of alternating rounds" if all("env_vs_raw_rounds" in r for r in env) else "") + ")")
    sftp = _span([r["paramiko"] for r in big]) + " MiB/s" if all("paramiko" in r for r in big) else "not measured"
    where = f"{cores} cores, " if cores else ""
    throughput = (f"| throughput, {label} end to end ({where}{link}, {kinds} data, one run each) | "
                  f"{ours} | {sftp} | n/a |")
    generated = {"memory": memory, "throughput": throughput}
    small = [r for r in bulk or [] if r.get("ours") and r.get("sftp") and r.get("paramiko")]
    if small:
        r = min(small, key=lambda x: x["bytes"] / x["files"])
        ours, sftp, para = r["ours"]["files_per_s"], r["sftp"]["files_per_s"], r["paramiko"]["files_per_s"]
        rounds = ", medians of alternating rounds" if "ours_vs_sftp_rounds" in r else ""
        generated["many small files"] = (
            f"| many small files, {r['files']:,} x {r['bytes'] // r['files'] // 1024} KiB, one send and one receive "
            f"({where}{link}) | {ours:,.0f} files/s ({ours / sftp:.2f}x OpenSSH sftp `put -r`{rounds}; "
            f"{ours / para:.1f}x paramiko) | {para:,.0f} files/s | n/a |")
    return generated


def update_readme(path: Path, rows: list[dict[str, Any]], date: str, cores: int | None,
                  bulk: list[dict[str, Any]] | None = None) -> None:
    """Replace the figure rows of the README's "Why" table; fail if the table or a row for
    a figure is not found."""
    text = path.read_text()
    try:
        head, rest = text.split(BEGIN + "\n", 1)
        block, tail = rest.split(END, 1)
    except ValueError:
        raise ValueError(f"{path}: the \"Why\" table markers are missing ({BEGIN!r} ... {END!r})") from None
    generated = why_rows(rows, date, cores, bulk)
    lines, seen = [], set()
    for line in block.splitlines():
        first = line.split("|")[1].strip() if line.startswith("|") else ""
        key = next((k for k in generated if first.startswith(k)), None)
        if key:
            seen.add(key)
            line = generated[key]
        lines.append(line)
    if seen != set(generated):
        raise ValueError(f"{path}: the \"Why\" table has no row starting with {sorted(set(generated) - seen)}")
    path.write_text(head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + tail)


def rows_from_report(report: Path) -> tuple[list[dict[str, Any]], str, int | None, list[dict[str, Any]]]:
    """The raw rows, date, core count and many-file rows that docs/benchmarks.md was
    written from."""
    text = report.read_text()
    raw, _, many = text.split("Raw rows (JSON):", 1)[-1].partition("Many-file rows (JSON):")

    def parsed(block: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in block.split("<!--", 1)[0].splitlines() if line.startswith("{")]

    date = re.search(r"\d{4}-\d{2}-\d{2}", text)
    cores = re.search(r"\((\d+) cores\)", text)
    return (parsed(raw), date.group(0) if date else "date unknown", int(cores.group(1)) if cores else None,
            parsed(many))
