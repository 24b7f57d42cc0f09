"""The ``amqstream`` scheme for common-messaging's ``MessageQueueTrigger``.

Usage (event-driven scheduling, one asset event per offered stream)::

    from airflow.providers.common.messaging.triggers.msg_queue import MessageQueueTrigger
    from airflow.sdk import Asset, AssetWatcher

    trigger = MessageQueueTrigger(scheme="amqstream", destination="/queue/incoming",
                                  amqstream_conn_id="amqstream_default")
    incoming = Asset("amqstream://amqstream_default/queue/incoming",
                     watchers=[AssetWatcher(name="incoming_streams", trigger=trigger)])

The keyword arguments are those of
:class:`~airflow_provider_amqstream.triggers.offered.StreamOfferedTrigger`.
apache-airflow-providers-common-messaging is optional (extra ``messaging``): without it
this module reports an optional feature missing and the rest of the provider works.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

try:
    from airflow.providers.common.messaging.providers.base_provider import BaseMessageQueueProvider
except ImportError as exc:  # the extra is not installed
    from airflow.exceptions import AirflowOptionalProviderFeatureException

    raise AirflowOptionalProviderFeatureException(
        f"the amqstream message queue needs apache-airflow-providers-common-messaging "
        f"(pip install 'airflow-provider-amqstream[messaging]'): {exc}") from exc

if TYPE_CHECKING:
    from airflow.triggers.base import BaseEventTrigger


class AmqStreamMessageQueueProvider(BaseMessageQueueProvider):
    """Streams offered on an ActiveMQ queue, for ``MessageQueueTrigger(scheme="amqstream")``:
    its keyword arguments and events are :class:`StreamOfferedTrigger`'s."""

    scheme = "amqstream"

    def trigger_class(self) -> type[BaseEventTrigger]:
        from airflow_provider_amqstream.triggers.offered import StreamOfferedTrigger

        return StreamOfferedTrigger
