"""The ``amqstream://`` asset URI: a destination on a broker, as an Airflow asset.

``amqstream://<broker host>:<port>/queue/<name>`` (or ``/topic/<name>``). The normaliser
lower-cases the host, adds the default STOMP port, checks the destination the same way
the protocol does, and drops what does not identify it (user, query, fragment). The
same string is the OpenLineage dataset of a destination (namespace and name), so an
asset and a lineage dataset name the same thing.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import SplitResult

from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol.wire import DEFAULT_PORT, Destination

SCHEME = "amqstream"


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Normalise an ``amqstream://`` asset URI; raise ValueError naming what is wrong."""
    if not uri.hostname:
        raise ValueError(f"{uri.geturl()}: an amqstream asset URI needs the broker host, "
                         "e.g. amqstream://mq.example.com:61613/queue/incoming")
    try:
        port = uri.port or DEFAULT_PORT
    except ValueError as exc:
        raise ValueError(f"{uri.geturl()}: {exc}") from None
    try:
        dest = Destination.parse(uri.path)
    except ProtocolError as exc:
        raise ValueError(f"{uri.geturl()}: the path must be /queue/NAME or /topic/NAME ({exc})") from None
    host = uri.hostname.lower()
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return SplitResult(SCHEME, netloc, str(dest), "", "")


def authority(host: str, port: int = DEFAULT_PORT) -> str:
    """``amqstream://host:port`` as assets and lineage name a broker: the host lower-cased
    (an IPv6 address in brackets), the port always written.

    :param host: the broker's host name or address.
    :param port: its STOMP port.
    """
    host = host.strip("[]").lower()
    return f"{SCHEME}://[{host}]:{port}" if ":" in host else f"{SCHEME}://{host}:{port}"


def destination_uri(host: str, port: int, destination: str) -> str:
    """The asset URI of ``destination`` on the broker at ``host:port``, normalised as
    :func:`sanitize_uri` would (so it is the URI Airflow stores).

    :param host: the broker's host (the first of a failover list: where senders and
        receivers of the destination meet).
    :param port: its STOMP port.
    :param destination: ``/queue/NAME`` or ``/topic/NAME``.
    """
    return f"{authority(host, port)}{Destination.parse(destination)}"


def create_asset(*, host: str, destination: str, port: int = DEFAULT_PORT, **kwargs: Any) -> Any:
    """An ``Asset`` for ``destination`` on the broker at ``host:port``."""
    from airflow.sdk import Asset

    return Asset(uri=destination_uri(host, port, destination), **kwargs)


def convert_asset_to_openlineage(asset: Any, lineage_context: Any) -> Any:
    """The OpenLineage dataset of an ``amqstream://`` asset (namespace ``amqstream://host:port``)."""
    from urllib.parse import urlsplit

    from openlineage.client.event_v2 import Dataset

    parts = urlsplit(asset.uri)
    return Dataset(namespace=f"{parts.scheme}://{parts.netloc}", name=parts.path)
