"""Assets as a user browses them: the destination a send produces and a receive consumes,
the landing directory a receive produces (and Spark consumes), the Parquet a Spark hand-off
writes. Each is one asset, declared when the DAG is parsed, so Airflow's asset graph draws
send -> destination -> receive -> landing directory -> Spark -> Parquet and the asset pages
list their producing and consuming tasks.

- A destination is ``amqstream://<connection id>/queue/NAME``
  (:mod:`~airflow_provider_amqstream.assets.amqstream`): nameable at parse time, and the same
  asset whatever port or host the connection's broker has today.
- A landing directory is ``file:///abs/out_dir`` (:mod:`~airflow_provider_amqstream.assets.files`),
  one asset per directory (a templated one is its static root: ``{{ ds }}`` subdirectories
  are where a run's files went, said in the extra).
- Only a real arrival makes an event: a send of nothing, or a receive that got only repeats
  of streams published before (status ``duplicate``), emits none. Airflow records an event
  for every static outlet of a task that succeeds, from the task's ``outlets`` when it ends,
  so such a run takes its asset out of them (:func:`emit`).
- What no DAG can name before it runs goes through an ``AssetAlias``, resolved at run time,
  which Airflow 3.3 draws as an alias with no producing or consuming task: a templated
  destination (alias per task), a wholly templated ``out_dir`` (``{{ params.out_dir }}``) and
  a user's ``file_asset_alias``.
- The extra of an event is bounded: counts and bytes, the manifest's path, at most
  :data:`MAX_IDS` stream ids; never a list per file.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from airflow_provider_amqstream.assets.amqstream import destination_uri
from airflow_provider_amqstream.assets.files import absolute, dir_uri, static_root

if TYPE_CHECKING:
    from airflow_provider_amqstream.operators.progress import TaskLog

MAX_IDS = 10


def destination_asset(conn_id: str, destination: str) -> Any:
    """The ``Asset`` of ``destination`` through connection ``conn_id``
    (``amqstream://<conn id>/queue/NAME``), e.g. for a DAG scheduled on it."""
    from airflow.sdk import Asset

    return Asset(uri=destination_uri(conn_id, destination))


def destination_port(conn_id: str, destination: str, task_id: str) -> Any:
    """What a send declares as outlet and a receive as inlet for its destination: its
    ``Asset``, or for a templated destination an ``AssetAlias`` of the task."""
    from airflow.sdk import AssetAlias

    if "{{" in destination or "{%" in destination:
        return AssetAlias(name=f"amqstream:{conn_id}:task:{task_id}")
    return destination_asset(conn_id, destination)


def directory_asset(path_template: str) -> Any:
    """The ``Asset`` of a directory: ``file://`` + the static root of ``path_template`` (a
    landing directory, the datasets of every stream under a Parquet directory); None when the
    whole directory is templated (no asset can be named before it is rendered)."""
    from airflow.sdk import Asset

    root = static_root(path_template)
    return Asset(uri=dir_uri(root)) if root else None


def landing_port(out_dir: str, task: Any, alias: str | None = None) -> Any:
    """What a receive declares as outlet for its landing directory: its ``Asset``, or an
    ``AssetAlias`` (``alias``, else one per task when ``out_dir`` is wholly templated)."""
    from airflow.sdk import AssetAlias

    asset = None if alias else directory_asset(out_dir)
    if asset is not None:
        return asset
    return AssetAlias(name=alias or f"amqstream:landing:task:{getattr(task, 'dag_id', None) or ''}."
                                    f"{getattr(task, 'task_id', '')}")


def with_port(ports: Any, port: Any) -> list[Any]:
    """``ports`` (a task's inlets or outlets) with ``port`` (an asset or alias) added once: a
    mapped task's ``partial(outlets=...)`` declares it for the DAG, and its ``__init__`` runs
    again when the task runs."""
    out: list[Any] = list(ports or [])
    if port not in out:
        out.append(port)
    return out


@dataclass
class Arrivals:
    """What a receive brought in, for its asset event, fed one stream at a time: counts and
    bytes, the first few stream ids; a ``duplicate`` (published before) is no arrival."""

    files: int = 0
    bytes: int = 0
    duplicates: int = 0
    stream_ids: list[str] = field(default_factory=list)
    first: dict[str, Any] | None = None

    def add(self, result: Mapping[str, Any]) -> None:
        """Count one received stream (a ``TransferResult.to_json()`` dict)."""
        if result.get("status") == "duplicate" or not result.get("path"):
            self.duplicates += 1
            return
        self.files += 1
        self.bytes += int(result.get("bytes") or 0)
        if len(self.stream_ids) < MAX_IDS:
            self.stream_ids.append(str(result.get("stream_id")))
        if self.first is None:
            self.first = {k: result.get(k) for k in ("stream_id", "name", "path", "bytes", "sha256")}

    @classmethod
    def of(cls, results: Iterable[Mapping[str, Any]]) -> Arrivals:
        out = cls()
        for r in results:
            out.add(r)
        return out

    def extra(self, out_dir: str, *, manifest: str | None = None, batch_id: str | None = None) -> dict[str, Any]:
        """The event's extra: where the files went (the rendered ``out_dir``), how many, how
        many bytes, the manifest, and for one file its stream id, path and SHA-256."""
        extra: dict[str, Any] = {"out_dir": absolute(out_dir), "files": self.files, "bytes": self.bytes,
                                 "stream_ids": self.stream_ids}
        if self.files > len(self.stream_ids):
            extra["stream_ids_truncated"] = True
        if self.duplicates:
            extra["duplicates"] = self.duplicates
        if manifest:
            extra["manifest"] = manifest
        if batch_id:
            extra["batch_id"] = batch_id
        if self.files == 1 and self.first is not None:
            extra.update({k: v for k, v in self.first.items() if k in ("stream_id", "path", "sha256")})
        return extra


def emit(context: Any, task: Any, port: Any, uri: str, extra: dict[str, Any] | None, log: TaskLog) -> bool:
    """The event of the asset ``uri`` with ``extra``, through the task's outlet ``port`` (the
    asset itself, or an alias); ``extra`` None: no event, the asset taken out of the task's
    outlets (Airflow would record one for it). False (logged) when no event was made.
    """
    from airflow.sdk import Asset

    if extra is None:
        task.outlets = [o for o in task.outlets if o != port]
        return False
    events = context.get("outlet_events") if hasattr(context, "get") else None
    if events is None:
        log.warning("no outlet events in this context: the asset event for %s was not emitted", uri)
        return False
    if isinstance(port, Asset):
        events[port].extra = extra
    else:
        events[port].add(Asset(uri=uri), extra=extra)
    shown = ", ".join(f"{k}={extra[k]}" for k in ("files", "bytes", "stream_id", "batch_id", "manifest", "out_dir")
                      if extra.get(k) is not None)
    log.info("asset event for %s: %s", uri, shown)
    return True


def sent_extra(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The extra of a send's destination event, from the task's result (one file's
    ``TransferResult`` JSON, or a batch's ``{"files", "totals"}``); None when nothing was sent."""
    totals = result.get("totals")
    if isinstance(totals, Mapping):
        if not totals.get("files_sent") and not totals.get("files_already_sent"):
            return None
        return {k: totals.get(k) for k in ("batch_id", "files", "files_sent", "files_already_sent", "bytes")}
    return {k: result.get(k) for k in ("stream_id", "name", "bytes", "sha256", "mode", "status")}

