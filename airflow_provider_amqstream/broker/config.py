"""What the embedded broker is configured with: ``conf/activemq.xml`` rendered from its settings,
and the secrets that file names: the TLS keystore, the trust store for ``ssl://`` peers, the
administrator's credentials and the users (in its data directory) and a network's bridge user.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import string
import subprocess
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.broker.auth import USER_NAME, auth_plugins, parse_grant, waiting_caps, xml_attr
from airflow_provider_amqstream.broker.network import NetworkConfig, connectors_xml, openwire_xml
from airflow_provider_amqstream.broker.process import broker_jar, keytool_binary
from airflow_provider_amqstream.exceptions import BrokerError, NetworkError

DEFAULT_USER = "amqstream"
DEFAULT_BRIDGE_USER = "amqs-bridge"
# Every listener of the embedded broker, and its clients, on loopback only.
HOST = "127.0.0.1"
# Where, below the data directory, the secrets live (all mode 0600).
CREDENTIALS_FILE = "credentials.json"
USERS_FILE = "users.json"
CA_FILE = Path("tls") / "broker-cert.pem"


# The STOMP connectors' read buffer and socket buffers: a 1 MiB chunk in 16 reads, not 128
# (ActiveMQ's defaults are 8 KiB and 64 KiB); see the template's header.
IO_BUFFERS = "transport.ioBufferSize=65536&amp;transport.socketBufferSize=1048576"


def read_users(data_dir: Path) -> dict[str, dict[str, Any]]:
    """Users added with :meth:`~airflow_provider_amqstream.broker.embedded.EmbeddedBroker.add_user`:
    name -> {password, send, receive}."""
    users_file = data_dir / USERS_FILE
    try:
        return dict(json.loads(users_file.read_text())["users"])
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError) as exc:
        raise BrokerError(f"{users_file} is unreadable ({exc}); fix or delete it") from exc


def new_user(name: str, *, send: Iterable[str] = (), receive: Iterable[str] = (),
             password: str | None = None, max_waiting: int | None = None) -> dict[str, Any]:
    """The users-file entry of a user who may only send to ``send`` and receive from
    ``receive``, checked (the arguments of :meth:`EmbeddedBroker.add_user`)."""
    if not USER_NAME.fullmatch(name or "") or name == DEFAULT_USER:
        raise BrokerError(f"user name {name!r} is not valid: use 1-64 of A-Z a-z 0-9 . _ - "
                          f"(and not {DEFAULT_USER!r}, the administrator)")
    send, receive = sorted(set(send)), sorted(set(receive))
    if not send and not receive:
        raise BrokerError(f"user {name}: grant at least one --send or --receive destination")
    for text in (*send, *receive):
        parse_grant(text)
    user: dict[str, Any] = {"password": password or _new_password(), "send": send, "receive": receive}
    if max_waiting is not None:
        if not 1 <= max_waiting <= 1_000_000:
            raise BrokerError(f"user {name}: --max-waiting {max_waiting} is not between 1 and 1000000")
        user["max_waiting"] = max_waiting
    return user


def write_users(data_dir: Path, users: Mapping[str, Any]) -> None:
    _write_private(data_dir / USERS_FILE, json.dumps({"users": dict(users)}, indent=1))


def keystore(data_dir: Path) -> tuple[Path, str]:
    """A PKCS12 keystore with a self-signed certificate for localhost/127.0.0.1,
    made once with the JDK's keytool; the certificate is exported for clients."""
    tls = data_dir / "tls"
    store, secret = tls / "broker.p12", tls / "keystore.json"
    if store.is_file() and secret.is_file():
        return store, json.loads(secret.read_text())["password"]
    tls.mkdir(parents=True, exist_ok=True, mode=0o700)
    keytool = keytool_binary()
    password = secrets.token_urlsafe(18)
    common = ["-keystore", str(store), "-storetype", "PKCS12", "-storepass", password]
    subprocess.run([keytool, "-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048",
                    "-validity", "825", "-dname", "CN=localhost", "-ext", f"SAN={certificate_names()}",
                    "-keypass", password, *common], check=True, capture_output=True, timeout=60)
    subprocess.run([keytool, "-exportcert", "-alias", "broker", "-rfc", "-file", str(data_dir / CA_FILE), *common],
                   check=True, capture_output=True, timeout=60)
    _write_private(secret, json.dumps({"password": password}, indent=1))
    os.chmod(store, 0o600)
    return store, password


