"""Find an ``amqstream`` connection without paying for Airflow when it is not needed.

Importing Airflow costs a command-line process about 2.5 s and 90 MiB, yet most connections
come from an ``AIRFLOW_CONN_<ID>`` variable, plain text read here exactly as Airflow 3.3 reads
it; Airflow is imported only to look a connection up in the metadata database.
:func:`parse_uri` is the one place a URI becomes fields, :meth:`ConnFields.broker_params` the
one place fields become settings. Every ``where`` names a connection's source in error
messages, never its value (it holds a password).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from airflow_provider_amqstream.exceptions import ConfigurationError, ConnectionNotFound
from airflow_provider_amqstream.transport.params import BrokerParams

log = logging.getLogger(__name__)

ENV_PREFIX = "AIRFLOW_CONN_"
DEFAULT_CONN_ID = "amqstream_default"
EXTRA_KEY = "__extra__"
# The URI schemes (Airflow's conn_type) of an amqstream connection, and whether the scheme
# alone means TLS. Any other scheme is refused: ActiveMQ's own connector schemes
# (``stomp+nio+ssl``, ``ssl``) read as unknown types would otherwise mean plain text.
SCHEMES: dict[str, bool] = {"amqstream": False, "stomp": False, "amqstream+ssl": True, "stomp+ssl": True}


@dataclass(frozen=True)
class ConnFields:
    """The fields of an Airflow connection that an ``amqstream`` connection uses: ``conn_type``
    is a URI's scheme, normalised as Airflow does; ``source`` names where the connection came
    from in error messages (``$AIRFLOW_CONN_X``)."""

    conn_id: str
    conn_type: str | None = None
    host: str | None = None
    port: int | None = None
    login: str | None = None
    password: str | None = field(default=None, repr=False)
    schema: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    source: str = field(default="connection", compare=False)

    def broker_params(self) -> BrokerParams:
        """The broker settings these fields describe; ConfigurationError for a scheme (conn_type;
        None or empty is ``amqstream``) that is not an amqstream one, or a setting we refuse."""
        scheme = self.conn_type or "amqstream"
        tls_scheme = SCHEMES.get(scheme.lower())
        if tls_scheme is None:
            accepted = ", ".join(f"{name}://" for name in SCHEMES)
            raise ConfigurationError(f"{self.source}: connection type (URI scheme) {scheme[:40]!r} is not an amqstream "
                                     f"one; accepted: {accepted} (the +ssl ones mean TLS; the others use TLS with the "
                                     "extra tls=true)")
        return BrokerParams.from_parts(self.host, self.port, self.login, self.password, self.extra,
                                       tls_scheme=tls_scheme, where=self.source)


def env_var_name(conn_id: str) -> str:
    """The environment variable Airflow reads connection ``conn_id`` from."""
    return ENV_PREFIX + conn_id.upper()


def _normalize_conn_type(conn_type: str | None) -> str | None:
    if conn_type == "postgresql":
        return "postgres"
    return conn_type.replace("-", "_") if conn_type else conn_type


def _decode_extra(raw: Any, where: str) -> dict[str, Any]:
    if raw in (None, ""):
        return {}
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as exc:
        # Airflow logs this and carries on with no extra at all; silently losing TLS or
        # failover settings would be worse than stopping here.
        raise ConfigurationError(f"{where}: the extra is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigurationError(f"{where}: the extra must be a JSON object, got {type(value).__name__}")
    return value


def parse_json(value: str, conn_id: str, where: str = "connection") -> ConnFields:
    """A connection in Airflow's JSON form: ``{"conn_type": ..., "host": ..., "extra": {...}}``
    (``extra`` an object or a string holding one, as in Airflow)."""
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ConfigurationError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigurationError(f"{where}: a JSON connection must be an object")
    port = data.get("port")
    if port not in (None, ""):
        try:
            port = int(port)
        except (TypeError, ValueError):
            raise ConfigurationError(f"{where}: expected an integer port, got {port!r}") from None
    return ConnFields(conn_id=conn_id, conn_type=_normalize_conn_type(data.get("conn_type")),
                      host=data.get("host") or None, port=port or None, login=data.get("login"),
                      password=data.get("password"), schema=data.get("schema"),
                      extra=_decode_extra(data.get("extra"), where), source=where)


def check_uri_credentials(uri: str, where: str = "the connection URI") -> None:
    """Refuse a URI whose user or password holds a character that ends the authority: urllib
    would read part of the password as the port, path or query, and every later error quote it."""
    rest = uri.split("://", 1)[-1]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in rest[len(authority):]:
        raise ConfigurationError(f"{where}: the user or password contains '/', '?', '#' or '@' that must be "
                         "percent-encoded (%2F, %3F, %23, %40); the URI is not shown because it holds a password")


def _uri_hostname(parts: Any) -> str:
    # As Airflow: urlsplit's hostname (lower-cased, brackets stripped), unless it holds a
    # path, then the raw netloc's host part.
    hostname = unquote(parts.hostname or "")
    if "/" in hostname:
        hostname = parts.netloc
        if "@" in hostname:
            hostname = hostname.rsplit("@", 1)[1]
        if ":" in hostname:
            hostname = hostname.split(":", 1)[0]
        hostname = unquote(hostname)
    return hostname


def parse_uri(uri: str, conn_id: str, where: str = "connection") -> ConnFields:
    """A connection in Airflow's URI form, parsed as the Task SDK's ``Connection.from_uri``.

    ``amqstream://user:pa%40ss@host:61613?heartbeat_ms=5000``: user and password are
    percent-decoded; query parameters become the extra (as strings), unless ``__extra__``
    is present, whose value is the extra as JSON. The scheme becomes the conn_type, as in
    Airflow; it is checked (and ``stomp+ssl`` read as TLS) by :meth:`ConnFields.broker_params`.
    """
    schemes = uri.count("://")
    if schemes == 0 or schemes > 2:
        raise ConfigurationError(f"{where}: not a connection URI (expected amqstream://[user:password@]host:port)")
    with_protocol = schemes == 2
    check_uri_credentials(uri, where)
    conn_type = urlsplit(uri).scheme
    rest = uri.replace(f"{conn_type}://", "" if with_protocol else "//")
    if with_protocol:
        first = rest.split("://", 1)[0]
        if "@" in first or ":" in first:
            raise ConfigurationError(f"{where}: invalid connection URI")
    parts = urlsplit(rest)
    try:
        port = parts.port
    except ValueError:
        # urllib's message quotes the text after the last ':', which may be a password.
        hint = (" (brokers with ports of their own go in the extra: ?hosts=mq1:61613,mq2:61614)"
                if "," in parts.netloc else "")
        raise ConfigurationError(f"{where}: the port is not a number from 0 to 65535{hint}") from None
    host = _uri_hostname(parts)
    if host and with_protocol:
        host = f"{parts.scheme}://{host}"
    extra: dict[str, Any] = {}
    if parts.query:
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        extra = _decode_extra(query[EXTRA_KEY], where) if EXTRA_KEY in query else query
    return ConnFields(conn_id=conn_id, conn_type=_normalize_conn_type(conn_type), host=host or None, port=port,
                      login=unquote(parts.username) if parts.username else parts.username,
                      password=unquote(parts.password) if parts.password else parts.password,
                      schema=unquote(parts.path[1:]) if parts.path[1:] else None, extra=extra, source=where)


def params_from_uri(uri: str, where: str = "connection URI") -> BrokerParams:
    """Broker settings from a connection URI: :func:`parse_uri`, then :meth:`ConnFields.broker_params`."""
    return parse_uri(uri, "", where).broker_params()


def parse_connection(value: str, conn_id: str, where: str = "connection") -> ConnFields:
    """A serialised connection as Airflow's secrets backends read it: JSON if it starts with ``{``, else a URI."""
    value = value.strip()
    if not value:
        raise ConfigurationError(f"{where} is empty")
    if value.startswith("{"):
        return parse_json(value, conn_id, where)
    return parse_uri(value, conn_id, where)


