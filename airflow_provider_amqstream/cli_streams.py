"""``amqstream streams ls|show|redrive|discard``: where streams are, and acting on stuck ones.

Without ``--from``, the destinations are those the connection's ``destinations`` extra lists.
Exit codes: 0 done, 1 failed or refused (the reason on stderr), 2 bad usage, 3 nothing is
known about the stream asked for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from airflow_provider_amqstream.cli_common import CONN_HELP
from airflow_provider_amqstream.cli_common import broker_params as _params
from airflow_provider_amqstream.protocol.names import Destination

NOT_FOUND = 3


def add_parser(sub: Any) -> None:
    """Add ``streams`` and its subcommands to the ``amqstream`` parser's subparsers ``sub``."""
    st = sub.add_parser("streams", help="where streams are (offered, in progress, parked, quarantined) and "
                        "acting on stuck ones")
    ss = st.add_subparsers(dest="streams_command", required=True)

    def common(parser: argparse.ArgumentParser, *, out_dir: bool = True) -> None:
        parser.add_argument("--conn", help=CONN_HELP)
        parser.add_argument("--from", dest="source", action="append", metavar="DEST",
                            help="the destination, /queue/NAME (repeatable for ls; default: the connection's "
                                 "'destinations' extra)")
        parser.add_argument("--quarantine", metavar="DEST", help="the quarantine queue the receivers were given, if "
                            "not /queue/DLQ.<name>")
        if out_dir:
            parser.add_argument("--out-dir", action="append", default=[], metavar="DIR",
                                help="a receiver's output directory to read (repeatable): streams in progress, "
                                     "incomplete batches, partial data")
        parser.add_argument("--json", action="store_true", help="print JSON on stdout and nothing else")
        parser.add_argument("--browse-limit", type=int, default=16, metavar="N",
                            help="how many messages a queue browser sees on this broker (maxBrowsePageSize; 16 in "
                                 "the shipped config): a section showing that many may be cut")

    ls = ss.add_parser("ls", help="streams offered, in progress, yielding, quarantined, and incomplete batches "
                       "(only looks: consumes and reorders nothing)")
    common(ls)
    ls.add_argument("--rate-window", type=float, default=1.0, metavar="S",
                    help="seconds between two looks at streams being received, for their rate (0: no rate)")
    ls.set_defaults(func=cmd_ls)

    show = ss.add_parser("show", help="one stream, everything known about it, both sides")
    show.add_argument("stream_id", metavar="ID")
    common(show)
    show.set_defaults(func=cmd_show)

    rd = ss.add_parser("redrive", help="put a quarantined stream back once its cause is fixed (over max_bytes, a "
                       "reused id, no room), after checking its chunks are complete")
    rd.add_argument("stream_id", metavar="ID")
    rd.add_argument("--receiver", action="append", default=[], metavar="USER",
                    help="a user your receivers connect as, whose quarantine copies are believed besides your own "
                         "(repeatable; a copy filed by another user is refused)")
    common(rd, out_dir=False)
    rd.set_defaults(func=cmd_redrive)

    dc = ss.add_parser("discard", help="remove a stream's messages everywhere (offer, parked and quarantine copies, "
                       "chunks) and its partial data in --out-dir")
    dc.add_argument("stream_id", metavar="ID")
    common(dc)
    dc.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    dc.set_defaults(func=cmd_discard)


# --------------------------------------------------------------------------- helpers
def _destinations(args: argparse.Namespace, *, one: bool) -> list[str]:
    """``--from``, else the connection's ``destinations`` extra; exactly one if ``one``."""
    from airflow_provider_amqstream.exceptions import ConfigurationError
    from airflow_provider_amqstream.hooks import connection
    from airflow_provider_amqstream.transport.params import extra_list

    found = list(args.source or [])
    if not found:
        fields, _ = connection.lookup(args.conn)  # as broker_params did, which took logging back from Airflow
        found = extra_list(fields.extra, "destinations") if fields else []
    if not found:
        raise ConfigurationError("name the destination with --from /queue/NAME (or list them in the connection's "
                         "'destinations' extra)")
    if one and len(found) > 1:
        raise ConfigurationError(f"name one destination with --from (the connection lists {', '.join(found)})")
    return [str(Destination.parse(d)) for d in found]


