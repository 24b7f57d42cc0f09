"""airflow-provider-amqstream: move files of any size through Apache ActiveMQ over STOMP."""

from __future__ import annotations

__version__ = "0.1.0"