def _airflow_home(env: Mapping[str, str]) -> Path:
    return Path(env.get("AIRFLOW_HOME") or Path.home() / "airflow").expanduser()


def _airflow_config(env: Mapping[str, str]) -> configparser.ConfigParser:
    """airflow.cfg as Airflow would find it, read without importing it."""
    cfg = Path(env.get("AIRFLOW_CONFIG") or _airflow_home(env) / "airflow.cfg").expanduser()
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read(cfg)
    except configparser.Error as exc:
        raise ConfigurationError(f"{cfg}: cannot be read as Airflow's configuration ({exc})") from None
    return parser


def _configured(env: Mapping[str, str], settings: list[tuple[str, str]]) -> str | None:
    """The first of Airflow's ``settings`` (section, key) set, as Airflow reads them: every
    ``AIRFLOW__<SECTION>__<KEY>`` variable before airflow.cfg."""
    for name in (f"AIRFLOW__{section}__{key}".upper() for section, key in settings):
        if env.get(name, "").strip():
            return env[name].strip()
    parser = _airflow_config(env)
    return next((v for v in (parser.get(s, k, fallback="").strip() for s, k in settings) if v), None)


_SECRETS_BACKEND = [("secrets", "backend"), ("workers", "secrets_backend")]


def custom_secrets_backend(environ: Mapping[str, str] | None = None) -> str | None:
    """The custom secrets backend Airflow is configured with (``[secrets] backend`` or
    ``[workers] secrets_backend``): Airflow asks it before the environment variables, so with
    one set the shortcut through ``AIRFLOW_CONN_<ID>`` would change which definition wins."""
    return _configured(os.environ if environ is None else environ, _SECRETS_BACKEND)


