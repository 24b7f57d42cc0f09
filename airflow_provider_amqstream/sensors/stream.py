"""StreamCompleteSensor: receive, verify and publish one stream."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.providers.common.compat.sdk import conf
from airflow.sdk import BaseSensorOperator, PokeReturnValue

from airflow_provider_amqstream.hooks.amqstream import (
    AmqStreamHook,
    TransferResult,
    find_claimed,
    find_received,
)
from airflow_provider_amqstream.operators.checkpoint import task_claim
from airflow_provider_amqstream.operators.lineage import ReportsLineage
from airflow_provider_amqstream.operators.outlets import Arrivals
from airflow_provider_amqstream.operators.receive import FailureReport, ReceivingTask
from airflow_provider_amqstream.triggers.stream import StreamOfferTrigger


class StreamCompleteSensor(ReceivingTask, ReportsLineage, BaseSensorOperator):
    """Wait for a stream, receive it into ``out_dir``, verify its SHA-256, publish it.

    Succeeds when the file is complete and verified, returning (XCom) its ``path``,
    ``bytes``, ``sha256``, ``name``, ``stream_id`` and transfer figures. Partial data
    and the resume point live in ``out_dir/.amqstream/``, beside the bytes they
    describe, so a retry (or another worker on a shared disk) continues where the
    last try stopped; the resumed offset is published as XCom ``resume_offset``. The
    stream a try takes is claimed for this task instance before its offer is
    acknowledged: if the try then fails to report success, the retry returns that
    stream instead of waiting for another.

    ``source``, ``amqstream_conn_id``, ``overwrite``, ``keys``, ``quarantine``,
    ``min_free_bytes``, ``records_retention_days`` and ``file_asset_alias`` are as on
    ``ReceiveStreamsOperator``.

    :param out_dir: directory where the file is published (templated).
    :param stream_id: receive this stream only (templated); default the next one offered.
    :param window: chunks synced and acknowledged together (default 8; keep it at most half
        the broker's maxPageSize, or the broker stops dispatching until we acknowledge).
    :param idle_timeout: seconds without a chunk before the sender is presumed dead;
        the try fails and a retry resumes.
    :param max_bytes: refuse streams larger than this.
    :param deferrable: wait in the triggerer instead of a worker slot (default
        ``[operators] default_deferrable``). Only the waiting is deferred.
    :param offer_wait: seconds each poke waits for an offer before giving up the poke.

    Assets (README, *Assets and lineage*): the destination is an inlet, the landing directory
    the outlet, with one event per stream that arrived (none for a stream received before).

    Small files of a many-file send travel packed, and a pack is received whole: a sensor
    that takes one then returns its first stream, and reports the others (published and
    recorded the same way) as XCom ``also_received`` and as asset events. Send with
    ``pack=False`` when each file should wait for a sensor of its own.
    """

    template_fields: Sequence[str] = ("source", "out_dir", "stream_id", "quarantine")
    ui_color = "#f3e6d8"
    lineage_sending, lineage_destination_field = False, "source"

    def __init__(self, *, source: str, out_dir: str, stream_id: str | None = None,
                 amqstream_conn_id: str = AmqStreamHook.default_conn_name, window: int | None = None,
                 idle_timeout: float = 120.0, overwrite: bool = False, max_bytes: int | None = None,
                 deferrable: bool = conf.getboolean("operators", "default_deferrable", fallback=False),
                 offer_wait: float = 5.0, file_asset_alias: str | None = None, quarantine: str | None = None,
                 min_free_bytes: int | None = None, records_retention_days: float | None = None,
                 keys: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(source=source, out_dir=out_dir, amqstream_conn_id=amqstream_conn_id, window=window,
                         idle_timeout=idle_timeout, overwrite=overwrite, max_bytes=max_bytes, quarantine=quarantine,
                         min_free_bytes=min_free_bytes, records_retention_days=records_retention_days, keys=keys,
                         file_asset_alias=file_asset_alias, **kwargs)
        if window is not None and window < 1:
            raise ValueError(f"{self.task_id}: window must be at least 1, got {window}")
        if idle_timeout <= 0 or offer_wait <= 0:
            raise ValueError(f"{self.task_id}: idle_timeout and offer_wait must be positive")
        self.stream_id = stream_id
        self.deferrable = deferrable
        self.offer_wait = offer_wait

    def poke(self, context: Any) -> PokeReturnValue:
        self._check_names(self.stream_id)
        result = self.take_stream(context, self.offer_wait)
        if result is None:
            return PokeReturnValue(is_done=False)
        return PokeReturnValue(is_done=True, xcom_value=result.to_json())

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        self._check_names(self.stream_id)
        # Take a stream that is already there without a round trip through the triggerer.
        result = self.take_stream(context, 1.0)
        if result is not None:
            return result.to_json()
        self._defer(context)
        return None

    def _defer(self, context: Any) -> None:
        self.defer(
            trigger=StreamOfferTrigger(source=self.source, stream_id=self.stream_id,
                                       amqstream_conn_id=self.amqstream_conn_id,
                                       poll_interval=float(self.poke_interval),
                                       timeout=timeout_left(self.timeout, context)),
            method_name="execute_complete",
        )

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if not event or event.get("status") != "success":
            from airflow.providers.common.compat.sdk import AirflowException

            raise AirflowException((event or {}).get("message", "trigger ended without an event"))
        result = self.take_stream(context, 30.0)
        if result is None:
            self.log.info("the offered stream was taken by another receiver, or yielded its place; waiting again")
            self._defer(context)
            return None
        return result.to_json()

    def take_stream(self, context: Any, wait: float) -> TransferResult | None:
        """This try's stream: the one ``out_dir`` already holds for this task, else the next
        one offered within ``wait`` seconds (None when none was). Kept for lineage and, if
        it arrived for this task instance, announced as the landing directory's asset event
        with the other files of its pack, which are also reported as XCom ``also_received``."""
        claim = task_claim(context)
        done = self.already_received(claim)
        got = [done] if done is not None else self.receive_offered(context, wait, claim)
        if not got:
            return None
        self._amqstream_result = got[0].to_json()
        # A stream this task instance took (now, or in a try that did not report success)
        # arrived for it; one found received before by anyone else is no arrival.
        ours = done is None or not self.stream_id or any(
            r.get("stream_id") == done.stream_id for r in self.claimed(claim))
        self.emit_landing(context, Arrivals.of(r.to_json() for r in got) if ours else Arrivals(duplicates=len(got)))
        for other in got[1:]:
            self.log.info("also received stream %s -> %s (same pack)", other.stream_id, other.path)
        if len(got) > 1 and context.get("ti") is not None:
            context["ti"].xcom_push(key="also_received", value=[r.to_json() for r in got[1:]])
        return got[0]

    def receive_offered(self, context: Any, wait: float, claim: str | None) -> list[TransferResult]:
        """The next stream offered within ``wait`` seconds, and the rest of its pack (its
        stream first); empty when none was offered.

        Publishes on the way, as XCom, the offset a resumed stream starts at
        (``resume_offset``) and the other streams on the destination that failed meanwhile
        (``failed_streams``).
        """
        ti = context.get("ti")

        def on_event(kind: str, data: dict[str, Any]) -> None:
            if kind == "stream_open" and ti is not None:
                ti.xcom_push(key="resume_offset", value={"stream_id": data["stream_id"],
                                                         "offset": data["resumed_from"]})
            if kind == "stream_open" and data["resumed_from"]:
                self.log.info("resuming stream %s at byte %d", data["stream_id"], data["resumed_from"])

        # Another stream on the destination failed; it was quarantined or yielded its
        # place, and this sensor keeps waiting for a good one.
        failures = FailureReport(self.log)
        opts = self.receive_options(wait=wait, claim=claim, events=on_event)
        hook = AmqStreamHook(self.amqstream_conn_id)  # built per poke, never in __init__
        try:
            got = hook.receive_streams(self.source, self.out_dir, count=1, stream_id=self.stream_id, options=opts,
                                       on_failure=failures)
        finally:
            if failures.streams and ti is not None:
                ti.xcom_push(key="failed_streams", value=failures.streams)
        if got:
            self.log.info("received stream %s -> %s (%d bytes, sha256 %s)", got[0].stream_id, got[0].path,
                          got[0].bytes, got[0].sha256)
        return got

    def claimed(self, claim: str | None) -> list[dict[str, Any]]:
        """The records of the streams ``claim`` (this task instance) took in ``out_dir``, oldest first."""
        return find_claimed(self.out_dir, claim, retention_days=self.records_retention_days) if claim else []

    def already_received(self, claim: str | None) -> TransferResult | None:
        """The stored result if ``out_dir`` already holds this task's stream, else None.

        With ``stream_id``: that stream's record (a re-run, or a run started for a stream
        another run took, must not wait for an offer that is gone). Without: the stream an
        earlier try of this task instance received (its offer was acknowledged, so the
        retry would otherwise wait for a new one and the received file would never reach
        the tasks downstream).
        """
        if self.stream_id:
            record = find_received(self.out_dir, self.stream_id, retention_days=self.records_retention_days)
            why = "was already received"
        else:
            record = next(iter(self.claimed(claim)), None)
            why = "was received by an earlier try of this task"
        if record is None:
            return None
        result = TransferResult.from_json(record)
        self.log.info("stream %s %s into %s (%d bytes, sha256 %s); not waiting for it again", result.stream_id, why,
                      result.path, result.bytes, result.sha256)
        if result.path and not Path(result.path).exists():
            self.log.warning("%s is no longer there (moved or deleted since stream %s was received)",
                             result.path, result.stream_id)
        return result


def timeout_left(timeout: float, context: Any) -> float:
    """Seconds a deferral may wait: the sensor's ``timeout`` (seconds, as BaseSensorOperator
    keeps it) less what this try has run (``ti.start_date``; at least 1)."""
    # The sensor's timeout counts from the start of this try, not from each deferral:
    # a sensor woken for a stream another receiver took must not wait afresh.
    started: datetime | None = getattr(context.get("ti"), "start_date", None) if hasattr(context, "get") else None
    if started is None:
        return float(timeout)
    return max(timeout - (datetime.now(timezone.utc) - started).total_seconds(), 1.0)
