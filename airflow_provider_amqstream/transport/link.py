"""The seam under the engine: what it needs from a connection to a broker, and how it gets one.

The engine speaks to a :class:`Link` only: the STOMP one for a real broker, or the in-memory
one (:mod:`~airflow_provider_amqstream.transport.memory`) when the settings name a ``memory``
backend, so the engine's logic runs in unit tests in milliseconds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from airflow_provider_amqstream.transport.params import BrokerParams


class Message(Protocol):
    """A message as a subscription hands it over: the broker's headers (``ack`` among them
    for a consuming subscription) and the body. The engine may replace ``body`` once it is
    done with the bytes."""

    headers: dict[str, Any]
    body: Any


class Link(Protocol):
    """One session with a broker. Not thread-safe; one per sender or receiver. Any method
    raises :class:`~airflow_provider_amqstream.exceptions.ConnectionLost` when the session
    dropped and :class:`~airflow_provider_amqstream.exceptions.AccessDenied` when the broker
    refused this user."""

    params: BrokerParams

    def __enter__(self) -> Link: ...

    def __exit__(self, *exc: object) -> None: ...

    def open(self) -> Link: ...

    def close(self) -> None: ...

    @property
    def connected(self) -> bool: ...

    def send(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str], *,
             receipt: bool = False, persistent: bool = True) -> str | None:
        """Send one message; with ``receipt``, return the id :meth:`wait_receipt` waits on."""

    def send_confirmed(self, destination: str, body: bytes | bytearray, headers: Mapping[str, str]) -> None:
        """Send one persistent message and return once the broker has stored it."""

    def wait_receipt(self, rid: str) -> None: ...

    def round_trip(self) -> None:
        """Prove the session works end to end."""

    def subscribe(self, destination: str, *, ack: str = "client-individual", prefetch: int = 1,
                  selector: str | None = None, browser: bool = False) -> str:
        """Subscribe (confirmed); return the subscription id. A ``browser`` sees the queue
        without consuming it and ends with a message whose ``browser`` header is ``end``."""

    def unsubscribe(self, sub_id: str) -> None:
        """Leave; what was not acknowledged goes back to the destination."""

    def ack(self, frame: Message) -> None: ...

    def nack(self, frame: Message) -> None:
        """Refuse a message: the broker moves it to its dead-letter queue."""

    def get(self, timeout: float, subscription: str | tuple[str, ...] | None = None) -> Message | None:
        """The next message (of ``subscription`` only, or of any of a tuple of them, if given),
        or None after ``timeout``."""


def open_link(params: BrokerParams, *, client_id: str | None = None) -> Link:
    """A link for ``params`` (``params.backend`` picks the implementation), not yet open: use
    it as a context manager, or call ``open``."""
    if params.backend == "memory":
        from airflow_provider_amqstream.transport.memory import MemoryLink

        return MemoryLink(params)
    from airflow_provider_amqstream.transport.session import StompLink

    return StompLink(params, client_id=client_id)
