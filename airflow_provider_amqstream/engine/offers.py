"""Which offers a receiver is handed: its subscriptions to a destination, and the streams
this output directory skips for now (yielded ones, until their back-off ends)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from airflow_provider_amqstream import bulk_wire as bw
from airflow_provider_amqstream import protocol as p
from airflow_provider_amqstream.engine import inline
from airflow_provider_amqstream.engine.records import StreamError, read_json, write_json
from airflow_provider_amqstream.engine.stream_receiver import ReceiveOptions
from airflow_provider_amqstream.transport import StompLink

# Longest a yielded stream is skipped, however often it yields.
MAX_YIELD_BACKOFF = 3600.0


class Offers:
    """The subscriptions that hand this receiver its offers.

    Offers of streams with a data queue come one at a time: prefetch 1 and no
    acknowledgement until the stream is settled, so while the receiver holds one the
    broker gives it no other, and if it dies the offer returns to the queue. Inline offers
    (a small file in the offer) and packs of them come up to a group at a time on a second
    subscription.
    Streams that yielded are left out by a selector until their back-off ends.
    """

    def __init__(self, link: StompLink, dest: p.Destination, stream_id: str | None, book: YieldBook,
                 opts: ReceiveOptions) -> None:
        self.link, self.dest, self.stream_id, self.book, self.opts = link, dest, stream_id, book, opts
        self.sub: str | None = None
        # Inline offers (small files in their offer) come through a second subscription with
        # a deeper prefetch, so a group of them can be made durable together.
        self.inline_sub: str | None = None
        self.excluded: tuple[str, ...] = ()

    def _selector(self, inline_only: bool) -> str:
        if self.stream_id:
            # A packed stream comes with its pack: the whole pack is received.
            return p.offer_selector(self.stream_id)
        # Batch messages and packs carry their id in amqs_stream, so the NOT IN below sees a value.
        sel = f"{p.H_KIND} IN ('offer', 'batch', 'pack')"
        if self.excluded:
            # Stream ids are validated: letters, digits, '.', '_' and '-' only, no quotes.
            sel += f" AND {p.H_STREAM} NOT IN ({', '.join(repr(s) for s in self.excluded)})"
        if inline_only:
            sel += f" AND {bw.H_INLINE} = '1'"
        else:  # any other value of the header is refused by the receiver, so it must reach one
            sel += f" AND ({bw.H_INLINE} IS NULL OR {bw.H_INLINE} <> '1')"
        return sel

    def next(self, deadline: float | None) -> Any:
        """The next offer (re-offers handled on the way), or None at ``deadline``."""
        while True:
            excluded = () if self.stream_id else self.book.active()
            if self.sub is None or excluded != self.excluded:
                self.release()
                self.excluded = excluded
                self.sub = self.link.subscribe(str(self.dest), prefetch=1, selector=self._selector(False))
                if not self.stream_id:
                    self.inline_sub = self.link.subscribe(str(self.dest), prefetch=inline.PREFETCH,
                                                          selector=self._selector(True))
                self.opts.emit("waiting", source=str(self.dest), skipping=list(excluded))
            now = time.monotonic()
            wake = self.book.next_expiry()
            left = 30.0 if deadline is None else deadline - now
            if wake is not None:
                left = min(left, max(0.05, wake - time.time()))
            subs = (self.inline_sub, self.sub) if self.inline_sub else (self.sub,)
            offer = self.link.get_any(max(0.0, left), subs)
            if offer is not None:
                return offer
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def gather_inline(self, first: Any, room: int | None) -> list[Any]:
        """``first`` and the inline offers already delivered after it, up to a group (and
        ``room``: a receiver asked for N streams takes no more)."""
        group, size, files = [first], len(first.body or b""), inline.files_in(first)
        limit = inline.GROUP_FILES if room is None else max(1, min(room, inline.GROUP_FILES))
        while self.inline_sub and files < limit and size < inline.GROUP_BYTES:
            more = self.link.get_any(0.0, (self.inline_sub,))
            if more is None:
                break
            group.append(more)
            size += len(more.body or b"")
            files += inline.files_in(more)
        return group

    def release(self) -> None:
        """Give back the offers we hold (the broker requeues them) by leaving the subscriptions."""
        for attr in ("inline_sub", "sub"):
            sub = getattr(self, attr)
            if sub is not None:
                setattr(self, attr, None)
                self.link.unsubscribe(sub)


class YieldBook:
    """Streams this output directory skips for now, with when each gets its turn back."""

    # Its file in the output directory's state directory.
    FILE = "yielded.json"

    MAX_SKIPPED = 64

    def __init__(self, path: Path, first_backoff: float) -> None:
        self.path, self.first = path, max(1.0, first_backoff)
        self._cache: dict[str, dict[str, Any]] | None = None

    def _entries(self) -> dict[str, dict[str, Any]]:
        if self._cache is None:
            try:
                data = read_json(self.path) or {}
            except (OSError, ValueError) as exc:
                raise StreamError(f"{self.path} is unreadable ({exc}); delete it (it only lists streams to skip)") \
                    from exc
            self._cache = {k: v for k, v in data.items() if isinstance(v, dict) and _valid_id(k)}
        return self._cache

    def active(self) -> tuple[str, ...]:
        now = time.time()
        live = sorted((v["until"], k) for k, v in self._entries().items() if v.get("until", 0) > now)
        return tuple(sorted(k for _, k in live[-self.MAX_SKIPPED:]))

    def skipping(self) -> dict[str, float]:
        """The streams skipped now, each with the time (epoch seconds) its turn comes back."""
        entries = self._entries()
        return {k: float(entries[k]["until"]) for k in self.active()}

    def next_expiry(self) -> float | None:
        now = time.time()
        ends = [v["until"] for v in self._entries().values() if v.get("until", 0) > now]
        return min(ends) if ends else None

    def add(self, stream_id: str, reason: str) -> float:
        """Skip ``stream_id`` for its next back-off; return that back-off in seconds."""
        entries = self._entries()
        prev = entries.get(stream_id)
        backoff = min(float(prev["backoff"]) * 2, MAX_YIELD_BACKOFF) if prev else self.first
        entries[stream_id] = {"until": time.time() + backoff, "backoff": backoff, "reason": reason[:500]}
        # Forget streams that have not yielded for a day.
        for k in [k for k, v in entries.items() if v["until"] < time.time() - 86400]:
            del entries[k]
        write_json(self.path, entries)
        return backoff

    def clear(self, stream_id: str) -> None:
        if self._entries().pop(stream_id, None) is not None:
            write_json(self.path, self._entries())


def _valid_id(stream_id: str) -> bool:
    try:
        p.validate_stream_id(stream_id)
    except p.ProtocolError:
        return False
    return True
