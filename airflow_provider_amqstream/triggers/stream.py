"""StreamOfferTrigger: wait, without a worker slot, until a stream is offered.

It only looks (a queue browser consumes nothing); the bulk transfer happens back in
the worker, in the sensor's ``execute_complete``, never inside the shared triggerer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class StreamOfferTrigger(BaseTrigger):
    """Fire when ``source`` holds an offer (for ``stream_id`` if given).

    :param source: destination to watch.
    :param stream_id: only this stream, or any.
    :param amqstream_conn_id: Airflow connection of type ``amqstream``.
    :param poll_interval: seconds between looks.
    :param timeout: seconds before giving up with an ``error`` event (None: never).
    """

    def __init__(self, *, source: str, stream_id: str | None = None,
                 amqstream_conn_id: str = "amqstream_default", poll_interval: float = 5.0,
                 timeout: float | None = None) -> None:
        super().__init__()
        self.source = source
        self.stream_id = stream_id
        self.amqstream_conn_id = amqstream_conn_id
        self.poll_interval = poll_interval
        self.timeout = timeout

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"source": self.source, "stream_id": self.stream_id, "amqstream_conn_id": self.amqstream_conn_id,
                 "poll_interval": self.poll_interval, "timeout": self.timeout})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

        hook = AmqStreamHook(self.amqstream_conn_id)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        what = f"stream {self.stream_id}" if self.stream_id else "a stream"
        while True:
            try:
                # The hook is blocking (stomp.py threads); keep it off the event loop.
                found = await asyncio.to_thread(hook.offer_waiting, self.source, stream_id=self.stream_id)
            except Exception as exc:  # report to the task, which fails with this message
                yield TriggerEvent({"status": "error", "message": f"watching {self.source} for {what}: {exc}"})
                return
            if found:
                yield TriggerEvent({"status": "success", "message": f"{what} is offered on {self.source}"})
                return
            if deadline is not None and time.monotonic() > deadline:
                yield TriggerEvent({"status": "timeout",
                                    "message": f"no {what} was offered on {self.source} within {self.timeout}s"})
                return
            await asyncio.sleep(self.poll_interval)
