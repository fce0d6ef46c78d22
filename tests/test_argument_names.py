"""Every public constructor refuses a keyword it does not know, naming the closest valid name and its own
arguments, before any process starts; names that really go on to Lightning's strategy or to DistributedDataParallel
are accepted where they take effect, and refused where they would do nothing."""

from __future__ import annotations

import copy
import inspect
import pickle
from dataclasses import replace
from datetime import timedelta

import pytest
import torch

import lightning_hdet
from lightning_hdet import (
    PBT,
    AsyncLocalSGDFabricStrategy,
    AsyncLocalSGDStrategy,
    ElasticDDPWorkerStrategy,
    ElasticWorkerStrategy,
    HDETCallback,
    HDETFabricStrategy,
    HDETStrategy,
    OuterService,
    SafetyNet,
    WorkerShape,
    experimental,
)
from lightning_hdet._checks import ArgumentNameError, own_arguments

# The arguments a constructor cannot do without (Python binds them before the constructor's first line runs).
REQUIRED = {ElasticWorkerStrategy: {"server": "127.0.0.1:1"}, ElasticDDPWorkerStrategy: {"server": "127.0.0.1:1"},
            OuterService: {"module": torch.nn.Linear(1, 1), "address": "127.0.0.1:0", "budget": 10}}
PUBLIC = sorted({obj for module in (lightning_hdet, experimental) for obj in map(module.__dict__.get, module.__all__)
                 if inspect.isclass(obj)}, key=lambda cls: cls.__name__)


def _typo(name: str) -> str:
    """A near miss: one letter too many or too few at the end (``num_group``, ``lrs``)."""
    return name[:-1] if name.endswith("s") else name + "s"


def _cases() -> list[tuple[type, str]]:
    own = [(cls, name) for cls in PUBLIC for name in own_arguments(cls)]
    # (AsyncLocalSGDFabricStrategy takes every name through **kwargs: its own are the Trainer strategy's options)
    return own + [(AsyncLocalSGDFabricStrategy, name) for name in ("local_steps", "mode", "outer", "compression")]


@pytest.mark.parametrize(("cls", "name"), _cases(), ids=[f"{c.__name__}.{n}" for c, n in _cases()])
def test_a_misspelled_argument_is_refused_with_the_closest_name(cls: type, name: str) -> None:
    typo = _typo(name)
    with pytest.raises(ArgumentNameError) as caught:
        cls(**REQUIRED.get(cls, {}), **{typo: 1})
    message = str(caught.value)
    assert message.startswith(f"{cls.__name__} got an unsupported argument `{typo}`=1. Did you mean `{name}`?")
    assert f"Its own arguments: {', '.join(own_arguments(cls))}" in message or cls is AsyncLocalSGDFabricStrategy


def test_every_public_class_is_checked() -> None:
    names = {cls.__name__ for cls, _ in _cases()}
    assert {"HDETStrategy", "HDETCallback", "PBT", "Softmax", "Best", "TrustRegion", "Search", "SafetyNet",
            "PlateauRule", "AsyncLocalSGDStrategy", "ElasticWorkerStrategy", "ElasticDDPWorkerStrategy",
            "OuterService", "HDETFabricStrategy", "AsyncLocalSGDFabricStrategy", "HDETFSDPStrategy", "HDETLoop",
            *experimental.__all__} <= names


@pytest.mark.parametrize(("make", "message"), [
    # the three mistakes of the first-contact report (issue 62)
    (lambda: AsyncLocalSGDStrategy(local_step=5), "Did you mean `local_steps`?"),
    (lambda: HDETStrategy(num_group=2), "Did you mean `num_groups`? Its own arguments: num_groups, lr_multipliers"),
    (lambda: HDETCallback(every_n_step=50), "Did you mean `every_n_steps`? Its own arguments: every_n_steps, vote"),
    # a DistributedDataParallel option misspelled, or one Lightning sets itself
    (lambda: HDETStrategy(find_unused_parameter=True), "Did you mean `find_unused_parameters`?"),
    (lambda: HDETStrategy(device_ids=[0]), "unsupported argument `device_ids`"),
    # ... or where no DistributedDataParallel wraps the model: it would do nothing
    (lambda: AsyncLocalSGDStrategy(find_unused_parameters=True), "With `ranks_per_worker=1` no DistributedDataParallel"),
    (lambda: AsyncLocalSGDFabricStrategy(static_graph=True), "never wrapped in DistributedDataParallel"),
    (lambda: ElasticWorkerStrategy("127.0.0.1:1", static_graph=True), "SingleDeviceStrategy's: accelerator"),
    (lambda: experimental.PartialMerge(strenght=0.5), "Did you mean `strength`?"),
    (lambda: OuterService(torch.nn.Linear(1, 1), "127.0.0.1:0", 10, local_step=5), "Did you mean `local_steps`?"),
])
def test_the_message_says_what_to_write(make, message: str) -> None:
    with pytest.raises(ArgumentNameError, match=message.replace("(", r"\(").replace("?", r"\?").replace("[", r"\[")):
        make()


