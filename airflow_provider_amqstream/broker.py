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

import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow_provider_amqstream.broker_auth import (
    USER_NAME,
    BrokerError,
    auth_plugins,
    parse_grant,
    xml_attr,
)
from airflow_provider_amqstream.broker_network import NetworkConfig, bridge_credentials, connectors_xml, openwire_xml

DEFAULT_PORT = 61613
DEFAULT_USER = "amqstream"
JAVA_OPENS = [
    "--add-reads=java.xml=java.logging",
    "--add-opens", "java.base/java.security=ALL-UNNAMED",
    "--add-opens", "java.base/java.net=ALL-UNNAMED",
    "--add-opens", "java.base/java.lang=ALL-UNNAMED",
    "--add-opens", "java.base/java.util=ALL-UNNAMED",
    "--add-opens", "java.naming/javax.naming.spi=ALL-UNNAMED",
    "--add-opens", "java.rmi/sun.rmi.transport.tcp=ALL-UNNAMED",
    "--add-opens", "java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens", "java.base/java.util.concurrent.atomic=ALL-UNNAMED",
]


def default_data_dir() -> Path:
    """Where the embedded broker keeps its config, KahaDB and pid unless told otherwise."""
    env = os.environ.get("AMQSTREAM_BROKER_DIR")
    if env:
        return Path(env)
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "amqstream" / "broker"


def activemq_home() -> Path:
    """Locate the ActiveMQ installation, or explain how to install one."""
    candidates = [os.environ.get("ACTIVEMQ_HOME"), "/usr/share/activemq"]
    for cand in candidates:
        if cand and (Path(cand) / "bin" / "activemq.jar").is_file():
            return Path(cand)
    raise BrokerError(
        "ActiveMQ Classic is not installed (looked for bin/activemq.jar in "
        f"{', '.join(c for c in candidates if c)}). Install it with "
        "`sudo apt-get install activemq` or set ACTIVEMQ_HOME to an unpacked ActiveMQ 5.17+."
    )


