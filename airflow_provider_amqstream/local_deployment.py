"""What ``make airflow`` (scripts/airflow.sh) needs from Python to keep a local deployment on
loopback.

Airflow 3.3's scheduler and triggerer each start a log server that binds every interface
(``0.0.0.0``/``[::]`` on 8793 and 8794) with no setting to change that. The script starts
them with ``--skip-serve-logs`` and runs one log server here instead, on 127.0.0.1 and a port
of its choosing (``[logging] worker_log_server_port`` and ``trigger_log_server_port`` both
name it). The API server reaches a worker's log server at the host name the worker
recorded, so every component records :func:`hostname` (``[core] hostname_callable``).

    python -m airflow_provider_amqstream.local_deployment serve-logs --port PORT [--host 127.0.0.1]

The deployment's ``amqstream_default`` also names the examples' destinations (its
``destinations`` extra), so that the streams page and ``amqstream streams ls`` show them
without one typed in:

    amqstream broker uri | python -m airflow_provider_amqstream.local_deployment default-conn --queue QUEUE
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

LOOPBACK = "127.0.0.1"

# How long a component waits for the SQLite metadata database's write lock before "database
# is locked" (sqlite3's default is 5 s): the scheduler, the API server, the triggerer and the
# DAG processor all write one file, and on a loaded 2-core machine (two deployments and their
# Spark jobs) the API server waited past 5 s and refused a run with "Database error".
# Airflow adds its own keys to the dict it is given: one for each engine.
SQLITE_CONNECT_ARGS: dict[str, Any] = {"timeout": 60}
SQLITE_CONNECT_ARGS_ASYNC: dict[str, Any] = {"timeout": 60}


def hostname() -> str:
    """The host name a component of a loopback-only deployment records
    (``AIRFLOW__CORE__HOSTNAME_CALLABLE``): ``AMQSTREAM_HOSTNAME`` where set (each Celery worker
    its own name, so the UI tells them apart), else the address the log server listens on."""
    return os.environ.get("AMQSTREAM_HOSTNAME") or LOOPBACK


def __getattr__(name: str) -> Any:
    # Built on first use (``[logging] logging_config_class`` names LOGGING_CONFIG): importing
    # Airflow's logging here would cost every user of this module (the SQLite connect
    # arguments above are read while Airflow configures itself).
    if name == "LOGGING_CONFIG":
        import copy

        from airflow.config_templates.airflow_local_settings import DEFAULT_LOGGING_CONFIG

        value: Any = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
        value["handlers"]["task"]["class"] = f"{__name__}.LoopbackTaskHandler"
    elif name == "LoopbackTaskHandler":
        from airflow.utils.log.file_task_handler import FileTaskHandler

        class LoopbackTaskHandler(FileTaskHandler):
            """Airflow's file task handler, fetching a worker's served log from the one log server
            on 127.0.0.1 whatever host name the worker recorded (``worker1`` resolves nowhere)."""

            def _get_log_retrieval_url(self, ti: Any, log_relative_path: str, log_type: Any = None) -> Any:
                url, rel = super()._get_log_retrieval_url(ti, log_relative_path, log_type)
                if url:
                    parts = urlsplit(url)
                    url = urlunsplit(parts._replace(netloc=f"{LOOPBACK}:{parts.port}"))
                return url, rel

        value = LoopbackTaskHandler
    else:
        raise AttributeError(name)
    globals()[name] = value
    return value


# The destinations of the example DAGs (dags/examples), after their common prefix.
EXAMPLE_QUEUES = (".one", ".bulk", ".sites", ".events")


def with_destinations(uri: str, destinations: list[str]) -> str:
    """``uri`` with a ``destinations`` query parameter (the connection's extra) naming these."""
    parts = urlsplit(uri)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "destinations"]
    query.append(("destinations", ",".join(destinations)))
    return urlunsplit(parts._replace(query=urlencode(query, safe="/,")))


def serve_logs(port: int, host: str = LOOPBACK) -> None:
    """Serve the task and trigger log files under ``[logging] base_log_folder`` to the API
    server, as ``airflow scheduler`` does, but on ``host`` only."""
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
    conn = sub.add_parser("default-conn", help="the connection URI on stdin, with the examples' destinations")
    conn.add_argument("--queue", required=True, help="the examples' queue prefix (AMQSTREAM_QUEUE)")
    args = ap.parse_args(argv)
    if args.command == "default-conn":
        # On stdin, not the command line: the URI holds the broker's password.
        print(with_destinations(sys.stdin.read().strip(), [args.queue + q for q in EXAMPLE_QUEUES]))
    else:
        serve_logs(args.port, args.host)
    return 0


if __name__ == "__main__":
    sys.exit(main())
