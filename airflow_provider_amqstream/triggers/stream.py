"""StreamOfferTrigger: wait, without a worker slot, until a stream is offered.

It only looks (a queue browser consumes nothing), over one kept connection; the bulk
transfer happens back in the worker, in the sensor's ``execute_complete``, never inside
the shared triggerer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from airflow_provider_amqstream.exceptions import TransportError
from airflow_provider_amqstream.triggers.pacing import Every


class StreamOfferTrigger(BaseTrigger):
    """Fire when ``source`` holds an offer (for ``stream_id`` if given).

    Logs once what it waits for and until when, then a line every
    10 minutes; a lost broker is reported and retried until the
    timeout, on a fresh connection.

    :param source: destination to watch.
    :param stream_id: only this stream, or any.
    :param amqstream_conn_id: Airflow connection of type ``amqstream``.
    :param poll_interval: seconds between looks.
    :param timeout: seconds before giving up with a ``timeout`` event (None: never).
    """

    def __init__(self, *, source: str, stream_id: str | None = None,
                 amqstream_conn_id: str = "amqstream_default", poll_interval: float = 5.0,
                 timeout: float | None = None) -> None:
        # untyped_calls_exclude (pyproject.toml) does not reach a super() call.
        super().__init__()  # type: ignore[no-untyped-call]
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

        what = f"stream {self.stream_id}" if self.stream_id else "a stream"
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        until = ("no time limit" if self.timeout is None else
                 f"until {(datetime.now(timezone.utc) + timedelta(seconds=self.timeout)):%Y-%m-%d %H:%M:%S} UTC")
        try:
            browser = await asyncio.to_thread(AmqStreamHook(self.amqstream_conn_id).offer_browser, self.source)
            params = browser.params
        except Exception as exc:  # handed to the task, which fails naming it
            yield TriggerEvent({"status": "error", "message": f"watching {self.source} for {what}: {exc}"})
            return
        self.log.info("waiting for %s to be offered on %s at %s (%s), looking every %gs", what, self.source,
                      params.url, until, self.poll_interval)
        note = Every()
        last_error: str | None = None
        try:
            while True:
                try:
                    found = bool(await asyncio.to_thread(browser.look, self.stream_id))
                    last_error = None
                except TransportError as exc:
                    if not browser.transient(exc):  # refused, or never got in (wrong address or password)
                        yield TriggerEvent({"status": "error",
                                            "message": f"watching {self.source} for {what}: {exc}"})
                        return
                    # The broker may come back (restart, failover): keep trying until the deadline.
                    if last_error is None:
                        self.log.warning("cannot look at %s: %s; retrying every %gs", self.source, exc,
                                         self.poll_interval)
                    last_error, found = str(exc), False
                if found:
                    yield TriggerEvent({"status": "success", "message": f"{what} is offered on {self.source}"})
                    return
                if deadline is not None and time.monotonic() > deadline:
                    why = f" (last error: {last_error})" if last_error else ""
                    yield TriggerEvent({"status": "timeout", "message": f"no {what} was offered on {self.source} "
                                                                       f"within {self.timeout}s{why}"})
                    return
                if note.due():
                    self.log.info("still waiting for %s on %s (%.0f min so far, %s)", what, self.source,
                                  (time.monotonic() - started) / 60, until)
                await asyncio.sleep(self.poll_interval)
        finally:
            await asyncio.to_thread(browser.close)
