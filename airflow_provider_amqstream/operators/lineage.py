"""OpenLineage datasets for what the operators move: files and broker destinations.

Naming: a file is namespace ``file``, name = its absolute path, which is how Airflow
turns a ``file:///path`` asset into an OpenLineage dataset (the ``file`` asset scheme); a
destination is namespace ``amqstream://<broker host>:<port>`` (the first broker of the
connection, host lower-cased), name = the destination (``/queue/NAME``). So a dataset here
and the asset the task emits (:mod:`~airflow_provider_amqstream.operators.outlets`) name the
same thing: ``file:///data/in`` is namespace ``file``, name ``/data/in``;
``amqstream://mq1:61613/queue/in`` is namespace ``amqstream://mq1:61613``, name ``/queue/in``.
No host in a file's name: the worker a task ran on (``vm``) is not part of what the file is. The
stream's size travels in the input/output statistics facets, its SHA-256 as the
dataset version. A many-file send lists each file up to ``MAX_FILE_DATASETS``; past that,
one dataset for the files' common directory with their count and total size, so one task's
event stays small when it moves a landing directory of thousands of files.

apache-airflow-providers-openlineage is optional (extra ``openlineage``): everything from it
is imported inside the functions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from airflow_provider_amqstream.assets.amqstream import authority
from airflow_provider_amqstream.assets.files import FILE_NAMESPACE
from airflow_provider_amqstream.hooks.amqstream import AmqStreamHook, BrokerParams
from airflow_provider_amqstream.operators.xcom import iter_result_files

MAX_FILE_DATASETS = 100


def _dataset(namespace: str, name: str, *, size: int | None, sha256: str | None, role: str,
             file_count: int = 1) -> Any:
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.generated.base import DatasetFacet, InputDatasetFacet, OutputDatasetFacet
    from openlineage.client.generated.dataset_version_dataset import DatasetVersionDatasetFacet
    from openlineage.client.generated.input_statistics_input_dataset import InputStatisticsInputDatasetFacet
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    facets: dict[str, DatasetFacet] = {"version": DatasetVersionDatasetFacet(datasetVersion=sha256)} if sha256 else {}
    if role == "input":
        inputs: dict[str, InputDatasetFacet] = {} if size is None else {
            "inputStatistics": InputStatisticsInputDatasetFacet(size=size, fileCount=file_count)}
        return InputDataset(namespace=namespace, name=name, facets=facets, inputFacets=inputs)
    outputs: dict[str, OutputDatasetFacet] = {} if size is None else {
        "outputStatistics": OutputStatisticsOutputDatasetFacet(size=size, fileCount=file_count)}
    return OutputDataset(namespace=namespace, name=name, facets=facets, outputFacets=outputs)


def file_dataset(path: str, *, role: str, size: int | None = None, sha256: str | None = None) -> Any:
    """A local file as an OpenLineage input or output dataset (``role``: input/output)."""
    return _dataset(FILE_NAMESPACE, str(Path(path).resolve()), size=size, sha256=sha256, role=role)


def destination_dataset(params: BrokerParams, destination: str, *, role: str, size: int | None = None,
                        sha256: str | None = None, file_count: int = 1) -> Any:
    """A broker destination as an OpenLineage input or output dataset."""
    return _dataset(authority(*params.hosts[0]), destination, size=size, sha256=sha256, role=role,
                    file_count=file_count)


def batch_lineage(result: dict[str, Any] | None, params: BrokerParams | None, *, sending: bool = True) -> Any:
    """``OperatorLineage`` of a task's result, one file's ``TransferResult`` as JSON or many
    (``{"files": ...}``): sent, its files (or their common directory) went to the destination;
    received, the destination became them. Files moved by an earlier try count, as the task
    moved them; one file's SHA-256 versions the destination too."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    if not result or params is None:
        return OperatorLineage()
    one = "files" not in result
    # Read once, a file at a time (a batch past MAX_XCOM_FILES is read from its files list):
    # the first MAX_FILE_DATASETS kept, then only their count, bytes and common directory.
    first: list[dict[str, Any]] = []
    count = total = 0
    root: str | None = None
    for f in [result] if one else iter_result_files(result):
        if not f.get("path"):
            continue
        count += 1
        total += int(f.get("bytes") or 0)
        parent = str(Path(f["path"]).resolve().parent)
        root = parent if root is None else os.path.commonpath([root, parent])
        if len(first) <= MAX_FILE_DATASETS:
            first.append(f)
    if not count:
        return OperatorLineage()
    file_role, dest_role = ("input", "output") if sending else ("output", "input")
    dest = destination_dataset(params, str(first[0]["destination"]), role=dest_role, size=total, file_count=count,
                               sha256=result.get("sha256") or None if one else None)
    if count <= MAX_FILE_DATASETS:
        local = [file_dataset(f["path"], role=file_role, size=f.get("bytes"), sha256=f.get("sha256") or None)
                 for f in first]
    else:
        local = [_dataset(FILE_NAMESPACE, root or "/", size=total, sha256=None, role=file_role, file_count=count)]
    if sending:
        return OperatorLineage(inputs=local, outputs=[dest])
    return OperatorLineage(inputs=[dest], outputs=local)


class ReportsLineage:
    """The OpenLineage facet methods (called by name by Airflow's OpenLineage listener) of a
    task that moves files to or from the destination its ``lineage_destination_field`` names,
    sending them if ``lineage_sending``; the broker is read then, never at DAG parse time."""

    amqstream_conn_id: str
    lineage_sending: ClassVar[bool]
    lineage_destination_field: ClassVar[str]

    def lineage_start_path(self) -> str | None:
        """The file a send reads, when known before it starts (None: not known yet)."""
        return None

    def get_openlineage_facets_on_start(self) -> Any:
        """Lineage known before anything moves: the destination, and the file when a send's
        ``path`` names one file."""
        from airflow.providers.openlineage.extractors import OperatorLineage

        params = AmqStreamHook(self.amqstream_conn_id).broker_params()
        dest = destination_dataset(params, getattr(self, self.lineage_destination_field),
                                   role="output" if self.lineage_sending else "input")
        if not self.lineage_sending:
            return OperatorLineage(inputs=[dest])
        path = self.lineage_start_path()
        return OperatorLineage(inputs=[file_dataset(path, role="input")] if path else [], outputs=[dest])

    def get_openlineage_facets_on_complete(self, task_instance: Any) -> Any:
        # What the task returned: kept on the operator by the run that just finished, else
        # read back from XCom (a deferred task resumes in another operator object).
        result = getattr(self, "_amqstream_result", None)
        if result is None and task_instance is not None:
            result = task_instance.xcom_pull(task_ids=task_instance.task_id, key="return_value")
        params = AmqStreamHook(self.amqstream_conn_id).broker_params()
        return batch_lineage(dict(result) if isinstance(result, dict) else None, params, sending=self.lineage_sending)
