"""AmqStreamHook: the Airflow connection and the whole transfer, in one place.

The hook never touches the network in ``__init__``; each call opens its own session, so a
retry or a reconnect always starts from a fresh socket.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

from airflow_provider_amqstream import engine
from airflow_provider_amqstream.engine import (
    BatchFile,
    BatchStatus,
    BulkResult,
    FileCheckpoint,
    ReceiveOptions,
    SendOptions,
    SendStateDir,
    StateDir,
    StreamFailure,
    TransferResult,
    default_stream_id,
    find_claimed,
    find_received,
    id_key,
    iter_files,
)
from airflow_provider_amqstream.engine.progress import ProgressMeter, RecentRate
from airflow_provider_amqstream.engine.receive.browse import OfferBrowser
from airflow_provider_amqstream.exceptions import AmqStreamError, StreamError
from airflow_provider_amqstream.hooks import connection
from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol.codec import COMPRESSION_SETTINGS
from airflow_provider_amqstream.protocol.headers import DEFAULT_RECEIVE_BATCH, MAX_CHUNK_SIZE
from airflow_provider_amqstream.protocol.names import Destination, keyed_digest, validate_stream_id
from airflow_provider_amqstream.protocol.seal import parse_recipient
from airflow_provider_amqstream.transport.link import Link, open_link
from airflow_provider_amqstream.transport.params import BrokerParams

# What the Airflow layers (operators, sensors, triggers) use, all from here: they import
# the hook and nothing below it (import-linter holds them to it); parse_recipient checks
# the operators' seal_to without the engine.
__all__ = [
    "COMPRESSION_SETTINGS", "DEFAULT_RECEIVE_BATCH", "MAX_CHUNK_SIZE", "MODES", "AmqStreamHook", "BatchStatus",
    "BrokerParams", "BulkResult", "Destination", "Drained", "FileCheckpoint", "OfferBrowser", "ProgressMeter",
    "ReceiveOptions", "RecentRate", "SendOptions", "SendStateDir", "StreamFailure", "TransferResult", "find_claimed",
    "find_received", "id_key", "iter_files", "keyed_digest", "parse_recipient", "validate_stream_id",
]
MODES = tuple(m.value for m in hdr.Mode)

log = logging.getLogger(__name__)


class AmqStreamHook(BaseHook):
    """Send and receive file streams through ActiveMQ over STOMP 1.2.

    :param amqstream_conn_id: Airflow connection of type ``amqstream``. If it is the
        default id and no such connection exists, the hook falls back to the embedded
        broker started by ``amqstream broker start`` on this machine.
    :param uri: use this ``amqstream://`` URI instead of an Airflow connection.
    """

    conn_name_attr = "amqstream_conn_id"
    default_conn_name = "amqstream_default"
    conn_type = "amqstream"
    hook_name = "ActiveMQ Stream (STOMP)"

    def __init__(self, amqstream_conn_id: str = default_conn_name, *, uri: str | None = None) -> None:
        super().__init__()
        self.amqstream_conn_id = amqstream_conn_id
        self.uri = uri

    # -- connection --------------------------------------------------------------
    def broker_params(self) -> BrokerParams:
        """Connection settings, read on first use (never at DAG parse time)."""
        return self._resolved[1]

    def conn_fields(self) -> connection.ConnFields | None:
        """The connection's fields, read on first use; None for the embedded broker."""
        return self._resolved[0]

    @cached_property
    def _resolved(self) -> tuple[connection.ConnFields | None, BrokerParams]:
        # Every source goes through connection.py's one parser and one reading of the fields,
        # so a URI, a variable and a stored connection cannot disagree about TLS.
        fields: connection.ConnFields | None
        if self.uri:
            fields = connection.parse_connection(self.uri, self.amqstream_conn_id, "the hook's uri")
        else:
            fields = connection.from_env(self.amqstream_conn_id) or connection.looked_up(
                self.get_connection, self.amqstream_conn_id, f"connection {self.amqstream_conn_id!r}")
        if fields is None:
            params = connection.embedded_instead(self.amqstream_conn_id)
            log.info("no connection %r: using the embedded broker at %s", self.amqstream_conn_id, params.url)
            return None, params
        if fields.password:  # out of task logs, as Airflow does for the connections it reads itself
            from airflow.sdk.log import mask_secret

            mask_secret(fields.password)
        return fields, fields.broker_params()

    def get_conn(self) -> Link:
        """A new, open STOMP session. The caller closes it (or uses ``with``)."""
        return open_link(self.broker_params()).open()

    def test_connection(self) -> tuple[bool, str]:
        """Connect, prove a round trip with a receipt, disconnect."""
        try:
            params = self.broker_params()
            with open_link(params) as link:
                link.round_trip()
        except AmqStreamError as exc:
            return False, str(exc)
        return True, f"Connected to {params.url} and received a receipt"

    # -- checks (no network) ----------------------------------------------------
    def default_stream_id(self, path: str | os.PathLike[str], destination: str, *, sealed: bool = False) -> str:
        """A file's default stream id: the same for a re-run (it resumes), keyed by this
        connection's secret (another user cannot offer it first).

        :param sealed: the stream is sealed: the id shows nothing of the file's name.
        """
        return default_stream_id(path, destination, key=id_key(self.broker_params()), sealed=sealed)

    @staticmethod
    def files_list_path(out_dir: str | os.PathLike[str], claim: str | None) -> Path:
        """Where a drain of ``out_dir`` by ``claim`` lists every stream it received (a retry replaces it)."""
        key = hashlib.sha256((claim or f"pid-{os.getpid()}-{time.time()}").encode()).hexdigest()[:32]
        return StateDir(out_dir).lists / f"{key}.files.jsonl"

    # -- transfers ---------------------------------------------------------------
    def send_file(self, path: str | os.PathLike[str], destination: str, *, options: SendOptions | None = None,
                  stream_id: str | None = None, name: str | None = None) -> TransferResult:
        """Send a file as a stream, resuming where an earlier try stopped.

        :param destination: ``/queue/NAME`` (or ``/topic/NAME`` in handshake mode).
        :param options: how to send (:class:`SendOptions`); see
            :func:`airflow_provider_amqstream.engine.send_file`.
        :param stream_id: stream id (default derived from the file and destination).
        :param name: file name announced to receivers (default the base name).
        """
        return engine.send_file(self.broker_params(), path, destination, options, stream_id=stream_id, name=name)

    def send_files(self, files: Iterable[str | os.PathLike[str] | BatchFile], destination: str, *,
                   options: SendOptions | None = None, batch_id: str | None = None,
                   progress: Callable[[BatchStatus], None] | None = None,
                   on_result: Callable[[TransferResult], None] | None = None) -> BulkResult:
        """Send many files over one connection; see :func:`airflow_provider_amqstream.engine.send_files`.

        :param files: paths, or :class:`BatchFile` (path and relative directory).
        :param batch_id: names the batch's ledger (default derived from the destination and files).
        :param progress: called with a :class:`BatchStatus` after each group of confirmations.
        :param on_result: called with each file's result as it is confirmed.
        """
        return engine.send_files(self.broker_params(), files, destination, options, batch_id=batch_id,
                                 progress=progress, on_result=on_result)

    def receive_streams(self, source: str, out_dir: str | os.PathLike[str], *, count: int | None = None,
                        stream_id: str | None = None, options: ReceiveOptions | None = None,
                        on_failure: Callable[[StreamFailure], None] | None = None) -> list[TransferResult]:
        """Receive streams over one connection, going on past streams that fail (each is
        quarantined or yields its place, and reported to ``on_failure``); see
        :func:`airflow_provider_amqstream.engine.receive_streams`."""
        return engine.receive_streams(self.broker_params(), source, out_dir, count=count, stream_id=stream_id,
                                      options=options, on_failure=on_failure)

    def drain(self, source: str, out_dir: str | os.PathLike[str], *, options: ReceiveOptions,
              count: int | None = None, batch_id: str | None = None, batch_sender: str | None = None,
              deadline: float = 3600.0, into: Drained | None = None) -> Drained:
        """Receive until ``count`` streams arrived, until the manifest of ``batch_id`` is
        written, until ``options.wait_timeout`` passes with no offer (without a batch), or
        until ``deadline`` seconds. Streams ``options.claim`` took in earlier tries count first.

        Raises :class:`StreamError` when a batch is not complete by the deadline.

        :param options: the receive options (their ``wait_timeout`` is the quiet time that ends a drain;
            their ``claim``, the taker recorded with each stream, an Airflow task instance).
        :param count: how many streams in all (None: no limit).
        :param batch_id: stop once this batch's manifest is written.
        :param batch_sender: the user whose batch it is (None: whoever, if only one).
        :param deadline: seconds in all.
        :param into: the :class:`Drained` to fill (its ``keep``, ``files_list`` and
            ``on_failure``); default one that lists every record.
        """
        if options.records_retention_days is None:
            options = dataclasses.replace(options, records_retention_days=self.broker_params().records_retention_days)
        with into or Drained() as drained:
            for done in (find_claimed(out_dir, options.claim, retention_days=options.records_retention_days)
                         if options.claim else []):
                drained.add(done)
            until = time.monotonic() + deadline
            watch = _BatchWatch(options.events, lambda: engine.find_manifest(out_dir, batch_id, batch_sender)) \
                if batch_id else None
            manifest = watch.find() if watch else None
            while (count is None or drained.count < count) and manifest is None:
                left = until - time.monotonic()
                # With a batch to wait for, also look for its manifest every few seconds: another
                # receiver of the same directory may be the one that completes it.
                wait = min(options.wait_timeout or 5.0, 5.0, max(left, 0.1)) if batch_id else options.wait_timeout
                before = drained.count
                engine.receive_streams(self.broker_params(), source, out_dir,
                                       count=None if count is None else count - drained.count,
                                       options=dataclasses.replace(
                                           options, wait_timeout=wait, stop_after=max(left, 0.0),
                                           stop_when=watch.done if watch else None,
                                           events=watch.on_event if watch else options.events),
                                       on_failure=drained.on_failure, on_result=lambda r: drained.add(r.to_json()))
                manifest = watch.find() if watch else None
                if manifest is not None or (count is not None and drained.count >= count):
                    break
                if time.monotonic() >= until:
                    if batch_id:
                        raise StreamError(f"batch {batch_id} was not complete in {out_dir} after {deadline:.0f}s "
                                          f"({drained.count} streams received); its manifest is written once every "
                                          "listed file is in")
                    break
                if not batch_id and drained.count == before:
                    break
        drained.manifest = manifest
        return drained

    def offer_browser(self, source: str) -> OfferBrowser:
        """A watcher of the offers on ``source`` over one kept session (blocking: call it from
        a thread in a trigger); it opens its session on the first look."""
        return OfferBrowser(self.broker_params(), source)


