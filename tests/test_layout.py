"""The package's architecture rules, checked on its source (issue #12): sizes, private Lightning access in one
module, pure modules free of Lightning and process groups, HDET's layers by folder, and no import cycles between
the packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hdet"
MAX_CLASS_LINES, MAX_FUNCTION_LINES = 300, 60
# Pure math: no Lightning, no process groups (unit-tested against hand-computed values): every module of hdet/rules/
# and directly in hdet/ (what HDET's layers share), and the modules listed.
PURE_FOLDERS = {"hdet/rules": "**/*.py", "hdet": "*.py", "asynchronous/outer": "*.py"}
PURE_MODULES = ["experimental/halving.py", "asynchronous/wire/messages.py", "asynchronous/wire/codecs.py",
                "asynchronous/wire/slow_link.py", "asynchronous/wire/memory.py",
                "asynchronous/elastic/sessions.py", "asynchronous/elastic/job.py",
                "asynchronous/result.py", "asynchronous/exchange/ranks.py", "asynchronous/exchange/reshard.py",
                "asynchronous/lightning/worker_shape.py", "records/history.py", "records/tensorboard.py",
                "_checks.py", "_text.py"]
PURE = PURE_MODULES + sorted(p.relative_to(PACKAGE).as_posix() for folder, pattern in PURE_FOLDERS.items()
                             for p in (PACKAGE / folder).glob(pattern))
# HDET's layers, lowest first: a module of hdet/ imports from its own layer or a lower one. The pure modules beside
# the folders share the lowest with rules/; execution/ imports no Lightning (FakeWorld runs it without).
HDET_LAYERS = {"": 0, "rules": 0, "execution": 1, "lightning": 2, "fsdp": 3}
# Private names of Lightning / W&B objects that only lightning_hdet/_compat.py may touch.
PRIVATE_ATTRIBUTES = {"_trainer", "_optimizer", "_timeout", "_ddp_kwargs", "_ddp_comm_hook", "_ddp_comm_wrapper",
                      "_experiment", "_init_pid", "_is_attached", "epoch_loop"}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _imports(tree: ast.Module) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


@pytest.mark.parametrize("path", _modules(), ids=_rel)
def test_no_class_over_300_lines_and_no_function_over_60(path: Path) -> None:
    too_long = []
    for node in ast.walk(_tree(path)):
        limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            if node.end_lineno - start + 1 > limit:
                too_long.append(f"{node.name}: {node.end_lineno - start + 1} lines (limit {limit})")
    assert not too_long, f"{_rel(path)}: {too_long}"


@pytest.mark.parametrize("path", [p for p in _modules() if _rel(p) != "_compat.py"], ids=_rel)
def test_private_lightning_and_wandb_names_only_in_compat(path: Path) -> None:
    tree = _tree(path)
    private_imports = [n for n in _imports(tree) if n.split(".")[0] in ("lightning", "pytorch_lightning", "wandb")
                       and any(part.startswith("_") for part in n.split("."))]
    attributes = sorted({node.attr for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and node.attr in PRIVATE_ATTRIBUTES})
    assert not private_imports and not attributes, (
        f"{_rel(path)} touches private Lightning/W&B names {private_imports + attributes}: "
        "go through lightning_hdet/_compat.py"
    )


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_need_neither_lightning_nor_process_groups(name: str) -> None:
    path = PACKAGE / name
    assert path.exists(), f"{name} is listed as pure but does not exist: update PURE_MODULES"
    impure = [n for n in _imports(_tree(path))
              if n.split(".")[0] in ("lightning", "pytorch_lightning", "wandb")
              or n.startswith("torch.distributed")]
    assert not impure, f"{name} is a pure module but imports {impure}"


def _layer(parts: list[str]) -> str:
    """The layer of ``hdet/<parts>`` (a path or a dotted name, split): its folder, "" beside the folders."""
    return parts[0] if parts[0] in HDET_LAYERS else ""


@pytest.mark.parametrize("path", [p for p in _modules() if _rel(p).startswith("hdet/")], ids=_rel)
def test_hdet_layers_import_only_their_own_or_lower_ones(path: Path) -> None:
    own = _layer(_rel(path).split("/")[1:])
    names = _imports(_tree(path))
    upward = sorted({n for n in names if n.startswith("lightning_hdet.hdet.")
                     and HDET_LAYERS[_layer(n.split(".")[2:])] > HDET_LAYERS[own]})
    assert not upward, f"{_rel(path)} (layer {own or 'hdet/'}) imports a higher layer: {upward}"
    if own == "execution":
        lightning = [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")]
        assert not lightning, f"{_rel(path)} is in hdet/execution/ but imports Lightning: {lightning}"


# asynchronous/'s layers, lowest first: a module imports its own layer or a lower one (what crosses the wire, the
# outer optimizer objects over it, one exchange carried out, the Lightning glue, workers as separate jobs). The
# modules beside the folders (result.py) are pure and share the lowest.
ASYNC_LAYERS = {"": 0, "wire": 0, "outer": 1, "exchange": 2, "lightning": 3, "elastic": 4}


def _async_layer(parts: list[str]) -> str:
    return parts[0] if parts[0] in ASYNC_LAYERS else ""


@pytest.mark.parametrize("path", [p for p in _modules() if _rel(p).startswith("asynchronous/")], ids=_rel)
def test_async_layers_import_only_their_own_or_lower_ones(path: Path) -> None:
    own = _async_layer(_rel(path).split("/")[1:])
    upward = sorted({n for n in _imports(_tree(path)) if n.startswith("lightning_hdet.asynchronous.")
                     and ASYNC_LAYERS[_async_layer(n.split(".")[2:])] > ASYNC_LAYERS[own]})
    assert not upward, f"{_rel(path)} (layer {own or 'asynchronous/'}) imports a higher layer: {upward}"


def test_async_modules_import_each_other_without_cycles() -> None:
    """No import circle among asynchronous/'s modules (the callback finds its strategy by a class the strategy
    mixes in, not by importing it back)."""
    paths = {"lightning_hdet." + _rel(p)[:-3].replace("/", ".").removesuffix(".__init__"): p for p in _modules()
             if _rel(p).startswith("asynchronous/")}
    graph = {module: {n for n in _imports(_tree(path)) if n in paths and n != module}
             for module, path in paths.items()}
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            raise AssertionError(f"import circle: {' -> '.join(stack[stack.index(node):] + [node])}")
        if node in done or node not in graph:
            return
        for target in sorted(graph[node]):
            visit(target, [*stack, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])


# asynchronous/'s folders: outer/ is pure (PURE_FOLDERS), wire/ and exchange/ carry messages over process groups but
# import no Lightning (one round runs without a Trainer); only lightning/ and elastic/ may.
ASYNC_WITHOUT_LIGHTNING = ("asynchronous/outer/", "asynchronous/wire/", "asynchronous/exchange/")


@pytest.mark.parametrize("path", [p for p in _modules() if _rel(p).startswith(ASYNC_WITHOUT_LIGHTNING)], ids=_rel)
def test_async_layers_below_lightning_import_no_lightning(path: Path) -> None:
    names = _imports(_tree(path))
    lightning = [n for n in names if n.split(".")[0] in ("lightning", "pytorch_lightning")
                 or n.startswith(("lightning_hdet.asynchronous.lightning", "lightning_hdet.asynchronous.elastic"))]
    assert not lightning, f"{_rel(path)} is below asynchronous/lightning/ but imports {lightning}"


# HDET's collectives go through its injected Communicator (hdet/execution/comm.py): tested in one process over
# FakeWorld.
COMMUNICATOR = "hdet/execution/comm.py"
COLLECTIVES = {"all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "scatter", "gather", "send", "recv", "isend", "irecv", "barrier",
               "all_gather_object", "broadcast_object_list"}


@pytest.mark.parametrize("path", [p for p in _modules() if _rel(p).startswith("hdet/") or _rel(p) == "fabric/hdet.py"],
                         ids=_rel)
def test_hdet_calls_collectives_only_through_its_communicator(path: Path) -> None:
    if _rel(path) == COMMUNICATOR:
        return
    tree = _tree(path)
    direct = sorted({f"{ast.unparse(node.value)}.{node.attr}" for node in ast.walk(tree)
                     if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES
                     and ast.unparse(node.value) in ("dist", "torch.distributed")})
    direct += [n for n in _imports(tree) if n.startswith("torch.distributed.") and n.split(".")[-1] in COLLECTIVES]
    assert not direct, f"{_rel(path)} calls {direct} directly: go through the injected Communicator ({COMMUNICATOR})"


def test_packages_import_each_other_without_cycles() -> None:
    """hdet/ and asynchronous/ never import each other; records/ and the private helpers import neither."""
    edges: dict[str, set[str]] = {}
    for path in _modules():
        parts = _rel(path).split("/")
        source = parts[0] if len(parts) > 1 else parts[0][:-3]
        for name in _imports(_tree(path)):
            if name.startswith("lightning_hdet."):
                target = name.split(".")[1]
                if target != source:
                    edges.setdefault(source, set()).add(target)
    assert "asynchronous" not in edges.get("hdet", set()) and "hdet" not in edges.get("asynchronous", set())
    for leaf in ("records", "_checks", "_tensors", "_compat", "_checkpoint", "_sharding", "_text", "_launch",
                 "_metrics"):
        assert not edges.get(leaf, set()) & {"hdet", "asynchronous"}, (leaf, edges.get(leaf))


def _lightning_classes() -> list[type]:
    import lightning_hdet
    from lightning_hdet.testing import SlowRanks

    found = {SlowRanks}
    for name in lightning_hdet.__all__:
        obj = getattr(lightning_hdet, name)
        if isinstance(obj, type) and any(base.__module__.startswith("lightning.") for base in obj.__mro__[1:]):
            found.add(obj)
    for cls in list(found):  # companion callbacks installed by the strategies
        found.update(c for c in cls.__subclasses__() if c.__module__.startswith("lightning_hdet"))
    return sorted(found, key=lambda c: c.__name__)


def test_every_overridden_lightning_hook_carries_override() -> None:
    """A Lightning release that renames a hook must not silently stop calling ours (``@override`` + type checkers)."""
    import lightning_hdet.asynchronous.lightning.strategy as async_strategy

    classes = _lightning_classes() + [c for c in vars(async_strategy).values()
                                      if isinstance(c, type) and c.__module__.startswith("lightning_hdet")
                                      and any(b.__module__.startswith("lightning.") for b in c.__mro__[1:])]
    missing = []
    for cls in classes:
        lightning_bases = [b for b in cls.__mro__[1:] if b.__module__.startswith("lightning.")]
        for name, member in vars(cls).items():
            func = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
            if callable(func) and any(name in vars(b) for b in lightning_bases) and name != "__init__":
                if not getattr(func, "__override__", False):
                    missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"overridden Lightning hooks without @override: {sorted(set(missing))}"


def test_report_module_runs_without_a_double_import_warning() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "lightning_hdet.report", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RuntimeWarning" not in done.stderr and "lightning-hdet-report" in done.stdout
