"""scripts/import_cycles.py finds a circle of imports, however long, and only circles."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_circles_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    assert spec and spec.loader
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pkg = tmp_path / "circles_pkg"
    pkg.mkdir()
    modules = {"__init__": "", "a": "from circles_pkg import b\n", "b": "def f():\n    from circles_pkg import c\n",
               "c": "from circles_pkg import a\n", "d": "from circles_pkg import a\n",
               "e": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circles_pkg import d\n",
               "f": "from circles_pkg import e\n"}
    modules["d"] += "from circles_pkg import f\n"
    for name, text in modules.items():
        (pkg / f"{name}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("circles_pkg", cache_dir=None)
    found = sorted(script.cycles(graph))
    # a -> b (in a function) -> c -> a; d -> f -> e (for types only) -> d; d's import of a is no circle.
    assert found == [["circles_pkg.a", "circles_pkg.b", "circles_pkg.c"], ["circles_pkg.d", "circles_pkg.e",
                                                                           "circles_pkg.f"]]
