"""StreamOfferedTrigger: an event trigger that fires once per stream offered on a queue.

Made for event-driven scheduling (an ``AssetWatcher`` on an ``Asset``), directly or as
``MessageQueueTrigger(scheme="amqstream", ...)``. It only looks: the triggerer never
takes an offer and never moves a byte of a file (it only files junk away); the DAG run it
starts receives the stream it names.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from airflow_provider_amqstream.exceptions import AccessDenied, TransportError
from airflow_provider_amqstream.triggers.pacing import Every


class StreamOfferedTrigger(BaseEventTrigger):
    """Fire one event per stream offered on ``destination``.

    The event's payload carries ``stream_id``, ``name``, ``size``, ``chunks``, ``mode``,
    ``destination``, ``sender`` (the user the broker authenticated as the offer's sender,
    its ``JMSXUserID`` stamp; None where the broker does not stamp it, said once in the log)
    and ``offered_at`` (broker timestamp, ms); a sealed stream's ``name`` is ``sealed``, the
    real one being inside the seal. A stream fires once while its
    offer stays visible, however many looks see it; the ids are remembered until the
    offer is gone (received), so a stream offered again later fires again. A new
    triggerer process starts with an empty memory and fires for waiting offers again;
    the receiving sensor returns at once for a stream its directory already holds.

    The broker shows a browser at most ``maxBrowsePageSize`` waiting messages (16 in the
    shipped config); more waiting offers are seen as receivers take the earlier ones. An
    invalid message among them is quarantined by the trigger itself (to ``DLQ.<name>``,
    with the reason, as a receiver would), so junk cannot hide offers when no receiver runs.

    Events are paced: after one fires, the next waits until the stream it named is taken
    (its offer leaves the queue) or ``pace`` seconds pass. Airflow 3.3 folds asset events
    that arrive while a run is being created into that one run (apache/airflow#54659,
    #56050), so streams offered together, fired together, would start one run for the
    first and leave the others waiting for the next offer. Paced, each starts its own
    run, one after the other as fast as the runs take their streams.

    ``amqstream_conn_id`` and ``poll_interval`` are as on ``StreamOfferTrigger``.

    :param destination: ``/queue/NAME`` where streams are offered.
    :param pace: seconds at most to wait for a fired stream to be taken before firing the
        next (0: fire every waiting stream at once, for an Airflow without that limit).
    """

    def __init__(self, *, destination: str, amqstream_conn_id: str = "amqstream_default",
                 poll_interval: float = 5.0, pace: float = 120.0) -> None:
        # untyped_calls_exclude (pyproject.toml) does not reach a super() call.
        super().__init__()  # type: ignore[no-untyped-call]
        if pace < 0 or poll_interval <= 0:
            raise ValueError(f"StreamOfferedTrigger on {destination}: pace must be >= 0 and poll_interval > 0, "
                             f"got {pace} and {poll_interval}")
        self.destination = destination
        self.amqstream_conn_id = amqstream_conn_id
        self.poll_interval = poll_interval
        self.pace = pace

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"destination": self.destination, "amqstream_conn_id": self.amqstream_conn_id,
                 "poll_interval": self.poll_interval, "pace": self.pace})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

        # Connection lookups and stomp.py are blocking: keep them off the event loop.
        browser = await asyncio.to_thread(AmqStreamHook(self.amqstream_conn_id).offer_browser, self.destination)
        params = browser.params
        fired: set[str] = set()
        last: tuple[str, float] | None = None  # the stream fired last, and when
        note = Every()
        self.log.info("watching %s on %s for offered streams, looking every %gs", self.destination, params.url,
                      self.poll_interval)
        failing = False
        unstamped_noted = False
        try:
            while True:
                try:
                    offers = await asyncio.to_thread(browser.look)
                except AccessDenied:
                    raise  # no retry can help; the message says which grant is missing
                except TransportError as exc:
                    if not failing or note.due():
                        self.log.warning("cannot look at %s: %s; trying again every %gs", self.destination, exc,
                                         self.poll_interval)
                    failing = True
                    await asyncio.sleep(self.poll_interval)
                    continue
                if failing:
                    self.log.info("watching %s on %s again", self.destination, params.url)
                    failing = False
                visible = {o.stream_id for o in offers}
                for offer in offers:
                    if offer.stream_id in fired:
                        continue
                    if self.pace and last and last[0] in visible and time.monotonic() - last[1] < self.pace:
                        break  # the run started for the last one has not taken it yet
                    fired.add(offer.stream_id)
                    last = (offer.stream_id, time.monotonic())
                    self.log.info("stream %s (%s, %d bytes) is offered on %s by %s", offer.stream_id, offer.name,
                                  offer.size, self.destination, offer.sender or "an unknown sender")
                    if offer.sender is None and not unstamped_noted:
                        unstamped_noted = True
                        self.log.warning("offers on %s carry no sender: the broker at %s does not stamp JMSXUserID "
                                         "(populateJMSXUserID and useAuthenticatedPrincipalForJMSXUserID on "
                                         "<broker>, see docs/security.md); events report sender None",
                                         self.destination, params.url)
                    yield TriggerEvent(offer.payload())
                fired &= visible
                if note.due():
                    self.log.info("still watching %s: %d offer(s) waiting to be received", self.destination,
                                  len(visible))
                await asyncio.sleep(self.poll_interval)
        finally:
            await asyncio.to_thread(browser.close)
