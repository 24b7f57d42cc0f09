"""The docs, comments and docstrings name modules that exist.

Modules get split and renamed; the prose that points at them is not checked by anything else,
and a newcomer who follows a name to a file that is not there stops trusting the rest. Two
spellings are checked in every text file of the repository: a file name ending in ``.py``
(``receive/session.py``: a tracked path ending so; ``session.py``: some module of that name)
and a dotted name under the package (``airflow_provider_amqstream.engine.store.RecordStore``:
the module, then a name it defines, then a name that class defines).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "airflow_provider_amqstream"
SCANNED = ["README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "setup.py", ".ci", "docs", PACKAGE, "tests",
           "scripts", "benchmarks", "dags"]
TEXT = {".py", ".md", ".sh", ".toml", ".tmpl", ".xml", ".html", ".properties", ".java", ".cfg", ".txt", ".ini", ""}
SKIPPED_DIRS = {"__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
# Names that are not files of ours, each with why.
NOT_OURS = {
    "stomp.py": "the STOMP client library",
    "bench_bulk.py": "the DAG file benchmarks/bulk.py writes into a scratch Airflow",
}
PY_NAME = re.compile(r"(?<![\w.-])((?:\.{0,2}/)?(?:[\w-]+/)*[\w-]+\.py)\b(?![\w-])")
DOTTED = re.compile(rf"(?<![\w.]){PACKAGE}(?:\.[A-Za-z_]\w*)+")


def text_files() -> list[Path]:
    found = []
    for name in SCANNED:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*")) if top.is_dir() else []
        for path in paths:
            if (path.is_file() and path.suffix in TEXT
                    and not SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts)):
                found.append(path)
    return found


@cache
def repo_paths() -> frozenset[str]:
    return frozenset(p.relative_to(ROOT).as_posix() for p in text_files())


@cache
def module_names() -> frozenset[str]:
    return frozenset(p.rsplit("/", 1)[-1] for p in repo_paths() if p.endswith(".py"))


def py_name_exists(name: str) -> bool:
    if name in NOT_OURS:
        return True
    if "/" not in name:
        return name in module_names()
    tail = name.lstrip("./")
    return any(p == tail or p.endswith("/" + tail) for p in repo_paths())


@cache
def defined_names(path: Path) -> dict[str, ast.AST]:
    """Top-level names a module defines (also under ``if``/``try``), each with its node."""
    names: dict[str, ast.AST] = {}
    pending: list[ast.stmt] = list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        names[leaf.id] = leaf
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending.extend(node.body)
            pending.extend(getattr(node, "orelse", []))
            pending.extend(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                pending.extend(handler.body)
    return names


def class_names(node: ast.ClassDef) -> set[str]:
    return set(defined_names_of_body(node.body))


def defined_names_of_body(body: list[ast.stmt]) -> list[str]:
    out = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(stmt.name)
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            out.append(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            out += [t.id for t in stmt.targets if isinstance(t, ast.Name)]
    return out


def dotted_name_problem(name: str) -> str | None:
    """None if ``name`` resolves, else what is missing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:cut])
        module = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if module.is_file():
            break
    else:
        return f"no module {parts[0]}"
    rest = parts[cut:]
    if not rest:
        return None
    names = defined_names(module)
    where = ".".join(parts[:cut])
    if rest[0] not in names and "__getattr__" not in names:
        return f"{where} has no module or name {rest[0]!r}"
    node = names.get(rest[0])
    if len(rest) > 1 and isinstance(node, ast.ClassDef) and rest[1] not in class_names(node):
        return f"{where}.{rest[0]} defines no {rest[1]!r}"
    return None


def test_named_modules_exist() -> None:
    stale = []
    for path in text_files():
        if path == Path(__file__).resolve():
            continue  # its examples of names that do not resolve
        text = path.read_text(errors="replace")
        rel = path.relative_to(ROOT).as_posix()
        for line_no, line in enumerate(text.splitlines(), 1):
            for match in PY_NAME.finditer(line):
                word = line[:match.start()].split(" ")[-1]  # a URL's path is someone else's file
                if "://" not in word and not py_name_exists(match.group(1)):
                    stale.append(f"{rel}:{line_no}: {match.group(1)} (no such file)")
            for match in DOTTED.finditer(line):
                problem = dotted_name_problem(match.group(0))
                if problem:
                    stale.append(f"{rel}:{line_no}: {match.group(0)} ({problem})")
    assert not stale, "names of modules that do not exist:\n" + "\n".join(stale)


@pytest.mark.parametrize(("name", "ok"), [
    ("session.py", True), ("receive/session.py", True), ("engine/receive/session.py", True),
    ("engine/session.py", False), ("no_such_module.py", False), ("stomp.py", True),
])
def test_file_names_resolve(name: str, ok: bool) -> None:
    assert py_name_exists(name) is ok


@pytest.mark.parametrize(("name", "ok"), [
    (f"{PACKAGE}.engine.store", True), (f"{PACKAGE}.engine.store.RecordStore", True),
    (f"{PACKAGE}.engine.store.RecordStore.get_many", True), (f"{PACKAGE}.engine.store.NoSuchName", False),
    (f"{PACKAGE}.engine.store.RecordStore.no_such_method", False), (f"{PACKAGE}.no_such_module.Thing", False),
])
def test_dotted_names_resolve(name: str, ok: bool) -> None:
    assert (dotted_name_problem(name) is None) is ok
