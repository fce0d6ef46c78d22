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
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from lightning_hdet import (
    AsyncLocalSGDStrategy,
    DelayedNesterov,
    ElasticWorkerStrategy,
    AsyncLocalSGDFabricStrategy,
    HDETCallback,
    HDETFabricStrategy,
    HDETFSDPStrategy,
    HDETLoop,
    HDETReplay,
    HDETStrategy,
    OuterService,
    SlowRanks,
)
from lightning_hdet.asynchronous.outer import OuterSettings
from lightning_hdet.hdet.config import HDETConfig
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
    "Fabric": (Fabric,),
    "HDETReplay": (HDETReplay,),
    "HDETFabricStrategy": (HDETFabricStrategy, FabricDDPStrategy),
    "HDETLoop": (HDETLoop, HDETConfig),  # **settings are HDETCallback's, validated by HDETConfig
    "AsyncLocalSGDFabricStrategy": (OuterSettings, FabricDDPStrategy, AsyncLocalSGDStrategy),
}

# Built from the literal arguments a doc shows; all validate their arguments in ``__init__``.
CONSTRUCTIBLE = ("HDETStrategy", "HDETCallback", "AsyncLocalSGDStrategy", "SlowRanks", "ElasticWorkerStrategy",
                 "HDETFabricStrategy")


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
                args = [ast.literal_eval(a) for a in node.args]
                kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                continue  # not all literal (e.g. a variable): the names were checked above
            SIGNATURES[name][0](*args, **kwargs)  # the values shown are accepted (validation runs here)


def test_blocks_were_found() -> None:
    assert len(python_blocks()) >= 10