def certificate_names() -> str:
    """Subject names for the generated certificate: loopback and this host's names (a
    remote site's bridge verifies the name it dialled)."""
    dns = {"localhost", socket.gethostname(), socket.getfqdn()}
    names = [f"dns:{n}" for n in sorted(dns) if n and re.fullmatch(r"[A-Za-z0-9.-]+", n)]
    return ",".join([*names, f"ip:{HOST}"])


def trust_store(data_dir: Path, certificates: Iterable[Path]) -> tuple[Path, str]:
    """A PKCS12 trust store holding ``certificates`` (PEM), remade at each start so it
    holds exactly the certificates asked for; for bridges to ``ssl://`` peers."""
    tls = data_dir / "tls"
    tls.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = tls / "peers.p12"
    store.unlink(missing_ok=True)
    password = secrets.token_urlsafe(18)
    keytool = keytool_binary()
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


def credentials(data_dir: Path) -> tuple[str, str, bool]:
    """Return (user, password, created_now); the password is generated once."""
    data, created = _login_file(data_dir / CREDENTIALS_FILE, lambda: {"user": DEFAULT_USER,
                                                                      "password": _new_password()})
    return data["user"], data["password"], created


def _login_file(path: Path, new: Callable[[], dict[str, str]]) -> tuple[dict[str, Any], bool]:
    """The JSON in ``path``, or ``new()`` written there first (mode 0600) if it is missing; and
    whether it was written now. It appears whole or not at all: two brokers of this machine
    starting at once both read the one that was linked first, never half of it."""
    try:
        return json.loads(path.read_text()), False
    except FileNotFoundError:
        data = new()
        tmp = path.with_name(f"{path.name}.{os.getpid()}.new")
        _write_private(tmp, json.dumps(data))
        try:
            os.link(tmp, path)  # fails if another start made it meanwhile
        except FileExistsError:
            return json.loads(path.read_text()), False
        finally:
            os.unlink(tmp)
        return data, True


def bridge_credentials(path: Path) -> tuple[str, str]:
    """The bridge user's (name, password) from ``path``, made there first if it is missing."""
    try:
        data, _ = _login_file(path, lambda: {"user": DEFAULT_BRIDGE_USER, "password": secrets.token_urlsafe(24)})
    except (OSError, ValueError) as exc:
        raise NetworkError(f"--bridge-secret {path}: unreadable ({exc})") from exc
    user, password = data.get("user"), data.get("password")
    if not (isinstance(user, str) and re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", user) and isinstance(password, str)
            and password):
        raise NetworkError(f"--bridge-secret {path}: expected {{\"user\": NAME, \"password\": SECRET}}")
    return user, password


