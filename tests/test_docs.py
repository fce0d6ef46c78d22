"""The documentation site builds without warnings, and the code in it uses only arguments that exist."""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

import lightning_hdet
from lightning_hdet import experimental
from lightning_hdet import (
    PBT,
    AsyncLocalSGDStrategy,
    Best,
    DelayedNesterov,
    ElasticWorkerStrategy,
    HDETCallback,
    HDETFSDPStrategy,
    HDETStrategy,
    OuterService,
    SafetyNet,
    Search,
    SlowRanks,
    Softmax,
)
from lightning_hdet.asynchronous.outer import OuterSettings
from lightning_hdet.demos import CharCorpusDataModule, CharLM

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

# Classes whose keyword arguments the docs use; **kwargs of the strategies go to DDPStrategy.
SIGNATURES = {
    "HDETStrategy": (HDETStrategy, DDPStrategy),
    "HDETFSDPStrategy": (HDETFSDPStrategy,),
    "HDETCallback": (HDETCallback,),
    "AsyncLocalSGDStrategy": (AsyncLocalSGDStrategy, DDPStrategy),
    "DelayedNesterov": (DelayedNesterov,),
    "ElasticWorkerStrategy": (ElasticWorkerStrategy, SingleDeviceStrategy),
    "OuterService": (OuterService, OuterSettings),
    "SlowRanks": (SlowRanks,),
    "CharLM": (CharLM,),
    "CharCorpusDataModule": (CharCorpusDataModule,),
    "Trainer": (Trainer,),
    "PBT": (PBT,),
    "Softmax": (Softmax,),
    "Best": (Best,),
    "Search": (Search,),
    "SafetyNet": (SafetyNet,),
    **{name: (getattr(experimental, name),) for name in experimental.__all__},
}
# The rules' objects a doc may pass as an argument value: built too, so their values are checked.
RULES = {name: getattr(lightning_hdet, name, None) or getattr(experimental, name)
         for name in ("PBT", "Softmax", "Best", "Search", "SafetyNet", *experimental.__all__)}

# Built from the literal arguments a doc shows; all validate their arguments in ``__init__``.
CONSTRUCTIBLE = ("HDETStrategy", "HDETCallback", "AsyncLocalSGDStrategy", "SlowRanks", "ElasticWorkerStrategy")


def python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, match in enumerate(FENCE.finditer(page.read_text())):
            blocks.append((f"{page.relative_to(ROOT)}#{i}", match.group(1)))
    return blocks


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    # API pages are generated from the docstrings, and example files are included into the pages.
    api = (site / "api" / "strategy" / "index.html").read_text()
    assert "gradient_sync" in api and "set_lr_multipliers" in api
    assert "every_n_steps" in (site / "api" / "callback" / "index.html").read_text()
    recipes = (site / "recipes" / "index.html").read_text()
    assert "lightning_hdet.HDETStrategy" in recipes and "#SBATCH" in recipes
    assert not [p for p in site.rglob("*.html") if "--8&lt;--" in p.read_text() or "--8<--" in p.read_text()]
    assert 'class="mermaid"' in (site / "concepts" / "index.html").read_text()


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_python_block_uses_real_arguments(where: str, code: str) -> None:
    tree = ast.parse(code)  # a syntax error in a doc block fails here
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name not in SIGNATURES:
            continue
        allowed = {p for cls in SIGNATURES[name] for p in inspect.signature(cls.__init__).parameters}
        for kw in node.keywords:
            if kw.arg is not None:
                assert kw.arg in allowed, f"{where}: {name}({kw.arg}=...) is not an argument of {name}"
        if name in CONSTRUCTIBLE:
            try:
                args = [_value(a) for a in node.args]
                kwargs = {kw.arg: _value(kw.value) for kw in node.keywords}
            except ValueError:
                continue  # not all literal (e.g. a variable): the names were checked above
            SIGNATURES[name][0](*args, **kwargs)  # the values shown are accepted (validation runs here)


def _value(node: ast.expr) -> object:
    """A literal, or a rule object built from literals (``vote=PBT(quantile=0.25)``); ``ValueError`` otherwise."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in RULES:
        args, kwargs = [_value(a) for a in node.args], {k.arg: _value(k.value) for k in node.keywords}
        try:
            return RULES[node.func.id](*args, **kwargs)
        except (TypeError, ValueError) as err:  # a value the doc shows is refused: not "not literal"
            raise AssertionError(f"{ast.unparse(node)}: {err}") from err
    return ast.literal_eval(node)


def test_blocks_were_found() -> None:
    assert len(python_blocks()) >= 10
