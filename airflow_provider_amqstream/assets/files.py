"""Directories as assets: where a receive lands its files, where Spark writes its Parquet.

A directory is ``file://`` + its absolute path, with no host part (Airflow's own ``file``
scheme, whose OpenLineage dataset is namespace ``file``, name = the path): the host a task
happened to run on (``vm``) would make a new asset per worker and name nothing a user can
browse. The lineage of the operators names files the same way
(:mod:`airflow_provider_amqstream.operators.lineage`).

A templated directory (``/data/in/{{ ds }}``) is one asset, its part before the first
template (``/data/in``): a run's dated subdirectory is where that run's files went, said
in the event's extra, not a new asset every day.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_NAMESPACE = "file"


def static_root(path_template: str) -> str:
    """The part of a (possibly templated) directory before its first templated component.

    ``/data/in/{{ ds }}/x`` gives ``/data/in``; a path without a template is itself; one
    with nothing fixed before its template (``{{ params.out_dir }}``, ``/{{ x }}``) gives
    ``""``: only the rendered path can say which directory it is."""
    cut = min((i for i in (path_template.find("{{"), path_template.find("{%")) if i >= 0), default=-1)
    if cut < 0:
        return path_template.rstrip("/") or "/"
    head = path_template[:cut]
    # A template inside a component (/data/in-{{ ds }}) makes that whole component vary.
    root = head.rstrip("/") if head.endswith("/") else os.path.dirname(head)
    return root if root.strip("/") else ""


def absolute(path: str | os.PathLike[str]) -> str:
    """The absolute, symlink-free form of ``path`` (it need not exist), as lineage names it."""
    return str(Path(path).expanduser().resolve())


def dir_uri(path: str | os.PathLike[str]) -> str:
    """``file:///abs/path`` of a local directory."""
    return f"file://{absolute(path)}"
