"""``python -m benchmarks.probe PROGRAM [ARGS...]``: run a Python program in this process,
then print its peak memory and CPU time as one last JSON line on stdout:
``{"probe": {"peak_rss_kib": N, "cpu_seconds": S, "system_seconds": K}}``.

PROGRAM is ``-m MODULE`` (as ``python -m``) or the path of a script, such as the installed
``amqstream`` console script, which then runs exactly as users run it. The product's command
line reports transfers, not its own resource use: the benchmarks and the memory tests
measure it from here. Imports only the standard library, so it adds next to nothing to what
it measures.
"""

from __future__ import annotations

import json
import resource
import runpy
import sys
from typing import Any


def peak_rss_kib() -> int:
    """This process's peak resident memory in KiB.

    Linux's ``ru_maxrss`` keeps the high-water mark of the process that forked us across
    exec (a child of a 250 MB pytest reports 250 MB), so read VmHWM, which belongs to
    this address space alone.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def cpu_seconds() -> tuple[float, float]:
    """User plus system CPU time of this process so far, all threads, and of the children it
    waited for, and the system part alone: the kernel's share tells file-system work (creating
    and syncing files) from Python's."""
    usage, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    system = usage.ru_stime + kids.ru_stime
    return usage.ru_utime + kids.ru_utime + system, system


def figures() -> dict[str, Any]:
    total, system = cpu_seconds()
    return {"peak_rss_kib": peak_rss_kib(), "cpu_seconds": round(total, 3), "system_seconds": round(system, 3)}


def merge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """JSON rows of a probed run with the probe's figures added to each (the probe line dropped)."""
    if rows and "probe" in rows[-1]:
        probe = rows[-1]["probe"]
        return [{**r, **probe} for r in rows[:-1]]
    return rows


def main(argv: list[str]) -> int:
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(__doc__, file=sys.stderr)
        return 2
    code: Any = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"probe": figures()}), flush=True)
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)  # sys.exit("message"): what the interpreter would print
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
