"""Senders and receivers: the protocol state machines driven over a STOMP link and files.
Which module does what: docs/protocol.md (its opening) and docs/development.md, "The code".
"""

from __future__ import annotations

from airflow_provider_amqstream.engine.receive.claims import find_claimed, find_received
from airflow_provider_amqstream.engine.receive.manifest import find_manifest, manifest_path
from airflow_provider_amqstream.engine.receive.session import receive_stream, receive_streams
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions
from airflow_provider_amqstream.engine.records import Checkpoint, FileCheckpoint, TransferResult
from airflow_provider_amqstream.engine.send.batch import (
    BatchFile,
    BatchStatus,
    BulkResult,
    FileFailure,
    FileSet,
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
from airflow_provider_amqstream.exceptions import (
    StreamError,
    StreamFailure,
    StreamNoRoom,
    StreamQuarantined,
    StreamStalled,
    StreamYielded,
)

__all__ = [
    "BatchFile", "BatchStatus", "BulkResult", "FileFailure", "FileSet", "iter_files",
    "find_claimed", "find_manifest",
    "manifest_path",
    "send_files",
    "SendStateDir", "StateDir", "Checkpoint", "FileCheckpoint", "ReceiveOptions", "SendOptions", "StreamError",
    "StreamFailure",
    "StreamNoRoom", "StreamQuarantined", "StreamStalled", "StreamYielded", "TransferResult", "checkpoint_name",
    "default_state_dir", "default_stream_id", "find_received", "id_key", "receive_stream", "receive_streams",
    "send_file",
]
