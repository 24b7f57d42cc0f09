"""Build-time setting pyproject.toml cannot hold: where setuptools writes its egg-info.

Left alone, an editable install writes the package's egg-info directory into the
checkout. Wherever the checkout is on ``sys.path`` (``python -m`` or ``-c`` run from it, the
tests' ``PYTHONPATH``), Python then finds the distribution twice, with its ``airflow.plugins``
entry point twice: Airflow reports the second as "Plugin 'amqstream_streams' already
registered", and the Task SDK (1.3.2) stops reading plugins at that name, so every plugin
after it, OpenLineage's listener among them, is missing from task processes: no task events.
Under ``build/`` (not on any path) it is found once.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

BUILD = Path(__file__).resolve().parent / "build"
BUILD.mkdir(exist_ok=True)
setup(options={"egg_info": {"egg_base": str(BUILD)}})
