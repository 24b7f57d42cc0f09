"""How to reach the broker(s): connection settings parsed from a URI or an Airflow connection.

Plain data and parsing, no stomp.py and no I/O, so that :mod:`~airflow_provider_amqstream.connection`
(and the command line's start-up through it) can build settings without loading the transport.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

DEFAULT_PORT = 61613


def check_uri_credentials(uri: str, where: str = "the connection URI") -> None:
    """Refuse a URI whose user or password holds a character that ends the authority.

    urllib then reads part of the password as the port, path or query, and every error
    from there on would quote it. Say what to do and quote nothing.
    """
    rest = uri.split("://", 1)[-1]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in rest[len(authority):]:
        raise ValueError(f"{where}: the user or password contains '/', '?', '#' or '@' that must be "
                         "percent-encoded (%2F, %3F, %23, %40); the URI is not shown because it holds a password")


@dataclass(frozen=True)
class BrokerParams:
    """How to reach the broker(s). Built from an Airflow connection or a URI.

    :param hosts: (host, port) pairs tried in order; more than one gives failover.
    :param heartbeat_ms: STOMP heart-beat interval both ways; 0 disables.
    :param chunk_size: default chunk size for streams sent through this connection.
    :param window: default number of chunks per confirmation window / prefetch.
    :param network: the broker is one of a network of brokers; a trigger watching for offers
        then also draws offers waiting at the other brokers to this one (a queue browser
        alone makes no bridge forward anything).
    """

    hosts: tuple[tuple[str, int], ...] = (("127.0.0.1", DEFAULT_PORT),)
    login: str | None = None
    password: str | None = field(default=None, repr=False)
    vhost: str | None = None
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    check_hostname: bool = True
    heartbeat_ms: int = 10_000
    connect_timeout: float = 15.0
    receipt_timeout: float = 60.0
    chunk_size: int | None = None
    window: int | None = None
    compression: str | None = None
    network: bool = False

    @property
    def url(self) -> str:
        """Broker address for messages and logs; never contains the password."""
        scheme = "stomp+ssl" if self.tls else "stomp"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.hosts)

    @classmethod
    def from_parts(cls, host: str | None, port: int | None, login: str | None,
                   password: str | None, extra: Mapping[str, Any] | None) -> BrokerParams:
        """Build from Airflow connection fields: ``host`` may list ``h1,h2:61614``."""
        extra = dict(extra or {})
        default_port = int(port or extra.get("port") or DEFAULT_PORT)
        host_list = str(extra.get("hosts") or host or "127.0.0.1")
        hosts = []
        for item in (h.strip() for h in host_list.split(",")):
            if not item:
                continue
            if item.count(":") == 1:
                h, _, p = item.partition(":")
                if not p.isdigit():
                    raise ValueError(f"broker host {item!r}: the port must be a number")
                hosts.append((h, int(p)))
            else:
                hosts.append((item.strip("[]"), default_port))
        if not hosts:
            raise ValueError("an amqstream connection needs at least one broker host")

        def flag(name: str, default: bool) -> bool:
            v = extra.get(name, default)
            return v if isinstance(v, bool) else str(v).strip().lower() in ("1", "true", "yes", "on")

        def num(name: str, default: Any, conv: Any = int) -> Any:
            v = extra.get(name)
            if v in (None, ""):
                return default
            try:
                return conv(v)
            except (TypeError, ValueError):
                kind = "a whole number" if conv is int else "a number"
                raise ValueError(f"connection extra {name!r} must be {kind}, got {str(v)[:40]!r}") from None

        return cls(
            hosts=tuple(hosts), login=login or None, password=password or None,
            vhost=extra.get("vhost") or None, tls=flag("tls", False),
            ca_file=extra.get("ca_file") or None, cert_file=extra.get("cert_file") or None,
            key_file=extra.get("key_file") or None, check_hostname=flag("check_hostname", True),
            heartbeat_ms=num("heartbeat_ms", 10_000), connect_timeout=num("connect_timeout", 15.0, float),
            receipt_timeout=num("receipt_timeout", 60.0, float),
            chunk_size=num("chunk_size", None), window=num("window", None),
            compression=(str(extra["compression"]).lower() or None) if extra.get("compression") not in
            (None, "", "none", "None") else None,
            network=flag("network", False),
        )

    @classmethod
    def from_uri(cls, uri: str) -> BrokerParams:
        """Parse ``amqstream://user:pass@host1,host2:61613?tls=true&window=16``."""
        parts = urlsplit(uri)
        if parts.scheme not in ("amqstream", "stomp", "stomp+ssl"):
            raise ValueError(f"not an amqstream URI (scheme {parts.scheme!r}); use amqstream://host:port")
        check_uri_credentials(uri)
        netloc = parts.netloc.rpartition("@")[2]
        host, port = netloc, None
        if re.search(r":\d+$", netloc):
            host, _, p = netloc.rpartition(":")
            port = int(p)
        elif ":" in netloc.strip("[]") and not netloc.startswith("["):
            raise ValueError(f"the connection URI's port must be a number (host part {netloc[:80]!r})")
        extra = dict(parse_qsl(parts.query))
        if parts.scheme == "stomp+ssl":
            extra.setdefault("tls", "true")
        return cls.from_parts(unquote(host), port, unquote(parts.username or "") or None,
                              unquote(parts.password or "") or None, extra)

    def with_overrides(self, **kw: Any) -> BrokerParams:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})
