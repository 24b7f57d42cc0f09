"""What one send of one stream carries through its attempts: the parameter object shared by
stream/atomic attempts (:mod:`.stream`) and handshake attempts (:mod:`.handshake`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.protocol import headers as hdr
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.codec import ChunkCodec
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.protocol.seal import H_SEAL, Seal
from airflow_provider_amqstream.protocol.state import SenderState
from airflow_provider_amqstream.transport.params import BrokerParams

Progress = Callable[[int, int], None]


@dataclass
class Outbound:
    """One file on its way to one destination, across reconnects.

    :param progress: called with (bytes confirmed, total bytes).
    :param origin: the offer's ``amqs_origin`` (which file went where).
    :param subdir: the receiver-side directory (offer header ``amqs_dir``).
    """

    params: BrokerParams
    src: Path
    dest: Destination
    state: SenderState
    save: Callable[[], None]
    window: int
    progress: Progress | None
    codec: ChunkCodec
    origin: str
    subdir: str = ""
    seal: Seal | None = None
    sent: int = 0  # bytes this run sent, chunks sent again included
    rerequests: int = 0

    def offer(self, window: int = hdr.DEFAULT_WINDOW, **kw: Any) -> dict[str, str]:
        """The stream's offer (``kw``: offer_headers' keywords), with its seal if sealed."""
        kw.setdefault("subdir", self.subdir)
        h = p.offer_headers(self.state.spec, self.dest, window, sender=self.params.user, origin=self.origin, **kw)
        if self.seal is not None:
            h[H_SEAL] = self.seal.header
        return h

    def end(self) -> dict[str, str]:
        """The end marker: the file's SHA-256, under the seal's HMAC if sealed."""
        sha = self.state.sha256 or ""
        return p.end_headers(self.state.spec, self.seal.digest(sha) if self.seal is not None else sha)
