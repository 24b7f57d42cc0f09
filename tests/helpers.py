"""Helpers shared by the tests: files, CLI subprocesses, waiting on conditions."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from queue import Queue
from typing import Any, Protocol, TypeVar

import stomp

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.engine import ReceiveOptions, TransferResult, receive_stream
from airflow_provider_amqstream.hooks.connection import params_from_uri
from airflow_provider_amqstream.protocol import wire as p
from airflow_provider_amqstream.protocol.names import Destination
from airflow_provider_amqstream.transport.params import BrokerParams

ROOT = Path(__file__).resolve().parents[1]


# Each pytest-xdist worker takes ports from a block of its own, below the kernel's ephemeral
# range (32768 and up here). A port the kernel picks for a bind to port 0 was handed out
# again between our pick and a broker's bind: a deployment's API server (scripts/airflow.sh
# picks its ports that way) once found a test broker of the other worker on its port.
_PORT_BASE, _PORT_BLOCK, _PORT_WORKERS = 20000, 2000, 6
# From a random place in the block: two processes of one worker start apart.
_port_seq = itertools.count(random.randrange(_PORT_BLOCK))


def free_port() -> int:
    """A loopback port nobody listens on, from this worker's block (see above)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    base = _PORT_BASE + (int(worker) % _PORT_WORKERS if worker.isdigit() else 0) * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = base + next(_port_seq) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + _PORT_BLOCK - 1}")


