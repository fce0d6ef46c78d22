"""The cache of ``make bench``: a part's result is kept under a key of its command and what its code does.

The key hashes the part's exact command, the versions of Python, torch and Lightning, every file of the
``lightning_hdet`` package, and the benchmark script with every local module it imports (``benchmarks.*``,
``tests.*``, followed transitively) plus the files it runs in subprocesses (``Part.code`` in ``run_all.py``).
A Python file is hashed by its behaviour, not its text: its syntax tree without docstrings (comments, blank
lines and line breaks never reach the tree), so a docstring or comment fix keeps every record while a changed
literal, operator or name invalidates them; any other file is hashed as bytes (:func:`behaviour`). A docstring
read at run time (``argparse``'s ``--help``) changes no number.

A part is skipped when its record has the same key *and* what it wrote is still there unchanged (its results
files, plots and docs blocks, by SHA-256): a table edited by hand, or overwritten by another command, is
regenerated rather than vouched for.

Records are small JSON files (``<part>.json``, ``<part>_quick.json`` for ``--quick``) beside the results they
describe; the full-size ones are committed with those results, so a fresh clone knows which tables its code
produced. Their ``inputs.hashing`` says how files were hashed: a record made with another hashing is stale.
This module only hashes and compares: it runs nothing.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import platform
import re
from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_hdet"
# Top-level packages of the repository whose modules a benchmark may import (hashed file by file).
LOCAL_PACKAGES = ("benchmarks", "tests")
# Outputs a part may write: results files and plots; docs pages are shared, so their blocks are hashed instead.
OUTPUT_PATTERNS = ("*.json", "img/*.png")
# How :func:`behaviour` reads a file, recorded in every key: changing it makes every record stale, saying why.
HASHING = "python files as syntax trees without docstrings, other files as bytes"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """``tree`` with the docstring of its module, classes and functions removed (in place)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                node.body = node.body[1:]
    return tree


def behaviour(path: Path) -> bytes:
    """What of the file at ``path`` can change a result: a Python file's syntax tree without docstrings and
    line numbers (comments and layout are gone once parsed); any other file's bytes."""
    source = path.read_bytes()
    if path.suffix != ".py":
        return source
    try:
        return _syntax(source)
    except SyntaxError as e:
        e.filename = str(path)
        raise


# By content, so never stale: every part's key parses the same package files (~0.8 CPU-s a time otherwise).
@functools.lru_cache(maxsize=None)
def _syntax(source: bytes) -> bytes:
    return ast.dump(_without_docstrings(ast.parse(source)), include_attributes=False).encode()


def local_imports(path: Path, repo: Path = REPO) -> list[Path]:
    """``path`` and the repository modules it imports from :data:`LOCAL_PACKAGES`, transitively, sorted."""
    seen: set[Path] = set()
    todo = [path.resolve()]
    while todo:
        current = todo.pop()
        if current in seen or not current.is_file():
            continue
        seen.add(current)
        for node in ast.walk(ast.parse(current.read_text(), filename=str(current))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                parts = name.split(".")
                if parts[0] in LOCAL_PACKAGES:
                    module = repo.joinpath(*parts)
                    todo += [module.with_suffix(".py"), module / "__init__.py"]
    return sorted(seen)


def package_digest(repo: Path = REPO) -> str:
    """One hash of every file of the package (names and :func:`behaviour`; caches and bytecode left out)."""
    h = hashlib.sha256()
    for f in sorted((repo / PACKAGE).rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            h.update(f.relative_to(repo).as_posix().encode() + b"\0" + behaviour(f) + b"\0")
    return h.hexdigest()


def _version(dist: str) -> str:
    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


def key_inputs(command: list[str], code: Iterable[Path], repo: Path = REPO) -> dict:
    """What a part's result depends on: its command, the library versions and what the code it runs does."""
    files = sorted({f for path in code for f in local_imports(repo / path, repo)})
    return {
        "hashing": HASHING,
        "command": command,
        "python": platform.python_version(),
        "torch": _version("torch"),
        "lightning": _version("lightning"),
        "package": package_digest(repo),
        "code": {_shown(f, repo): sha256(behaviour(f)) for f in files},
    }


def key_of(inputs: dict) -> str:
    return sha256(json.dumps(inputs, sort_keys=True).encode())[:16]


def _shown(path: Path, repo: Path = REPO) -> str:
    """``path`` relative to the repository when inside it (records stay valid in any clone), else absolute."""
    path = path.resolve()
    return path.relative_to(repo).as_posix() if path.is_relative_to(repo) else str(path)


def snapshot(dirs: Iterable[Path]) -> dict[Path, int]:
    """Modification times of the files a part may write under ``dirs``: compared after it ran, they say which
    files it wrote."""
    return {f: f.stat().st_mtime_ns for d in dirs for pattern in OUTPUT_PATTERNS for f in d.glob(pattern)
            if f.is_file()}


# A generated block's markers stand on lines of their own (``update_doc_section`` writes them so); markers quoted
# in prose are not blocks.
BLOCK = re.compile(r"^<!-- BEGIN (?P<name>\S+) -->\n(?P<body>.*?)^<!-- END (?P=name) -->$", re.S | re.M)


def docs_blocks(docs_dir: Path) -> dict[str, str]:
    """Every generated block (``<!-- BEGIN name -->`` ... ``<!-- END name -->``) of the pages under
    ``docs_dir``, by name."""
    return {m["name"]: m["body"] for page in sorted(docs_dir.rglob("*.md")) for m in BLOCK.finditer(page.read_text())}


def outputs_of(written: Iterable[Path], docs_dir: Path, repo: Path = REPO) -> dict[str, dict[str, str]]:
    """Hashes of the files a part wrote and of the docs blocks named after its results files."""
    written = sorted(written)
    blocks = docs_blocks(docs_dir)
    names = {f.stem for f in written if f.suffix == ".json"}
    return {
        "files": {_shown(f, repo): sha256(f.read_bytes()) for f in written},
        "blocks": {name: sha256(blocks[name].encode()) for name in sorted(names & blocks.keys())},
    }


def stale_reason(record: dict | None, inputs: dict, docs_dir: Path, repo: Path = REPO) -> str | None:
    """Why a part must run again (``None``: its cached result stands): no record, other key inputs (named), or
    an output missing or changed since the record was written."""
    if record is None:
        return "never run"
    if record.get("key") != key_of(inputs):
        changed = [k for k, v in inputs.items() if record.get("inputs", {}).get(k) != v]
        return f"changed since it ran: {', '.join(changed) or 'the key'}"
    if "outputs" not in record:
        return "its record does not say what it wrote"
    for shown, digest in record["outputs"]["files"].items():
        path = Path(shown) if Path(shown).is_absolute() else repo / shown
        if not path.is_file() or sha256(path.read_bytes()) != digest:
            return f"{shown} is missing or changed since it ran"
    blocks = docs_blocks(docs_dir)
    for name, digest in record["outputs"]["blocks"].items():
        if name not in blocks or sha256(blocks[name].encode()) != digest:
            return f"its docs block {name!r} is missing or changed since it ran"
    return None


def read_record(path: Path) -> dict | None:
    """The record at ``path``; ``None`` when absent or unreadable (the part then runs)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_record(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