def size_text(n: int | None) -> str:
    """Bytes for people: ``512 B``, ``48.0 MiB``, ``1.00 GiB``."""
    if n is None:
        return "? bytes"
    if n < 1024:
        return f"{n} B"
    power = min(4, (n.bit_length() - 1) // 10)  # 1 KiB, 2 MiB, 3 GiB, 4 TiB
    return f"{n / 2 ** (10 * power):,.{2 if power >= 3 else 1}f} {'KMGT'[power - 1]}iB"


def when_text(epoch: float | None) -> str:
    """A moment for people, in UTC."""
    if not epoch:
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(epoch))


def _until(epoch: float | None) -> str:
    """When a parked stream is due: ``until <when> (in 5m03s)``, or ``due now``."""
    if not epoch:
        return "due now"
    seconds = epoch - time.time()
    s = int(abs(seconds))
    text = f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    return f"until {when_text(epoch)} ({f'in {text}' if seconds >= 0 else f'{text} ago'})"


def _who(user: str) -> str:
    return user or "an unidentified sender"


def _print_json(data: Any) -> None:
    print(json.dumps(data, default=str), flush=True)


# --------------------------------------------------------------------------- ls
def render_inventory(inv: Any) -> str:
    """An inventory (``engine.inventory.Inventory``) as text for people."""
    lines = [f"{inv.destination} on {inv.broker}, {when_text(inv.taken_at)}"]

    def section(title: str, rows: list[str], key: str | None = None) -> None:
        if key and key in inv.denied:
            lines.append(f"{title}: not shown: {inv.denied[key]}")
            return
        cut = " (may be more: see below)" if key and inv.truncated.get(key) else ""
        lines.append(f"{title} ({len(rows)}{cut}):" if rows else f"{title}: none{cut}")
        lines.extend(f"  {r}" for r in rows)

    offered = []
    for o in inv.offered:
        pack = f" in pack {o.pack}" if o.pack else ""
        what = {"inline": " (inline)", "re-offer": " (re-offer: clears repeats, starts nothing)",
                "invalid": f" INVALID: {o.note}"}.get(o.kind, "")
        again = f" (redriven by {o.redriven_by})" if o.redriven_by else ""
        again += " (being received now)" if o.receiving else ""
        offered.append(f"{o.stream_id}  {o.name or '?'}  {size_text(o.size)}  from {_who(o.sender)}  offered "
                       f"{when_text(o.offered_at)}{pack}{what}{again}")
    offered += [f"batch {b.batch_id} part {b.part}/{b.parts}: {'sealed' if b.files is None else f'{b.files} files'}, "
                f"from {_who(b.sender)}, announced {when_text(b.offered_at)}" for b in inv.batches_offered]
    section("offered, not yet received", offered, "offered")
    if inv.in_progress or inv.batches:
        rows = []
        for e in inv.in_progress:
            pct = f" ({e.percent:.0f}%)" if e.percent is not None else ""
            state = {True: "receiving now", False: "idle", None: "receiving: unknown"}[e.receiving_now]
            rate = f", {e.rate / 2**20:,.1f} MiB/s" if e.rate else ""
            rows.append(f"{e.stream_id}  {e.name or '?'}  {size_text(e.durable_bytes)} of {size_text(e.size)}{pct} "
                        f"durable in {e.out_dir}  {state}{rate}, since {when_text(e.since)}, last progress "
                        f"{when_text(e.last_progress_at)}  from {_who(e.sender)}")
        section("in progress", rows)
    parked = [f"{pk.stream_id}  {pk.name or '?'}  {size_text(pk.size)}  {_until(pk.not_before)}, yielded "
              f"{pk.yields}x: {pk.reason or '?'}  from {_who(pk.first_sender)}" for pk in inv.parked]
    section("yielding (parked)", parked, "parked")
    quarantined = [f"{q.stream_id}  {q.name or '?'}  {size_text(q.size)}  [{q.cause}] {q.reason}  (by "
                   f"{q.by_host or '?'} as {q.by_user or '?'}, {q.at or '?'}; redrive: "
                   f"{'yes' if q.redrivable else 'no'}: {q.advice})"
                   for q in inv.quarantined]
    section("quarantined", quarantined, "quarantined")
    if inv.batches:
        section("incomplete batches", [
            f"{b.batch_id} from {_who(b.sender)} in {b.out_dir}: {b.files_in} of {b.files_announced} files in "
            f"({b.parts_seen} of {b.parts} parts of its list), waiting since {when_text(b.since)}"
            for b in inv.batches])
    for key, cut in inv.truncated.items():
        if cut:
            lines.append(f"note: {inv.queues[key]} showed {inv.browse_limit} messages, as many as a queue browser sees "
                         f"on this broker (maxBrowsePageSize): there may be more behind them")
    return "\n".join(lines)