def test_names_that_take_effect_are_accepted() -> None:
    assert HDETStrategy(find_unused_parameters=True, timeout=timedelta(seconds=30))._ddp_kwargs == {
        "find_unused_parameters": True}
    two_ranks = WorkerShape(ranks_per_worker=2)
    assert AsyncLocalSGDStrategy(static_graph=True, worker=two_ranks)._ddp_kwargs == {"static_graph": True}
    assert HDETFabricStrategy(bucket_cap_mb=10)._ddp_kwargs == {"bucket_cap_mb": 10}
    assert ElasticDDPWorkerStrategy("127.0.0.1:1", gradient_as_bucket_view=True)._ddp_kwargs == {
        "gradient_as_bucket_view": True}
    assert AsyncLocalSGDFabricStrategy(local_steps=7, timeout=timedelta(seconds=30)).outer_settings.rounds == 7
    service = OuterService(torch.nn.Linear(1, 1), "127.0.0.1:0", 10, local_steps=7)
    assert service.settings.rounds == 7


def test_the_error_is_both_a_type_error_and_a_value_error() -> None:
    """Python raises ``TypeError`` for an unknown keyword, this package ``ValueError`` for bad input: either
    ``except`` catches the refusal."""
    for kind in (TypeError, ValueError):
        with pytest.raises(kind):
            SafetyNet(divergence=3.0)


def test_rule_objects_still_copy_pickle_and_replace() -> None:
    rule = PBT(quantile=0.5)
    assert copy.deepcopy(rule) == rule == pickle.loads(pickle.dumps(rule))
    assert replace(rule, quantile=0.25) == PBT()
    with pytest.raises(ArgumentNameError, match="Did you mean `quantile`"):
        replace(rule, quantiles=0.25)


def test_a_subclass_taking_any_keyword_checks_its_own() -> None:
    class Custom(PBT):
        def __init__(self, scale: float = 1.0, **options: object) -> None:
            super().__init__(**options)
            object.__setattr__(self, "scale", scale)

    assert Custom(scale=2.0, quantile=0.5).quantile == 0.5  # the keywords reach its __init__


@pytest.mark.parametrize(("make", "message"), [
    (lambda: HDETCallback(vote="pbtt"), "`vote` must be one of ('pbt', 'softmax', 'best', 'trust_region') or a Vote"
     " object (PBT(...), Softmax(...), Best(...), TrustRegion(...)), got 'pbtt'. Did you mean 'pbt'?"),
    (lambda: HDETCallback(signal="maen"),
     "`signal` must be 'mean' or a Signal object, got 'maen'. Did you mean 'mean'?"),
    (lambda: HDETStrategy(preset="recomended"), "got 'recomended'. Did you mean 'recommended'?"),
    (lambda: HDETStrategy(gradient_sync="globl"), "got 'globl'. Did you mean 'global'?"),
    (lambda: AsyncLocalSGDStrategy(outer="stabel"), "got 'stabel'. Did you mean 'stable'? Or an object"),
    (lambda: AsyncLocalSGDStrategy(compression="bf61"), "got 'bf61'. Did you mean 'bf16'? Or a codec object"),
    (lambda: AsyncLocalSGDStrategy(mode="snyc"), "`mode` must be one of ('async', 'sync'), got 'snyc'. Did you mean"
     " 'sync'?"),
    (lambda: AsyncLocalSGDStrategy(worker=WorkerShape(ranks_per_worker=2, inside_worker="fdsp")),
     "`inside_worker` must be one of ('ddp', 'fsdp'), got 'fdsp'. Did you mean 'fsdp'? It says how the ranks"),
])
def test_a_misspelled_choice_is_refused_with_the_closest_one(make, message: str) -> None:
    """A string outside a fixed set of choices names them all and the closest (issue: vote='pbtt')."""
    with pytest.raises(ValueError) as caught:
        make()
    assert message in str(caught.value)


def test_a_value_far_from_every_choice_gets_no_guess() -> None:
    with pytest.raises(ValueError) as caught:
        HDETCallback(vote="median")
    assert "Did you mean" not in str(caught.value)
