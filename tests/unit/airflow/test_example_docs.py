"""The examples explain themselves in the UI: every DAG has a description
and docs (doc_md), every trigger parameter a description; the provider's documentation URL
exists. The deployment test reads the same through the REST API of a running Airflow."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from tests.helpers import ROOT


def _example_dags() -> dict[str, object]:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=ROOT / "dags" / "examples")
    assert bag.import_errors == {}
    return {dag_id: dag for dag_id, dag in bag.dags.items() if dag_id.startswith("amqstream_")}


def test_every_example_has_a_description_docs_and_described_params() -> None:
    dags = _example_dags()
    assert len(dags) == 5, sorted(dags)
    for dag_id, dag in dags.items():
        assert dag.description and len(dag.description) < 120, dag_id  # one line in the DAG list
        doc = dag.doc_md or ""
        assert doc.lstrip().startswith("###") and "**Run it:**" in doc, dag_id
        assert str(ROOT / "README.md") in doc, dag_id
        for name, param in dag.params.items():
            assert param.description, f"{dag_id}: param {name} has no description"
    one = dags["amqstream_one_file"].params
    assert set(one) == {"path", "rows"} and one.get_param("rows").schema["minimum"] == 1
    assert dags["amqstream_event_driven"].params.get_param("stream_ids").schema["type"] == "array"


def test_the_provider_documentation_url_is_the_projects_web_address() -> None:
    """The Documentation project URL (what Airflow's Providers page links the provider to;
    without one it links to an apache.org page that does not exist) is a web address a
    browser opens from the page, not a file: path, and the installed package carries it."""
    from importlib.metadata import distribution

    import tomllib

    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    assert urlsplit(urls["Homepage"]).scheme == "https", urls
    assert urls["Documentation"].startswith(urls["Homepage"]), urls
    installed = dict(u.split(", ", 1) for u in distribution("airflow-provider-amqstream").metadata.get_all(
        "Project-URL") or [])
    assert installed.get("Documentation") == urls["Documentation"], "reinstall: make setup"


def test_every_example_spark_application_is_named_alike() -> None:
    """Amqstream:<dag>.<task> for all (example 4's was SparkSubmitOperator's
    default, arrow-spark)."""
    from airflow_provider_amqstream.operators.spark import APP_NAME, QuietSparkSubmitOperator

    spark_tasks = 0
    for dag in _example_dags().values():
        for task in dag.tasks:
            cls = getattr(task, "operator_class", type(task))  # a mapped task names its class
            if "SparkSubmit" not in "".join(c.__name__ for c in getattr(cls, "__mro__", ())):
                continue
            spark_tasks += 1
            assert issubclass(cls, QuietSparkSubmitOperator), (dag.dag_id, task.task_id, cls)
            name = getattr(task, "name", None) or getattr(task, "partial_kwargs", {}).get("name")
            assert name in (None, APP_NAME), (dag.dag_id, task.task_id, name)  # None: set when mapped
    assert spark_tasks == 4


def test_the_readmes_first_dag_builds() -> None:
    """The README's first DAG is what a new user copies: it must match the real signatures."""
    text = (ROOT / "README.md").read_text()
    code = text.split("\n## A DAG\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, object] = {}
    exec(compile(code, str(ROOT / "README.md"), "exec"), scope)
    dag: Any = scope["dag"]
    tasks = {t.task_id: (type(t).__name__, t.downstream_task_ids) for t in dag.tasks}
    assert tasks == {"send": ("SendStreamOperator", {"receive"}), "receive": ("StreamCompleteSensor", {"to_parquet"}),
                     "to_parquet": ("StreamToParquetOperator", set())}
