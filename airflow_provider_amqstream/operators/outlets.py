"""Assets as a user browses them: the destination a send produces and a receive consumes,
the landing directory a receive produces, the Parquet a Spark hand-off writes.

- A destination is ``amqstream://<broker host>:<port>/queue/NAME``. The broker is the
  connection's, known only when the task runs (hooks never read it at parse time), so the
  sending task declares an ``AssetAlias`` (:func:`destination_alias`) as its outlet and,
  once its files are confirmed, attaches the event to the destination's asset; the
  receiving task declares the same alias as its inlet.
- A landing directory is ``file:///abs/out_dir`` (:mod:`~airflow_provider_amqstream.assets.files`),
  one asset per directory (a templated one is its static root: ``{{ ds }}`` subdirectories
  are where a run's files went, said in the extra). It is also attached through an alias,
  because only real arrivals make an event: a receive that got nothing, or only repeats of
  streams published before (status ``duplicate``), emits none, which a static outlet cannot
  do (Airflow records an event for every static outlet of a successful task).
- The extra of an event is bounded: counts and bytes, the manifest's path, at most
  :data:`MAX_IDS` stream ids; never a list per file.

The operators feed :class:`Arrivals` one received stream at a time (:meth:`Arrivals.add`),
so what they keep does not grow with the number of files.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_amqstream.assets.amqstream import destination_uri
from airflow_provider_amqstream.assets.files import absolute, dir_uri, static_root

MAX_IDS = 10


def destination_alias_name(conn_id: str, destination: str, task_id: str) -> str:
    """The alias of a destination's asset: the same for every task that sends to it or
    receives from it through that connection (a templated destination: per task).

    :param conn_id: the ``amqstream`` connection id.
    :param destination: ``/queue/NAME`` as written in the DAG (unrendered).
    :param task_id: the task, for a templated destination.
    """
    if "{{" in destination or "{%" in destination:
        return f"amqstream:{conn_id}:task:{task_id}"
    return f"amqstream:{conn_id}:{destination}"


def destination_alias(conn_id: str, destination: str, task_id: str = "") -> Any:
    """The ``AssetAlias`` a send declares as outlet and a receive as inlet (see
    :func:`destination_alias_name`)."""
    from airflow.sdk import AssetAlias

    return AssetAlias(name=destination_alias_name(conn_id, destination, task_id))


def landing_alias_name(out_dir: str, task: Any = None) -> str:
    """The alias of a landing directory's asset: named by the directory's static root, or
    by the task when the whole directory is templated.

    :param out_dir: the receive's ``out_dir`` as written in the DAG (unrendered).
    :param task: the receiving task (for a wholly templated ``out_dir``).
    """
    root = static_root(out_dir)
    if root:
        return f"amqstream:landing:{root}"
    return f"amqstream:landing:task:{getattr(task, 'dag_id', None) or ''}.{getattr(task, 'task_id', '')}"


def alias_outlet(name: str) -> Any:
    """An ``AssetAlias`` of this name."""
    from airflow.sdk import AssetAlias

    return AssetAlias(name=name)


def with_alias(ports: Any, alias: Any) -> list[Any]:
    """``ports`` (a task's inlets or outlets) with ``alias`` added once: a mapped task's
    ``partial(outlets=...)`` declares it for the DAG, and its ``__init__`` runs again when
    the task runs."""
    ports = list(ports or [])
    if not any(getattr(p, "name", None) == alias.name and type(p) is type(alias) for p in ports):
        ports.append(alias)
    return ports


def parquet_asset(output_dir: str) -> Any:
    """The ``Asset`` of a Spark hand-off's output: ``file://`` + the static root of
    ``output_dir`` (the datasets of every stream, or of every batch, under it); None when
    the whole directory is templated (no asset can be declared before it is rendered).

    :param output_dir: the operator's ``output_dir`` as written in the DAG.
    """
    from airflow.sdk import Asset

    root = static_root(output_dir)
    return Asset(uri=dir_uri(root)) if root else None


@dataclass
class Arrivals:
    """What a receive brought in, for its asset event: counts and bytes, and the first few
    stream ids. Fed one stream at a time; its size does not grow with the number of files.
    A stream of status ``duplicate`` (published before, repeated) is counted apart and is
    no arrival."""

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
        """The arrivals among ``results``."""
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


def emit(context: Any, alias_name: str, uri: str, extra: dict[str, Any], log: logging.Logger) -> bool:
    """Attach one event for the asset ``uri``, with ``extra``, to the task's outlet alias
    ``alias_name``; False (logged) where the context has no outlet events (a task run
    outside Airflow's task runner).

    :param context: the task's context.
    :param alias_name: an ``AssetAlias`` the task declared as outlet.
    :param uri: the asset's URI.
    :param extra: the event's extra (small: see :class:`Arrivals`).
    :param log: the task's logger.
    """
    from airflow.sdk import Asset

    events = context.get("outlet_events") if hasattr(context, "get") else None
    if events is None:
        log.warning("no outlet events in this context: the asset event for %s (alias %s) was not emitted",
                    uri, alias_name)
        return False
    events[alias_outlet(alias_name)].add(Asset(uri=uri), extra=extra)
    log.info("asset event for %s: %s", uri, _brief(extra))
    return True


def emit_landing(context: Any, alias_name: str, root: str, arrivals: Arrivals, log: logging.Logger, *,
                 out_dir: str, manifest: str | None = None, batch_id: str | None = None) -> bool:
    """The landing directory's event, when anything arrived (nothing, or only repeats:
    no event, logged).

    :param context: the task's context.
    :param alias_name: the task's landing alias (:func:`landing_alias_name`, or the user's).
    :param root: the asset's directory: the static root of the task's ``out_dir`` template
        (:func:`~airflow_provider_amqstream.assets.files.static_root`, taken before rendering);
        ``""`` (all of it templated): the rendered ``out_dir``.
    :param arrivals: what arrived.
    :param log: the task's logger.
    :param out_dir: the rendered ``out_dir``, where this run's files went.
    :param manifest: the batch's manifest, if one was written.
    :param batch_id: the batch waited for, if any.
    """
    uri = dir_uri(root or out_dir)
    if not arrivals.files:
        log.info("no asset event for %s: nothing new arrived (%d repeats of streams received before)",
                 uri, arrivals.duplicates)
        return False
    return emit(context, alias_name, uri, arrivals.extra(out_dir, manifest=manifest, batch_id=batch_id),
                log)


def emit_destination(context: Any, alias_name: str, destination: str, extra: dict[str, Any],
                     log: logging.Logger, *, host: str, port: int) -> bool:
    """The destination's event (``amqstream://host:port/queue/NAME``) after a send.

    :param context: the task's context.
    :param alias_name: the task's destination alias (:func:`destination_alias_name`).
    :param destination: the rendered destination.
    :param extra: what was sent (small).
    :param log: the task's logger.
    :param host: the connection's (first) broker host.
    :param port: its port.
    """
    return emit(context, alias_name, destination_uri(host, port, destination), extra, log)


def sent_extra(result: Mapping[str, Any]) -> dict[str, Any] | None:
    """The extra of a send's destination event, from the task's result (one file's
    ``TransferResult`` JSON, or a batch's ``{"files", "totals"}``); None when nothing was sent.

    :param result: the send task's return value.
    """
    totals = result.get("totals")
    if isinstance(totals, Mapping):
        if not totals.get("files_sent") and not totals.get("files_already_sent"):
            return None
        return {k: totals.get(k) for k in ("batch_id", "files", "files_sent", "files_already_sent", "bytes")}
    return {k: result.get(k) for k in ("stream_id", "name", "bytes", "sha256", "mode", "status")}


def _brief(extra: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={extra[k]}" for k in ("files", "bytes", "stream_id", "batch_id", "manifest", "out_dir")
                     if extra.get(k) is not None)

