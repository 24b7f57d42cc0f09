"""Baseline: a file through the same broker with plain stomp.py and no protocol.

``python -m benchmarks.raw_stomp send FILE QUEUE URI CHUNK`` sends persistent chunks with
a receipt only on the last; ``recv OUT QUEUE URI COUNT`` drains with client-individual
acks and writes the bodies in arrival order. Each prints ``{"seconds": .., "peak_rss_kib": ..}``.
This is what a user would write by hand: the ceiling our protocol is measured against.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import stomp

from airflow_provider_amqstream.hooks.connection import params_from_uri
from benchmarks.probe import cpu_seconds, peak_rss_kib


class _Listener(stomp.ConnectionListener):
    def __init__(self, conn: stomp.Connection12, out: object, count: int) -> None:
        self.conn, self.out, self.left = conn, out, count
        self.done = threading.Event()
        self.receipt = threading.Event()

    def on_message(self, frame: stomp.utils.Frame) -> None:
        self.out.write(frame.body)  # type: ignore[attr-defined]
        self.conn.ack(frame.headers["ack"])
        self.left -= 1
        if self.left <= 0:
            self.done.set()

    def on_receipt(self, frame: stomp.utils.Frame) -> None:
        self.receipt.set()


def _connect(uri: str) -> stomp.Connection12:
    bp = params_from_uri(uri)
    conn = stomp.Connection12(list(bp.hosts), auto_decode=False)
    conn.connect(bp.login, bp.password, wait=True)
    return conn


def main(argv: list[str]) -> int:
    role, path, queue, uri, n = argv[0], argv[1], argv[2], argv[3], int(argv[4])
    t0 = time.monotonic()
    if role == "send":
        conn = _connect(uri)
        lst = _Listener(conn, None, 0)
        conn.set_listener("l", lst)
        with open(path, "rb") as fh:
            body = fh.read(n)
            while body:
                nxt = fh.read(n)
                headers = {"persistent": "true"}
                if not nxt:
                    headers["receipt"] = "last"
                conn.send(queue, body, headers=headers)
                body = nxt
        if not lst.receipt.wait(600):
            raise SystemExit("no receipt for the last chunk")
    else:
        with open(path, "wb") as out:
            conn = _connect(uri)
            lst = _Listener(conn, out, n)
            conn.set_listener("l", lst)
            conn.subscribe(queue, id="1", ack="client-individual", headers={"activemq.prefetchSize": "16"})
            if not lst.done.wait(1800):
                raise SystemExit(f"only {n - lst.left} of {n} messages arrived")
    conn.disconnect()
    print(json.dumps({"seconds": time.monotonic() - t0, "peak_rss_kib": peak_rss_kib(),
                      "cpu_seconds": cpu_seconds()[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
