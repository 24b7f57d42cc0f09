"""Fail when a module of the package imports another that imports it back, directly or round a
longer circle (run by `make lint` and scripts/test.sh).

import-linter's contracts cannot say this: `acyclic_siblings` squashes each package into one
node, so two modules of engine/ that never import each other count as a cycle as soon as
engine/ and exceptions.py touch both ways. Here every module is its own node, and every import
counts: at module level, inside a function, or under ``if TYPE_CHECKING`` (a circle that only
the type checker follows still ties the two modules' designs together).
"""

from __future__ import annotations

import sys
from pathlib import Path

import grimp

PACKAGE = "airflow_provider_amqstream"


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each set of modules that all reach one another through imports (more than one module).

    :param graph: the package's import graph.
    """
    found: dict[frozenset[str], list[str]] = {}
    for module in sorted(graph.modules):
        circle = graph.find_upstream_modules(module) & graph.find_downstream_modules(module)
        if circle:
            found.setdefault(frozenset(circle | {module}), sorted(circle | {module}))
    return list(found.values())


def describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """Each import inside the circle, with its line, so the reader sees which one to move."""
    lines = [f"import cycle between {', '.join(component)}:"]
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & set(component)):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer}:{detail['line_number']}: {detail['line_contents']}")
    return "\n".join(lines)


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    found = cycles(graph)
    bad = found
    for component in bad:
        print(describe(graph, component), file=sys.stderr)
    if bad:
        print(f"import_cycles: {len(bad)} import cycle(s) in {PACKAGE}: move what both sides need into the "
              "module that owns it, or into a lower one", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