def make_file(path: Path, size: int, *, seed: int = 0, block: int = 4 * 1024 * 1024) -> Path:
    """A file of incompressible bytes (with NULs), written block by block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rnd = hashlib.sha256(str(seed).encode()).digest()
    with open(path, "wb") as fh:
        left = size
        while left > 0:
            n = min(block, left)
            fh.write(os.urandom(n - 32) + rnd if n > 32 else os.urandom(n))
            left -= n
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(4 * 1024 * 1024), b""):
            h.update(block)
    return h.hexdigest()


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> Any:
    """Poll ``cond`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def cli(*args: str, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[str]:
    """Start ``amqstream ARGS`` as a real process."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "airflow_provider_amqstream.cli", *args], text=True,
                            env={**os.environ, **(env or {})}, cwd=ROOT, **kw)


def cli_probed(*args: str, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen[str]:
    """``amqstream ARGS`` under ``benchmarks.probe``: :func:`cli_json` then gives each row the
    process's ``peak_rss_kib`` and ``cpu_seconds`` (the CLI reports transfers only)."""
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen([sys.executable, "-m", "benchmarks.probe", "-m", "airflow_provider_amqstream.cli", *args],
                            text=True, env={**os.environ, **(env or {})}, cwd=ROOT, **kw)


def cli_json(proc: subprocess.Popen[str], timeout: float = 300) -> list[dict[str, Any]]:
    from benchmarks.probe import merge

    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"amqstream exited {proc.returncode}: {err[-2000:]}"
    return merge([json.loads(line) for line in out.splitlines() if line.startswith("{")])


def peak_rss_kib_of(pid: int) -> int:
    """A running process's peak resident memory so far (VmHWM), read from outside."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for process {pid}")


def browse(params: BrokerParams, queue: str, timeout: float = 10.0) -> list[Any]:
    """Every message on ``queue`` right now, without consuming it (a queue browser)."""
    from airflow_provider_amqstream.transport.session import StompLink

    frames = []
    with StompLink(params) as link:
        link.subscribe(queue, browser=True)
        while (frame := link.get(timeout)) is not None and frame.headers.get("browser") != "end":
            frames.append(frame)
    return frames


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Receiver(threading.Thread):
    """receive_stream in a thread; ``waiting`` is set once it listens for offers."""

    def __init__(self, params: BrokerParams, source: str, out: Path, **opts: Any) -> None:
        super().__init__(daemon=True)
        self.waiting = threading.Event()
        self.result: TransferResult | None = None
        self.error: BaseException | None = None
        self.args = (params, source, out)
        self.opts = ReceiveOptions(wait_timeout=30, idle_timeout=30, events=self._event, **opts)
        self.start()

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "waiting":
            self.waiting.set()

    def run(self) -> None:
        try:
            self.result = receive_stream(*self.args, options=self.opts)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def finish(self) -> TransferResult:
        self.join(120)
        assert not self.is_alive(), "receiver did not finish"
        if self.error:
            raise self.error
        assert self.result is not None
        return self.result


class RawSender:
    """An authorized sender speaking STOMP with stomp.py directly: any header, any body."""

    def __init__(self, params: BrokerParams) -> None:
        self.params = params
        self.conn = stomp.Connection12([params.hosts[0]], auto_decode=False)
        self.conn.connect(params.login, params.password, wait=True)

    def send(self, dest: str, body: bytes, headers: dict[str, str]) -> None:
        self.conn.send(dest, body, headers={**headers, "persistent": "true"})

    def close(self) -> None:
        self.conn.disconnect(receipt="bye")  # the receipt: every frame before it was stored


def offer_many(params: BrokerParams, queue: str, n: int, *, size: int, tag: str,
               extra: dict[str, str] | None = None) -> None:
    """``n`` offers of streams ``<tag>-00000``... of ``size`` bytes that their sender never
    sends, as ``params``'s user with raw stomp.py (``extra``: headers written on each)."""
    dest = Destination.parse(queue)
    raw = RawSender(params)
    try:
        for i in range(n):
            spec = p.StreamSpec(f"{tag}-{i:05d}", f"{tag}.bin", size, 1024 * 1024)
            raw.send(str(dest), b"", {**p.offer_headers(spec, dest, sender=params.user), **(extra or {})})
    finally:
        raw.close()


def flood(params: BrokerParams, queue: str, n: int, *, size: int = 1000, tag: str = "flood") -> None:
    """``n`` good, complete streams ``<tag>-00000``... of ``size`` bytes, one chunk each, sent
    as fast as raw stomp.py sends (no receipt until the last)."""
    raw = RawSender(params)
    try:
        for i in range(n):
            data = os.urandom(size)
            send_stream(raw.send, queue, p.StreamSpec(f"{tag}-{i:05d}", f"{tag}-{i:05d}.bin", size, size), data, [1])
    finally:
        raw.close()


@contextlib.contextmanager
def half_sent_and_trickling(params: BrokerParams, queue: str, half: int) -> Iterator[None]:
    """``half`` offers of two one-byte chunks with only the first sent, then one offer whose
    sender trickles a byte a second until the block ends, as ``params``'s user with raw stomp.py."""
    dest, raw, stop = Destination.parse(queue), RawSender(params), threading.Event()
    drip = p.StreamSpec("drip-1", "drip.bin", 10_000, 1)

    def trickle() -> None:
        seq = 1
        while not stop.wait(1.0 if seq > 1 else 0):
            raw.send(dest.data_queue(drip.stream_id, params.user), b"y", p.data_message(drip, seq, b"y")[0])
            seq += 1

    dripping = threading.Thread(target=trickle, daemon=True)
    try:
        for i in range(half):
            spec = p.StreamSpec(f"half-{i}", "half.bin", 2, 1)
            raw.send(queue, b"", p.offer_headers(spec, dest, sender=params.user))
            raw.send(dest.data_queue(spec.stream_id, params.user), b"x", p.data_message(spec, 1, b"x")[0])
        raw.send(queue, b"", p.offer_headers(drip, dest, sender=params.user))
        dripping.start()
        yield
    finally:
        stop.set()
        if dripping.is_alive():
            dripping.join(10)
        raw.close()


def orphan_batch_part(batch_id: str, part: int, parts: int) -> tuple[dict[str, str], bytes]:
    """Part ``part`` of ``parts`` of a batch, listing 1,999 files of 128-character ids nobody
    sends (about 470 KiB once kept): never its first part."""
    from airflow_provider_amqstream.protocol import bulk as bw
    from airflow_provider_amqstream.protocol import headers as hdr

    tag = f"{batch_id}-{part}-"
    entries = [{"stream_id": f"{tag}{i:05d}".ljust(hdr.MAX_STREAM_ID, "x"), "dir": "", "name": "x", "bytes": 1,
                "sha256": "0" * 64} for i in range(1999)]
    [(headers, body)] = list(bw.iter_batch_messages(batch_id, entries, len(entries)))
    return {**headers, bw.H_PART: str(part), bw.H_PARTS: str(parts)}, body


class JsonRows(threading.Thread):
    """The JSON lines a running ``amqstream receive --json`` prints, read as they come, each
    with ``at``, the monotonic time it was read; :meth:`wait` waits on a condition over them."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        super().__init__(daemon=True)
        self.proc = proc
        self.rows: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self.start()

    def run(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                with self.changed:
                    self.rows.append({**json.loads(line), "at": time.monotonic()})
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def wait(self, cond: Callable[[list[dict[str, Any]]], Any], timeout: float, what: str) -> Any:
        """Wait until ``cond(rows)`` is truthy and return it; fail naming ``what`` and the last
        rows if the receiver exits or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while not (value := cond(self.rows)):
                left = deadline - time.monotonic()
                if left <= 0 or (not self.is_alive() and self.proc.poll() is not None):
                    raise AssertionError(f"{what}: not after {timeout:.0f}s (receiver exit code "
                                         f"{self.proc.poll()}); last rows {self.rows[-3:]}")
                self.changed.wait(min(left, 1.0))
        return value


Send = Callable[[str, bytes, dict[str, str]], Any]
Tamper = Callable[[int, dict[str, str], bytes], tuple[dict[str, str], bytes]]


# Past the limit by its keyword-only knobs: each is one way a test's sender misbehaves.
def send_stream(  # noqa: PLR0913
        send: Send, queue: str, spec: p.StreamSpec, data: bytes, seqs: Iterable[int], *, end: bool = True,
        tamper: Tamper | None = None, sha: str | None = None, offer: bool = True) -> None:
    """Play a sender by hand: offer ``spec`` on ``queue`` and send chunks ``seqs`` (in that
    order, repeats allowed), then the end marker, each through ``send(destination, body,
    headers)`` (a broker's raw sender or an in-memory link).

    :param end: send the end marker (with ``sha``, default the SHA-256 of ``data``).
    :param tamper: ``tamper(seq, headers, body)`` returns the chunk to send instead.
    :param offer: send the offer first.
    """
    dest = Destination.parse(queue)
    user = send.__self__.params.user  # type: ignore[attr-defined]  # a RawSender's or a link's
    if offer:
        send(str(dest), b"", p.offer_headers(spec, dest, sender=user))
    for seq in seqs:
        off, n = spec.chunk_span(seq)
        body = data[off:off + n]
        headers = p.data_message(spec, seq, body)[0]
        if tamper:
            headers, body = tamper(seq, headers, body)
        send(dest.data_queue(spec.stream_id, user), body, headers)
    if end:
        send(dest.data_queue(spec.stream_id, user), b"", p.end_headers(spec, sha or hashlib.sha256(data).hexdigest()))


def play(params: BrokerParams, queue: str, spec: p.StreamSpec, data: bytes, seqs: list[int], *,
         end: bool = True, tamper: Tamper | None = None, sha: str | None = None) -> None:
    """Offer ``spec`` and send chunks ``seqs`` to the broker with raw stomp.py (see :func:`send_stream`)."""
    raw = RawSender(params)
    send_stream(raw.send, queue, spec, data, seqs, end=end, tamper=tamper, sha=sha)
    raw.close()


class StompFrames(stomp.ConnectionListener):
    """Receipts and errors of a raw stomp.py connection, in arrival order."""

    def __init__(self) -> None:
        self.frames: Queue[tuple[str, dict[str, str]]] = Queue()

    def on_receipt(self, frame: Any) -> None:
        self.frames.put(("RECEIPT", dict(frame.headers)))

    def on_error(self, frame: Any) -> None:
        self.frames.put(("ERROR", dict(frame.headers)))


class Startable(Protocol):
    def start(self) -> Any: ...

    def stop(self) -> Any: ...


S = TypeVar("S", bound=Startable)


def started(service: S) -> Iterator[S]:
    """Start ``service`` (a broker, two bridged sites), yield it and stop it after: the body
    of a fixture, ``yield from started(...)``."""
    service.start()
    try:
        yield service
    finally:
        service.stop()


def running_broker(data_dir: Path, users: dict[str, dict[str, Any]] | None = None) -> Iterator[EmbeddedBroker]:
    """A broker on a free port, with ``users`` beside its administrator, started, and stopped
    after: a fixture's body, ``yield from running_broker(...)``.

    :param data_dir: the broker's directory.
    :param users: name -> its ``send``/``receive`` grants and other ``EmbeddedBroker.add_user``
        keywords.
    """
    b = EmbeddedBroker(data_dir, port=free_port())
    for name, grants in (users or {}).items():
        b.add_user(name, **grants)
    yield from started(b)


def params_as(broker: EmbeddedBroker, user: str | None) -> BrokerParams:
    """The connection of ``user`` (None: the administrator) to ``broker``, with the tests'
    connect and receipt timeouts."""
    return dataclasses.replace(params_from_uri(broker.info(user=user).uri), connect_timeout=10.0,
                               receipt_timeout=15.0)


def old_gen_mib(pid: int) -> float:
    """The old generation in use in JVM ``pid`` after a full collection, in MiB (the JDK's
    jcmd and jstat)."""
    subprocess.run(["jcmd", str(pid), "GC.run"], check=True, capture_output=True, timeout=60)
    out = subprocess.run(["jstat", "-gc", str(pid)], check=True, capture_output=True, text=True, timeout=60).stdout
    head, values = out.split("\n")[:2]
    return float(dict(zip(head.split(), values.split(), strict=True))["OU"]) / 1024


def settled_old_gen_mib(pid: int, below: float, timeout: float = 90.0) -> float:
    """The lowest old generation of JVM ``pid`` after a full collection, collected again every
    2 s until it is under ``below`` MiB or ``timeout`` seconds pass. A broker still moving
    messages (to a DLQ, or through its expiry scan, which pages them in every 30 s) holds them
    until it is done, so one reading under load can catch work in flight; what it retains,
    every reading finds, and the caller's assertion fails on it."""
    deadline = time.monotonic() + timeout
    lowest = old_gen_mib(pid)
    while lowest >= below and time.monotonic() < deadline:
        time.sleep(2.0)
        lowest = min(lowest, old_gen_mib(pid))
    return lowest


# What the old generation of a test broker (-Xmx512M) may hold after a full collection at the
# end of a hostile test: a fresh one holds about 13 MiB; the cap on each user's destinations
# (~14 KiB each) and the 128 MiB memoryUsage bound what an attack may add.
OLD_GEN_BOUND_MIB = 96.0


def assert_old_gen_bounded(broker: EmbeddedBroker, what: str, bound: float = OLD_GEN_BOUND_MIB) -> float:
    """Assert ``broker``'s old generation after a full collection is under ``bound`` MiB once
    ``what`` is done; return it (for the test's printout)."""
    pid = broker.running_pid()
    assert pid, f"broker of {broker.data_dir} is not running after {what}"
    used = settled_old_gen_mib(pid, bound + 1)
    assert used <= bound, f"broker's old generation {used:.0f} MiB after {what} (bound {bound:.0f} MiB)"
    return used


def records_in(out: Path) -> int:
    """How many completion records ``out`` holds (each stream published once is one), by
    reading every file of its record store: for tests, never on a receiver's path."""
    from airflow_provider_amqstream.engine import store as st

    ids = set()
    root = out / ".amqstream" / st.STORE_DIR_NAME
    for seg in [*root.glob("*/*/*.log"), *root.glob(f"*/*/*{st.SORTED}")]:
        try:
            data = seg.read_bytes()
        except FileNotFoundError:
            continue
        for line in data.split(b"\n"):
            if seg.suffix == st.SORTED:  # a sorted line has its day after its key
                head, _, rest = line.partition(b"\t")
                line = head + b"\t" + rest.partition(b"\t")[2]
            rec = st.decode(line)
            if rec is not None and rec[0].startswith(st.DONE):
                ids.add(rec[0])
    return len(ids)


class HeldProxy:
    """A loopback TCP proxy to a broker on ``port`` that passes at most ``budget`` bytes one
    way, over all its connections, and then holds that way until :meth:`release`. A test that
    kills a sender or a receiver "part way" needs it to be part way when the test looks: on a
    quiet machine a 128 MiB send took one second, and a loaded test process looked next after
    its last chunk.

    :param to_broker: hold what clients send (a sender's chunks); False: what the broker
        delivers (a receiver's).
    """

    def __init__(self, port: int, budget: int, *, to_broker: bool = True) -> None:
        self.upstream = port
        self.left = budget
        self.to_broker = to_broker
        self.released = threading.Event()
        self.closed = threading.Event()
        self.lock = threading.Lock()
        self.server = socket.create_server(("127.0.0.1", free_port()))
        self.port = self.server.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def uri(self, uri: str) -> str:
        """``uri`` (a broker's, on its port) through this proxy. The port is the last
        ``:<port>`` in it: the password before it may hold the same digits."""
        head, sep, tail = uri.rpartition(f":{self.upstream}")
        if not sep:
            raise ValueError(f"{uri!r} does not name port {self.upstream}")
        return f"{head}:{self.port}{tail}"

    def release(self) -> None:
        """Pass everything from now on."""
        self.released.set()

    def close(self) -> None:
        self.closed.set()
        self.released.set()
        for s in [self.server, *self.socks]:
            s.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            try:
                broker = socket.create_connection(("127.0.0.1", self.upstream), timeout=10)
            except OSError:
                client.close()  # as a broker that is down would: the client sees a refusal
                continue
            broker.settimeout(None)
            self.socks += [client, broker]
            threading.Thread(target=self._pump, args=(client, broker, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(broker, client, False), daemon=True).start()

    def _take(self, n: int) -> int:
        """How many of ``n`` bytes may pass now, waiting (in steps, so that close ends it)
        while the budget is spent and not released."""
        while not self.released.is_set():
            with self.lock:
                if self.left > 0:
                    take = min(n, self.left)
                    self.left -= take
                    return take
            self.released.wait(0.1)
        return n

    def _pump(self, src: socket.socket, dst: socket.socket, to_broker: bool) -> None:
        try:
            while data := src.recv(65536):
                while data:
                    n = self._take(len(data)) if to_broker == self.to_broker else len(data)
                    dst.sendall(data[:n])
                    data = data[n:]
        except OSError:
            pass  # either end went away: the other one is closed below
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def resident_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache now (``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    size = path.stat().st_size
    if size == 0:
        return 0
    pages = -(-size // mmap.PAGESIZE)
    with path.open("rb") as fh:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw)
        finally:
            libc.munmap(addr, size)


def page_cache_droppable(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` gives a synced file's pages back when asked
    (tmpfs keeps them: its pages are the file)."""
    probe = directory / ".fadvise-probe"
    probe.write_bytes(b"x" * 65536)
    try:
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return resident_pages(probe) == 0
    finally:
        probe.unlink()
