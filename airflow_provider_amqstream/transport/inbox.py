"""The one stomp.py listener of a session: what the reader thread hands over.

Messages go into a queue (holding the reader back while the consumer is far behind),
receipts into a set, ERROR frames into a list of their texts; a lost connection is
remembered. The session reads all of it from its own thread.
"""

from __future__ import annotations

import queue
import threading

import stomp
from stomp.utils import Frame

from airflow_provider_amqstream.transport.errors import error_text


class Inbox(stomp.ConnectionListener):
    # Message bodies delivered but not yet taken by get(), in bytes. Past this the reader
    # thread waits for the consumer, so the rest of a prefetch window stays in the kernel's
    # socket buffer rather than in Python objects: a receiver holds a few chunks, not
    # prefetch x chunk size, and its peak memory no longer depends on how a run's timing
    # happened to bunch deliveries.
    HIGH_WATER = 2 * 2**20
    # The reader also delivers receipts and errors, so it never waits long, and not at all
    # while someone waits for a receipt.
    MAX_HOLD = 0.2

    def __init__(self) -> None:
        self.messages: queue.Queue[Frame | None] = queue.Queue()
        self.receipts: set[str] = set()
        self.errors: list[str] = []
        # The ERROR frames that answered a receipted frame, by receipt id: that frame's failure.
        self.answers: dict[str, str] = {}
        self.lost = False
        self.connected = False
        self.cond = threading.Condition()
        self.held = 0
        self.receipt_waiters = 0

    def _can_deliver(self) -> bool:
        return self.held <= self.HIGH_WATER or self.lost or self.receipt_waiters > 0

    def on_message(self, frame: Frame) -> None:
        with self.cond:
            self.cond.wait_for(self._can_deliver, timeout=self.MAX_HOLD)  # returns at once if it can
            self.held += len(frame.body or b"")
        self.messages.put(frame)

    def taken(self, frame: Frame) -> None:
        """get() handed ``frame`` to the consumer."""
        with self.cond:
            self.held -= len(frame.body or b"")
            self.cond.notify_all()

    def on_receipt(self, frame: Frame) -> None:
        with self.cond:
            self.receipts.add(frame.headers.get("receipt-id", ""))
            self.cond.notify_all()

    def on_error(self, frame: Frame) -> None:
        msg = error_text(frame)
        with self.cond:
            self.errors.append(msg)
            if rid := frame.headers.get("receipt-id"):
                self.answers[rid] = msg
            self.cond.notify_all()

    def on_connected(self, frame: Frame) -> None:
        with self.cond:
            self.connected = True
            self.cond.notify_all()

    def await_connected(self, timeout: float) -> bool:
        """Wait until the broker answered CONNECT (CONNECTED or ERROR) or the socket ended;
        False if none of that happened within ``timeout`` seconds. The reader thread hands
        an ERROR frame to the listeners before it reports the socket's end, so a refusal's
        reason is in :attr:`errors` once :attr:`lost` is set."""
        with self.cond:
            return bool(self.cond.wait_for(lambda: self.connected or self.errors or self.lost, timeout=timeout))

    def on_disconnected(self) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()
        self.messages.put(None)

    on_heartbeat_timeout = on_disconnected
