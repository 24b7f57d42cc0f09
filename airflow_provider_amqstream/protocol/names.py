"""Names on the wire: stream ids, the user element of a data queue's name, and
:class:`Destination` with every queue a destination's streams use (offers, data,
parked, control, held notes, quarantine and dead letters).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass

from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol import headers as hdr

# fullmatch only: `$` also matches before a trailing newline, which would reach file names.
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def validate_stream_id(stream_id: str) -> str:
    """Return ``stream_id`` if it is safe as a queue-name suffix and a file name."""
    if not isinstance(stream_id, str) or not stream_id:
        raise ProtocolError("stream id must be a non-empty string")
    if len(stream_id) > hdr.MAX_STREAM_ID or not _NAME_RE.fullmatch(stream_id) or ".." in stream_id:
        raise ProtocolError(
            f"stream id {stream_id!r} is not valid: use 1-{hdr.MAX_STREAM_ID} characters from "
            "A-Z a-z 0-9 . _ - starting with a letter or digit, and no '..'"
        )
    return stream_id


def derive_stream_id(file_name: str, identity: str, key: bytes = b"") -> str:
    """A stable stream id for a file: readable prefix plus a keyed hash of ``identity``.

    The same file (same identity: path, size, mtime) gets the same id, which is what
    lets a re-run of an interrupted send find its own resume point. With ``key`` (a secret
    only the sender's connection holds) another user who knows the file's name, size,
    mtime and destination still cannot compute the id, so cannot offer it first.
    """
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", file_name).strip("._-")[:48] or "stream"
    return f"{stem}-{keyed_digest(identity, key)[:16]}"


def keyed_digest(text: str, key: bytes = b"") -> str:
    """Hex HMAC-SHA256 of ``text`` under ``key``; plain SHA-256 without a key.

    :param key: the sender's id key, or empty where no secret is known.
    """
    data = text.encode("utf-8", "surrogatepass")
    return hmac.new(key, data, hashlib.sha256).hexdigest() if key else hashlib.sha256(data).hexdigest()


def owner_element(user: str) -> str:
    """The name element standing for ``user`` in its data queues' names: a name of
    A-Z a-z 0-9 and ``-`` as it is; any other character as ``_`` and two hex digits per
    UTF-8 byte (``a.b`` -> ``a_2eb``), so no two users share an element and a dot in a
    name cannot reach into another user's prefix; ``_`` alone for no user; a name longer
    than 64 characters once escaped as ``_h`` and 40 hex digits of its SHA-256.

    :param user: the user name as the broker stamps it (``JMSXUserID``), or "".
    """
    if not user:
        return "_"
    element = "".join(c if c.isascii() and (c.isalnum() or c == "-") else
                      "".join(f"_{b:02x}" for b in c.encode("utf-8", "surrogatepass")) for c in user)
    if len(element) > 64:
        return "_h" + hashlib.sha256(user.encode("utf-8", "surrogatepass")).hexdigest()[:40]
    return element


@dataclass(frozen=True)
class Destination:
    """A STOMP destination on ActiveMQ: ``/queue/NAME`` or ``/topic/NAME``."""

    kind: str
    name: str

    @classmethod
    def parse(cls, text: str) -> Destination:
        """Accept ``/queue/x``, ``/topic/x``, ``queue://x``, ``topic://x`` or bare ``x`` (queue)."""
        raw = (text or "").strip()
        prefix = next((p for p in ("/queue/", "/topic/", "queue://", "topic://") if raw.startswith(p)), "")
        kind, name = prefix.strip("/:") or "queue", raw[len(prefix):]
        if not name or len(name) > 200 or not _NAME_RE.fullmatch(name):
            raise ProtocolError(
                f"destination {text!r} is not valid: use /queue/NAME or /topic/NAME where NAME "
                "has only A-Z a-z 0-9 . _ -"
            )
        return cls(kind, name)

    def __str__(self) -> str:
        return f"/{self.kind}/{self.name}"

    def data_queue(self, stream_id: str, sender: str) -> str:
        """Where one stream's chunks and end marker go: a queue, or for a topic a
        per-stream topic so every subscriber gets every chunk. Under its sender's own
        prefix (:func:`owner_element`), so a broker can grant each user, and cap, only its
        own data queues (``NAME.amqs.<owner>.>``).

        :param sender: the user the broker knows the sender as ("" for none).
        """
        return f"/{self.kind}/{self.name}.amqs.{owner_element(sender)}.{validate_stream_id(stream_id)}"

    def parked_queue(self) -> str:
        """Where receivers park the offers of streams that gave way (queues only). Its own
        name element, so a broker ACL can let receivers write it and no sender."""
        return f"/queue/{self.name}.amqs_parked"

    def control_queue(self, stream_id: str) -> str:
        """Where receivers answer the sender in handshake mode (always a queue). Its own
        name element, not a suffix of the data queue's, so that a broker ACL (whose
        wildcards match prefixes only) can let senders read it without reading data."""
        return f"/queue/{self.name}.amqs_ctl.{validate_stream_id(stream_id)}"

    def quarantine_queue(self, quarantine: str | None = None) -> str:
        """Where receivers file the streams of this destination that can never succeed:
        ``quarantine`` if one was named (``--quarantine``), else the broker's dead-letter
        queue of the destination itself (``/queue/DLQ.NAME``)."""
        return str(Destination.parse(quarantine)) if quarantine else dead_letter_queue(str(self))

    def staging_queue(self, stream_id: str) -> str:
        """Where ``redrive`` gathers a stream's chunks while it checks them (under ``DLQ.``,
        which only administrators read: nothing else takes them from there)."""
        return f"/queue/DLQ.{self.name}.amqs_redrive.{validate_stream_id(stream_id)}"

    def stream_queues(self, stream_id: str, senders: Iterable[str]) -> list[str]:
        """Every queue that may hold chunks of ``stream_id``: its data queue under each sender
        it is known by (data queues are named after their sender) and the dead letters of each."""
        return [q for s in sorted(set(senders))
                for q in (self.data_queue(stream_id, s), dead_letter_queue(self.data_queue(stream_id, s)))]

    def held_queue(self, stream_id: str) -> str:
        """Where receivers note that they hold a stream's partial data (queues only; one
        note per receiving directory, removed when the stream is published or quarantined).
        Its own name element: receivers write it, senders need not see it."""
        return f"/queue/{self.name}.amqs_held.{validate_stream_id(stream_id)}"


def dead_letter_queue(queue: str) -> str:
    """Where the broker moves what is refused on ``queue`` (a ``/queue/NAME`` string): its
    own ``DLQ.NAME`` (the shipped broker's per-destination dead-letter strategy)."""
    return "/queue/DLQ." + queue.split("/", 2)[2]
