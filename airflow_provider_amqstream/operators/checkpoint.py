"""What a task's retries must find again: the sender's resume point (TaskStateCheckpoint,
send_checkpoint), the files of a many-file send already confirmed (BatchLedger) and the
receiver's claim on the streams it took (task_claim)."""

from __future__ import annotations

import time
from typing import Any

from airflow_provider_amqstream.hooks.amqstream import BrokerParams, FileCheckpoint, SendStateDir


class TaskStateCheckpoint:
    """A sender checkpoint that survives retries on any worker.

    Airflow 3.3 clears a task's XCom at the start of every try, so the resume point
    lives in the task state store (scoped to this task instance, kept across tries),
    mirrored in a local ``file`` for speed. On load the more advanced of the two wins:
    both only ever record chunks the broker confirmed. Each save also publishes the
    offset to XCom (``resume_offset``) for other tasks and for people in the UI. Writes the
    store at most every ``min_interval`` seconds, unless the state changes.
    """

    def __init__(self, context: Any, key: str, file: FileCheckpoint, min_interval: float = 2.0) -> None:
        self.store = context.get("task_state_store")
        self.ti = context.get("ti")
        self.key = key
        self.file = file
        self.min_interval = min_interval
        self.last = 0.0
        self.last_flags: tuple[Any, Any] | None = None

    def load(self) -> dict[str, Any] | None:
        candidates = [self.file.load()]
        if self.store is not None:
            candidates.append(self.store.get(self.key))
        found = [c for c in candidates if isinstance(c, dict)]
        if not found:
            return None
        return max(found, key=lambda c: (c.get("end_sent", False), c.get("offer_sent", False),
                                         c.get("confirmed_seq", 0)))

    def save(self, data: dict[str, Any], *, final: bool = False) -> None:
        self.file.save(data)
        flags = (data.get("offer_sent"), data.get("end_sent"))
        now = time.monotonic()
        if not final and flags == self.last_flags and now - self.last < self.min_interval:
            return
        self.last, self.last_flags = now, flags
        if self.store is not None:
            self.store.set(self.key, data)
        if self.ti is not None:
            offset = min(int(data["confirmed_seq"]) * int(data["chunk_size"]), int(data["size"]))
            self.ti.xcom_push(key="resume_offset", value={"stream_id": data["stream_id"], "offset": offset,
                                                           "size": data["size"]})


def send_checkpoint(context: Any, stream_id: str, params: BrokerParams) -> TaskStateCheckpoint:
    """The resume point of one stream a task sends: one per stream and broker, as for the CLI."""
    sdir = SendStateDir()
    key = f"amqstream_send:{stream_id}@{sdir.broker_key(params)}"
    return TaskStateCheckpoint(context, key, FileCheckpoint(sdir.task_checkpoint(stream_id, params)))


class BatchLedger:
    """The streams of a many-file send the broker confirmed, kept in the task state store
    (scoped to this task instance, kept across tries) so a retry skips them."""

    def __init__(self, context: Any, batch_id: str) -> None:
        self.store = context.get("task_state_store")
        self.key = f"amqstream_batch:{batch_id}"

    def seed(self) -> list[str]:
        """The stream ids earlier tries recorded (none outside a task)."""
        return (self.store.get(self.key) if self.store is not None else None) or []

    def flush(self, ids: list[str]) -> None:
        if self.store is not None:
            self.store.set(self.key, ids)


def task_claim(context: Any) -> str | None:
    """The label under which this task instance claims the streams it receives: the same
    for every try of it (DAG, run, task, map index), so a retry finds what an earlier try
    published. None outside a task (no ``ti`` in the context)."""
    ti = context.get("ti") if hasattr(context, "get") else None
    if ti is None:
        return None
    return f"airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}/{getattr(ti, 'map_index', -1)}"
