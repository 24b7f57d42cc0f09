"""Messages as the receiver acts on them: parsed once from what the broker delivered, frozen,
and carried beside the delivery they came in (h11's events are the model). Pure, no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.paths import safe_subdir

M = TypeVar("M")
H = TypeVar("H")


@dataclass(frozen=True)
class Delivered(Generic[M, H]):
    """A parsed ``message`` beside ``handle``, the delivery the engine acknowledges, parks or
    quarantines. What the engine decided about it (settled, parked) is the engine's state."""

    message: M
    handle: H


@dataclass(frozen=True)
class StreamOffer:
    """A valid offer: its stream, data queue, ``origin`` ("" for none), handshake control queue
    and window (None outside handshake mode) and the subdirectory its file goes to."""

    spec: wire.StreamSpec
    data_queue: str
    origin: str = ""
    handshake: tuple[str, int] | None = None
    subdir: tuple[str, ...] = ()


@wire.from_the_wire
def read_offer(headers: Mapping[str, Any], offered_on: Destination, *, sender: str, inline: bool = False,
               ) -> StreamOffer:
    """An offer parsed (:func:`wire.parse_offer`, its handshake terms, its subdirectory), or
    :class:`RemoteProtocolError`. ``sender`` is the broker's stamp (:func:`wire.sender_of`);
    an ``inline`` offer has no handshake, and its subdirectory is read after its body is."""
    spec, data_q = wire.parse_offer(headers, offered_on, sender=sender)
    if inline:
        return StreamOffer(spec, data_q, wire.offer_origin(headers))
    terms = wire.handshake_terms(headers, spec, offered_on) if spec.mode is hdr.Mode.HANDSHAKE else None
    return StreamOffer(spec, data_q, wire.offer_origin(headers), terms, safe_subdir(headers.get(hdr.H_DIR),
                                                                                     spec.stream_id))
