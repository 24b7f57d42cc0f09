"""Every exception the provider raises, under one root: :class:`AmqStreamError`.

Catch the root to handle anything the provider refuses or cannot do; anything else that
escapes is a bug and should be seen. Each class also derives from the built-in exception
of its kind (``ValueError``, ``ConnectionError``, ...), which is what generic code catches.

Protocol errors come in two kinds, as in h11: :class:`RemoteProtocolError` (a peer sent
something the protocol does not allow: the stream is quarantined) and
:class:`LocalProtocolError` (we were asked to do something the protocol does not allow: a
bad argument).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


class AmqStreamError(Exception):
    """The root of every exception the provider raises on purpose."""


@dataclass
class StreamFailure:
    """A stream a receiver gave up on, and why; receiving goes on with the next stream.

    :param status: ``quarantined`` (can never succeed; moved to ``quarantine``), or one that
        gets its turn back later, keeping its partial data: ``stalled`` (sender silent),
        ``no_room`` (does not fit), ``elsewhere`` (its first chunks are in another receiver's
        directory), ``busy`` (another receiver process of this directory is receiving it) or
        ``refused`` (the broker refused its data queue: its sender is at its cap).
    :param cause: its row of the failure table (:class:`~airflow_provider_amqstream.protocol.outcomes.Outcome`).
    """

    stream_id: str
    destination: str
    status: str
    reason: str
    offset: int = 0
    quarantine: str | None = None
    chunks_moved: int = 0
    retry_after: float | None = None
    time: float = field(default_factory=time.time)
    cause: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class ProtocolError(AmqStreamError, ValueError):
    """A message or argument breaks the protocol; the text names the stream and field."""


class RemoteProtocolError(ProtocolError):
    """A message from the wire breaks the protocol (its stream is quarantined): raised by
    whatever parses what a peer sent."""


class LocalProtocolError(ProtocolError):
    """We were asked to do something the protocol does not allow (a bad argument). A check
    that serves both sides (a stream id, a destination) raises the base class; a parser of
    the wire turns it into :class:`RemoteProtocolError`."""


class ConfigurationError(AmqStreamError, ValueError):
    """A connection or option that cannot work; the text names which (never a password)."""


class UsageError(ConfigurationError):
    """Command-line arguments that do not go together; the CLI exits 2, as for argparse's own."""


class ConnectionNotFound(AmqStreamError, LookupError):
    """No connection of that id anywhere we looked; the message says how to make one."""


class TransportError(AmqStreamError, ConnectionError):
    """The broker could not be reached or refused us; the text names the broker URL."""


class ConnectionLost(TransportError):
    """An established connection dropped (broker restart, network, heartbeat timeout)."""


class BrokerUnreachable(TransportError):
    """No broker accepted a TCP connection: none is listening (not started yet, restarting;
    ActiveMQ refuses connections until it serves) or the network is down. Waiting can help: a
    sender gives a broker that is not up yet the same patience as one lost mid-transfer. A
    broker that answered and refused (a wrong password, a denied destination, a port that does
    not speak STOMP) is a plain :class:`TransportError` or :class:`AccessDenied`, and fails at
    once."""


class AccessDenied(TransportError):
    """The broker refused this user an operation on a destination; retrying cannot help."""


class DestinationFull(TransportError):
    """The broker refused a message because the destination's memory limit stayed full
    through its flow-control wait, or because the sender has as many streams waiting there
    as the broker lets one user have: its receivers are not taking messages (stopped, or
    slower than its senders). Nothing confirmed is lost, and retrying later can succeed."""


class DestinationRefused(DestinationFull):
    """The broker refused to create a destination a subscription named, because its owner
    has as many as the broker lets one user have (a sender's data queues): it does not
    exist, so nothing waits there, and the session goes on."""


class StreamError(AmqStreamError, RuntimeError):
    """A stream cannot be completed as it is; the text names stream, offset and remedy.
    ``failure`` is set when a receiver handled it (quarantined or yielded the stream)."""

    failure: StreamFailure | None = None


class StreamYielded(StreamError):
    """The stream cannot go on now but may later: its partial data is kept and it gives up
    its place in the queue, so the streams behind it are received meanwhile."""


class StreamStalled(StreamYielded):
    """Nothing arrived for the idle timeout; re-running continues where it stopped."""


class StreamRefused(StreamYielded):
    """The broker refused to create the stream's data queue: its sender has as many streams
    waiting as the broker allows it, so it sent nothing of this one yet. The sender's
    failure, not the receiver's: the offer is parked and tried again later."""


class StreamNoRoom(StreamYielded):
    """The stream does not fit the output directory's free space (less the reserve)."""


class StreamBusy(StreamYielded):
    """Another receiver process of the same output directory holds the stream's partial file
    (the broker handed its offer to this one too, e.g. after the other's connection dropped):
    this one touches nothing of it and parks the offer. When the offer comes back, the stream
    is a repeat of what the other published, or this receiver resumes the other's data."""


class StreamElsewhere(StreamYielded):
    """Another receiver, whose output directory this one cannot see (another worker's
    disk), took the stream's first chunks: the rest is left for it (or kept here, if this
    receiver took some), and the message says where the first bytes are and how to finish."""


class RedriveRefused(StreamError):
    """A quarantined stream cannot arrive as it is: the message names the stream, the
    destination, why, and where its messages are now."""


class DiscardRefused(StreamError):
    """A receiver holds the stream (its partial file, or its offer) right now: nothing was
    removed; discard it once the receiver has settled it."""


class StreamQuarantined(StreamError):
    """The stream can never succeed (integrity failure, protocol violation, over a limit,
    reused id): its offer and remaining chunks were moved to a quarantine queue."""

    def __init__(self, message: str, failure: StreamFailure) -> None:
        super().__init__(message)
        self.failure = failure


class BrokerError(AmqStreamError, RuntimeError):
    """The embedded broker cannot start, stop or be configured; the message says why."""


class NetworkError(BrokerError, ValueError):
    """A network-of-brokers option that cannot work; the message names the option and the value."""
