"""The embedded default broker: a local ActiveMQ Classic process run with our config.

``amqstream broker start`` renders the shipped configuration into a data directory,
starts the installed ActiveMQ (Debian's ``/usr/share/activemq`` or ``$ACTIVEMQ_HOME``)
as a background Java process, waits until its STOMP port accepts connections and
records the pid. Restarting on the same data directory keeps every undelivered
persistent message (KahaDB), which is what makes the embedded broker crash-safe.

Authentication is on by default: on first start a password is generated into
``<data-dir>/credentials.json`` (mode 0600) and printed once. That administrator may use
every destination; :meth:`EmbeddedBroker.add_user` adds users who may only send to, or
receive from, the destinations they are granted (``<data-dir>/users.json``, mode 0600).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow_provider_amqstream.broker.config import (
    CA_FILE,
    CREDENTIALS_FILE,
    HOST,
    USERS_FILE,
    new_user,
    read_users,
    render_config,
    write_users,
)
from airflow_provider_amqstream.broker.network import NetworkConfig
from airflow_provider_amqstream.broker.process import (
    activemq_home,
    java_binary,
    java_command,
    running_pid,
    sigkill,
    spawn,
    tail,
    terminate,
    wait_ready,
)
from airflow_provider_amqstream.exceptions import BrokerError
from airflow_provider_amqstream.protocol.headers import DEFAULT_PORT


def default_data_dir() -> Path:
    """Where the embedded broker keeps its config, KahaDB and pid unless told otherwise."""
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return Path(os.environ.get("AMQSTREAM_BROKER_DIR") or state / "amqstream" / "broker")


@dataclass(frozen=True)
class BrokerInfo:
    """Where a running embedded broker listens and how to log in to it."""

    host: str
    port: int
    user: str | None
    password: str | None
    pid: int | None
    data_dir: Path
    tls_port: int | None = None
    ca_file: Path | None = None

    def _cred(self) -> str:
        if not self.user:
            return ""
        return quote(self.user, safe="") + ":" + quote(self.password or "", safe="") + "@"

    @property
    def uri(self) -> str:
        """Airflow connection URI for this broker (contains the password: do not log)."""
        return f"amqstream://{self._cred()}{self.host}:{self.port}"

    @property
    def tls_uri(self) -> str | None:
        """The same over TLS, trusting the broker's generated certificate."""
        if not self.tls_port:
            return None
        return (f"amqstream://{self._cred()}{self.host}:{self.tls_port}?tls=true&ca_file="
                f"{quote(str(self.ca_file), safe='/')}")


