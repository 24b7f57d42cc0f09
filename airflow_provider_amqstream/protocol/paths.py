"""Names off the wire made into safe local paths: an offer's file name (``amqs_name``) and
subdirectory (``amqs_dir``) become a path that cannot leave the receiver's output directory.

The rules are in ``docs/protocol.md``, "File names" and "The output directory".
"""

from __future__ import annotations

import re

from airflow_provider_amqstream.exceptions import ProtocolError
from airflow_provider_amqstream.protocol.headers import H_DIR
from airflow_provider_amqstream.protocol.wire import from_the_wire

MAX_DIR_BYTES = 1024
MAX_DIR_DEPTH = 16
MAX_DIR_COMPONENT_BYTES = 200

_UNSAFE_CHARS = set('<>:"|?*\\')
_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(10)), *(f"LPT{i}" for i in range(10))}


def _clean_component(part: str) -> str:
    part = "".join(ch for ch in part if ch.isprintable() and ch not in _UNSAFE_CHARS)
    # Until stable: ". .bashrc" must not become ".bashrc", nor ". .." become "..".
    while part != (stripped := part.strip().lstrip(".")):
        part = stripped
    if part and part.split(".", 1)[0].upper() in _RESERVED:
        part = "_" + part
    return part


@from_the_wire
def safe_subdir(raw: str | None, stream_id: str) -> tuple[str, ...]:
    """The components of an offer's ``amqs_dir``, each made safe as names are; refuses
    (ProtocolError) what cannot be a relative path inside the output directory.

    Refused: an absolute path, an empty, ``.`` or ``..`` component, a component that is
    empty once cleaned or longer than 200 bytes, more than 16 levels, more than 1024 bytes.
    Leading dots are dropped, so nothing can land in (or shadow) ``.amqstream``.
    """
    text = str(raw or "")
    if not text:
        return ()
    if len(text.encode("utf-8", "surrogatepass")) > MAX_DIR_BYTES:
        raise ProtocolError(f"stream {stream_id}: {H_DIR} is longer than {MAX_DIR_BYTES} bytes")
    text = text.replace("\\", "/")
    if text.startswith("/") or re.match(r"^[A-Za-z]:", text):
        raise ProtocolError(f"stream {stream_id}: {H_DIR}={text[:80]!r} is absolute; it must be relative")
    parts = text.split("/")
    if len(parts) > MAX_DIR_DEPTH:
        raise ProtocolError(f"stream {stream_id}: {H_DIR} has {len(parts)} levels, more than {MAX_DIR_DEPTH}")
    out = []
    for part in parts:
        if part in ("", ".", ".."):
            raise ProtocolError(f"stream {stream_id}: {H_DIR}={text[:80]!r} has an empty, '.' or '..' component")
        clean = _clean_component(part)
        if not clean or len(clean.encode("utf-8", "surrogatepass")) > MAX_DIR_COMPONENT_BYTES:
            raise ProtocolError(f"stream {stream_id}: {H_DIR} component {part[:40]!r} is empty once cleaned or "
                                f"longer than {MAX_DIR_COMPONENT_BYTES} bytes")
        out.append(clean)
    return tuple(out)


def safe_file_name(name: str, stream_id: str) -> str:
    """Turn a file name from the wire into one that cannot leave the output directory.

    Keeps only the last path component, drops control and shell-hostile characters,
    leading dots (no ``..``, no hidden files that shadow our state directory) and
    reserved device names, and caps the length at 200 UTF-8 bytes.
    """
    base = _clean_component(str(name).replace("\\", "/").rsplit("/", 1)[-1]) or stream_id
    raw = base.encode("utf-8", "ignore")
    if len(raw) > 200:
        stem, dot, ext = base.rpartition(".")
        ext_b = (dot + ext).encode("utf-8", "ignore")[:20] if stem else b""
        base = raw[: 200 - len(ext_b)].decode("utf-8", "ignore") + ext_b.decode("utf-8", "ignore")
    return base
