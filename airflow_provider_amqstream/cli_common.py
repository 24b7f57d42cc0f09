"""What every ``amqstream`` command shares: finding its connection, and logging to stderr.

Here, below both cli.py and cli_streams.py, so neither imports the other for it; like
them it imports nothing at module level that a command does not need.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from airflow_provider_amqstream.transport.params import BrokerParams

CONN_HELP = ("amqstream:// URI, or a connection id looked up in AIRFLOW_CONN_<ID>, then in Airflow's metadata "
             "database (default amqstream_default, else the embedded broker)")


def broker_params(args: argparse.Namespace) -> BrokerParams:
    """``--conn`` is a URI, a connection id, or (default) amqstream_default."""
    from airflow_provider_amqstream.hooks.connection import resolve

    params, source = resolve(args.conn)
    if "airflow" in sys.modules:
        # Airflow's import configures logging to stdout: take it back for --json.
        setup_logging(args.verbose)
    if source.startswith("the embedded broker") and not getattr(args, "quiet", False):
        print(f"amqstream: using {source} at {params.url}", file=sys.stderr)
    logging.getLogger("airflow_provider_amqstream.cli").info("connection from %s: %s", source, params.url)
    return params


def setup_logging(verbose: bool) -> None:
    """Logs to stderr (stdout is for ``--json``); stomp.py's only with ``-v``."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not verbose:
        logging.getLogger("stomp.py").setLevel(logging.CRITICAL)
