"""What one send of one stream carries through its attempts: the parameter object shared by
stream/atomic attempts (:mod:`.stream`) and handshake attempts (:mod:`.handshake`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.state import SenderState
from airflow_provider_amqstream.transport.params import BrokerParams

Progress = Callable[[int, int], None]


@dataclass
class Outbound:
    """One file on its way to one destination, across reconnects.

    :param save: writes the checkpoint (``final=True`` makes it durable at once).
    :param progress: called with (bytes confirmed, total bytes).
    :param origin: the offer's ``amqs_origin`` (which file went where).
    :param subdir: the receiver-side directory (offer header ``amqs_dir``).
    """

    params: BrokerParams
    src: Path
    dest: p.Destination
    state: SenderState
    save: Callable[..., None]
    window: int
    progress: Progress | None
    codec: p.ChunkCodec
    origin: str
    subdir: str = ""
