"""Embedded brokers joined into a network: each site keeps its own broker, and the brokers
forward streams to each other when the link is up (store and forward).

What a network needs, found on ActiveMQ 5.17 with two of our brokers on loopback:

* An OpenWire listener on the remote side (``--openwire-port``): network bridges speak
  OpenWire, not STOMP. JMS clients can use it too.
* Advisory messages on both brokers: a bridge forwards a destination's messages only where
  a consumer for it exists, and learns of consumers from advisories.
* A duplex bridge: handshake mode sends control messages back, from the receiver's site to
  the sender's; a one-way bridge drops them ("no receiver answered the offer").
* TLS, when asked: an OpenWire listener over TLS (``--openwire-tls-port``) with the
  broker's certificate, and ``ssl://`` peers trusted through the remote brokers'
  certificates (``--network-ca``), imported into a trust store of this broker.
* One bridge user, with the same name and password on both brokers. A bridge logs in to
  the remote broker *and* to its own over ``vm://`` with the same credentials (5.17 has no
  separate local user name), so the secret is made once and given to every site.

This module only renders configuration; :mod:`airflow_provider_amqstream.broker.embedded` runs it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.exceptions import NetworkError, ProtocolError
from airflow_provider_amqstream.protocol.names import Destination

NETWORK_FILE = "network.json"
_URI = re.compile(r"(tcp|ssl)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):([0-9]{1,5})")


def forwarded_names(queues: Sequence[str]) -> list[str]:
    """The queue names a bridge forwards for ``/queue/NAME`` destinations: each one's offers,
    its streams' data and their control queues."""
    names = []
    for text in queues:
        try:
            dest = Destination.parse(text)
        except ProtocolError as exc:
            raise NetworkError(f"--network-queue {text!r}: {exc}") from None
        if dest.kind != "queue":
            raise NetworkError(f"--network-queue {text!r}: only queues are forwarded")
        names += [dest.name, f"{dest.name}.amqs.>", f"{dest.name}.amqs_ctl.>"]
    return names


@dataclass(frozen=True)
class NetworkConfig:
    """How one broker joins a network.

    :param openwire_port: listen for OpenWire (bridges, JMS clients) on this port.
    :param peers: remote brokers' OpenWire URIs to bridge to (duplex).
    :param bridge_secret: JSON file with the bridge user's ``user`` and ``password``,
        created (mode 0600) if missing; give the same file to every broker of the network.
    :param queues: ``/queue/NAME`` destinations forwarded (empty: every queue).
    :param openwire_tls_port: listen for OpenWire over TLS on this port (the broker's
        certificate, the one ``--tls-port`` uses).
    :param peer_cas: PEM certificates to trust for ``ssl://`` peers (each remote broker's
        ``tls/broker-cert.pem``, or the CA that signed it).
    """

    openwire_port: int | None = None
    peers: tuple[str, ...] = ()
    bridge_secret: Path | None = None
    queues: tuple[str, ...] = ()
    openwire_tls_port: int | None = None
    peer_cas: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        for option, port in (("--openwire-port", self.openwire_port), ("--openwire-tls-port", self.openwire_tls_port)):
            if port is not None and not 1 <= port <= 65535:
                raise NetworkError(f"{option} {port}: not a port number")
        for peer in self.peers:
            m = _URI.fullmatch(peer.strip())
            if m is None or not 1 <= int(m.group(3)) <= 65535:
                raise NetworkError(f"--network-to {peer!r}: expected tcp://HOST:PORT or ssl://HOST:PORT (the remote "
                                   "broker's OpenWire listener, its --openwire-port or --openwire-tls-port)")
            if peer.startswith("ssl://") and not self.peer_cas:
                raise NetworkError(f"--network-to {peer}: a TLS bridge needs --network-ca FILE, the remote "
                                   "broker's certificate (its <data dir>/tls/broker-cert.pem)")
        forwarded_names(self.queues)
        if self.active and self.bridge_secret is None:
            raise NetworkError("a broker in a network needs --bridge-secret FILE (the bridge user's name and "
                               "password, the same file on every broker of the network)")

    @property
    def active(self) -> bool:
        return bool(self.openwire_port or self.openwire_tls_port or self.peers)

    @property
    def needs_tls(self) -> bool:
        """Whether the broker needs its key (a TLS listener) or a trust store (TLS peers)."""
        return bool(self.openwire_tls_port or any(p.startswith("ssl://") for p in self.peers))

    @classmethod
    def remembered(cls, data_dir: Path) -> NetworkConfig:
        """The network a broker was last started with (``broker restart`` keeps it), if any."""
        try:
            data = json.loads((data_dir / NETWORK_FILE).read_text())
            secret = data.get("bridge_secret")
            return cls(openwire_port=data.get("openwire_port"), peers=tuple(data.get("peers") or ()),
                       bridge_secret=Path(secret) if secret else None, queues=tuple(data.get("queues") or ()),
                       openwire_tls_port=data.get("openwire_tls_port"),
                       peer_cas=tuple(Path(c) for c in data.get("peer_cas") or ()))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            raise NetworkError(f"{data_dir / NETWORK_FILE} is unreadable ({exc}); start with the network "
                               "options again") from exc

    def remember(self, data_dir: Path) -> None:
        # Paths as text, tuples as lists: the file remembered reads.
        (data_dir / NETWORK_FILE).write_text(json.dumps(asdict(self), default=str))


def connectors_xml(cfg: NetworkConfig, name: str, bridge: tuple[str, str] | None, attr: Any) -> str:
    """``<networkConnectors>`` for ``cfg.peers``, logging in as ``bridge`` (name, password); ``attr``
    escapes XML attribute values."""
    if not cfg.peers:
        return ""
    creds = f' userName="{attr(bridge[0])}" password="{attr(bridge[1])}"' if bridge else ""
    include = "".join(f'<queue physicalName="{attr(n)}"/>' for n in forwarded_names(cfg.queues))
    blocks = []
    for i, peer in enumerate(cfg.peers):
        # duplex: control messages of handshake mode flow back over the same bridge.
        # networkTTL=2: a message may cross back once, to a receiver at its sender's site.
        # conduitSubscriptions=false: each remote receiver is its own consumer, so queue
        # dispatch stays one stream per receiver. Local receivers are preferred.
        blocks.append(
            f'      <networkConnector name="{attr(name)}-{i}" uri="static:({attr(peer)})?maxReconnectDelay=2000'
            f'&amp;useExponentialBackOff=false"{creds} duplex="true" networkTTL="2" '
            'conduitSubscriptions="false" decreaseNetworkConsumerPriority="true" '
            'bridgeTempDestinations="false" suppressDuplicateQueueSubscriptions="true">'
            + (f"<dynamicallyIncludedDestinations>{include}</dynamicallyIncludedDestinations>" if include else "")
            + "</networkConnector>")
    return "    <networkConnectors>\n" + "\n".join(blocks) + "\n    </networkConnectors>\n"


def openwire_xml(cfg: NetworkConfig, bind: str) -> str:
    """The OpenWire listeners: plain, TLS (the broker's ``<sslContext>``), or both."""
    options = "?transport.tcpNoDelay=true&amp;wireFormat.maxInactivityDuration=30000"
    listeners = [f'      <transportConnector name="{name}" uri="{scheme}://{bind}:{port}{options}"/>'
                 for name, scheme, port in (("openwire", "tcp", cfg.openwire_port),
                                            ("openwire+ssl", "ssl", cfg.openwire_tls_port)) if port]
    return "\n".join(listeners)
