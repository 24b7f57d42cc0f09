"""Fixtures: real ActiveMQ brokers started for the tests and stopped after them."""

from __future__ import annotations

import atexit
import base64
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from airflow_provider_amqstream.broker.embedded import EmbeddedBroker
from airflow_provider_amqstream.transport.params import BrokerParams
from tests import spark_cds
from tests.helpers import HeldProxy, running_broker

# Airflow reads its settings on first import (none of the imports above import it):
# give the tests a private home first.
ROOT = Path(__file__).resolve().parents[1]
if "AIRFLOW_HOME" not in os.environ:
    # A plain `pytest` run: a home of its own, removed when it ends (scripts/test.sh sets one
    # for its three sessions, and xdist workers inherit the controller's).
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="amqs-airflow-")
    atexit.register(shutil.rmtree, os.environ["AIRFLOW_HOME"], ignore_errors=True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel workers (scripts/test.sh): one SQLite metadata DB each, or their migrations collide.
    os.environ["AIRFLOW_HOME"] = os.path.join(os.environ["AIRFLOW_HOME"], os.environ["PYTEST_XDIST_WORKER"])
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags" / "examples")
# One Fernet key for every Airflow process on these metadata DBs: without it, the first child
# (a DAG loaded in a subprocess) writes an airflow.cfg with a key of its own, encrypts the
# example's asset triggers with it, and this process, which read no key, then fails to decrypt
# them. Derived from the Airflow home, not random: scripts/test.sh runs three pytest sessions
# on the same home, and each must read what the one before wrote. A throwaway test DB's key.
os.environ.setdefault("AIRFLOW__CORE__FERNET_KEY", base64.urlsafe_b64encode(
    hashlib.sha256(os.environ["AIRFLOW_HOME"].encode()).digest()).decode())
# The examples' shared settings live beside them (example_support.py), as Airflow finds them.
sys.path.insert(0, str(ROOT / "dags" / "examples"))
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # spark-submit, airflow
# Spark drivers started by tests (dag.test(), deployments, the lineage tests) compile with C1
# only, collect with the serial collector and map their classes from an archive made once per
# machine: a short conversion then costs about a third of the CPU (tests/spark_cds.py,
# docs/decisions/test-suite-time.md), and the system part is CPU-bound. Users' jobs keep
# Spark's defaults.
spark_cds.configure()


logging.getLogger("stomp.py").setLevel(logging.CRITICAL)

# scripts/test.sh runs the suite in three parts. Most tests wait on a broker, not on a core:
# five parallel workers. System tests (tests/system: a whole deployment, Spark, several
# brokers) are `serial`: three files at a time, each file in one worker with its module's
# deployment. Tests that assert time bounds, or heap bounds under load they make, are
# `quiet`: last, with none of the other parts beside them, each file in a worker of its own
# (together they keep about half of the two cores busy, and mostly wait). A heap bound on a
# quiet broker of the test's own is not `quiet`.
_QUIET_FILES = {"test_hostile_scale.py", "test_late_broker.py", "test_broker_memory.py",
                # the API server must answer within 2 s while a broker hangs
                "test_streams_ui.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath))
        if path.name in _QUIET_FILES:
            item.add_marker(pytest.mark.quiet)
        elif path.parent.name == "system":
            item.add_marker(pytest.mark.serial)


def _params(broker: EmbeddedBroker) -> BrokerParams:
    info = broker.info()
    return BrokerParams(hosts=((info.host, info.port),), login=info.user, password=info.password,
                        connect_timeout=10.0, receipt_timeout=30.0)


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One authenticated broker for the session (tests use their own queue names)."""
    yield from running_broker(tmp_path_factory.mktemp("broker"))


@pytest.fixture
def private_broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A broker this test may kill and restart."""
    yield from running_broker(tmp_path / "broker")


@pytest.fixture
def params(broker: EmbeddedBroker) -> BrokerParams:
    return _params(broker)


@pytest.fixture
def uri(broker: EmbeddedBroker) -> str:
    return broker.info().uri


@pytest.fixture
def queue_name(request: pytest.FixtureRequest) -> str:
    """A destination no other test uses."""
    safe = "".join(c if c.isalnum() else "_" for c in request.node.name)[:48]
    # Cut names of parametrized cases can agree; the digest of the full id cannot.
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    return f"/queue/t.{safe}.{digest}.{os.getpid()}"


@pytest.fixture(scope="session")
def airflow_db() -> Path:
    """A migrated SQLite metadata DB in the private AIRFLOW_HOME."""
    home = Path(os.environ["AIRFLOW_HOME"])
    subprocess.run([sys.executable, "-m", "airflow", "db", "migrate"], check=True, capture_output=True,
                   timeout=300)
    return home / "airflow.db"


@pytest.fixture(autouse=True)
def _state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AMQSTREAM_STATE_DIR", str(tmp_path / "send-state"))


@pytest.fixture
def held_proxy() -> Iterator[Callable[..., HeldProxy]]:
    """Makes :class:`~tests.helpers.HeldProxy` proxies (same arguments), closed when the test ends."""
    made: list[HeldProxy] = []

    def make(port: int, budget: int, *, to_broker: bool = True) -> HeldProxy:
        made.append(HeldProxy(port, budget, to_broker=to_broker))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()