class _BatchWatch:
    """Ends a drain as soon as its batch's manifest is written: the receiver announces each
    manifest it completes (``batch_complete``), and only then is ``find`` asked; ``events``
    is still told every event."""

    def __init__(self, events: Callable[[str, dict[str, Any]], None] | None,
                 find: Callable[[], Path | None]) -> None:
        self.events, self.find = events, find
        self.announced = False

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "batch_complete":
            self.announced = True
        if self.events is not None:
            self.events(kind, data)

    def done(self) -> bool:
        if not self.announced:
            return False
        self.announced = False  # another batch's manifest: look again at the next announcement
        return self.find() is not None


@dataclass
class Drained:
    """What :meth:`AmqStreamHook.drain` received: the streams' records (the first ``keep`` of
    them; all without ``keep``, the others counted, so memory stays flat however many streams
    arrive), how many and their bytes, and the batch's manifest. With a ``files_list`` (a
    path) every record is also written there, one JSON line each (replaced); ``on_failure``
    is called with each stream quarantined or yielded."""

    files: list[dict[str, Any]] = field(default_factory=list)
    manifest: Path | None = None
    keep: int | None = None
    count: int = 0
    bytes: int = 0
    files_list: Any = None  # an open text file while draining; its path before and after
    on_failure: Callable[[StreamFailure], None] | None = None

    def __enter__(self) -> Drained:
        if self.files_list is not None:
            Path(self.files_list).parent.mkdir(parents=True, exist_ok=True)
            self.files_list = open(self.files_list, "w", encoding="utf-8")  # noqa: SIM115 - closed by __exit__
        return self

    def add(self, record: dict[str, Any]) -> None:
        self.count += 1
        self.bytes += int(record.get("bytes") or 0)
        if self.keep is None or len(self.files) < self.keep:
            self.files.append(record)
        if self.files_list is not None:
            self.files_list.write(json.dumps(record, ensure_ascii=False) + "\n")

    def __exit__(self, *exc: object) -> None:
        if self.files_list is not None:
            self.files_list.close()
            self.files_list = self.files_list.name
