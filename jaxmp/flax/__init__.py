"""Flax integration: a loss-scaling ``TrainState``, NNX training, per-module policies.

* :class:`TrainState` wraps a Linen model's optimizer with
  :func:`jaxmp.loss_scaling` and runs the loss under a policy.
* NNX needs no module of its own: ``nnx.Optimizer(model,
  jaxmp.loss_scaling(...), wrt=nnx.Param)``,
  ``jaxmp.scaled_value_and_grad(..., value_and_grad=nnx.value_and_grad)`` and
  :func:`jaxmp.keep_on_skip`; under an FP8 policy the scales and amax
  histories of the NNX FP8 ops are :class:`Fp8Meta` variables.
* :class:`ModulePolicy` runs chosen modules (``nn.LayerNorm``, ``"head"``) under
  their own policy, for Linen and NNX models.
* :func:`save_checkpoint` / :func:`restore_checkpoint` use orbax and check the
  loss scale's configuration on resume (and follow a precision switch of
  :class:`jaxmp.PrecisionFallback`).
* :func:`find_overflowing_modules` finds the modules whose outputs overflow;
  its report's ``propose_policy`` proposes a :class:`ModulePolicy` that keeps just
  those in float32.
"""

from jaxmp._src.flax.checkpoint import restore_checkpoint, save_checkpoint
from jaxmp._src.flax.fp8 import Fp8Meta
from jaxmp._src.flax.module_policy import ModulePolicy
from jaxmp._src.flax.promotion import find_overflowing_modules
from jaxmp._src.flax.train_state import TrainState

__all__ = [
    "TrainState",
    "ModulePolicy",
    "Fp8Meta",
    "save_checkpoint",
    "restore_checkpoint",
    "find_overflowing_modules",
]
