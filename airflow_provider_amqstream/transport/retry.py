"""The one reconnect policy: which failures are worth another connection, and how long to try.

Every loop that keeps a transfer going over lost connections (a receiver, a stream sender,
a bulk sender and its batch announcement) and the offer trigger decide with :func:`transient`;
the loops pace and bound their attempts with :class:`Reconnect`.

Why a small class of our own and not tenacity (installed, with Airflow): what ends a wait is
not a successful call but progress the caller sees (a chunk confirmed, a file confirmed, an
offer settled, or a connection that opened when the broker had been away), and a full
destination lets us connect while it stays full; tenacity's stop and wait strategies know
neither, and would still need this state beside them.

**A broker never reached** (:class:`~airflow_provider_amqstream.exceptions.BrokerUnreachable`
before any connection opened): a sender waits for it as for a lost one, since it was handed
work to deliver and a broker restarting as a DAG starts must not fail it. A receiver or a
watcher fails at once, the error naming the broker's URL and asking whether it runs: nothing of
its is in flight, whoever runs it tries again on its own clock (Airflow's retries, a sensor's
next poke, a service manager), and a mistyped host looks exactly like a broker not up yet.
"""

from __future__ import annotations

import logging
import time

from airflow_provider_amqstream.exceptions import (
    AccessDenied,
    BrokerUnreachable,
    ConnectionLost,
    DestinationFull,
    StreamError,
    TransportError,
)

log = logging.getLogger(__name__)


def transient(exc: BaseException, *, reached: bool, wait_at_start: bool = True) -> bool:
    """Whether another connection can help after ``exc``: the broker went away
    (:class:`ConnectionLost`), is not up (:class:`BrokerUnreachable`, unless never reached and
    not ``wait_at_start``) or is full (:class:`DestinationFull`); or any other transport failure
    once the broker was reached (a broker restarting refuses us for a moment). Never an
    :class:`AccessDenied`, nor a broker that answered and refused us before we ever got in (a
    wrong password, a port that does not speak STOMP). ``reached``: a connection opened
    before; ``wait_at_start``: wait for a broker never reached (senders), or not (receivers).
    """
    if isinstance(exc, AccessDenied) or not isinstance(exc, TransportError):
        return False
    if isinstance(exc, BrokerUnreachable) and not reached:
        return wait_at_start
    return reached or isinstance(exc, (ConnectionLost, BrokerUnreachable, DestinationFull))


class Reconnect:
    """Attempts paced 0.5 s doubling to 5 s, for up to ``timeout`` seconds from the first failure
    since the work last moved (or a connection opened): a receiver idle for an hour, or a
    sender an hour into a file, gets the whole timeout when its connection drops.

    A failure the same as the last one is logged at most every :data:`REPEAT_LOG_INTERVAL`
    seconds at WARNING (debug otherwise): a broker down for the whole timeout would put a line
    in the log every 5 s saying the same thing. ``what`` ("sending stream s to /queue/q") and
    ``url`` name the work and the broker in the messages.
    """

    REPEAT_LOG_INTERVAL = 30.0

    def __init__(self, what: str, url: str, timeout: float, *, wait_at_start: bool = True) -> None:
        self.what, self.url, self.timeout, self.wait_at_start = what, url, timeout, wait_at_start
        self.attempts = 0  # failed attempts, in all
        self.reached = self._full = False
        self._restart()

    def _restart(self) -> None:
        self.deadline: float | None = None  # set by the first failure since the work last moved
        self.delay = 0.5
        self._said = ("", 0.0)

    def connected(self) -> None:
        """A connection opened: a wait for a lost or unreachable broker is over, not one for a
        full destination (such a broker lets us connect; only progress ends that wait)."""
        self.reached = True
        if not self._full:
            self._restart()

    def progressed(self) -> None:
        """The work moved on: the next failure gets the whole timeout again."""
        self.reached, self._full = True, False
        self._restart()

    def failed(self, exc: BaseException) -> None:
        """After a failed attempt: raise ``exc`` unless another can help (:func:`transient`);
        else sleep before the next, or raise :class:`StreamError` naming ``exc`` once the
        timeout has passed (the last attempt is made at the deadline, not a delay before it)."""
        if not transient(exc, reached=self.reached, wait_at_start=self.wait_at_start):
            raise exc
        self._full = self._full or isinstance(exc, DestinationFull)
        self.attempts += 1
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.timeout
        if now >= self.deadline:
            raise StreamError(
                f"{self.what}: gave up after {self.timeout:.0f}s of trying to reach {self.url} "
                f"({self.attempts} attempts); last error: {str(exc).rstrip('. ')}. "
                "Re-run to continue from the checkpoint."
            ) from exc
        delay = min(self.delay, self.deadline - now)
        text, when = self._said
        if str(exc) != text or now - when >= self.REPEAT_LOG_INTERVAL:
            self._said = (str(exc), now)
            log.warning("%s: %s (trying again in %.1fs, for up to %.0fs more)", self.what, exc, delay,
                        self.deadline - now)
        else:
            log.debug("%s: %s (trying again in %.1fs)", self.what, exc, delay)
        time.sleep(delay)
        self.delay = min(self.delay * 2, 5.0)
