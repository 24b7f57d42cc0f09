"""The ``amqstream://`` asset URI: a destination, as an Airflow asset.

``amqstream://<connection id>/queue/<name>`` (or ``/topic/<name>``): the destination on the
broker(s) of that Airflow connection. This is the form the operators declare, when the DAG is
parsed (no connection is read then), so the asset graph links a send to its receives and both
to their runs; and it stays the same asset when the broker moves, restarts on another port or
gains a failover peer: the connection says where the broker is, the asset what it holds.
``amqstream://<broker host>:<port>/queue/<name>`` (a port written) names a broker by its
address instead, for an asset declared by hand with no connection. The normaliser lower-cases
a host (never a connection id), checks the destination the same way the protocol does, and
drops what does not identify it (user, query, fragment).

OpenLineage names the physical place: namespace ``amqstream://<first broker host>:<port>``
(read from the connection when the event is made), name ``/queue/NAME``; an asset of a
connection converts to that same dataset.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import SplitResult, urlsplit

from airflow_provider_amqstream.exceptions import AmqStreamError, ProtocolError
from airflow_provider_amqstream.protocol.headers import DEFAULT_PORT
from airflow_provider_amqstream.protocol.names import Destination

SCHEME = "amqstream"
log = logging.getLogger(__name__)


def sanitize_uri(uri: SplitResult) -> SplitResult:
    """Normalise an ``amqstream://`` asset URI; raise ValueError naming what is wrong."""
    where = uri.netloc.rpartition("@")[2]
    if not where or where.startswith(":"):
        raise ValueError(f"{uri.geturl()}: an amqstream asset URI needs the connection id (or the broker's "
                         "host:port), e.g. amqstream://amqstream_default/queue/incoming")
    try:
        port = uri.port
    except ValueError as exc:
        raise ValueError(f"{uri.geturl()}: {exc}") from None
    try:
        dest = Destination.parse(uri.path)
    except ProtocolError as exc:
        raise ValueError(f"{uri.geturl()}: the path must be /queue/NAME or /topic/NAME ({exc})") from None
    netloc = authority(uri.hostname or "", port).partition("://")[2] if port else where
    return SplitResult(SCHEME, netloc, str(dest), "", "")


def authority(host: str, port: int = DEFAULT_PORT) -> str:
    """``amqstream://host:port`` as lineage names a broker: the host lower-cased (an IPv6
    address in brackets), the port always written."""
    host = host.strip("[]").lower()
    return f"{SCHEME}://[{host}]:{port}" if ":" in host else f"{SCHEME}://{host}:{port}"


def destination_uri(conn_id: str, destination: str) -> str:
    """The asset URI of ``destination`` on the broker of connection ``conn_id``, normalised as
    :func:`sanitize_uri` would (so it is the URI Airflow stores)."""
    return f"{SCHEME}://{conn_id}{Destination.parse(destination)}"


def create_asset(*, destination: str, conn_id: str | None = None, host: str | None = None, port: int = DEFAULT_PORT,
                 **kwargs: Any) -> Any:
    """An ``Asset`` for ``destination`` on the broker of connection ``conn_id`` (or, with no
    connection, of the broker at ``host:port``)."""
    from airflow.sdk import Asset

    if conn_id:
        return Asset(uri=destination_uri(conn_id, destination), **kwargs)
    if not host:
        raise ValueError(f"create_asset({destination!r}): name the connection (conn_id) or the broker (host)")
    return Asset(uri=f"{authority(host, port)}{Destination.parse(destination)}", **kwargs)


def convert_asset_to_openlineage(asset: Any, lineage_context: Any) -> Any:
    """The OpenLineage dataset of an ``amqstream://`` asset: namespace
    ``amqstream://host:port`` of the broker (a connection's first), name the destination."""
    from openlineage.client.event_v2 import Dataset

    parts = urlsplit(asset.uri)
    namespace = f"{parts.scheme}://{parts.netloc}"
    if parts.port is None:
        from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook

        try:
            host, port = AmqStreamHook(parts.netloc).broker_params().hosts[0]
            namespace = authority(host, port)
        except AmqStreamError as exc:  # lineage must not fail a task: the connection's name stands in
            log.warning("%s: lineage names the broker by its connection (%s)", asset.uri, exc)
    return Dataset(namespace=namespace, name=parts.path)
