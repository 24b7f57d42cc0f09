"""AmqStreamHook: the Airflow connection and the whole transfer, in one place.

Operators and sensors stay thin: they validate arguments, call :meth:`send_file` or
:meth:`receive_stream`, and publish results. The hook never touches the network in
``__init__``; each call opens its own STOMP session, so a retry or a reconnect
always starts from a fresh socket.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from airflow.sdk import BaseHook

from airflow_provider_amqstream import engine
from airflow_provider_amqstream.exceptions import TransportError
from airflow_provider_amqstream.hooks import connection
from airflow_provider_amqstream.protocol.wire import Destination, offer_selector
from airflow_provider_amqstream.transport.link import Link, open_link
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)


class AmqStreamHook(BaseHook):
    """Send and receive file streams through ActiveMQ over STOMP 1.2.

    :param amqstream_conn_id: Airflow connection of type ``amqstream``. If it is the
        default id and no such connection exists, the hook falls back to the embedded
        broker started by ``amqstream broker start`` on this machine.
    :param uri: use this ``amqstream://`` URI instead of an Airflow connection.
    """

    conn_name_attr = "amqstream_conn_id"
    default_conn_name = "amqstream_default"
    conn_type = "amqstream"
    hook_name = "ActiveMQ Stream (STOMP)"

    def __init__(self, amqstream_conn_id: str = default_conn_name, *, uri: str | None = None) -> None:
        super().__init__()
        self.amqstream_conn_id = amqstream_conn_id
        self.uri = uri
        self._params: BrokerParams | None = None

    # -- connection --------------------------------------------------------------
    def broker_params(self) -> BrokerParams:
        """Connection settings, read on first use (never at DAG parse time)."""
        if self._params is None:
            self._params = self._resolve_params()
        return self._params

    def _resolve_params(self) -> BrokerParams:
        # Every source goes through connection.py's one parser and one reading of the fields,
        # so a URI, a variable and a stored connection cannot disagree about TLS.
        if self.uri:
            return connection.parse_uri(self.uri, self.amqstream_conn_id, "the hook's uri").broker_params()
        # The same reading of AIRFLOW_CONN_<ID> as the CLI's; anything else goes through
        # Airflow's own lookup.
        fields = connection.from_env(self.amqstream_conn_id)
        if fields is not None:
            _mask(fields.password)
            return fields.broker_params()
        try:
            conn = self.get_connection(self.amqstream_conn_id)
        except Exception as exc:
            if self.amqstream_conn_id != self.default_conn_name or type(exc).__name__ != "AirflowNotFoundException":
                raise
            embedded = connection.embedded_params()
            if embedded is None:
                raise
            log.info("no connection %r: using the embedded broker at %s", self.amqstream_conn_id, embedded.url)
            return embedded
        return connection.from_airflow(conn, f"connection {self.amqstream_conn_id!r}").broker_params()

    def get_conn(self) -> Link:
        """A new, open STOMP session. The caller closes it (or uses ``with``)."""
        return open_link(self.broker_params()).open()

    def test_connection(self) -> tuple[bool, str]:
        """Connect, prove a round trip with a receipt, disconnect."""
        try:
            params = self.broker_params()
            with open_link(params) as link:
                link.round_trip()
        except (TransportError, ValueError) as exc:
            return False, str(exc)
        return True, f"Connected to {params.url} and received a receipt"

    # -- transfers ---------------------------------------------------------------
    def send_file(self, path: str | os.PathLike[str], destination: str, **kwargs: Any) -> engine.TransferResult:
        """Send a file as a stream; see :func:`airflow_provider_amqstream.engine.send_file`."""
        return engine.send_file(self.broker_params(), path, destination, **kwargs)

    def send_files(self, files: Any, destination: str, **kwargs: Any) -> engine.BulkResult:
        """Send many files over one connection; see :func:`airflow_provider_amqstream.engine.send_files`."""
        return engine.send_files(self.broker_params(), files, destination, **kwargs)

    def receive_stream(self, source: str, out_dir: str | os.PathLike[str], *, stream_id: str | None = None,
                       options: engine.ReceiveOptions | None = None) -> engine.TransferResult | None:
        """Receive one stream; see :func:`airflow_provider_amqstream.engine.receive_stream`."""
        return engine.receive_stream(self.broker_params(), source, out_dir, stream_id=stream_id, options=options)

    def receive_streams(self, source: str, out_dir: str | os.PathLike[str], *, count: int | None = None,
                        stream_id: str | None = None, options: engine.ReceiveOptions | None = None,
                        on_failure: Any = None, stop_after: float | None = None) -> list[engine.TransferResult]:
        """Receive streams over one connection, going on past streams that fail (each is
        quarantined or yields its place, and reported to ``on_failure``); see
        :func:`airflow_provider_amqstream.engine.receive_streams`."""
        return engine.receive_streams(self.broker_params(), source, out_dir, count=count, stream_id=stream_id,
                                      options=options, on_failure=on_failure, stop_after=stop_after)

    def offer_waiting(self, source: str, *, stream_id: str | None = None, timeout: float = 2.0) -> bool:
        """Whether a stream is offered on ``source`` right now (alone or in a pack), without taking it.

        Uses a queue browser, so nothing is consumed: cheap enough for a trigger to poll.
        """
        dest = Destination.parse(source)
        with open_link(self.broker_params()) as link:
            link.subscribe(str(dest), selector=offer_selector(stream_id or None), browser=True)
            frame = link.get(timeout)
            # A browser ends with an empty end-of-browse message; anything else is an offer.
            return frame is not None and frame.headers.get("browser") != "end"


def _mask(secret: str | None) -> None:
    """Keep a password read from the environment out of task logs, as Airflow does for the
    connections it reads itself."""
    if secret:
        from airflow.sdk.log import mask_secret

        mask_secret(secret)
