"""Senders and receivers: the protocol state machines driven over a STOMP link and files.

* ``send/stream.py``: one file out as a stream (stream and atomic modes), resumable.
* ``send/bulk.py``: many files out over one connection, pipelined, resumable per file;
  ``send/batch.py``: what a batch is (its files, results, the ledger a re-run resumes from).
* ``receive/manifest.py``: a batch's manifest on the receiving side, once all its files are in.
* ``send/handshake.py``: the sender's side of handshake mode (paced by its receivers).
* ``receive/session.py``: streams in, one at a time over one connection, and the policy for a
  stream that fails (quarantine, or yield its place).
* ``receive/stream.py``: one stream's messages: decide, commit, verify, publish.
* ``receive/partial_file.py``: one stream's bytes on disk: reservation, writes, durable batches.
* ``receive/claims.py``: which streams a receiving task took, so its retry finds them.
* ``state_dir.py``: the layout of a receiver's ``out_dir/.amqstream/``.
* ``records.py``: results, errors and crash-safe files shared by both ends.
"""

from __future__ import annotations

from airflow_provider_amqstream.engine.receive.claims import find_claimed, find_received
from airflow_provider_amqstream.engine.receive.manifest import find_manifest, manifest_path
from airflow_provider_amqstream.engine.receive.session import receive_stream, receive_streams
from airflow_provider_amqstream.engine.receive.stream import ReceiveOptions
from airflow_provider_amqstream.engine.records import Checkpoint, FileCheckpoint, TransferResult, default_state_dir
from airflow_provider_amqstream.engine.send.batch import (
    BatchFile,
    BatchStatus,
    BulkResult,
    FileFailure,
    FileSet,
    collect_files,
    iter_files,
)
from airflow_provider_amqstream.engine.send.bulk import send_files
from airflow_provider_amqstream.engine.send.stream import (
    SendOptions,
    checkpoint_name,
    default_stream_id,
    id_key,
    send_file,
)
from airflow_provider_amqstream.engine.state_dir import StateDir
from airflow_provider_amqstream.exceptions import (
    StreamError,
    StreamFailure,
    StreamNoRoom,
    StreamQuarantined,
    StreamStalled,
    StreamYielded,
)

__all__ = [
    "BatchFile", "BatchStatus", "BulkResult", "FileFailure", "FileSet", "collect_files", "iter_files",
    "find_claimed", "find_manifest",
    "manifest_path",
    "send_files",
    "StateDir", "Checkpoint", "FileCheckpoint", "ReceiveOptions", "SendOptions", "StreamError", "StreamFailure",
    "StreamNoRoom", "StreamQuarantined", "StreamStalled", "StreamYielded", "TransferResult", "checkpoint_name",
    "default_state_dir", "default_stream_id", "find_received", "id_key", "receive_stream", "receive_streams",
    "send_file",
]
