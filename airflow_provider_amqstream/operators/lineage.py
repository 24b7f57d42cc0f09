"""OpenLineage datasets for what the operators move: files and broker destinations.

Naming (OpenLineage naming spec): a file is namespace ``file://<host>``, name = its
absolute path; a destination is namespace ``amqstream://<broker host>:<port>`` (the first
broker of the connection), name = the destination as written (``/queue/NAME``). The
stream's size travels in the input/output statistics facets, its SHA-256 as the
dataset version.

apache-airflow-providers-openlineage is optional (extra ``openlineage``): everything is
imported inside the functions, which only Airflow's OpenLineage listener calls.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from airflow_provider_amqstream.transport import BrokerParams


def file_namespace(host: str | None = None) -> str:
    return f"file://{host or socket.gethostname()}"


def destination_namespace(params: BrokerParams) -> str:
    host, port = params.hosts[0]
    return f"amqstream://{host}:{port}"


def _dataset(namespace: str, name: str, *, size: int | None, sha256: str | None, role: str) -> Any:
    from openlineage.client.event_v2 import InputDataset, OutputDataset
    from openlineage.client.generated.dataset_version_dataset import DatasetVersionDatasetFacet
    from openlineage.client.generated.input_statistics_input_dataset import InputStatisticsInputDatasetFacet
    from openlineage.client.generated.output_statistics_output_dataset import OutputStatisticsOutputDatasetFacet

    facets = {"version": DatasetVersionDatasetFacet(datasetVersion=sha256)} if sha256 else {}
    if role == "input":
        stats = {"inputStatistics": InputStatisticsInputDatasetFacet(size=size, fileCount=1)} if size is not None \
            else {}
        return InputDataset(namespace=namespace, name=name, facets=facets, inputFacets=stats)
    stats = {"outputStatistics": OutputStatisticsOutputDatasetFacet(size=size, fileCount=1)} if size is not None \
        else {}
    return OutputDataset(namespace=namespace, name=name, facets=facets, outputFacets=stats)


def file_dataset(path: str, *, role: str, size: int | None = None, sha256: str | None = None) -> Any:
    """A local file as an OpenLineage input or output dataset (``role``: input/output)."""
    return _dataset(file_namespace(), str(Path(path).resolve()), size=size, sha256=sha256, role=role)


def transfer_lineage(result: dict[str, Any] | None, params: BrokerParams | None, *, sending: bool) -> Any:
    """``OperatorLineage`` of one send (file -> destination) or receive (destination -> file),
    from the task's result (a ``TransferResult`` as JSON); empty when there is none."""
    from airflow.providers.openlineage.extractors import OperatorLineage

    if not result or params is None or not result.get("path"):
        return OperatorLineage()
    size, sha = result.get("bytes"), result.get("sha256") or None
    dest_ns, dest_name = destination_namespace(params), str(result["destination"])
    if sending:
        return OperatorLineage(inputs=[file_dataset(result["path"], role="input", size=size, sha256=sha)],
                               outputs=[_dataset(dest_ns, dest_name, size=size, sha256=sha, role="output")])
    return OperatorLineage(inputs=[_dataset(dest_ns, dest_name, size=size, sha256=sha, role="input")],
                           outputs=[file_dataset(result["path"], role="output", size=size, sha256=sha)])


def result_of(operator: Any, task_instance: Any) -> dict[str, Any] | None:
    """What the task returned: kept on the operator by the run that just finished, else
    read back from XCom (a deferred task resumes in another operator object)."""
    kept = getattr(operator, "_amqstream_result", None)
    if kept is not None:
        return dict(kept)
    if task_instance is None:
        return None
    value = task_instance.xcom_pull(task_ids=task_instance.task_id, key="return_value")
    return dict(value) if isinstance(value, dict) else None
