"""The precision switch of a Flax training state.

:func:`jaxmp.switch_precision` imports this module when its target is a Flax
object (so ``import jaxmp`` never imports Flax), and switches the two kinds
that hold more than a loss scale:

* a :class:`jaxmp.flax.TrainState`: a new state with the new policy (a static
  field), ``apply_fn`` wrapped by the new policy and ``tx`` starting from the
  new loss scale;
* an ``nnx.Optimizer`` and its model: ``opt_state`` and ``tx`` replaced in
  place, and the ``dtype`` of the model's modules set by
  :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from flax import nnx

from jaxmp._src.flax.apply import WrappedApply
from jaxmp._src.flax.fp8 import split_fp8_grads
from jaxmp._src.flax.fp8_nnx import detach_fp8_ops, is_fp8_op, reattach_fp8_op
from jaxmp._src.flax.module_policy import ModulePolicy, runs_fp8
from jaxmp._src.flax.train_state import TrainState, wrap_apply
from jaxmp._src.loss_scaling import with_initial_loss_scale, with_loss_scale
from jaxmp._src.policy import Fp8Policy, Policy
from jaxmp._src.validation import listing

Switch = Callable[[Any, Any, Any, Any], Any]
ParamsOf = Callable[[Any, Any], Any]


def switch_of(target: Any) -> tuple[ParamsOf, Switch] | None:
  """``(params_of, switch)`` for a TrainState or an ``nnx.Optimizer``;
  ``None`` for any other Flax pytree (switched as any pytree is).

  ``params_of(target, model)`` returns the params the switch keeps (and
  refuses a wrong ``model``); ``switch(target, policy, loss_scale, model)``
  switches, ``loss_scale`` being the new loss scale, ``None`` to keep it.
  """
  if isinstance(target, TrainState):
    return _train_state_params, _switch_train_state
  if isinstance(target, nnx.Optimizer):
    return _nnx_params, _switch_nnx
  return None


def _train_state_params(state: TrainState, model: Any) -> Any:
  if model is not None:
    raise TypeError(
        "switch_precision: model= is for an nnx.Optimizer; a TrainState holds "
        "its apply_fn and takes no model."
    )
  split = split_fp8_grads(state.params)
  return state.params if split is None else split[0]


def _nnx_params(optimizer: nnx.Optimizer, model: Any) -> Any:
  del optimizer
  if not isinstance(model, nnx.Module) or isinstance(model, nnx.Optimizer):
    raise TypeError(
        "switch_precision: an nnx.Optimizer needs its model, whose modules' "
        "dtype the policy sets: switch_precision(optimizer, policy, "
        f"model=model); got model={model!r}."
    )
  return nnx.state(model, nnx.Param)


def _switch_train_state(state: TrainState, policy: Any, loss_scale: Any,
                        model: Any) -> TrainState:
  del model  # checked by _train_state_params
  if isinstance(policy, Fp8Policy):
    policy = ModulePolicy({}, default=policy)  # as TrainState.create does
  split = split_fp8_grads(state.params)
  fp8_policy = runs_fp8(policy)
  if fp8_policy and split is None:
    raise ValueError(
        f"switch_precision: the policy {policy} runs FP8 matmuls, but the "
        "state has no FP8 meta for them. A switch goes towards wider dtypes "
        "and keeps the state it finds; to train in FP8, build a new state "
        "with the FP8 policy: variables = policy.wrap_apply(model.init)(key, "
        "x), then TrainState.create(..., params=variables, policy=policy).")
  if split is not None and not fp8_policy:
    warnings.warn(
        f"switch_precision: the policy {policy} runs no FP8 matmuls: the "
        "Dense, DenseGeneral and Einsum layers compute in the new policy's "
        "dtype, and the state's FP8 meta stays in params unused (kept as it "
        "is), so the loss function keeps its variables.", UserWarning,
        stacklevel=3)
  apply_fn = state.apply_fn
  if isinstance(apply_fn, WrappedApply):
    apply_fn = apply_fn.apply_fn  # the model's own apply, unwrapped
  tx, opt_state = state.tx, state.opt_state
  if loss_scale is not None:
    tx = with_initial_loss_scale(tx, loss_scale)
    opt_state = with_loss_scale(opt_state, loss_scale)
  return state.replace(policy=policy, apply_fn=wrap_apply(
      policy, apply_fn, state.autocast), tx=tx, opt_state=opt_state)


def _as_module_policy(policy: Any) -> ModulePolicy:
  if isinstance(policy, ModulePolicy):
    return policy
  if isinstance(policy, Policy):
    return ModulePolicy({}, default=policy)
  raise TypeError(
      "switch_precision: an NNX model takes a jaxmp.Policy or a "
      f"jaxmp.flax.ModulePolicy, which set the modules' dtype; got {policy}. "
      "A PathPolicy casts a params tree, which an NNX model does not take."
  )


def _switch_nnx(optimizer: nnx.Optimizer, policy: Any, loss_scale: Any,
                model: Any) -> nnx.Optimizer:
  dropped = set_model_policy(model, policy)
  if dropped:
    warnings.warn(
        f"switch_precision: the policy {policy} runs {len(dropped)} layer(s) "
        f"that had FP8 matmuls without them ({listing(repr(p) for p in dropped)}): their FP8 "
        "ops, and the jaxmp.flax.Fp8Meta in them, are removed from the model, "
        "which computes those matmuls in the new policy's dtype.",
        UserWarning, stacklevel=3)
  if loss_scale is not None:
    optimizer.opt_state = with_loss_scale(optimizer.opt_state, loss_scale)
    optimizer.tx = with_initial_loss_scale(optimizer.tx, loss_scale)
  return optimizer


def set_model_policy(model: nnx.Module, policy: Any) -> list[str]:
  """Sets the dtypes (and FP8 ops) of an NNX model's modules to ``policy``'s,
  keeping the FP8 ops (and meta) of the layers that stay in FP8; returns the
  paths of those whose FP8 op came off. On an error the model is unchanged."""
  module_policy = _as_module_policy(policy)
  declared = [(module, module.dtype) for _, module in nnx.iter_modules(model)
              if hasattr(module, "dtype")]
  # The FP8 ops come off first, so that set_nnx_dtypes gives FP8 ops to just
  # the layers the new policy runs in FP8; those get their old op (and meta)
  # back.
  detached = detach_fp8_ops(model)
  try:
    module_policy.set_nnx_dtypes(model)
  except Exception:
    detach_fp8_ops(model)  # leave the model as it was
    for module, attribute, op in detached.values():
      reattach_fp8_op(module, attribute, op)
    for module, dtype in declared:
      module.dtype = dtype
    raise
  dropped = []
  for path, (module, attribute, op) in detached.items():
    new = getattr(module, attribute)
    if is_fp8_op(new) and new.amax_history_length == op.amax_history_length:
      reattach_fp8_op(module, attribute, op)
    else:
      dropped.append(path)
  return dropped
