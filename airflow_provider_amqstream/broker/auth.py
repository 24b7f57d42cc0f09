"""Who may do what on the embedded broker: its users (the administrator, per-destination
users, the bridge user of a network) and the ActiveMQ authentication and authorization
configuration rendered from them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from airflow_provider_amqstream.broker.network import forwarded_names
from airflow_provider_amqstream.exceptions import BrokerError, ProtocolError
from airflow_provider_amqstream.protocol.names import Destination, owner_element


def xml_attr(value: str) -> str:
    """``value`` escaped for an XML attribute in double quotes."""
    return (value.replace("&", "&amp;").replace('"', "&quot;")
            .replace("<", "&lt;").replace(">", "&gt;"))


USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
ADMIN_GROUP = "amqstream"
BRIDGE_GROUP = "amqs-bridge"
# Every advisory topic. Only the bridge (and the administrator) may read or write them.
ADVISORY_TOPICS = ("topic", "ActiveMQ.Advisory.>")
# How many data queues (streams offered and not yet taken, plus queues emptied less than a
# minute ago) one user may have at once on each destination it may send to: the broker
# refuses the next. Each costs the broker ~14 KiB of heap whatever it holds, so without a
# cap a send-only user could leave one message on each of any number of them, and the
# destination purge never drops a queue that is not empty. Users' ``max_waiting`` overrides it.
MAX_WAITING = 1000


def parse_grant(text: str) -> tuple[str, str]:
    """``/queue/x`` or ``/queue/x.>`` -> (kind, ActiveMQ destination pattern)."""
    family = text.endswith(".>")
    try:
        dest = Destination.parse(text[:-2] if family else text)
    except ProtocolError as exc:
        raise BrokerError(f"cannot grant {text!r}: {exc}") from None
    return dest.kind, dest.name + (".>" if family else "")


def stream_acls(role: str, kind: str, pattern: str, user: str) -> list[tuple[str, str, str]]:
    """The (kind, pattern, rights) ``user`` needs to ``send`` streams to, or ``receive``
    them from, ``kind``/``pattern``: the offers there, each stream's data
    (``NAME.amqs.<sender>.<id>``: a sender writes only under its own name, a receiver reads
    every sender's) and, in handshake mode, its control queue (``NAME.amqs_ctl.<id>``).
    ``admin`` lets the first user of a destination create it."""
    main, ctl = ("write,admin", "read,admin") if role == "send" else ("read,admin", "write,admin")
    # A stream that gives way is parked by its receiver, in a queue of its own no sender writes;
    # receivers note where a stream's partial data is, for receivers on other disks (engine/receive/holders.py).
    parked = [("queue", f"{pattern}.{q}", "read,write,admin") for q in ("amqs_parked", "amqs_held.>")
              if role == "receive" and kind == "queue"]
    # A receiver files a stream that can never succeed under DLQ.<name>, with the reason.
    quarantine = [("queue", f"DLQ.{pattern}", "write,admin")] if role == "receive" else []
    if pattern.endswith(".>"):
        # ActiveMQ wildcards match prefixes only, so a family pattern cannot tell a
        # member's offers and data from its control queues: on queues it grants both.
        if kind == "queue":
            return [("queue", pattern, "read,write,admin"), *quarantine]
        return [("topic", pattern, main), ("queue", pattern, ctl), *quarantine]
    data = f"{pattern}.amqs.{owner_element(user)}.>" if role == "send" else f"{pattern}.amqs.>"
    return [(kind, pattern, main), (kind, data, main), ("queue", f"{pattern}.amqs_ctl.>", ctl), *parked, *quarantine]


def waiting_caps(users: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str, int]]:
    """(kind, pattern, most destinations) for each user's own data queues on each single
    destination it may send to (:data:`MAX_WAITING`); a family grant (``x.>``) has none,
    as its members' names cannot be told from their data queues' by a prefix."""
    caps = []
    for user, info in sorted(users.items()):
        limit = int(info.get("max_waiting") or MAX_WAITING)
        for text in info.get("send", []):
            kind, pattern = parse_grant(text)
            if not pattern.endswith(".>"):
                caps.append((kind, f"{pattern}.amqs.{owner_element(user)}.>", limit))
                if kind == "queue":
                    # The broker moves a quarantined stream's chunks to DLQ.<its data queue>:
                    # as many of those, never purged while they hold chunks, as data queues.
                    caps.append(("queue", f"DLQ.{pattern}.amqs.{owner_element(user)}.>", limit))
    return caps


def acl_entries(users: Mapping[str, Mapping[str, Any]], *, bridge: Sequence[tuple[str, str, str]] = (),
                ) -> dict[tuple[str, str], dict[str, set[str]]]:
    """Every user's grants, and the bridge user's (``bridge``: (kind, pattern, rights)), as
    ActiveMQ authorization entries: (kind, pattern) -> right -> groups. Each user is the only
    member of its own group, ``amqs-user-<name>``."""
    grants = [(BRIDGE_GROUP, acl) for acl in bridge]
    for user, info in sorted(users.items()):
        for role in ("send", "receive"):
            for text in info.get(role, []):
                grants += [(f"amqs-user-{user}", acl) for acl in stream_acls(role, *parse_grant(text), user)]
    entries: dict[tuple[str, str], dict[str, set[str]]] = {}
    for group, (kind, pattern, rights) in grants:
        entry = entries.setdefault((kind, pattern), {"read": set(), "write": set(), "admin": set()})
        for right in rights.split(","):
            entry[right].add(group)
    return entries


def auth_plugins(user: str, password: str, users: Mapping[str, Mapping[str, Any]], *,
                  bridge: tuple[str, str] | None = None, forwarded: Sequence[str] = ()) -> str:
    """The ``<plugins>`` entries for authentication and authorization: the administrator,
    the bridge user of a network (``bridge``: its name and password; the advisory topics then
    get their own entry) and every user, each confined to its grants."""
    logins = [(user, password, ADMIN_GROUP), *([(*bridge, BRIDGE_GROUP)] if bridge else []),
              *((name, info["password"], f"amqs-user-{name}") for name, info in sorted(users.items()))]
    lines = [f'          <authenticationUser username="{xml_attr(name)}" password="{xml_attr(secret)}" '
             f'groups="{xml_attr(group)}"/>' for name, secret, group in logins]
    # The administrator may do everything; ActiveMQ unions the groups of every entry
    # whose pattern matches, so the per-user entries only ever add rights.
    acl = [f'              <authorizationEntry {k}=">" read="{ADMIN_GROUP}" write="{ADMIN_GROUP}" '
           f'admin="{ADMIN_GROUP}"/>' for k in ("queue", "topic")]
    # The bridge user consumes and produces the forwarded queues (and creates them), and reads
    # the advisories that tell it where consumers are.
    bridged = [*(("queue", n, "read,write,admin") for n in forwarded_names(forwarded) or [">"]),
               (*ADVISORY_TOPICS, "read,write,admin")] if bridge else []
    entries = acl_entries(users, bridge=bridged)
    if bridge:
        # With advisories on, the broker raises one for each destination and consumer a user
        # creates, and creates the advisory's topic in that user's name: without admin there
        # the user's own send or subscribe fails ("not authorized to create:
        # topic://ActiveMQ.Advisory.Queue"). Admin is all a user gets. Reading advisories
        # (who consumes what) and writing them stay with the bridge and the administrator:
        # a plain message a user wrote to ActiveMQ.Advisory.Consumer.Queue.NAME reached the
        # bridge as a consumer advisory and shut it down (NullPointerException at the other
        # site, the bridge rebuilt and shut down again for every such message).
        entries[ADVISORY_TOPICS]["admin"].update(f"amqs-user-{name}" for name in users)
    for (kind, pattern), groups in sorted(entries.items()):
        attrs = " ".join(f'{r}="{xml_attr(",".join(sorted(groups[r] | {ADMIN_GROUP})))}"'
                         for r in ("read", "write", "admin"))
        acl.append(f'              <authorizationEntry {kind}="{xml_attr(pattern)}" {attrs}/>')
    nl = "\n"
    return f"""      <simpleAuthenticationPlugin anonymousAccessAllowed="false">
        <users>
{nl.join(lines)}
        </users>
      </simpleAuthenticationPlugin>
      <authorizationPlugin>
        <map>
          <authorizationMap>
            <authorizationEntries>
{nl.join(acl)}
            </authorizationEntries>
            <!-- Temporary destinations: the protocol uses none; only the administrator may. -->
            <tempDestinationAuthorizationEntry>
              <tempDestinationAuthorizationEntry read="{ADMIN_GROUP}" write="{ADMIN_GROUP}" admin="{ADMIN_GROUP}"/>
            </tempDestinationAuthorizationEntry>
          </authorizationMap>
        </map>
      </authorizationPlugin>"""
