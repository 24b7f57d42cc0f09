"""SendStreamOperator: stream one file, or many over one connection, to an ActiveMQ destination."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_amqstream import metrics
from airflow_provider_amqstream.assets.amqstream import destination_uri
from airflow_provider_amqstream.hooks.amqstream import (
    COMPRESSION_SETTINGS,
    MAX_CHUNK_SIZE,
    MODES,
    AmqStreamHook,
    BulkResult,
    Destination,
    SendOptions,
    id_key,
    iter_files,
    keyed_digest,
    parse_recipient,
)
from airflow_provider_amqstream.operators.checkpoint import BatchLedger, send_checkpoint
from airflow_provider_amqstream.operators.lineage import ReportsLineage
from airflow_provider_amqstream.operators.outlets import destination_port, emit, sent_extra, with_port
from airflow_provider_amqstream.operators.progress import BatchLogProgress, LogProgress, TaskLog
from airflow_provider_amqstream.operators.xcom import listed


class SendStreamOperator(ReportsLineage, BaseOperator):
    """Send a file as a chunked, resumable stream, or many files over one connection.

    A retry continues from the last chunk the broker confirmed (kept in the task
    state store), never from zero. For one file, returns (XCom ``return_value``) the
    stream id, destination, bytes, chunks, SHA-256, seconds, ``resumed_from`` and
    ``bytes_transferred``; ``resume_offset`` is published while it runs.

    Given a list, a glob pattern or a directory (``recursive``), sends them all in this
    one task over one connection (small files pipelined, see ``engine.send_files``) and
    returns ``{"files": [one entry per file], "failed": [...], "totals": {...}}``. A retry
    skips the files already confirmed (kept in the task state store) and resumes a large
    one where it stopped. A file that fails does not stop the others unless ``fail_fast``;
    the task fails at the end if any did.

    :param path: file to send, or a list of files, a glob pattern or a directory (templated).
    :param recursive: a directory in ``path`` sends everything under it, keeping relative
        paths on the receiving side.
    :param fail_fast: many files: stop at the first one that fails.
    :param manifest: many files: announce the batch so the receiving side writes
        ``<batch id>.manifest.jsonl`` once all of them are in (default on); the batch id is
        in ``totals["batch_id"]``.
    :param pack: many files: send files of one chunk or less up to 64 to a broker message
        (default on, several times faster for small files). Turn off when each file is
        received by its stream id into a directory of its own (a sensor asking for one
        packed stream receives its whole pack) or by receivers that do not read packs (Java).
    :param destination: ``/queue/NAME`` the receivers listen on (templated).
    :param stream_id: stream id (templated); default derived from path, size and mtime.
    :param name: file name announced to receivers (templated); default the base name.
    :param amqstream_conn_id: Airflow connection of type ``amqstream``.
    :param chunk_size: bytes per chunk; default from the connection, else 1 MiB.
    :param window: chunks per broker confirmation; default from the connection, else 16.
    :param mode: ``stream`` (receivers start at once) or ``atomic`` (receivers see the
        stream only after every chunk is stored in the broker).
    :param compression: ``"auto"`` compresses chunks that shrink to half or less (CSV, JSON) and
        stops trying on data that does not; ``"zstd"`` tries every chunk; ``"none"`` sends chunks
        as they are. Default the connection's ``compression`` extra, else none.
    :param seal_to: recipients (``amqs1...``, from ``amqstream keys show``) every file is sealed for:
        the broker then holds nothing readable of it. Default the connection's ``seal_to`` extra.
    :param reconnect_timeout: seconds to keep trying to reach a lost broker, or one that is not up
        yet when the task starts, before failing (a broker that refuses the login fails at once).
    :param progress_interval: seconds between progress lines in the task log.

    Assets (README, *Assets and lineage*): the destination is the outlet, one event per send
    of at least one file; a templated destination goes through an ``AssetAlias`` of the task.
    """

    template_fields: Sequence[str] = ("path", "destination", "stream_id", "name")
    ui_color = "#d8ecf3"
    lineage_sending, lineage_destination_field = True, "destination"

    def __init__(self, *, path: str | list[str], destination: str, recursive: bool = False, fail_fast: bool = False,
                 manifest: bool = True, pack: bool = True,
                 stream_id: str | None = None, name: str | None = None,
                 amqstream_conn_id: str = AmqStreamHook.default_conn_name, chunk_size: int | None = None,
                 window: int | None = None, mode: str = "stream", compression: str | None = None,
                 reconnect_timeout: float = 120.0, seal_to: list[str] | None = None,
                 progress_interval: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Checked here, at parse time: a typo fails the DAG, not a run; each error names the task.
        if mode not in MODES:
            raise ValueError(f"{self.task_id}: mode must be one of {list(MODES)}, got {mode!r}")
        if chunk_size is not None and not 1 <= chunk_size <= MAX_CHUNK_SIZE:
            raise ValueError(f"{self.task_id}: chunk_size must be in 1..{MAX_CHUNK_SIZE}, got {chunk_size}")
        if window is not None and window < 1:
            raise ValueError(f"{self.task_id}: window must be at least 1, got {window}")
        if compression not in (None, *COMPRESSION_SETTINGS):
            raise ValueError(f"{self.task_id}: compression must be one of {COMPRESSION_SETTINGS} or None (the "
                             f"connection's), got {compression!r}")
        for recipient in seal_to or ():
            parse_recipient(recipient)
        # The options every send of this task starts from (nothing in them reads the connection).
        self.send_options = SendOptions(chunk_size=chunk_size, window=window, mode=mode, compression=compression,
                                        reconnect_timeout=reconnect_timeout, fail_fast=fail_fast, manifest=manifest,
                                        pack=pack, seal_to=tuple(seal_to or ()))
        self.path = path
        self.recursive = recursive
        self.destination = destination
        self.stream_id = stream_id
        self.name = name
        self.amqstream_conn_id = amqstream_conn_id
        self.progress_interval = progress_interval
        self.destination_port = destination_port(amqstream_conn_id, destination, self.task_id)
        self.outlets = with_port(self.outlets, self.destination_port)

    def execute(self, context: Any) -> dict[str, Any]:
        hook = AmqStreamHook(self.amqstream_conn_id)
        params = hook.broker_params()
        options = replace(self.send_options, checkpoint_for=lambda sid: send_checkpoint(context, sid, params))
        one = names_one_file(self.path)
        result = self._execute_one(hook, options) if one else self._execute_many(context, hook, options)
        self._amqstream_result = result
        emit(context, self, self.destination_port, destination_uri(self.amqstream_conn_id, self.destination),
             sent_extra(result), self.log)
        return result

    def _execute_one(self, hook: AmqStreamHook, options: SendOptions) -> dict[str, Any]:
        src = Path(str(self.path))
        if not src.is_file():
            raise FileNotFoundError(f"{self.task_id}: {self.path} does not exist or is not a regular file")
        Destination.parse(self.destination)
        stream_id = self.stream_id or hook.default_stream_id(
            src, self.destination, sealed=bool(options.seal_to or hook.broker_params().seal_to))
        progress = LogProgress(self.log, f"stream {stream_id} -> {self.destination}", self.progress_interval)
        result = hook.send_file(src, self.destination, options=replace(options, progress=progress),
                                stream_id=stream_id, name=self.name)
        if result.resumed_from:
            self.log.info("resumed stream %s at byte %d; sent %d bytes in this try",
                          stream_id, result.resumed_from, result.bytes_transferred)
        self.log.info("sent %s (%d bytes, %d chunks) to %s in %.1fs, sha256 %s", src, result.bytes, result.chunks,
                      result.destination, result.seconds, result.sha256)
        sent = result.to_json()
        metrics.emit("stream_sent", sent, destination=self.destination)
        return sent

    def _execute_many(self, context: Any, hook: AmqStreamHook, options: SendOptions) -> dict[str, Any]:
        if self.stream_id or self.name:
            raise ValueError(f"{self.task_id}: stream_id and name apply to one file; not with many")
        paths = [self.path] if isinstance(self.path, str) else list(self.path)
        files = iter_files(paths, recursive=self.recursive)
        ti = context.get("ti")
        batch_id = task_batch_id(hook, ti, self.task_id)
        ledger = BatchLedger(context, batch_id)
        bulk = hook.send_files(
            files, self.destination, options=replace(options, ledger_flush=ledger.flush, ledger_seed=ledger.seed()),
            batch_id=batch_id, on_result=self._sent,
            progress=BatchLogProgress(self.log, f"batch {batch_id} -> {self.destination}", self.progress_interval),
        )
        return batch_result(bulk, batch_id, self.task_id, ti, self.log)

    def _sent(self, sent: Any) -> None:
        """Each file's metrics as it is confirmed (its result is not kept)."""
        if sent.status == "complete":
            metrics.emit("stream_sent", sent.to_json(), destination=self.destination)

    def lineage_start_path(self) -> str | None:
        """The file, when ``path`` names one file (a glob or directory is known only once expanded)."""
        return str(self.path) if names_one_file(self.path) else None