def airflow_may_know(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Airflow's own lookup could find a connection here (a custom secrets backend, a
    metadata database configured, or the default SQLite file); else importing Airflow is wasted."""
    env = os.environ if environ is None else environ
    keys = ("sql_alchemy_conn", "sql_alchemy_conn_cmd", "sql_alchemy_conn_secret")
    # One reading of airflow.cfg for all of them (this runs before most CLI commands).
    settings = [*_SECRETS_BACKEND, *((s, k) for s in ("database", "core") for k in keys)]
    return _configured(env, settings) is not None or (_airflow_home(env) / "airflow.db").is_file()


def local_deployments() -> list[Path]:
    """The env.sh files of local deployments (``make airflow``) found from here: the one
    ``AMQSTREAM_AIRFLOW_DIR`` names, ``./airflow-local`` and the checkout's."""
    dirs = [Path(os.environ["AMQSTREAM_AIRFLOW_DIR"])] if os.environ.get("AMQSTREAM_AIRFLOW_DIR") else []
    dirs += [Path.cwd() / "airflow-local", Path(__file__).resolve().parents[2] / "airflow-local"]
    found: list[Path] = []
    for d in dirs:
        env_sh = (d / "env.sh").expanduser().absolute()
        if env_sh.is_file() and env_sh not in found:
            found.append(env_sh)
    return found


def from_env(conn_id: str, environ: Mapping[str, str] | None = None) -> ConnFields | None:
    """Connection ``conn_id`` from its ``AIRFLOW_CONN_<ID>`` variable, or None if unset
    (or if a custom secrets backend is configured: Airflow asks that first)."""
    name = env_var_name(conn_id)
    env = os.environ if environ is None else environ
    value = env.get(name)
    if value is None or custom_secrets_backend(env):
        return None
    return parse_connection(value, conn_id, where=name)


# The loggers of Airflow's two secrets maskers (core, Task SDK).
MASKER_LOGGERS = ("airflow._shared.secrets_masker.secrets_masker", "airflow.sdk._shared.secrets_masker.secrets_masker")


def _not_short_secret_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Skipping masking for a secret as it's too short")


@contextlib.contextmanager
def settings_not_flagged_as_secrets() -> Iterator[None]:
    """While Airflow looks a connection up: without the masker's ``Skipping masking for a
    secret as it's too short`` warning. Airflow masks every string of an extra, and ours are
    settings (``"auto"``, ``"zstd"``), no secrets."""
    loggers = [logging.getLogger(name) for name in MASKER_LOGGERS]
    for logger in loggers:
        logger.addFilter(_not_short_secret_notice)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_not_short_secret_notice)


