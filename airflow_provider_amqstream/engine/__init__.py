"""Senders and receivers: the protocol state machines driven over a STOMP link and files.
Which module does what: docs/protocol.md (its opening) and docs/development.md, "The code".
"""

from __future__ import annotations

from airflow_provider_amqstream.engine.receive.claims import find_claimed, find_received
from airflow_provider_amqstream.engine.receive.manifest import find_manifest
from airflow_provider_amqstream.engine.receive.session import receive_stream, receive_streams
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions
from airflow_provider_amqstream.engine.records import FileCheckpoint, TransferResult
from airflow_provider_amqstream.engine.send.batch import (
    BatchFile,
    BatchStatus,
    BulkResult,
    FileFailure,
    iter_files,
)
from airflow_provider_amqstream.engine.send.bulk import send_files
from airflow_provider_amqstream.engine.send.stream import (
    SendOptions,
    default_stream_id,
    id_key,
    send_file,
)
from airflow_provider_amqstream.engine.state_dir import SendStateDir, StateDir, checkpoint_name, default_state_dir
from airflow_provider_amqstream.exceptions import StreamFailure, StreamQuarantined, StreamStalled

__all__ = [
    "BatchFile", "BatchStatus", "BulkResult", "FileFailure", "iter_files",
    "find_claimed", "find_manifest",
    "send_files",
    "SendStateDir", "StateDir", "FileCheckpoint", "ReceiveOptions", "SendOptions",
    "StreamFailure",
    "StreamQuarantined", "StreamStalled", "TransferResult", "checkpoint_name",
    "default_state_dir", "default_stream_id", "find_received", "id_key", "receive_stream", "receive_streams",
    "send_file",
]