def cmd_ls(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import inventory, partials

    params = _params(args)
    for destination in _destinations(args, one=False):
        inv = inventory.take_inventory(params, destination, out_dirs=args.out_dir, quarantine=args.quarantine,
                                       browse_limit=args.browse_limit)
        if args.rate_window > 0 and any(e.receiving_now for e in inv.in_progress):
            # A second look at the receivers' directories: bytes made durable meanwhile.
            marks = partials.progress_marks(inv.in_progress)
            time.sleep(args.rate_window)
            inv.in_progress = [e for d in args.out_dir for e in partials.partial_streams(d, previous=marks)]
        if args.json:
            _print_json(inv.to_json())
        else:
            print(render_inventory(inv), flush=True)
    return 0


# --------------------------------------------------------------------------- show
def render_report(rep: Any) -> str:
    """One stream's report (``engine.show.StreamReport``) as text for people."""
    lines = [f"stream {rep.stream_id} on {rep.destination} ({rep.broker})"]
    for o in rep.offered:
        lines.append(f"  offered: {o.name or '?'}, {size_text(o.size)} in {o.chunks} chunks, mode {o.mode or '?'}, "
                     f"from {_who(o.sender)} at {when_text(o.offered_at)}" + (f", in pack {o.pack}" if o.pack else "")
                     + (f"; INVALID: {o.note}" if o.kind == "invalid" else "") + ("; held by a receiver, or waiting"))
    for pk in rep.parked:
        lines.append(f"  parked: {_until(pk.not_before)}, yielded {pk.yields}x, last because: "
                     f"{pk.reason or '?'}; first sent by {_who(pk.first_sender)}")
    for q in rep.quarantined:
        lines.append(f"  quarantined at {q.at or '?'} by {q.by_host or '?'} (user {q.by_user or '?'}) [{q.cause}]: "
                     f"{q.reason}")
        lines.append(f"    redrive: {'yes' if q.redrivable else 'no'}: {q.advice}"
                     + (f" (redriven before by {q.redriven_by})" if q.redriven_by else ""))
    for e in rep.in_progress:
        pct = f" ({e.percent:.0f}%)" if e.percent is not None else ""
        lines.append(f"  partial in {e.out_dir}: {size_text(e.durable_bytes)} of {size_text(e.size)}{pct} durable, "
                     f"{'receiving now' if e.receiving_now else 'idle'}, last progress {when_text(e.last_progress_at)}")
    lines.extend(f"  partial data held by a receiver on host {h['host']} in {h['out_dir']} (partial file {h['part']}, "
                 f"since {when_text(h['since'])}): its chunks so far are there, the rest waits for it"
                 for h in rep.held)
    for r in rep.received:
        lines.append(f"  received into {r.get('out_dir')}: {r.get('path')}, {size_text(r.get('bytes'))}, sha256 "
                     f"{r.get('sha256')}, at {when_text(r.get('finished_at'))}, sent by {_who(r.get('sender', ''))}")
    for b in rep.in_batches:
        lines.append(f"  listed by batch {b.get('batch_id')} (part {b.get('part')}/{b.get('parts')}) of "
                     f"{_who(b.get('sender') or '')}, waiting in {b.get('out_dir')}")
    for q in rep.queues:
        if q.denied:
            lines.append(f"  {q.queue}: not shown: {q.denied}")
        elif q.end_marker:
            lines.append(f"  {q.queue}: holds its end marker (sent by {_who(q.sender)}), so its chunks were all sent")
    for key, why in rep.denied.items():
        lines.append(f"  {key}: not shown: {why}")
    if not rep.found:
        lines.append("  nothing known about it here (not offered, parked, quarantined, in progress or received in "
                     "the directories given; a browser sees only the first messages of a queue)")
    return "\n".join(lines)


def cmd_show(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import show

    params = _params(args)
    rep = show.show_stream(params, _destinations(args, one=True)[0], args.stream_id, out_dirs=args.out_dir,
                                quarantine=args.quarantine, browse_limit=args.browse_limit)
    if args.json:
        _print_json(rep.to_json())
    else:
        print(render_report(rep), flush=True)
    return 0 if rep.found else NOT_FOUND


# --------------------------------------------------------------------------- actions
def cmd_redrive(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import redrive

    params = _params(args)
    res = redrive.redrive(params, _destinations(args, one=True)[0], args.stream_id, quarantine=args.quarantine,
                          browse_limit=args.browse_limit, receivers=args.receiver)
    if args.json:
        _print_json(res.to_json())
        return 0
    checked = "CRC-32 and SHA-256" if res.sha256_checked else "CRC-32 (its SHA-256 is checked by the receiver)"
    print(f"redrove stream {res.stream_id} to {res.destination} ({res.cause}): {res.chunks} chunks, "
          f"{size_text(res.bytes)}, complete, {checked} OK; sent by {_who(res.sender_before)} before, by "
          f"{res.redriven_by or '?'} now (receivers record it as {res.redriven_by or '?'}'s)"
          + (f"; {res.duplicates_dropped} repeated messages left out" if res.duplicates_dropped else ""), flush=True)
    return 0


def cmd_discard(args: argparse.Namespace) -> int:
    from airflow_provider_amqstream.engine import discard, show
    from airflow_provider_amqstream.exceptions import ConfigurationError

    params = _params(args)
    destination = _destinations(args, one=True)[0]
    if not args.yes:
        rep = show.show_stream(params, destination, args.stream_id, out_dirs=args.out_dir,
                                    quarantine=args.quarantine, browse_limit=args.browse_limit)
        print(render_report(rep), file=sys.stderr)
        if not sys.stdin.isatty():
            raise ConfigurationError(f"discard of stream {args.stream_id} on {destination} asks for confirmation: "
                                     "pass --yes to discard without a terminal")
        answer = input(f"discard every message of stream {args.stream_id} on {destination}"
                       + (f" and its partial data in {', '.join(args.out_dir)}" if args.out_dir else "")
                       + "? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing discarded", file=sys.stderr)
            return 1
    res = discard.discard(params, destination, args.stream_id, out_dirs=args.out_dir, quarantine=args.quarantine,
                          browse_limit=args.browse_limit)
    if args.json:
        _print_json(res.to_json())
    else:
        where = ", ".join(f"{n} from {q}" for q, n in res.removed.items()) or "nothing on the broker"
        local = f"; removed {len(res.local)} partial files ({size_text(res.local_bytes)})" if res.local else ""
        print(f"discarded stream {res.stream_id} on {res.destination}: {res.messages} message"
              f"{'' if res.messages == 1 else 's'} ({where}){local}; "
              f"freed {size_text(res.bytes_freed)} ({res.broker_bytes} bytes of message bodies on the broker, "
              f"{res.local_bytes} on disk)", flush=True)
    for note in res.notes:
        print(f"amqstream: note: {note}", file=sys.stderr)
    return 0
