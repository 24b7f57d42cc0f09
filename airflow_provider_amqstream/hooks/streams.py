"""AmqStreamAdminHook: the streams waiting on a broker, seen and acted on through an Airflow
connection of type ``amqstream`` (the Airflow page of the streams, and DAGs that clean up).

Optional connection extras feed the views: ``destinations`` (to show), ``out_dirs``
(receivers' output directories readable here), ``receivers`` and ``quarantine``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping

from airflow_provider_amqstream.engine import discard as discarding
from airflow_provider_amqstream.engine import inventory as views
from airflow_provider_amqstream.engine import redrive as redriving
from airflow_provider_amqstream.engine.show import StreamReport, show_stream
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams, extra_list

log = logging.getLogger(__name__)


class AmqStreamAdminHook(AmqStreamHook):
    """See where streams are and redrive or discard them (``amqstream streams``).

    ``amqstream_conn_id`` is as on ``AmqStreamHook``.

    :param connect_timeout: seconds to wait for the broker (overrides the connection's: a
        page must not wait for a slow broker as long as a transfer would).
    """

    def __init__(self, amqstream_conn_id: str = AmqStreamHook.default_conn_name, *,
                 connect_timeout: float | None = None) -> None:
        super().__init__(amqstream_conn_id)
        self.connect_timeout = connect_timeout

    def broker_params(self) -> BrokerParams:
        """The connection's settings; only the connect waits less when asked (a redrive's
        receipts for big chunks keep the connection's patience)."""
        params = super().broker_params()
        return params if self.connect_timeout is None else dataclasses.replace(
            params, connect_timeout=self.connect_timeout)

    def _extra_list(self, key: str) -> list[str]:
        fields = self.conn_fields()
        return extra_list(fields.extra, key) if fields else []

    def destinations(self) -> list[str]:
        """The destinations the connection's ``destinations`` extra names, checked."""
        return [str(Destination.parse(d)) for d in self._extra_list("destinations")]

    def out_dirs(self) -> list[str]:
        """The receivers' directories the connection's ``out_dirs`` extra names."""
        return [os.path.expanduser(d) for d in self._extra_list("out_dirs")]

    def receivers(self) -> list[str]:
        """The users the connection's ``receivers`` extra names: receivers whose quarantine copies redrive believes."""
        return self._extra_list("receivers")

    def quarantine(self) -> str | None:
        """The quarantine queue the connection's ``quarantine`` extra names, if any."""
        fields = self.conn_fields()
        value = str(fields.extra.get("quarantine") or "") if fields else ""
        return str(Destination.parse(value)) if value else None

    def inventory(self, destination: str, *,
                  previous: Mapping[str, tuple[int, float]] | None = None) -> views.Inventory:
        """Every stream of ``destination``, as the connection's ``out_dirs`` and ``quarantine`` extras
        see it; see :func:`~airflow_provider_amqstream.engine.inventory.take_inventory`.

        :param previous: an earlier look's progress marks, for rates.
        """
        return views.take_inventory(self.broker_params(), destination, previous=previous, out_dirs=self.out_dirs(),
                                    quarantine=self.quarantine())

    def show(self, destination: str, stream_id: str) -> StreamReport:
        """Everything known about one stream; see :func:`~airflow_provider_amqstream.engine.show.show_stream`."""
        return show_stream(self.broker_params(), destination, stream_id, out_dirs=self.out_dirs(),
                           quarantine=self.quarantine())

    def redrive(self, destination: str, stream_id: str) -> redriving.RedriveResult:
        """Put a quarantined stream back; see :func:`~airflow_provider_amqstream.engine.redrive.redrive`. The
        quarantine copies believed are the connection user's and those of the users its ``receivers`` extra names."""
        return redriving.redrive(self.broker_params(), destination, stream_id, quarantine=self.quarantine(),
                                 receivers=self.receivers())

    def discard(self, destination: str, stream_id: str) -> discarding.DiscardResult:
        """Remove a stream everywhere; see :func:`~airflow_provider_amqstream.engine.discard.discard`."""
        return discarding.discard(self.broker_params(), destination, stream_id, out_dirs=self.out_dirs(),
                                  quarantine=self.quarantine())