def names_one_file(path: str | list[str]) -> bool:
    """Whether ``path`` (rendered) is one file, not a list, a glob pattern or a directory."""
    return isinstance(path, str) and not any(c in path for c in "*?[") and not Path(path).is_dir()


def task_batch_id(hook: AmqStreamHook, ti: Any, task_id: str) -> str:
    """The batch id of a many-file send: the same for every try of the task instance, so a
    retry finds the ledger of what earlier tries sent; keyed by the connection's secret (as
    default stream ids are), so another user who knows the dag, task and run cannot announce it first."""
    run = f"{getattr(ti, 'dag_id', '')}|{task_id}|{getattr(ti, 'run_id', '')}|{getattr(ti, 'map_index', -1)}"
    return "af-" + keyed_digest(run, id_key(hook.broker_params()))[:24]


def batch_result(bulk: BulkResult, batch_id: str, task_id: str, ti: Any, log: TaskLog) -> dict[str, Any]:
    """Log what a many-file send did and return its XCom ``{"files", "failed", "totals",
    "files_listed", "files_list"}``: ``files`` lists every file up to ``MAX_XCOM_FILES``
    (1,000) and is empty past that (``files_listed`` false; ``files_list``, a JSON-lines file
    in the worker's state directory, lists each); ``failed`` lists the first 1,000 failures.

    If any file failed, the result is pushed as XCom ``partial_result`` instead and the task
    fails naming the first few.
    """
    totals = bulk.totals()
    log.info("batch %s: %d files sent, %d sent before, %d failed; %d bytes in %.1fs (%.1f files/s)",
             batch_id, totals["files_sent"], totals["files_already_sent"], totals["files_failed"],
             totals["bytes_transferred"], totals["seconds"], totals["files_per_second"])
    files = listed([r.to_json() for r in bulk.results], totals["files"] - totals["files_failed"])
    result = {"files": files, "files_listed": bulk.complete and len(files) == len(bulk.results),
              "files_list": bulk.files_list, "failed": [f.to_json() for f in bulk.failures], "totals": totals}
    if bulk.failed:
        if ti is not None:
            ti.xcom_push(key="partial_result", value=result)
        names = ", ".join(f"{f.path} ({f.error})" for f in bulk.failures[:5])
        raise RuntimeError(f"{task_id}: {bulk.failed} of {totals['files']} files failed: {names}; "
                           "a retry sends only what was not confirmed")
    return result
