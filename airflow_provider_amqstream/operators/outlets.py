"""Asset events for received files: what lets downstream DAGs schedule on a file's arrival.

A task that receives declares an ``AssetAlias`` as its outlet (the files' names are not
known when the DAG is parsed) and, on success, attaches one asset event per received file
to it: ``file://<host><absolute path>`` with the stream id, size and SHA-256 as extra.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any


def file_asset_uri(path: str) -> str:
    """The asset URI of a received file (the OpenLineage file naming: ``file://host`` + path)."""
    return f"file://{socket.gethostname()}{Path(path).resolve()}"


def alias_outlet(name: str) -> Any:
    """The ``AssetAlias`` a receiving task declares as an outlet."""
    from airflow.sdk import AssetAlias

    return AssetAlias(name=name)


def emit_file_assets(context: Any, alias: str, results: Iterable[Mapping[str, Any]], log: logging.Logger) -> int:
    """Attach an asset event per received file to ``alias``; returns how many were emitted.

    :param context: the task's context (its ``outlet_events`` carries the events).
    :param alias: the ``AssetAlias`` name the task declared.
    :param results: received streams, as ``TransferResult.to_json()`` dicts.
    :param log: the task's logger.
    """
    from airflow.sdk import Asset

    events = context.get("outlet_events") if hasattr(context, "get") else None
    if events is None:
        missed = sum(1 for r in results if r.get("path"))
        log.warning("no outlet events in this context: %d file assets for alias %s not emitted", missed, alias)
        return 0
    target = events[alias_outlet(alias)]
    # One file at a time: ``results`` may be a list file of 100,000 rows read as it goes.
    count, first = 0, ""
    for r in results:
        if not r.get("path"):
            continue
        uri = file_asset_uri(str(r["path"]))
        target.add(Asset(uri=uri),
                   extra={"stream_id": r.get("stream_id"), "bytes": r.get("bytes"), "sha256": r.get("sha256")})
        count += 1
        first = first or uri
    if count == 1:
        log.info("asset event for %s (alias %s)", first, alias)
    elif count:
        log.info("%d asset events for the received files (alias %s)", count, alias)
    return count
