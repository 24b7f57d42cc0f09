"""Streams moved, quarantined and yielded, as Airflow metrics (StatsD, Datadog or
OpenTelemetry: whatever ``[metrics]`` configures), per destination.

The engine reports what happens to streams through the ``events`` callback of its options
(``ReceiveOptions(events=...)``), as ``(kind, data)``; :func:`emit` maps those events to
Airflow's own metrics (``airflow.sdk.observability.stats``, the Task SDK's; the old
``airflow.stats.Stats`` is a deprecated shim in 3.3), each with a ``destination`` tag. The
metrics and the events that count them: README.md, "Metrics". Metrics never fail a
transfer: a metrics backend that raises is logged at debug and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from airflow_provider_amqstream.protocol.outcomes import Outcome

log = logging.getLogger(__name__)

PREFIX = "amqstream"
FILES_RECEIVED = f"{PREFIX}.files_received"
BYTES_RECEIVED = f"{PREFIX}.bytes_received"
FILES_SENT = f"{PREFIX}.files_sent"
BYTES_SENT = f"{PREFIX}.bytes_sent"
STREAMS_QUARANTINED = f"{PREFIX}.streams_quarantined"
STREAMS_YIELDED = f"{PREFIX}.streams_yielded"
DUPLICATES = f"{PREFIX}.duplicates"
NAMES = (FILES_RECEIVED, BYTES_RECEIVED, FILES_SENT, BYTES_SENT, STREAMS_QUARANTINED, STREAMS_YIELDED, DUPLICATES)


def _count(value: Any) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        return 0
    return max(n, 0)


def metric_calls(event_kind: str, data: Mapping[str, Any], *,
                 destination: str | None = None) -> list[tuple[str, int, dict[str, str]]]:
    """The counter increments one engine event makes: ``(name, count, tags)`` each;
    ``destination`` where the event's data does not name it."""
    dest = str(data.get("destination") or destination or "unknown")
    tags = {"destination": dest}
    moved = _count(data.get("bytes_transferred", data.get("bytes")))
    if event_kind == "stream_close":
        return [(FILES_RECEIVED, 1, tags), (BYTES_RECEIVED, moved, tags)]
    if event_kind == "stream_sent":  # a file an earlier run sent moved nothing now
        return [] if data.get("status") == "already_sent" else [(FILES_SENT, 1, tags), (BYTES_SENT, moved, tags)]
    if event_kind == "stream_quarantined":
        return [(STREAMS_QUARANTINED, 1, tags)]
    if event_kind == "stream_yielded":
        outcome = Outcome.parse(data.get("cause"))
        status = outcome.label if outcome is not None else str(data.get("status") or Outcome.STALLED.label)
        return [(STREAMS_YIELDED, 1, {**tags, "status": status})]
    if event_kind == "duplicate_offer":
        return [(DUPLICATES, 1, tags)]
    if event_kind == "bytes":
        name = BYTES_SENT if data.get("direction") == "sent" else BYTES_RECEIVED
        return [(name, _count(data.get("count")), tags)]
    return []


def emit(event_kind: str, data: Mapping[str, Any], *, destination: str | None = None) -> None:
    """Report one engine event as Airflow metrics (see the module doc for the names)."""
    calls = metric_calls(event_kind, data, destination=destination)
    if not calls:
        return
    try:
        from airflow.sdk.observability import stats

        for name, count, tags in calls:
            if count:
                stats.incr(name, count=count, tags=tags)
    except Exception as exc:  # a metrics backend must never fail a transfer
        log.debug("metrics for %s not emitted: %s", event_kind, exc)