def from_metadata_db(conn_id: str) -> ConnFields | None:
    """Connection ``conn_id`` through Airflow's own lookup (secrets backends, then the
    metadata database), as ``airflow connections get`` does; None if it is not defined.
    Imports Airflow (about 2 s), so only where it has somewhere to look (:func:`airflow_may_know`).
    """
    if "airflow" not in sys.modules and not airflow_may_know():
        return None
    from airflow.models.connection import Connection

    # The core lookup: environment, configured secrets backends, then the metadata
    # database. (The Task SDK's BaseHook.get_connection, outside a task, reads only
    # the environment: hence the AirflowNotFoundException users saw for UI connections.)
    where = f"connection {conn_id!r} in the metadata database"
    return looked_up(Connection.get_connection_from_secrets, conn_id, where)


def looked_up(get: Callable[[str], Any], conn_id: str, where: str) -> ConnFields | None:
    """The fields of connection ``conn_id`` as Airflow's ``get`` finds it (the core lookup, or
    a hook's ``get_connection``); None if it is not defined."""
    try:
        with settings_not_flagged_as_secrets():
            conn = get(conn_id)
    except Exception as exc:
        if type(exc).__name__ != "AirflowNotFoundException":
            raise
        return None
    return from_airflow(conn, where)


def from_airflow(conn: Any, where: str) -> ConnFields:
    """The fields of an Airflow ``Connection`` object (core or Task SDK)."""
    return ConnFields(conn_id=conn.conn_id, conn_type=conn.conn_type, host=conn.host, port=conn.port,
                      login=conn.login, password=conn.password, schema=conn.schema,
                      extra=_decode_extra(conn.extra, where), source=where)


def lookup(conn: str | None) -> tuple[ConnFields | None, str]:
    """The fields of the connection the CLI's ``--conn`` (a URI, JSON, an id, or None for
    ``amqstream_default``) names, and where they came from: ``AIRFLOW_CONN_<ID>``, then Airflow's
    lookup; None (and "") when nothing defines it."""
    if conn and ("://" in conn or conn.lstrip().startswith("{")):
        # JSON too: read as a connection id it would be quoted back, password and all, in
        # the "no connection" error.
        return parse_connection(conn, "", "--conn"), "--conn"
    conn_id = conn or DEFAULT_CONN_ID
    fields = from_env(conn_id)
    if fields is not None:
        return fields, f"${env_var_name(conn_id)}"
    fields = from_metadata_db(conn_id)
    if fields is not None:
        return fields, f"connection {conn_id!r} through Airflow's lookup"
    return None, ""


def resolve(conn: str | None) -> tuple[BrokerParams, str]:
    """Broker settings for the CLI's ``--conn`` and where they came from: :func:`lookup`, and
    for a missing ``amqstream_default`` the embedded broker; else :class:`ConnectionNotFound`."""
    fields, source = lookup(conn)
    if fields is not None:
        return fields.broker_params(), source
    conn_id = conn or DEFAULT_CONN_ID
    return embedded_instead(conn_id), f"the embedded broker (no connection {conn_id!r})"


def embedded_instead(conn_id: str) -> BrokerParams:
    """The embedded broker in place of connection ``conn_id``, which nothing defines: only
    for ``amqstream_default``, and only if that broker was ever started; else :class:`ConnectionNotFound`
    saying what a user can do."""
    if conn_id == DEFAULT_CONN_ID:
        from airflow_provider_amqstream.broker.embedded import EmbeddedBroker

        broker = EmbeddedBroker()
        if (broker.data_dir / "broker.port").is_file():
            info = broker.info()
            return BrokerParams(hosts=((info.host, info.port),), login=info.user, password=info.password)
    deployed = "".join(f" A local deployment (make airflow) defines its connections for another shell: "
                       f"`source {env_sh}`, then run this again." for env_sh in local_deployments()[:1])
    raise ConnectionNotFound(
        f"no connection {conn_id!r}: neither ${env_var_name(conn_id)} nor Airflow's metadata database "
        f"defines it.{deployed} Or set {env_var_name(conn_id)}='amqstream://USER:PASSWORD@HOST:61613', or run "
        f"`airflow connections add {conn_id} --conn-uri 'amqstream://USER:PASSWORD@HOST:61613'` "
        "(or add it in the UI, type amqstream), or pass --conn with the URI itself")
