"""How to reach the broker(s): connection settings built from an Airflow connection's fields.

Plain data and parsing, no stomp.py and no I/O, so that the command line's start-up can
build settings without loading the transport.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_amqstream.exceptions import ConfigurationError, ProtocolError
from airflow_provider_amqstream.protocol.codec import DEFAULT_COMPRESSION, normalise_compression
from airflow_provider_amqstream.protocol.headers import DEFAULT_PORT
from airflow_provider_amqstream.protocol.seal import parse_recipient

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
# Other spellings of a TLS switch (``ssl=true``, ``use_tls``, ``TLS``): refused rather than
# ignored, since ignoring one would connect in plain text while the user asked for TLS.
_TLS_LOOKALIKE = re.compile(r"(use_|enable_)?(tls|ssl)(_enabled)?")


def _at(where: str | None) -> str:
    return f"{where}: " if where else ""


def parse_flag(value: Any, name: str, default: bool, where: str | None = None) -> bool:
    """A true/false connection extra.

    Unset (None) is ``default``. Anything not clearly true or false is an error, never False:
    read leniently, ``tls=maybe`` or ``tls=ture`` would mean plain text. Accepted: a bool, 0
    or 1, true/false, 1/0, yes/no, on/off."""
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ConfigurationError(f"{_at(where)}connection extra {name!r} must be true or false, got {str(value)[:40]!r}")


@dataclass(frozen=True)
class BrokerParams:
    """How to reach the broker(s). Built from an Airflow connection or a URI.

    :param hosts: (host, port) pairs tried in order; more than one gives failover.
    :param heartbeat_ms: STOMP heart-beat interval both ways; 0 disables.
    :param chunk_size: default chunk size for streams sent through this connection.
    :param window: default number of chunks per confirmation window / prefetch.
    :param records_retention_days: connection extra: days receivers (and senders) keep their
        completion records, claims and "already sent" checkpoints (None: 30; 0: for ever).
    :param min_rate: connection extra: bytes a second a stream must bring to keep a receiver
        (None: the engine's default; 0: only the idle timeout counts).
    :param keys: connection extra ``keys``: key files a receiver opens sealed streams with.
    :param seal_to: connection extra ``seal_to``: recipients a sender seals every stream to.
    :param seal_required: connection extra ``seal: required``: senders refuse to send unsealed,
        receivers quarantine unsealed streams.
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
    # "auto" (compress chunks that shrink), "zstd" (try every chunk), or None (none).
    compression: str | None = normalise_compression(DEFAULT_COMPRESSION)
    network: bool = False
    records_retention_days: float | None = None
    min_rate: float | None = None
    keys: tuple[str, ...] = ()
    seal_to: tuple[str, ...] = ()
    seal_required: bool = False
    # Which link the engine gets (transport/link.py): "stomp", or "memory" in unit tests.
    backend: str = "stomp"

    @property
    def user(self) -> str:
        """The user it logs in as ("" for none): the name a broker that stamps senders
        (``JMSXUserID``) gives its messages, which names its data queues."""
        return self.login or ""

    @property
    def url(self) -> str:
        """Broker address for messages and logs; never contains the password."""
        scheme = "stomp+ssl" if self.tls else "stomp"
        return ",".join(f"{scheme}://{h}:{p}" for h, p in self.hosts)

    @classmethod
    def from_parts(cls, host: str | None, port: int | None, login: str | None,
                   password: str | None, extra: Mapping[str, Any] | None, *, tls_scheme: bool = False,
                   where: str | None = None) -> BrokerParams:
        """Build from Airflow connection fields: ``host`` may list ``h1,h2:61614`` (``port`` for
        hosts that name none). With ``tls_scheme`` (``stomp+ssl``), an extra ``tls`` that says
        false is a contradiction, refused."""
        at = _at(where)
        extra = dict(extra or {})
        default_port = int(port or extra.get("port") or DEFAULT_PORT)
        host_list = str(extra.get("hosts") or host or "127.0.0.1")
        hosts = []
        for item in (h.strip() for h in host_list.split(",")):
            if not item:
                continue
            if "://" in item:
                # Airflow's ``type://protocol://host`` form puts the protocol into the host; it
                # would be looked up as a host name. Quote only the scheme: the rest may hold a password.
                raise ConfigurationError(f"{at}a broker host starts with a scheme ({item.split('://', 1)[0][:20]}://): "
                                 "give host[:port] only, and ask for TLS with the scheme stomp+ssl:// or the "
                                 "extra tls=true")
            if item.count(":") == 1:
                h, _, p = item.partition(":")
                if not p.isdigit():
                    raise ConfigurationError(f"broker host {item!r}: the port must be a number")
                hosts.append((h, int(p)))
            else:
                hosts.append((item.strip("[]"), default_port))
        if not hosts:
            raise ConfigurationError("an amqstream connection needs at least one broker host")

        def flag(name: str, default: bool) -> bool:
            return parse_flag(extra.get(name), name, default, where)

        def num(name: str, default: Any, conv: Any = int) -> Any:
            v = extra.get(name)
            if v in (None, ""):
                return default
            try:
                return conv(v)
            except (TypeError, ValueError):
                kind = "a whole number" if conv is int else "a number"
                raise ConfigurationError(f"{at}connection extra {name!r} must be {kind}, got {str(v)[:40]!r}") from None

        return cls(
            hosts=tuple(hosts), login=login or None, password=password or None,
            vhost=extra.get("vhost") or None, tls=_tls(extra, tls_scheme, where),
            ca_file=extra.get("ca_file") or None, cert_file=extra.get("cert_file") or None,
            key_file=extra.get("key_file") or None, check_hostname=flag("check_hostname", True),
            heartbeat_ms=num("heartbeat_ms", 10_000), connect_timeout=num("connect_timeout", 15.0, float),
            receipt_timeout=num("receipt_timeout", 60.0, float),
            chunk_size=num("chunk_size", None), window=num("window", None),
            compression=_compression(extra, at),
            network=flag("network", False),
            records_retention_days=_at_least_zero("records_retention_days", num("records_retention_days", None, float),
                                                  at, zero=" (keep records for ever)"),
            min_rate=_at_least_zero("min_rate", num("min_rate", None, float), at),
            keys=tuple(extra_list(extra, "keys")), seal_to=_recipients(extra_list(extra, "seal_to"), at),
            seal_required=_seal_policy(extra.get("seal"), at),
        )


def extra_list(extra: Mapping[str, Any], key: str) -> list[str]:
    """A connection extra holding a list: a JSON list, or a comma-separated string."""
    value = extra.get(key)
    if value in (None, ""):
        return []
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def _recipients(found: list[str], at: str) -> tuple[str, ...]:
    try:
        for text in found:
            parse_recipient(text)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{at}connection extra 'seal_to': {exc}") from None
    return tuple(found)


def _seal_policy(value: Any, at: str) -> bool:
    text = str(value or "").strip().lower()
    if text not in ("", "required", "optional"):
        raise ConfigurationError(f"{at}connection extra 'seal' must be 'required' or 'optional', got {text[:20]!r}")
    return text == "required"


def _compression(extra: Mapping[str, Any], at: str) -> str | None:
    """The extra's ``compression``: the default (:data:`DEFAULT_COMPRESSION`) when the key is
    absent or empty; ``none`` or a null value is none (the connection form saves its choice
    "none" as null)."""
    if "compression" not in extra or extra["compression"] == "":
        return normalise_compression(DEFAULT_COMPRESSION)
    value = extra["compression"]
    try:
        return normalise_compression(None if value is None else str(value))
    except ProtocolError as exc:
        raise ConfigurationError(f"{at}connection extra 'compression': {exc}") from None


def _at_least_zero(name: str, value: float | None, at: str, *, zero: str = "") -> float | None:
    """``value``, refused if negative; ``zero`` says what 0 means."""
    if value is not None and value < 0:
        raise ConfigurationError(f"{at}connection extra {name!r} must be 0{zero} or more, got {value:g}")
    return value


def _tls(extra: Mapping[str, Any], tls_scheme: bool, where: str | None) -> bool:
    """Whether a connection speaks TLS (``tls_scheme``: its scheme alone asks for it);
    refuses every setting that leaves it unclear."""
    at = _at(where)
    for key in extra:
        if key != "tls" and _TLS_LOOKALIKE.fullmatch(str(key).strip().lower().replace("-", "_")):
            raise ConfigurationError(f"{at}connection extra {str(key)[:40]!r} is not an amqstream setting: TLS is "
                             "switched on with the extra tls=true, or the scheme stomp+ssl://")
    tls = parse_flag(extra.get("tls"), "tls", tls_scheme, where)
    if tls_scheme and not tls:
        raise ConfigurationError(f"{at}the scheme asks for TLS but the extra tls is false: remove one of the two")
    files = [name for name in ("ca_file", "cert_file", "key_file") if extra.get(name)]
    if files and not tls:
        raise ConfigurationError(f"{at}{', '.join(files)} given but TLS is off: set the extra tls=true (or use "
                         "stomp+ssl://), or remove them")
    return tls
