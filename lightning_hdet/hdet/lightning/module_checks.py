"""What HDETCallback needs of the user's LightningModule: refused at ``setup`` when it is missing, and each step's
real loss when Lightning hands over a scaled one.

* **A loss to vote on.** ``monitor=None`` votes on the loss ``training_step`` returns. Lightning's automatic
  optimization needs it anyway; under manual optimization returning it is optional, and a module that never does
  gave HDET nothing to vote on, found only at the first vote (with a run shorter than a vote interval: after the
  run). :func:`check_module` refuses at ``setup`` a manual ``training_step`` whose source has no ``return`` with a
  value; one that has (``return loss if ... else None``) but hands back nothing is refused at its first step
  (:func:`missing_loss`).
* **Several optimizers** (manual optimization: Lightning's automatic optimization takes one) are supported, each
  param group its own multiplier column; but Lightning's ``global_step`` counts every optimizer's step, and votes
  fall on multiples of ``every_n_steps``: :func:`stepping_warning` says when they would fall less often than asked.
* **The real loss under accumulation.** With ``accumulate_grad_batches=k`` Lightning's automatic optimization
  divides each batch's loss by ``k`` before the backward pass and hands that to ``on_train_batch_end``;
  :func:`step_loss` multiplies it back, so a vote compares the per-step loss whatever ``k`` (manual optimization
  leaves the returned loss alone).
"""

from __future__ import annotations

import ast
import inspect
import math
import textwrap
from typing import Any, Callable, Optional

from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

_FIX = ("Return the loss tensor (or a dict with 'loss') from `training_step`, or vote on a logged validation metric "
        "with `HDETCallback(monitor='val_loss')`.")


def check_module(module: Any, monitor: Optional[str]) -> None:
    """Refuse a module whose votes would have no loss: manual optimization whose ``training_step`` never returns a
    value, under ``monitor=None`` (call at ``setup``, before the first step)."""
    if monitor is not None or getattr(module, "automatic_optimization", True):
        return
    if returns_a_value(type(module).training_step) is False:
        raise MisconfigurationException(
            f"HDETCallback(monitor=None) votes on the loss `training_step` returns, but {type(module).__name__} "
            f"uses manual optimization and its `training_step` returns nothing. {_FIX}"
        )


def missing_loss(module: Any, step: int) -> MisconfigurationException:
    """The error for a manual-optimization step that returned no loss to vote on (raised at the first step)."""
    return MisconfigurationException(
        f"HDETCallback(monitor=None) votes on the loss `training_step` returns, but {type(module).__name__}'s "
        f"`training_step` (manual optimization) returned none at step {step}. {_FIX}"
    )


def returns_a_value(function: Callable[..., Any]) -> Optional[bool]:
    """Whether ``function``'s own body has a ``return`` with a value other than ``None`` (nested functions and
    lambdas not counted); ``None`` when its source cannot be read (then the first step tells)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return any(_returns_value(node) for node in _own_nodes(definition))


def _own_nodes(definition: ast.AST) -> list[ast.AST]:
    """The nodes of a function's body, without those of the functions, lambdas and classes defined in it."""
    nodes, todo = [], list(ast.iter_child_nodes(definition))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def _returns_value(node: ast.AST) -> bool:
    if not isinstance(node, ast.Return) or node.value is None:
        return False
    return not (isinstance(node.value, ast.Constant) and node.value.value is None)


def stepping_warning(module: Any, num_optimizers: int, every_n_steps: int) -> Optional[str]:
    """The warning when ``num_optimizers`` optimizers stepping every batch would move ``global_step`` past most
    multiples of ``every_n_steps`` (manual optimization only); ``None`` when votes fall as asked."""
    if getattr(module, "automatic_optimization", True) or num_optimizers < 2 or every_n_steps % num_optimizers == 0:
        return None
    every = math.lcm(every_n_steps, num_optimizers)
    return (
        f"HDETCallback(every_n_steps={every_n_steps}) counts optimizer steps (Lightning's `global_step`), and "
        f"{type(module).__name__} steps {num_optimizers} optimizers (manual optimization). If each steps every batch, "
        f"`global_step` moves by {num_optimizers} a batch and a vote falls only on multiples of both: every {every} "
        f"steps ({every // num_optimizers} batches). Give every_n_steps a multiple of {num_optimizers} (e.g. "
        f"{every_n_steps * num_optimizers}: a vote every {every_n_steps} batches)."
    )


def step_loss(outputs: Any, module: Any, accumulate_grad_batches: int) -> Optional[Tensor]:
    """The loss of the batch that just ended, as the user computed it: ``outputs["loss"]`` (or ``outputs``), times
    ``accumulate_grad_batches`` under automatic optimization (Lightning divided it); ``None`` if there is none."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, Tensor):
        return None
    if accumulate_grad_batches > 1 and getattr(module, "automatic_optimization", True):
        return loss * accumulate_grad_batches  # on the device: no host sync
    return loss
