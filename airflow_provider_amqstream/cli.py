"""Command line: ``amqstream broker|users|send|receive|test-connection|streams``.

Exit codes: 0 success, 1 the transfer failed (message on stderr), 2 bad usage,
3 nothing to receive within ``--wait``.

Start-up time is part of every transfer a script makes, so this module imports only
what a command needs, when it runs it; Airflow only to look a connection up in the
metadata database. Machine output (``--json``) goes alone to stdout; progress, notices
and logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from airflow_provider_amqstream import __version__
from airflow_provider_amqstream.cli_common import CONN_HELP, setup_logging
from airflow_provider_amqstream.cli_common import broker_params as _params
from airflow_provider_amqstream.exceptions import AmqStreamError, ConfigurationError, UsageError
from airflow_provider_amqstream.protocol.headers import DEFAULT_RECEIVE_BATCH

# The choices of ``send --mode``, here so that building the parser imports nothing;
# tests check them against protocol.Mode.
MODES = ("stream", "atomic", "handshake")

class _Progress:
    """A one-line progress bar on a terminal; a line every 10 s otherwise (logs)."""

    def __init__(self, label: str) -> None:
        from airflow_provider_amqstream.engine.progress import ProgressMeter

        self.label = label
        self.tty = sys.stderr.isatty()
        self.meter = ProgressMeter(0.2 if self.tty else 10.0)

    def __call__(self, done: int, total: int) -> None:
        rep = self.meter.reading(done, total)
        if rep is None:
            return
        rate = f" {rep.rate / 2**20:,.1f} MiB/s" if rep.rate is not None else ""
        if self.tty:
            bar = "#" * int(rep.percent / 4)
            line = (f"{self.label} [{bar:<25}] {rep.percent:5.1f}% {done / 2**20:,.1f}/"
                    f"{total / 2**20:,.1f} MiB{rate}")
        else:
            line = f"{self.label}: {rep.percent:5.1f}% {done}/{total} bytes{rate}"
        _show(line, tty=self.tty, final=rep.final)


def _show(line: str, *, tty: bool, final: bool) -> None:
    """A progress line on stderr: rewritten in place on a terminal, one after another in logs."""
    sys.stderr.write((f"\r{line}\x1b[K" + ("\n" if final else "")) if tty else line + "\n")
    sys.stderr.flush()


def _print_result(res: Any, as_json: bool, verb: str) -> None:
    data = res.to_json()
    if as_json:
        print(json.dumps(data), flush=True)
        return
    if data.get("status") == "already_sent":
        at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(data["finished_at"]))
        print(f"stream {data['stream_id']} ({data['name']}) was already sent completely to {data['destination']} "
              f"on {data['broker']} at {at}; sha256 {data['sha256']}. Nothing sent: --restart sends it again",
              flush=True)
        return
    if not data["bytes_transferred"] and data["resumed_from"] == data["bytes"] and data["bytes"]:
        print(f"stream {data['stream_id']} ({data['name']}) was already {verb} completely; "
              f"sha256 {data['sha256']}", flush=True)
        return
    # This run's bytes over this run's time: a resumed transfer moved less than its size.
    rate = data["bytes_transferred"] / max(data["seconds"], 1e-6) / 2**20
    where = f" -> {data['path']}" if verb == "received" else ""
    resumed = f", resumed at byte {data['resumed_from']}" if data["resumed_from"] else ""
    print(f"{verb} stream {data['stream_id']} ({data['name']}, {data['bytes']} bytes, {data['chunks']} chunks) "
          f"via {data['destination']}{where} in {data['seconds']:.2f}s ({rate:,.1f} MiB/s{resumed}); "
          f"sha256 {data['sha256']}", flush=True)


def cmd_broker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from airflow_provider_amqstream.broker.config import HOST
    from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
    from airflow_provider_amqstream.broker.network import NetworkConfig

    network = NetworkConfig(openwire_port=args.openwire_port, peers=tuple(args.network_to or ()),
                            bridge_secret=Path(args.bridge_secret) if args.bridge_secret else None,
                            queues=tuple(args.network_queue or ()), openwire_tls_port=args.openwire_tls_port,
                            peer_cas=tuple(Path(c) for c in args.network_ca or ()))
    # No network option given: the network this data dir was last started with.
    broker = EmbeddedBroker(args.data_dir, port=args.port, auth=not args.no_auth, tls_port=args.tls_port,
                            network=network if network != NetworkConfig() else None)
    if args.action in ("start", "restart"):
        if args.action == "restart":
            broker.stop()
        info, created = broker.start()
        print(f"broker {'restarted' if args.action == 'restart' else 'running'}: pid {info.pid}, "
              f"stomp://{info.host}:{info.port}, data in {info.data_dir}")
        if info.tls_port:
            print(f"  TLS: stomp+ssl://{info.host}:{info.tls_port}, certificate {info.ca_file}")
        net = broker.network
        if net.openwire_port:
            print(f"  OpenWire: tcp://{info.host}:{net.openwire_port} (bridges from other brokers, JMS clients)")
        if net.openwire_tls_port:
            print(f"  OpenWire over TLS: ssl://{info.host}:{net.openwire_tls_port}, certificate {broker.ca_file}")
        for peer in net.peers:
            print(f"  bridged to {peer} (duplex), as the user in {net.bridge_secret}")
        if created:
            print(f"generated credentials (kept in {broker.creds_file}, shown once):")
            print(f"  export AIRFLOW_CONN_AMQSTREAM_DEFAULT='{info.tls_uri or info.uri}'")
        return 0
    if args.action == "stop":
        print("broker stopped" if broker.stop() else "broker was not running")
        return 0
    if args.action == "uri":
        info = broker.info()
        print(info.tls_uri if args.tls and info.tls_uri else info.uri)
        return 0
    pid = broker.running_pid()
    if pid is not None and broker.port_open():
        print(f"running: pid {pid}, stomp://{HOST}:{broker.port}, data in {broker.data_dir}")
        return 0
    print(f"not running (data dir {broker.data_dir})")
    return 1


def cmd_users(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.broker.embedded import EmbeddedBroker

    broker = EmbeddedBroker(args.data_dir)
    if args.action == "list":
        for name, info in sorted(broker.users().items()):
            print(f"{name}: send {', '.join(info['send']) or '-'}; receive {', '.join(info['receive']) or '-'}")
        return 0
    if not args.name:
        raise UsageError(f"users {args.action}: name the user")
    if args.action == "add":
        added = broker.add_user(args.name, send=args.send, receive=args.receive, max_waiting=args.max_waiting)
        print(f"user {args.name} may send to {', '.join(args.send) or 'nothing'} and receive from "
              f"{', '.join(args.receive) or 'nothing'}; its connection (password shown once, kept in "
              f"{broker.users_file}):")
        print(f"  {added.tls_uri or added.uri}")
    elif not broker.remove_user(args.name):
        raise ConfigurationError(f"no user {args.name!r} in {broker.users_file}; `amqstream users list` names them")
    else:
        print(f"user {args.name} removed")
    if broker.running_pid() is not None:
        print("the broker is running: `amqstream broker restart` applies the change")
    return 0


class _BatchProgress:
    """Progress of a many-file send on stderr: files done/total, bytes, recent MiB/s of this run."""

    def __init__(self) -> None:
        from airflow_provider_amqstream.engine.progress import ProgressMeter, RecentRate

        self.tty = sys.stderr.isatty()
        # Paced by files: a batch ends when every file is sent or failed, whatever bytes that took.
        self.meter = ProgressMeter(0.2 if self.tty else 10.0)
        self.rate = RecentRate()

    def __call__(self, st: Any) -> None:
        rate = self.rate.add(time.monotonic(), st.bytes_done)
        rep = self.meter.reading(st.files_done + st.failed, st.files_total)
        if rep is None:
            return
        shown = f", {rate / 2**20:,.1f} MiB/s" if rate is not None else ""
        _show(f"send: {st.files_done}/{st.files_total} files, {st.bytes_done / 2**20:,.1f}/"
              f"{st.bytes_total / 2**20:,.1f} MiB{shown}", tty=self.tty, final=rep.final)


def cmd_keys(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import keys

    ident = keys.new_key_file(args.keyfile) if args.action == "new" else keys.read_key_file(args.keyfile)
    if args.action == "new":
        print(f"wrote {args.keyfile} (readable by you only); senders seal to its recipient:", file=sys.stderr)
    print(ident.recipient)
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import SendOptions, iter_files, send_file, send_files

    single = len(args.path) == 1 and not args.recursive and os.path.isfile(args.path[0])
    options = SendOptions(chunk_size=args.chunk_size, window=args.window, mode=args.mode, restart=args.restart,
                          compression=args.compress, fail_fast=args.fail_fast, pack=args.pack,
                          seal_to=tuple(args.seal_to or ()),
                          manifest=args.manifest if args.manifest is not None else args.recursive,
                          progress=_Progress(f"send {os.path.basename(args.path[0])}")
                          if single and not args.quiet else None)
    if single:
        res = send_file(_params(args), args.path[0], args.to, options, stream_id=args.stream_id)
        _print_result(res, args.json, "sent")
        return 0
    if args.stream_id:
        raise UsageError("--stream-id names one stream; it cannot be used with several files")
    files = iter_files(args.path, recursive=args.recursive)
    progress = None if args.quiet else _BatchProgress()

    def on_failure(failure: Any) -> None:
        print(f"amqstream: {failure.path}: {failure.error}", file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(failure.to_json()), flush=True)

    def on_result(res: Any) -> None:
        if args.json:
            print(json.dumps(res.to_json()), flush=True)

    bulk = send_files(_params(args), files, args.to, options, batch_id=args.batch_id, progress=progress,
                      on_result=on_result, on_failure=on_failure)
    totals = bulk.totals()
    if args.json:
        print(json.dumps(totals), flush=True)
    else:
        print(f"sent {totals['files_sent']} files ({totals['files_already_sent']} sent before, "
              f"{totals['files_failed']} failed), {totals['bytes_transferred']} bytes to {bulk.destination} in "
              f"{totals['seconds']:.2f}s ({totals['files_per_second']:,.1f} files/s, "
              f"{totals['mib_per_second']:,.1f} MiB/s); batch {bulk.batch_id}; every file's result in "
              f"{bulk.files_list}", flush=True)
    return 1 if bulk.failed else 0


def cmd_receive(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import ReceiveOptions, receive_streams

    params = _params(args)
    events = None
    if args.events:
        ev_fh = open(args.events, "a", buffering=1)  # noqa: SIM115 - lives as long as the command

        def events(kind: str, data: dict[str, Any]) -> None:
            ev_fh.write(json.dumps({"event": kind, "pid": os.getpid(), **data}) + "\n")

    failures = 0

    def on_failure(failure: Any) -> None:
        # Another stream's failure is reported, never fatal: the receiver goes on.
        nonlocal failures
        failures += 1
        print(f"amqstream: stream {failure.stream_id} on {failure.destination} {failure.status}: {failure.reason}",
              file=sys.stderr, flush=True)
        if args.json:
            print(json.dumps(failure.to_json()), flush=True)

    opts = ReceiveOptions(window=args.window or DEFAULT_RECEIVE_BATCH, wait_timeout=args.wait,
                          idle_timeout=args.idle_timeout, overwrite=args.overwrite, events=events,
                          max_bytes=args.max_bytes, min_free_bytes=args.min_free, quarantine=args.quarantine,
                          progress=None if args.quiet else _Progress("receive"),
                          records_retention_days=args.records_retention_days, min_rate=args.min_rate,
                          keys=tuple(args.key or ()))
    received = 0

    def on_result(res: Any) -> None:
        nonlocal received
        received += 1
        _print_result(res, args.json, "received")

    # Each result is printed as it comes and only counted: memory stays flat however many arrive.
    receive_streams(params, args.source, args.out_dir, count=None if args.follow else args.count,
                    stream_id=args.stream_id, options=opts, on_failure=on_failure, on_result=on_result)
    if not received and not args.follow:
        if failures:
            print(f"no stream was received from {args.source}: {failures} offered within {args.wait}s "
                  "failed (see above)", file=sys.stderr)
        else:
            print(f"no stream was offered on {args.source} within {args.wait}s", file=sys.stderr)
        return 3
    return 0


def cmd_test_connection(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.transport.link import open_link

    params = _params(args)
    with open_link(params) as link:
        link.round_trip()
    print(f"ok: connected to {params.url} and received a receipt")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="amqstream", description="Move files through ActiveMQ over STOMP.")
    ap.add_argument("--version", action="version", version=f"amqstream {__version__}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log protocol and connection events")
    sub = ap.add_subparsers(dest="command", required=True)

    b = sub.add_parser("broker", help="run the embedded ActiveMQ broker")
    b.add_argument("action", choices=["start", "stop", "restart", "status", "uri"])
    b.add_argument("--data-dir", help="config, KahaDB and logs (default ~/.local/state/amqstream/broker)")
    b.add_argument("--port", type=int, help="STOMP port on 127.0.0.1 (default 61613)")
    b.add_argument("--no-auth", action="store_true", help="allow anonymous clients (not recommended)")
    b.add_argument("--tls-port", type=int, help="also listen for STOMP over TLS here (certificate generated)")
    b.add_argument("--tls", action="store_true", help="uri: print the TLS URI")
    b.add_argument("--openwire-port", type=int, help="network: also listen for OpenWire (other brokers' bridges, "
                   "JMS clients), authenticated")
    b.add_argument("--openwire-tls-port", type=int, help="network: also listen for OpenWire over TLS, with this "
                   "broker's certificate (tls/broker-cert.pem in the data dir)")
    b.add_argument("--network-to", action="append", metavar="URI", help="network: bridge to this broker's "
                   "OpenWire listener, tcp://HOST:PORT or ssl://HOST:PORT (repeatable; duplex; the link is "
                   "retried while down)")
    b.add_argument("--network-ca", action="append", metavar="PEM", help="network: trust this certificate for "
                   "ssl:// bridges (the remote broker's tls/broker-cert.pem; repeatable)")
    b.add_argument("--bridge-secret", metavar="FILE", help="network: the bridge user's name and password, made "
                   "here if missing (mode 0600); give the same file to every broker of the network")
    b.add_argument("--network-queue", action="append", metavar="/queue/NAME", help="network: forward only these "
                   "destinations and their streams (repeatable; default every queue)")
    b.set_defaults(func=cmd_broker)

    u = sub.add_parser("users", help="users of the embedded broker limited to some destinations")
    u.add_argument("action", choices=["add", "remove", "list"])
    u.add_argument("name", nargs="?")
    u.add_argument("--send", action="append", default=[], metavar="DEST",
                   help="add: may send streams to DEST (repeatable; /queue/x, /topic/x, /queue/x.> for a family)")
    u.add_argument("--receive", action="append", default=[], metavar="DEST",
                   help="add: may receive streams from DEST (repeatable)")
    u.add_argument("--max-waiting", type=int, metavar="N", help="add: streams of this user that may wait at once "
                   "on each destination it sends to (their data queues; default 1000, ~14 KiB of broker heap each)")
    u.add_argument("--data-dir", help="the broker's data dir (default ~/.local/state/amqstream/broker)")
    u.set_defaults(func=cmd_users)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--conn", help=CONN_HELP)
        p.add_argument("--stream-id", help="stream id (send: default derived from the file; receive: any)")
        p.add_argument("--window", type=int, help="send: chunks per broker confirmation (default 16); "
                                                  "receive: chunks per sync and acknowledgement (default 8)")
        p.add_argument("--json", action="store_true", help="print one JSON object per stream")
        p.add_argument("-q", "--quiet", action="store_true", help="no progress output")

    s = sub.add_parser("send", help="send files as streams (several over one connection)")
    s.add_argument("path", nargs="+", help="files, directories (with --recursive) or quoted glob patterns")
    s.add_argument("-r", "--recursive", action="store_true",
                   help="send what is under each directory, keeping its relative paths on the receiving side")
    s.add_argument("--batch-id", help="several files: the batch's resume ledger name (default derived from "
                                      "the destination and the files)")
    s.add_argument("--fail-fast", action="store_true", help="several files: stop at the first file that fails")
    s.add_argument("--manifest", action=argparse.BooleanOptionalAction, default=None,
                   help="several files: announce the batch so receivers write <batch id>.manifest.jsonl once all "
                        "its files are in (default: on with --recursive)")
    s.add_argument("--pack", action=argparse.BooleanOptionalAction, default=True,
                   help="several files: send files of one chunk or less up to 64 to a message (default on; "
                        "--no-pack for receivers that do not read packs (Java), or that take each stream by id into "
                        "its own directory: they would receive the whole pack)")
    s.add_argument("--to", required=True, help="destination, e.g. /queue/landing")
    s.add_argument("--chunk-size", type=int, help="bytes per chunk (default 1 MiB)")
    s.add_argument("--mode", choices=MODES, default=MODES[0],
                   help="stream: receivers start at once; atomic: only after every chunk is stored")
    s.add_argument("--restart", action="store_true", help="ignore an interrupted transfer and start over")
    s.add_argument("--compress", choices=["auto", "zstd", "none"],
                   help="auto: compress chunks that shrink to half or less (CSV, JSON) and stop trying on "
                        "data that does not; zstd: try every chunk; none: send chunks as they are (default: "
                        "the connection's compression extra, else auto)")
    s.add_argument("--seal-to", action="append", metavar="RECIPIENT",
                   help="seal every stream for this recipient (amqs1..., from `amqstream keys show`); repeat for "
                        "several receivers (default: the connection's extra seal_to)")
    common(s)
    s.set_defaults(func=cmd_send)

    r = sub.add_parser("receive", help="receive streams into a directory")
    r.add_argument("--from", dest="source", required=True, help="destination, e.g. /queue/landing")
    r.add_argument("--out-dir", required=True)
    r.add_argument("--count", type=int, default=1,
                   help="streams to receive (default 1); the files of a pack arrive together, so the last pack may "
                        "bring a few more, all reported")
    r.add_argument("--follow", action="store_true",
                   help="keep receiving until --wait passes with nothing; a stream that fails is reported "
                        "(quarantined or skipped for now) and the next one received")
    r.add_argument("--wait", type=float, default=60.0, help="seconds to wait for a stream (default 60)")
    r.add_argument("--idle-timeout", type=float, default=120.0,
                   help="seconds without a chunk before giving up on a sender (default 120)")
    r.add_argument("--min-rate", type=float, metavar="BYTES_PER_S",
                   help="bytes a second a stream must bring to keep this receiver; a slower or stopped one gives "
                        "way, parked for later (default: the connection's extra min_rate, else 16384; 0: only "
                        "--idle-timeout)")
    r.add_argument("--overwrite", action="store_true", help="replace a file of the same name")
    r.add_argument("--events", help="append JSON lines of stream_open/stream_close events to this file")
    r.add_argument("--max-bytes", type=int, help="quarantine streams larger than this many bytes")
    r.add_argument("--min-free", type=int, metavar="BYTES",
                   help="free space to keep in --out-dir; larger streams wait (default 2%% of the disk, max 1 GiB)")
    r.add_argument("--quarantine", metavar="DEST",
                   help="where streams that can never succeed go (default /queue/DLQ.<name>)")
    r.add_argument("--records-retention-days", type=float, metavar="DAYS",
                   help="days --out-dir keeps its completion records (default: the connection's extra "
                        "records_retention_days, else 30; 0 keeps them for ever); a stream offered again after "
                        "its record expired is received again")
    r.add_argument("--key", action="append", metavar="KEYFILE",
                   help="a key file to open sealed streams with; repeat for several (key rotation) (default: the "
                        "connection's extra keys)")
    common(r)
    r.set_defaults(func=cmd_receive)

    k = sub.add_parser("keys", help="key files for sealed streams")
    k.add_argument("action", choices=["new", "show"],
                   help="new: write a new private key (mode 0600); show: print its recipient again")
    k.add_argument("keyfile", help="the private key file")
    k.set_defaults(func=cmd_keys)

    t = sub.add_parser("test-connection", help="connect and prove a round trip")
    t.add_argument("--conn", help=CONN_HELP)
    t.set_defaults(func=cmd_test_connection)

    from airflow_provider_amqstream.cli_streams import add_parser as add_streams_parser

    add_streams_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    try:
        code: int = args.func(args)
        return code
    # Ours say what failed and what to do; OSError is the file system's (a path that is
    # not there). Anything else is a bug, shown with its traceback.
    except UsageError as exc:
        print(f"amqstream: error: {exc}", file=sys.stderr)
        return 2
    except (AmqStreamError, OSError) as exc:
        print(f"amqstream: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("amqstream: interrupted; run the same command again to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
