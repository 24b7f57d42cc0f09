"""ReceiveStreamsOperator: drain a destination into a directory in one task, one connection;
and what it shares with StreamCompleteSensor (ReceivingTask, FailureReport)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_provider_amqstream import metrics
from airflow_provider_amqstream.assets.files import dir_uri, static_root
from airflow_provider_amqstream.hooks.amqstream import (
    DEFAULT_RECEIVE_BATCH,
    AmqStreamHook,
    Destination,
    Drained,
    ReceiveOptions,
    StreamFailure,
    validate_stream_id,
)
from airflow_provider_amqstream.operators.checkpoint import task_claim
from airflow_provider_amqstream.operators.lineage import ReportsLineage
from airflow_provider_amqstream.operators.outlets import (
    Arrivals,
    destination_port,
    emit,
    landing_port,
    with_port,
)
from airflow_provider_amqstream.operators.progress import LogProgress, TaskLog
from airflow_provider_amqstream.operators.xcom import MAX_XCOM_FILES, iter_result_files, listed

if TYPE_CHECKING:
    from airflow.sdk.types import Logger


class ReceivingTask:
    """What the receiving tasks share: the receive arguments they keep (documented on each
    task), their assets, the checks of their destinations and the engine options built from
    them. Mixed in before the Airflow base class: its ``__init__`` keeps the arguments, then
    declares the destination as inlet and the landing directory as outlet (named before
    ``out_dir`` is rendered)."""

    task_id: str
    log: Logger
    inlets: Any
    outlets: Any

    def __init__(self, *, source: str, out_dir: str, amqstream_conn_id: str, window: int | None,
                 idle_timeout: float, overwrite: bool, max_bytes: int | None, quarantine: str | None,
                 min_free_bytes: int | None, records_retention_days: float | None, keys: list[str] | None,
                 file_asset_alias: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.source, self.out_dir, self.amqstream_conn_id = source, out_dir, amqstream_conn_id
        self.window, self.idle_timeout, self.overwrite, self.max_bytes = window, idle_timeout, overwrite, max_bytes
        self.quarantine, self.min_free_bytes = quarantine, min_free_bytes
        self.records_retention_days, self.keys = records_retention_days, tuple(keys or ())
        self.landing_port = landing_port(out_dir, self, file_asset_alias)
        self.landing_root = static_root(out_dir)
        self.outlets = with_port(self.outlets, self.landing_port)
        self.inlets = with_port(self.inlets, destination_port(amqstream_conn_id, source, self.task_id))

    def emit_landing(self, context: Any, arrivals: Arrivals, *, manifest: str | None = None,
                     batch_id: str | None = None) -> bool:
        """The landing directory's event, when anything arrived (nothing, or only repeats: no
        event, logged). For an alias, the static root of the ``out_dir`` template is the asset's
        directory, or the rendered ``out_dir`` when all of it is templated."""
        uri = getattr(self.landing_port, "uri", None) or dir_uri(self.landing_root or self.out_dir)
        if not arrivals.files:
            self.log.info("no asset event for %s: nothing new arrived (%d repeats of streams received before)",
                          uri, arrivals.duplicates)
        extra = arrivals.extra(self.out_dir, manifest=manifest, batch_id=batch_id) if arrivals.files else None
        return emit(context, self, self.landing_port, uri, extra, self.log)

    def _check_names(self, stream_id: str | None) -> None:
        """Refuse, before any connection, a ``source`` or ``quarantine`` that names no
        destination, or a stream (or batch) id no sender could have used."""
        Destination.parse(self.source)
        if self.quarantine:
            Destination.parse(self.quarantine)
        if stream_id:
            validate_stream_id(stream_id)

    def receive_options(self, *, wait: float, claim: str | None,
                        events: Callable[[str, dict[str, Any]], None] | None = None) -> ReceiveOptions:
        """The engine's options for one receive of this task: wait ``wait`` seconds for an
        offer, take streams under ``claim``; every event goes to ``events`` and to metrics."""

        def on_event(kind: str, data: dict[str, Any]) -> None:
            metrics.emit(kind, data, destination=self.source)
            if events is not None:
                events(kind, data)

        return ReceiveOptions(window=self.window or DEFAULT_RECEIVE_BATCH, wait_timeout=wait,
                              idle_timeout=self.idle_timeout, overwrite=self.overwrite, max_bytes=self.max_bytes,
                              quarantine=self.quarantine, min_free_bytes=self.min_free_bytes, claim=claim,
                              events=on_event, progress=LogProgress(self.log, f"receive from {self.source}"),
                              records_retention_days=self.records_retention_days, keys=self.keys)


class ReceiveStreamsOperator(ReceivingTask, ReportsLineage, BaseOperator):
    """Receive many streams in one task over one connection: until ``count`` arrived, until
    the manifest of ``batch_id`` is written, until ``wait_timeout`` passes with no offer, or
    until ``deadline``.

    Returns (XCom ``return_value``) ``{"files": [one entry per stream], "failed": [...],
    "manifest": path or None, "count": n, "bytes": total, "files_listed": bool, "files_list":
    path, "failed_count": n}``: ``files`` lists every stream up to ``MAX_XCOM_FILES`` (1,000),
    and is empty past that (``files_listed`` false), when ``files_list`` (a JSON-lines file
    in ``out_dir/.amqstream/lists/``, one record a line) and the manifest list them;
    ``failed`` lists the first 1,000 failures. Streams that fail are quarantined or yield
    their place and are reported in ``failed``; they do not stop the others. A retry
    starts from the streams earlier tries of the same task instance received (they count
    towards ``count`` and are listed in ``files``), so none is lost between tries.

    :param source: ``/queue/NAME`` to receive from (templated).
    :param out_dir: the output directory (templated).
    :param count: stop after this many streams (None: no limit); the files of a pack arrive
        together, so the last pack may bring a few more, all listed.
    :param batch_id: stop once the manifest of this batch is written (templated; a sender's
        ``totals["batch_id"]``); the task fails if it is not by ``deadline``. Manifests are
        kept per sending user under ``out_dir/.amqstream/manifests/<user>/``.
    :param batch_sender: the user (as the broker knows it) whose batch ``batch_id`` is
        (templated). Without it, a batch id completed by two users fails the task rather
        than pick one; with it, no other user's batch of that id is ever taken.
    :param wait_timeout: seconds with no offer before stopping (without ``batch_id``).
    :param deadline: seconds in all: with ``batch_id`` the task fails if the batch is not
        complete by then; without, it takes no new stream after it and returns what arrived
        (a steady trickle of offers would otherwise keep it draining for ever).
    :param amqstream_conn_id: Airflow connection of type ``amqstream``.
    :param window: chunks synced and acknowledged together (default 8).
    :param idle_timeout: seconds without a chunk before a sender is presumed gone.
    :param overwrite: replace an existing file of the same name.
    :param max_bytes: quarantine streams larger than this.
    :param keys: key files sealed streams are opened with (default the connection's ``keys`` extra).
    :param quarantine: where streams that can never succeed go (templated; default
        ``/queue/DLQ.<name>``).
    :param min_free_bytes: free space to keep in ``out_dir``; a stream that would cross it
        yields its place (default 2 % of the filesystem, at most 1 GiB).
    :param records_retention_days: days ``out_dir`` keeps its completion records and claims
        (default: the connection's extra ``records_retention_days``, else 30; 0: for ever).
        Older ones are pruned as receiving starts; a stream offered again after its record
        expired is received again.
    :param file_asset_alias: name of an ``AssetAlias`` for the landing directory's events
        to go through instead of its asset (resolved at run time: Airflow draws no link).

    Assets (README, *Assets and lineage*): the destination is an inlet, the landing directory
    the outlet, with one event per run that received anything new.
    """

    template_fields: Sequence[str] = ("source", "out_dir", "batch_id", "batch_sender", "quarantine")
    ui_color = "#f3e6d8"
    lineage_sending, lineage_destination_field = False, "source"

    def __init__(self, *, source: str, out_dir: str, count: int | None = None, batch_id: str | None = None,
                 wait_timeout: float = 30.0, deadline: float = 3600.0,
                 amqstream_conn_id: str = AmqStreamHook.default_conn_name, window: int | None = None,
                 idle_timeout: float = 120.0, overwrite: bool = False, max_bytes: int | None = None,
                 file_asset_alias: str | None = None, quarantine: str | None = None,
                 min_free_bytes: int | None = None, batch_sender: str | None = None,
                 records_retention_days: float | None = None, keys: list[str] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(source=source, out_dir=out_dir, amqstream_conn_id=amqstream_conn_id, window=window,
                         idle_timeout=idle_timeout, overwrite=overwrite, max_bytes=max_bytes, quarantine=quarantine,
                         min_free_bytes=min_free_bytes, records_retention_days=records_retention_days, keys=keys,
                         file_asset_alias=file_asset_alias, **kwargs)
        if count is not None and count < 1:
            raise ValueError(f"{self.task_id}: count must be at least 1, got {count}")
        if wait_timeout <= 0 or deadline <= 0:
            raise ValueError(f"{self.task_id}: wait_timeout and deadline must be positive")
        self.count, self.batch_id, self.batch_sender = count, batch_id, batch_sender
        self.wait_timeout, self.deadline = wait_timeout, deadline

    def execute(self, context: Any) -> dict[str, Any]:
        self._check_names(self.batch_id)
        hook = AmqStreamHook(self.amqstream_conn_id)
        claim = task_claim(context)
        failed = FailureReport(self.log)
        opts = self.receive_options(wait=self.wait_timeout, claim=claim)
        into = Drained(keep=MAX_XCOM_FILES + 1, files_list=hook.files_list_path(self.out_dir, claim), on_failure=failed)
        drained = hook.drain(self.source, self.out_dir, options=opts, count=self.count, batch_id=self.batch_id,
                             batch_sender=self.batch_sender, deadline=self.deadline, into=into)
        files = listed(drained.files, drained.count)
        self.log.info("received %d streams (%d bytes) from %s into %s%s; each listed in %s", drained.count,
                      drained.bytes, self.source, self.out_dir,
                      f"; manifest {drained.manifest}" if drained.manifest else "", drained.files_list)
        manifest = str(drained.manifest) if drained.manifest else None
        result = {"files": files, "files_listed": len(files) == drained.count, "files_list": str(drained.files_list),
                  "failed": failed.streams, "failed_count": failed.count, "manifest": manifest,
                  "count": drained.count, "bytes": drained.bytes}
        # Counted a stream at a time: past MAX_XCOM_FILES the list file is read as it goes.
        self.emit_landing(context, Arrivals.of(iter_result_files(result)), manifest=manifest, batch_id=self.batch_id)
        self._amqstream_result = result
        return self._amqstream_result


class FailureReport:
    """The streams a receive gave up on (quarantined, or yielded their place), each logged
    as it fails and kept for the task's result or XCom; receiving goes on without them."""

    def __init__(self, log: TaskLog) -> None:
        self.log = log
        self.streams: list[dict[str, Any]] = []  # the first MAX_XCOM_FILES
        self.count = 0

    def __call__(self, failure: StreamFailure) -> None:
        self.log.warning("stream %s on %s %s: %s", failure.stream_id, failure.destination, failure.status,
                         failure.reason)
        self.count += 1
        if len(self.streams) < MAX_XCOM_FILES:
            self.streams.append(failure.to_json())
