"""Key files of sealed streams on disk (the seal itself is protocol/seal.py): written readable by
their owner only, and refused when anyone else can read them, as ssh refuses a private key."""

from __future__ import annotations

import os
import stat

from airflow_provider_amqstream.exceptions import ConfigurationError
from airflow_provider_amqstream.protocol import seal


def new_key_file(path: str | os.PathLike[str]) -> seal.Identity:
    """Write a new private key to ``path`` (mode 0600; an existing file is never replaced)."""
    ident = seal.Identity.generate()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise ConfigurationError(f"{path} exists already; amqstream never replaces a key file "
                                 "(move it away, or pick another name)") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(ident.to_text())
        fh.flush()
        os.fsync(fh.fileno())
    return seal.Identity(ident.private, str(path))


def read_key_file(path: str | os.PathLike[str]) -> seal.Identity:
    """The private key in ``path``; refused (naming the file) if group or others may read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ConfigurationError(f"cannot read key file {path}: {exc.strerror}") from None
    with os.fdopen(fd) as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode) or mode & 0o077:
            raise ConfigurationError(f"key file {path} is not a regular file readable by its owner only "
                                     f"(mode {stat.S_IMODE(mode):o}): `chmod 600 {path}`")
        try:
            text = fh.read(4096)
        except UnicodeDecodeError:
            text = ""
    return seal.Identity.parse(text, str(path))
