"""SendStreamOperator: stream one file to an ActiveMQ destination."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_amqstream import protocol as p
from airflow_provider_amqstream.engine import checkpoint_name, default_stream_id
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.operators.checkpoint import TaskStateCheckpoint
from airflow_provider_amqstream.operators.progress import LogProgress


class SendStreamOperator(BaseOperator):
    """Send a file as a chunked, resumable stream.

    A retry continues from the last chunk the broker confirmed (kept in the task
    state store), never from zero. Returns (XCom ``return_value``) the stream id,
    destination, bytes, chunks, SHA-256, seconds, ``resumed_from`` and
    ``bytes_transferred``; ``resume_offset`` is published while it runs.

    :param path: file to send (templated).
    :param destination: ``/queue/NAME`` the receivers listen on (templated).
    :param stream_id: stream id (templated); default derived from path, size and mtime.
    :param name: file name announced to receivers (templated); default the base name.
    :param amqstream_conn_id: Airflow connection of type ``amqstream``.
    :param chunk_size: bytes per chunk; default from the connection, else 1 MiB.
    :param window: chunks per broker confirmation; default from the connection, else 16.
    :param mode: ``stream`` (receivers start at once) or ``atomic`` (receivers see the
        stream only after every chunk is stored in the broker).
    :param compression: ``"zstd"`` to compress chunks that shrink (CSV, JSON); default the
        connection's ``compression`` extra, else none.
    :param reconnect_timeout: seconds to keep reconnecting to a lost broker before failing.
    :param progress_interval: seconds between progress lines in the task log.
    """

    template_fields: Sequence[str] = ("path", "destination", "stream_id", "name")
    ui_color = "#d8ecf3"

    def __init__(self, *, path: str, destination: str, stream_id: str | None = None, name: str | None = None,
                 amqstream_conn_id: str = AmqStreamHook.default_conn_name, chunk_size: int | None = None,
                 window: int | None = None, mode: str = p.Mode.STREAM.value, compression: str | None = None,
                 reconnect_timeout: float = 120.0,
                 progress_interval: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if mode not in {m.value for m in p.Mode}:
            raise ValueError(f"{self.task_id}: mode must be one of {[m.value for m in p.Mode]}, got {mode!r}")
        if chunk_size is not None and not 1 <= chunk_size <= p.MAX_CHUNK_SIZE:
            raise ValueError(f"{self.task_id}: chunk_size must be in 1..{p.MAX_CHUNK_SIZE}, got {chunk_size}")
        if window is not None and window < 1:
            raise ValueError(f"{self.task_id}: window must be at least 1, got {window}")
        if compression not in (None, *p.ENCODINGS):
            raise ValueError(f"{self.task_id}: compression must be one of {p.ENCODINGS} or None, got {compression!r}")
        self.compression = compression
        self.path = path
        self.destination = destination
        self.stream_id = stream_id
        self.name = name
        self.amqstream_conn_id = amqstream_conn_id
        self.chunk_size = chunk_size
        self.window = window
        self.mode = mode
        self.reconnect_timeout = reconnect_timeout
        self.progress_interval = progress_interval

    def execute(self, context: Any) -> dict[str, Any]:
        src = Path(self.path)
        if not src.is_file():
            raise FileNotFoundError(f"{self.task_id}: {self.path} does not exist or is not a regular file")
        p.Destination.parse(self.destination)
        stream_id = self.stream_id or default_stream_id(src, self.destination)
        hook = AmqStreamHook(self.amqstream_conn_id)
        result = hook.send_file(
            src, self.destination, stream_id=stream_id, name=self.name, chunk_size=self.chunk_size,
            window=self.window, mode=self.mode, reconnect_timeout=self.reconnect_timeout,
            compression=self.compression,
            # One resume point per stream and broker, as for the CLI.
            checkpoint=TaskStateCheckpoint(
                context, "amqstream_send:" + checkpoint_name(stream_id, hook.broker_params()).removesuffix(".json")),
            progress=LogProgress(self.log, f"stream {stream_id} -> {self.destination}", self.progress_interval),
        )
        if result.resumed_from:
            self.log.info("resumed stream %s at byte %d; sent %d bytes in this try",
                          stream_id, result.resumed_from, result.bytes_transferred)
        self.log.info("sent %s (%d bytes, %d chunks) to %s in %.1fs, sha256 %s", src, result.bytes, result.chunks,
                      result.destination, result.seconds, result.sha256)
        self._amqstream_result = result.to_json()
        return self._amqstream_result

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        """Lineage: the file (``file://host`` + path) went to the destination
        (``amqstream://broker:port`` + name), with its size and SHA-256."""
        from airflow_provider_amqstream.operators.lineage import result_of, transfer_lineage

        return transfer_lineage(result_of(self, task_instance),
                                AmqStreamHook(self.amqstream_conn_id).broker_params(), sending=True)
