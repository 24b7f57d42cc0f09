"""What ``make airflow`` (scripts/airflow.sh) needs from Python to keep a local deployment on
loopback.

Airflow 3.3's scheduler and triggerer each start a log server that binds every interface
(``0.0.0.0``/``[::]`` on 8793 and 8794) with no setting to change that. The script starts
them with ``--skip-serve-logs`` and runs one log server here instead, on 127.0.0.1 and a port
of its choosing (``[logging] worker_log_server_port`` and ``trigger_log_server_port`` both
name it). The API server reaches a worker's log server at the host name the worker
recorded, so every component records :func:`hostname` (``[core] hostname_callable``).

    python -m airflow_provider_amqstream.local_deployment serve-logs --port PORT [--host 127.0.0.1]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

LOOPBACK = "127.0.0.1"

# How long a component waits for the SQLite metadata database's write lock before "database
# is locked" (sqlite3's default is 5 s): the scheduler, the API server, the triggerer and the
# DAG processor all write one file, and on a loaded 2-core machine (two deployments and their
# Spark jobs) the API server waited past 5 s and refused a run with "Database error".
# Airflow adds its own keys to the dict it is given: one for each engine.
SQLITE_CONNECT_ARGS: dict[str, Any] = {"timeout": 60}
SQLITE_CONNECT_ARGS_ASYNC: dict[str, Any] = {"timeout": 60}


def hostname() -> str:
    """The host name every component of a loopback-only deployment records: the address its
    log server listens on (``AIRFLOW__CORE__HOSTNAME_CALLABLE``)."""
    return LOOPBACK


def serve_logs(port: int, host: str = LOOPBACK) -> None:
    """Serve the task and trigger log files under ``[logging] base_log_folder`` to the API
    server, as ``airflow scheduler`` does, but on ``host`` only.

    :param port: the TCP port.
    :param host: the address to listen on.
    """
    import uvicorn
    from airflow.configuration import conf

    # The same application and settings Airflow's own serve_logs runs (airflow.utils.serve_logs.core).
    uvicorn.run("airflow.utils.serve_logs.log_server:get_app", host=host, port=port,
                log_level=conf.get("logging", "uvicorn_logging_level", fallback="info").lower(),
                log_config=None, access_log=False, factory=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m airflow_provider_amqstream.local_deployment",
                                 description="helpers of scripts/airflow.sh (make airflow)")
    sub = ap.add_subparsers(dest="command", required=True)
    logs = sub.add_parser("serve-logs", help="serve task and trigger logs to the API server on one address")
    logs.add_argument("--port", type=int, required=True)
    logs.add_argument("--host", default=LOOPBACK)
    args = ap.parse_args(argv)
    serve_logs(args.port, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