def java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise BrokerError(
            "Java is not on PATH; ActiveMQ needs Java 11+. Install it with "
            "`sudo apt-get install default-jre-headless`."
        )
    return java


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
    :param port: STOMP port on loopback.
    :param auth: require a user name and password (generated on first start).
    :param network: join a network of brokers (see :mod:`~airflow_provider_amqstream.broker_network`).
    """

    def __init__(self, data_dir: str | os.PathLike[str] | None = None, *, port: int | None = None,
                 auth: bool = True, bind: str = "127.0.0.1", heap_mb: int = 512, tls_port: int | None = None,
                 store_dir: str | os.PathLike[str] | None = None, network: NetworkConfig | None = None) -> None:
        self.data_dir = Path(data_dir) if data_dir else default_data_dir()
        # None: the network this data dir was last started with, if any (restart keeps it).
        self.network = network if network is not None else (NetworkConfig.remembered(self.data_dir)
                                                             or NetworkConfig())
        self.port = port if port is not None else self._remembered("broker.port", DEFAULT_PORT)
        self.tls_port = tls_port if tls_port is not None else self._remembered("broker.tls_port", None)
        self.auth = auth
        self.bind = bind
        self.heap_mb = heap_mb
        # Two brokers given the same store_dir form a shared-store master/slave pair: the
        # one holding the KahaDB lock serves, the other waits to take over.
        self.store_dir = Path(store_dir) if store_dir else self.data_dir / "data" / "kahadb"

    def _remembered(self, name: str, default: int | None) -> int | None:
        try:
            return int((self.data_dir / name).read_text().strip())
        except (OSError, ValueError):
            return default

    # -- files -------------------------------------------------------------------
    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "data" / "broker.log"

    @property
    def creds_file(self) -> Path:
        return self.data_dir / "credentials.json"

    @property
    def ca_file(self) -> Path:
        return self.data_dir / "tls" / "broker-cert.pem"

    @property
    def users_file(self) -> Path:
        return self.data_dir / "users.json"

    # -- users -------------------------------------------------------------------
    def users(self) -> dict[str, dict[str, Any]]:
        """Users added with :meth:`add_user`: name -> {password, send, receive}."""
        try:
            return dict(json.loads(self.users_file.read_text())["users"])
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError) as exc:
            raise BrokerError(f"{self.users_file} is unreadable ({exc}); fix or delete it") from exc

    def add_user(self, name: str, *, send: Iterable[str] = (), receive: Iterable[str] = (),
                 password: str | None = None) -> BrokerInfo:
        """Add (or replace) a user who may only send to ``send`` and receive from
        ``receive``; return its connection details. Takes effect at the next start.

        :param name: user name (``A-Z a-z 0-9 . _ -``, up to 64 characters).
        :param send: destinations it may send streams to (``/queue/x``, ``/topic/x``; a
            trailing ``.>`` grants a whole family, e.g. ``/queue/sites.>``).
        :param receive: destinations it may receive streams from, in the same form.
        :param password: its password; generated when not given.
        """
        if not USER_NAME.fullmatch(name or "") or name == DEFAULT_USER:
            raise BrokerError(f"user name {name!r} is not valid: use 1-64 of A-Z a-z 0-9 . _ - "
                              f"(and not {DEFAULT_USER!r}, the administrator)")
        send, receive = sorted(set(send)), sorted(set(receive))
        if not send and not receive:
            raise BrokerError(f"user {name}: grant at least one --send or --receive destination")
        for text in (*send, *receive):
            parse_grant(text)
        users = self.users()
        users[name] = {"password": password or _new_password(), "send": send, "receive": receive}
        self._write_users(users)
        return self.info(user=name)

    def remove_user(self, name: str) -> bool:
        """Remove a user added with :meth:`add_user`; takes effect at the next start."""
        users = self.users()
        if users.pop(name, None) is None:
            return False
        self._write_users(users)
        return True

    def _write_users(self, users: Mapping[str, Any]) -> None:
        _write_secret_json(self.users_file, {"users": dict(users)})

    def _keystore(self) -> tuple[Path, str]:
        """A PKCS12 keystore with a self-signed certificate for localhost/127.0.0.1,
        made once with the JDK's keytool; the certificate is exported for clients."""
        tls = self.data_dir / "tls"
        store, secret = tls / "broker.p12", tls / "keystore.json"
        if store.is_file() and secret.is_file():
            return store, json.loads(secret.read_text())["password"]
        tls.mkdir(parents=True, exist_ok=True, mode=0o700)
        keytool = shutil.which("keytool") or str(Path(java_binary()).resolve().parent / "keytool")
        password = secrets.token_urlsafe(18)
        common = ["-keystore", str(store), "-storetype", "PKCS12", "-storepass", password]
        subprocess.run([keytool, "-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048",
                        "-validity", "825", "-dname", "CN=localhost", "-ext", f"SAN={self._certificate_names()}",
                        "-keypass", password, *common], check=True, capture_output=True, timeout=60)
        subprocess.run([keytool, "-exportcert", "-alias", "broker", "-rfc", "-file", str(self.ca_file), *common],
                       check=True, capture_output=True, timeout=60)
        _write_secret_json(secret, {"password": password})
        os.chmod(store, 0o600)
        return store, password

    def _certificate_names(self) -> str:
        """Subject names for the generated certificate: loopback, this host's names (a
        remote site's bridge verifies the name it dialled), and the bind address."""
        dns = {"localhost", socket.gethostname(), socket.getfqdn()}
        ips = {"127.0.0.1"}
        if self.bind not in ("0.0.0.0", "::", ""):
            try:
                ipaddress.ip_address(self.bind)
                ips.add(self.bind)
            except ValueError:
                dns.add(self.bind)
        names = [f"dns:{n}" for n in sorted(dns) if n and re.fullmatch(r"[A-Za-z0-9.-]+", n)]
        return ",".join(names + [f"ip:{ip}" for ip in sorted(ips)])

    def _trust_store(self, certificates: Iterable[Path]) -> tuple[Path, str]:
        """A PKCS12 trust store holding ``certificates`` (PEM), remade at each start so it
        holds exactly the certificates asked for; for bridges to ``ssl://`` peers."""
        tls = self.data_dir / "tls"
        tls.mkdir(parents=True, exist_ok=True, mode=0o700)
        store = tls / "peers.p12"
        store.unlink(missing_ok=True)
        password = secrets.token_urlsafe(18)
        keytool = shutil.which("keytool") or str(Path(java_binary()).resolve().parent / "keytool")
        for i, cert in enumerate(certificates):
            if not Path(cert).is_file():
                raise BrokerError(f"--network-ca {cert}: no such file (give the remote broker's certificate, "
                                  "its <data dir>/tls/broker-cert.pem)")
            run = subprocess.run([keytool, "-importcert", "-noprompt", "-alias", f"peer-{i}", "-file", str(cert),
                                  "-keystore", str(store), "-storetype", "PKCS12", "-storepass", password],
                                 capture_output=True, text=True, timeout=60)
            if run.returncode != 0:
                raise BrokerError(f"--network-ca {cert}: not a certificate keytool can read: "
                                  f"{(run.stdout + run.stderr).strip()[-300:]}")
        os.chmod(store, 0o600)
        return store, password

    def _credentials(self) -> tuple[str, str, bool]:
        """Return (user, password, created_now); the password is generated once."""
        if self.creds_file.is_file():
            data = json.loads(self.creds_file.read_text())
            return data["user"], data["password"], False
        password = _new_password()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.creds_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"user": DEFAULT_USER, "password": password}, fh)
        return DEFAULT_USER, password, True

    def render_config(self) -> tuple[Path, bool]:
        """Write conf/activemq.xml and conf/log4j.properties; return (conf dir, creds created)."""
        conf = self.data_dir / "conf"
        conf.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "data").mkdir(exist_ok=True)
        (self.data_dir / "tmp").mkdir(exist_ok=True)
        created = False
        auth_xml = ""
        net = self.network
        bridge = bridge_credentials(net.bridge_secret) if net.active and net.bridge_secret else None
        if self.auth:
            user, password, created = self._credentials()
            auth_xml = auth_plugins(user, password, self.users(), bridge=bridge, forwarded=net.queues)
        pkg = resources.files("airflow_provider_amqstream") / "broker_conf"
        template = string.Template((pkg / "activemq.xml.tmpl").read_text())
        free = shutil.disk_usage(self.data_dir).free
        # KahaDB refuses sends past storeUsage; leave the disk 10 % headroom.
        store_mb = max(512, int(free * 0.9 / 2**20))
        ssl_xml = tls_xml = ""
        if self.tls_port or net.needs_tls:
            store, store_pw = self._keystore()
            trust = ""
            if net.peer_cas:
                trust_store, trust_pw = self._trust_store(net.peer_cas)
                trust = (f' trustStore="file:{xml_attr(str(trust_store))}" '
                         f'trustStorePassword="{xml_attr(trust_pw)}" trustStoreType="pkcs12"')
            ssl_xml = (f'    <sslContext><sslContext keyStore="file:{xml_attr(str(store))}" '
                       f'keyStorePassword="{xml_attr(store_pw)}" keyStoreType="pkcs12"{trust}/></sslContext>')
        if self.tls_port:
            tls_xml = (f'      <transportConnector name="stomp+ssl" uri="stomp+ssl://{self.bind}:{self.tls_port}'
                       '?transport.tcpNoDelay=true&amp;wireFormat.maxDataLength=67108864'
                       '&amp;transport.hbGracePeriodMultiplier=2.5"/>')
        xml = template.safe_substitute(
            broker_name=f"amqstream-{self.port}", data_dir=str(self.data_dir / "data"),
            store_dir=str(self.store_dir), store_limit=f"{store_mb} mb", auth_plugins=auth_xml,
            bind=self.bind, port=self.port, ssl_context=ssl_xml, tls_connector=tls_xml,
            advisory="true" if net.active else "false", openwire_connector=openwire_xml(net, self.bind),
            network_connectors=connectors_xml(net, f"amqstream-{self.port}", *(bridge or (None, None)), xml_attr),
        )
        target = conf / "activemq.xml"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(xml)
        (conf / "log4j.properties").write_text((pkg / "log4j.properties").read_text())
        return conf, created

    # -- process -----------------------------------------------------------------
    def running_pid(self) -> int | None:
        """The pid recorded for this data dir if that process is still alive."""
        try:
            pid = int(self.pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        # A pid can be reused after a reboot; only trust it if it is our java.
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return pid
        return pid if str(self.data_dir).encode() in cmdline else None

    def port_open(self, timeout: float = 0.5, port: int | None = None) -> bool:
        try:
            with socket.create_connection((self.bind, port or self.port), timeout=timeout):
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
        return BrokerInfo(self.bind, self.port, user, password, self.running_pid(), self.data_dir,
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
                f"port {self.bind}:{self.port} is already in use by another process; "
                "stop it or pass --port to run the embedded broker elsewhere."
            )
        conf, created = self.render_config()
        data = self.data_dir / "data"
        cmd = [
            java, f"-Xmx{self.heap_mb}M", f"-Xms{min(self.heap_mb, 256)}M",
            "-XX:+ExitOnOutOfMemoryError",
            *JAVA_OPENS,
            *shlex.split(os.environ.get("AMQSTREAM_BROKER_JAVA_OPTS", "")),
            f"-Djava.io.tmpdir={self.data_dir / 'tmp'}",
            f"-Dactivemq.classpath={conf}",
            f"-Dactivemq.home={home}", f"-Dactivemq.base={self.data_dir}",
            f"-Dactivemq.conf={conf}", f"-Dactivemq.data={data}",
            f"-Dlog4j.configuration=file:{conf / 'log4j.properties'}",
            "-Dorg.apache.activemq.UseDedicatedTaskRunner=false",
            "-jar", str(home / "bin" / "activemq.jar"),
            "start", f"xbean:file:{conf / 'activemq.xml'}",
        ]
        out = open(data / "broker.out", "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=self.data_dir)
        finally:
            out.close()
        self.pid_file.write_text(f"{proc.pid}\n")
        (self.data_dir / "broker.port").write_text(f"{self.port}\n")
        if self.tls_port:
            (self.data_dir / "broker.tls_port").write_text(f"{self.tls_port}\n")
        if self.network.active:
            self.network.remember(self.data_dir)
        if not wait:
            return self.info(), created
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise BrokerError(
                    f"ActiveMQ exited with code {proc.returncode} while starting; "
                    f"see {data / 'broker.out'} and {self.log_file}:\n{self._tail()}"
                )
            if self._ready():
                return self.info(), created
            time.sleep(0.2)
        self.stop()
        raise BrokerError(
            f"ActiveMQ did not open {self.bind}:{self.port} within {timeout:.0f}s; "
            f"see {self.log_file}:\n{self._tail()}"
        )

    def stop(self, *, timeout: float = 30.0) -> bool:
        """Stop the broker cleanly (SIGTERM, then SIGKILL); return whether one was running."""
        pid = self.running_pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout):
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10)
        self.pid_file.unlink(missing_ok=True)
        return True

    def kill(self) -> None:
        """SIGKILL the broker, as a crash would (tests use this)."""
        pid = self.running_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 10)

    def _tail(self, lines: int = 15) -> str:
        texts = []
        for f in (self.data_dir / "data" / "broker.out", self.log_file):
            try:
                texts.extend(f.read_text(errors="replace").splitlines()[-lines:])
            except OSError:
                continue
        return "\n".join(texts)


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # Reap it if it is our child, so it does not linger as a zombie.
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _write_secret_json(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data``, readable by its owner only from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(dict(data), fh, indent=1)
    os.replace(tmp, path)


def _new_password() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(24))