class EmbeddedBroker:
    """Start, stop and inspect one ActiveMQ process bound to a data directory.

    :param data_dir: directory for config, KahaDB, logs and pid file.
    :param port: STOMP port on loopback (:data:`~airflow_provider_amqstream.broker.config.HOST`).
    :param auth: require a user name and password (generated on first start).
    :param network: join a network of brokers (see :mod:`~airflow_provider_amqstream.broker.network`).
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 auth: bool = True, tls_port: int | None = None,
                 store_dir: str | os.PathLike[str] | None = None, network: NetworkConfig | None = None) -> None:
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        self.pid_file = self.data_dir / "broker.pid"
        self.log_file = self.data_dir / "data" / "broker.log"
        self.creds_file = self.data_dir / CREDENTIALS_FILE
        self.ca_file = self.data_dir / CA_FILE
        self.users_file = self.data_dir / USERS_FILE
        # None: the network this data dir was last started with, if any (restart keeps it).
        self.network = network if network is not None else NetworkConfig.remembered(self.data_dir)
        self.port = port if port is not None else self._remembered("broker.port") or DEFAULT_PORT
        self.tls_port = tls_port if tls_port is not None else self._remembered("broker.tls_port")
        self.auth = auth
        # Two brokers given the same store_dir form a shared-store master/slave pair: the
        # one holding the KahaDB lock serves, the other waits to take over.
        self.store_dir = Path(store_dir) if store_dir else self.data_dir / "data" / "kahadb"

    def _remembered(self, name: str) -> int | None:
        try:
            return int((self.data_dir / name).read_text().strip())
        except (OSError, ValueError):
            return None

    # -- users and configuration --------------------------------------------------
    def users(self) -> dict[str, dict[str, Any]]:
        return read_users(self.data_dir)

    def add_user(self, name: str, *, send: Iterable[str] = (), receive: Iterable[str] = (),
                 password: str | None = None, max_waiting: int | None = None) -> BrokerInfo:
        """Add (or replace) a user who may only send to ``send`` and receive from
        ``receive``; return its connection details. Takes effect at the next start.

        :param name: user name (``A-Z a-z 0-9 . _ -``, up to 64 characters).
        :param send: destinations it may send streams to (``/queue/x``, ``/topic/x``; a
            trailing ``.>`` grants a whole family, e.g. ``/queue/sites.>``).
        :param receive: destinations it may receive streams from, in the same form.
        :param password: its password; generated when not given.
        :param max_waiting: how many streams' data queues it may have at once on each
            destination it sends to (default 1,000; the broker refuses more).
        """
        user = new_user(name, send=send, receive=receive, password=password, max_waiting=max_waiting)
        write_users(self.data_dir, {**self.users(), name: user})
        return self.info(user=name)

    def remove_user(self, name: str) -> bool:
        """Remove a user added with :meth:`add_user`; takes effect at the next start."""
        users = self.users()
        if users.pop(name, None) is None:
            return False
        write_users(self.data_dir, users)
        return True

    def render_config(self) -> tuple[Path, bool]:
        return render_config(self.data_dir, port=self.port, auth=self.auth, tls_port=self.tls_port,
                             store_dir=self.store_dir, network=self.network)

    # -- process -----------------------------------------------------------------
    def running_pid(self) -> int | None:
        return running_pid(self.pid_file, self.data_dir)

    def port_open(self, timeout: float = 0.5, port: int | None = None) -> bool:
        try:
            with socket.create_connection((HOST, port or self.port), timeout=timeout):
                return True
        except OSError:
            return False

    def _ready(self) -> bool:
        # Connectors start one after another: the TLS one ~0.1 s after plain STOMP.
        net = self.network
        return self.port_open() and all(self.port_open(port=p) for p in (self.tls_port, net.openwire_port,
                                                                          net.openwire_tls_port) if p)

    def info(self, *, user: str | None = None) -> BrokerInfo:
        """Where the broker listens, with the administrator's credentials, or ``user``'s."""
        password = None
        if user is not None:
            users = self.users()
            if user not in users:
                raise BrokerError(f"no user {user!r} in {self.users_file}")
            password = users[user]["password"]
        elif self.auth and self.creds_file.is_file():
            data = json.loads(self.creds_file.read_text())
            user, password = data["user"], data["password"]
        return BrokerInfo(HOST, self.port, user, password, self.running_pid(), self.data_dir,
                          self.tls_port, self.ca_file if self.tls_port else None)

    def start(self, *, timeout: float = 90.0, wait: bool = True) -> tuple[BrokerInfo, bool]:
        """Start the broker unless it already runs; return (info, credentials created now).

        :param wait: wait until the STOMP port accepts. A shared-store slave opens its
            ports only once it holds the store lock, so start it with ``wait=False``.
        """
        if self.running_pid() is not None and (self.port_open() or not wait):
            return self.info(), False
        home = activemq_home()
        java = java_binary()
        if self.port_open():
            raise BrokerError(
                f"port {HOST}:{self.port} is already in use by another process; "
                "stop it or pass --port to run the embedded broker elsewhere."
            )
        conf, created = self.render_config()
        proc = spawn(java_command(java, home, self.data_dir, conf), self.data_dir)
        self.pid_file.write_text(f"{proc.pid}\n")
        (self.data_dir / "broker.port").write_text(f"{self.port}\n")
        if self.tls_port:
            (self.data_dir / "broker.tls_port").write_text(f"{self.tls_port}\n")
        if self.network.active:
            self.network.remember(self.data_dir)
        if not wait:
            return self.info(), created
        logs = (self.data_dir / "data" / "broker.out", self.log_file)
        if wait_ready(proc, self._ready, timeout, *logs):
            return self.info(), created
        self.stop()
        raise BrokerError(
            f"ActiveMQ did not open {HOST}:{self.port} within {timeout:.0f}s; "
            f"see {self.log_file}:\n{tail(logs)}"
        )

    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stop the broker cleanly (SIGTERM, then SIGKILL); return whether one was running."""
        pid = self.running_pid()
        if pid is not None:
            terminate(pid, timeout)
        self.pid_file.unlink(missing_ok=True)
        return pid is not None

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would (tests use this)."""
        pid = self.running_pid()
        if pid is not None:
            sigkill(pid)