def render_config(data_dir: Path, *, port: int, auth: bool, tls_port: int | None, store_dir: Path,
                  network: NetworkConfig) -> tuple[Path, bool]:
    """Write conf/activemq.xml and conf/log4j.properties; return (conf dir, creds created)."""
    # The data dir holds the credentials and every stored message (KahaDB's journal):
    # its owner's only, whatever the umask left on the files the broker writes in it.
    data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(data_dir, 0o700)
    conf = data_dir / "conf"
    for sub in (conf, data_dir / "data", data_dir / "tmp"):
        sub.mkdir(exist_ok=True)
    created = False
    auth_xml = caps_xml = ""
    bridge = bridge_credentials(network.bridge_secret) if network.active and network.bridge_secret else None
    pkg = resources.files("airflow_provider_amqstream") / "broker" / "conf"
    text = (pkg / "activemq.xml.tmpl").read_text()
    if auth:
        user, password, created = credentials(data_dir)
        users = read_users(data_dir)
        auth_xml = auth_plugins(user, password, users, bridge=bridge, forwarded=network.queues)
        # The template's entry for every queue (or topic), once per capped pattern: the same settings
        # as every other destination, since ActiveMQ applies the most specific entry alone.
        caps_xml = "".join(_policy_copy(text, kind, f'{kind}="{xml_attr(pattern)}" maxDestinations="{limit}"')
                           for kind, pattern, limit in waiting_caps(users))
    free = shutil.disk_usage(data_dir).free
    # KahaDB refuses sends past storeUsage; leave the disk 10 % headroom.
    store_mb = max(512, int(free * 0.9 / 2**20))
    ssl_xml = tls_xml = ""
    if tls_port or network.needs_tls:
        store, store_pw = keystore(data_dir)
        trust = ""
        if network.peer_cas:
            peers_store, trust_pw = trust_store(data_dir, network.peer_cas)
            trust = (f' trustStore="file:{xml_attr(str(peers_store))}" '
                     f'trustStorePassword="{xml_attr(trust_pw)}" trustStoreType="pkcs12"')
        ssl_xml = (f'    <sslContext><sslContext keyStore="file:{xml_attr(str(store))}" '
                   f'keyStorePassword="{xml_attr(store_pw)}" keyStoreType="pkcs12"{trust}/></sslContext>')
    if tls_port:
        tls_xml = (f'      <transportConnector name="stomp+ssl" uri="stomp+ssl://{HOST}:{tls_port}'
                   f'?transport.tcpNoDelay=true&amp;{IO_BUFFERS}&amp;wireFormat.maxDataLength=9437184'
                   '&amp;transport.hbGracePeriodMultiplier=2.5"/>')
    store_xml = offers_xml = ""
    if broker_jar():
        store_xml = "\n".join(f'      <bean xmlns="http://www.springframework.org/schema/beans" '
                              f'class="org.amqstream.broker.{name}"/>'
                              for name in ("SizedStorePlugin", "FairOfferPlugin"))
        # FairOfferPlugin gives every queue of offers this entry: the template's, prioritised.
        offers_xml = _policy_copy(text, "queue", 'queue="amqs_offer_queues" prioritizedMessages="true" '
                                  'advisoryForConsumed="true"')
    xml = string.Template(text).safe_substitute(
        broker_name=f"amqstream-{port}", data_dir=str(data_dir / "data"),
        store_dir=str(store_dir), store_limit=f"{store_mb} mb", auth_plugins=auth_xml, store_plugin=store_xml,
        bind=HOST, port=port, ssl_context=ssl_xml, tls_connector=tls_xml, io_buffers=IO_BUFFERS,
        waiting_caps=caps_xml + offers_xml,
        advisory="true" if network.active else "false", openwire_connector=openwire_xml(network, HOST),
        network_connectors=connectors_xml(network, f"amqstream-{port}", bridge, xml_attr),
    )
    _write_private(conf / "activemq.xml", xml)
    (conf / "log4j.properties").write_text((pkg / "log4j.properties").read_text())
    return conf, created


def _policy_copy(template: str, kind: str, attrs: str) -> str:
    """The template's policy entry for every queue (or topic) with ``attrs`` in place of its
    ``queue=">"`` (or ``topic=">"``)."""
    found = re.search(rf'(?s)\n( *<policyEntry {kind}=">".*?</policyEntry>\n)', template)
    if found is None:
        raise BrokerError(f"activemq.xml.tmpl has no policyEntry {kind}=\">\" to copy for {attrs}")
    return found.group(1).replace(f'{kind}=">"', attrs, 1)


def _write_private(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``, readable by its owner only from the first byte."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def _new_password() -> str:
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(24))
