"""How many files a task's XCom lists: every one up to :data:`MAX_XCOM_FILES`; past that,
totals only and ``files_list``, the path of a JSON-lines file on the worker that lists each
(one ``TransferResult`` as JSON a line), so a batch of 100,000 files is a few hundred bytes
of XCom rather than tens of MB in the metadata database."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

MAX_XCOM_FILES = 1000


def listed(files: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """What XCom ``files`` holds: ``files`` when they are all ``count`` files and at most
    :data:`MAX_XCOM_FILES`, else nothing (the totals and ``files_list`` say the rest)."""
    return files if len(files) == count <= MAX_XCOM_FILES else []


def iter_result_files(result: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every file of a many-file result: its ``files`` when they are all listed, else read
    one at a time from its ``files_list`` (empty if that file is gone, e.g. on another worker)."""
    if result.get("files_listed", True) or not result.get("files_list"):
        yield from (f for f in result.get("files") or [] if isinstance(f, dict))
        return
    try:
        with open(str(result["files_list"]), encoding="utf-8") as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    yield row
    except OSError:
        return
