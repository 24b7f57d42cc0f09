"""Build-time metadata that pyproject.toml cannot hold: the documentation URL.

Airflow's Providers page links a provider's name to the ``Documentation`` project URL of its
distribution (and, without one, to an apache.org page that does not exist for this
provider). The project has no public home, so the URL is the README of the checkout the
package is built from, as a ``file:`` URL: right for the editable install ``make`` makes.
pyproject.toml's ``[project.urls]`` takes only absolute URLs with a host, fixed in the file.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup

setup(project_urls={"Documentation": (Path(__file__).resolve().parent / "README.md").as_uri()})
