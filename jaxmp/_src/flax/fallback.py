"""The precision switch for Flax training states, and its checkpoints.

Importing this module (``import jaxmp.flax`` does) teaches
:func:`jaxmp.switch_precision` and :class:`jaxmp.PrecisionFallback` the two
kinds of training state that Flax users hold:

* a :class:`jaxmp.flax.TrainState`: a new state with the new policy (a static
  field), ``apply_fn`` wrapped by the new policy and ``tx`` starting from the
  new loss scale;
* an ``nnx.Optimizer`` and its model: ``opt_state`` and ``tx`` replaced in
  place, and the ``dtype`` of the model's modules set by
  :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`.

For :func:`jaxmp.flax.save_checkpoint` and
:func:`jaxmp.flax.restore_checkpoint` it writes the controller's state as JSON
(the policy included) and switches a resumed target as the saved run was.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import jax
import numpy as np

from jaxmp._src.fallback import (
    PrecisionFallback,
    TargetKind,
    register_target_kind,
    switch_precision,
    with_initial_loss_scale,
    with_loss_scale,
)
from jaxmp._src.flax.fp8_nnx import detach_fp8_ops, is_fp8_op, reattach_fp8_op
from jaxmp._src.flax.module_policy import ModulePolicy, runs_fp8
from jaxmp._src.flax.train_state import TrainState
from jaxmp._src.path_policy import PathPolicy
from jaxmp._src.policy import Fp8Policy, Policy, WrappedApply, get_policy
from jaxmp._src.validation import listing


def _check_storage_dtypes(params: Any, policy: Any) -> None:
  """Refuses a policy that would store the params in other dtypes."""
  stored = jax.eval_shape(policy.params_for_storage, params)
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree_util.tree_leaves(stored)):
    old_dtype = getattr(old, "dtype", None)
    if old_dtype is not None and np.dtype(old_dtype) != np.dtype(new.dtype):
      raise ValueError(
          f"switch_precision: the policy {policy} stores the params in other "
          f"dtypes than the state holds (at {jax.tree_util.keystr(path)}: "
          f"{np.dtype(old_dtype)} now, {np.dtype(new.dtype)} under the new "
          "policy). A switch keeps the params bit-identical, so the policies "
          "of a ladder share their param_dtype (float32 master params)."
      )


def _switch_train_state(state: TrainState, policy: Any, loss_scale: Any,
                        model: Any) -> TrainState:
  if model is not None:
    raise TypeError(
        "switch_precision: model= is for an nnx.Optimizer; a TrainState holds "
        "its apply_fn and takes no model."
    )
  if isinstance(policy, Fp8Policy):
    policy = ModulePolicy({}, default=policy)  # as TrainState.create does
  _check_storage_dtypes(state.params, policy)
  fp8_meta = state.fp8_meta
  fp8_policy = runs_fp8(policy)
  if fp8_policy and fp8_meta is None:
    raise ValueError(
        f"switch_precision: the policy {policy} runs FP8 matmuls, but the "
        "state has no FP8 meta (TrainState.fp8_meta) for them. A switch goes "
        "towards wider dtypes and keeps the state it finds; to train in FP8, "
        "build a new state with the FP8 policy: variables = "
        "policy.wrap_apply(model.init)(key, x), then TrainState.create(..., "
        "fp8_meta=variables['_overwrite_with_gradient'], policy=policy).")
  if fp8_meta is not None and not fp8_policy:
    warnings.warn(
        f"switch_precision: the policy {policy} runs no FP8 matmuls, so the "
        "state's FP8 meta is dropped (fp8_meta=None) and the Dense, "
        "DenseGeneral and Einsum layers compute in the new policy's dtype.",
        UserWarning, stacklevel=3)
    fp8_meta = None
  apply_fn = state.apply_fn
  if isinstance(apply_fn, WrappedApply):
    apply_fn = apply_fn.apply_fn  # the model's own apply, unwrapped
  tx, opt_state = state.tx, state.opt_state
  if loss_scale is not None:
    tx = with_initial_loss_scale(tx, loss_scale)
    opt_state = with_loss_scale(opt_state, loss_scale)
  return state.replace(policy=policy, apply_fn=policy.wrap_apply(apply_fn),
                       tx=tx, opt_state=opt_state, fp8_meta=fp8_meta)


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


def _switch_nnx(optimizer: Any, policy: Any, loss_scale: Any, model: Any) -> Any:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if not isinstance(model, nnx.Module) or isinstance(model, nnx.Optimizer):
    raise TypeError(
        "switch_precision: an nnx.Optimizer needs its model, whose modules' "
        "dtype the policy sets: switch_precision(optimizer, policy, "
        f"model=model); got model={model!r}."
    )
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


def _is_nnx_optimizer(x: Any) -> bool:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return isinstance(x, nnx.Optimizer)


def _nnx_step(optimizer: Any) -> Any:
  step = optimizer.step
  return step.get_value() if hasattr(step, "get_value") else step


register_target_kind(TargetKind(
    name="nnx.Optimizer",
    is_kind=_is_nnx_optimizer,
    switch=_switch_nnx,
    opt_state_of=lambda optimizer: optimizer.opt_state,
    step_of=_nnx_step,
))
register_target_kind(TargetKind(
    name="TrainState",
    is_kind=lambda x: isinstance(x, TrainState),
    switch=_switch_train_state,
    opt_state_of=lambda state: state.opt_state,
    step_of=lambda state: state.step,
))


# Checkpoints: the controller's state as JSON, and a resumed target.


def _class_name(cls: type) -> str:
  name = f"{cls.__module__}:{cls.__qualname__}"
  if _class_from_name(name) is not cls:
    raise ValueError(
        f"save_checkpoint: the policy names the module class {cls.__qualname__}, "
        "which cannot be imported by its name (a class defined inside a "
        "function?), so the checkpoint cannot record it. Define the class at "
        "the top level of a module, or name the modules by path ('head')."
    )
  return name


def _class_from_name(name: str) -> Any:
  module_name, _, qualname = name.partition(":")
  try:
    value = importlib.import_module(module_name)
    for part in qualname.split("."):
      value = getattr(value, part)
  except (ImportError, AttributeError):
    return None
  return value


def _encode_policy(policy: Any, ladder: tuple[Any, ...]) -> dict[str, Any]:
  """A policy as JSON: a rung of the ladder by its index, any other in full."""
  if policy in ladder:
    return {"rung": ladder.index(policy)}
  if isinstance(policy, Policy):
    return {"policy": str(policy)}
  default = None if policy.default is None else str(policy.default)
  if isinstance(policy, ModulePolicy):
    key = lambda k: {"class": _class_name(k)} if isinstance(k, type) else {"pattern": k}
    override = policy.override_dtype
    return {"module_policy": {
        "rules": [[key(k), str(p)] for k, p in policy.rules],
        "default": default,
        "first_match": policy.first_match,
        "override_dtype": (override if isinstance(override, bool)
                           else [_class_name(c) for c in override]),
    }}
  if isinstance(policy, PathPolicy):
    return {"path_policy": {
        "rules": [[k, str(p)] for k, p in policy.rules],
        "default": default,
        "first_match": policy.first_match,
    }}
  raise ValueError(
      f"save_checkpoint: cannot record the policy {policy} of type "
      f"{type(policy).__name__}; a checkpoint records jaxmp.Policy, "
      "jaxmp.PathPolicy and jaxmp.flax.ModulePolicy."
  )


def _decode_policy(data: dict[str, Any], ladder: tuple[Any, ...]) -> Any:
  if "rung" in data:
    return ladder[int(data["rung"])]
  if "policy" in data:
    return get_policy(data["policy"])
  if "module_policy" in data:
    spec = data["module_policy"]
    key = lambda k: _class_from_name(k["class"]) if "class" in k else k["pattern"]
    override = spec["override_dtype"]
    return ModulePolicy(
        [(key(k), p) for k, p in spec["rules"]], default=spec["default"],
        first_match=spec["first_match"],
        override_dtype=(override if isinstance(override, bool)
                        else tuple(_class_from_name(c) for c in override)))
  spec = data["path_policy"]
  return PathPolicy([tuple(rule) for rule in spec["rules"]],
                    default=spec["default"], first_match=spec["first_match"])


def fallback_config(fallback: PrecisionFallback) -> dict[str, Any]:
  """The controller's state as JSON, for :func:`jaxmp.flax.save_checkpoint`."""
  state = fallback.state_dict()
  state["policy"] = _encode_policy(state["policy"], fallback.ladder)
  return state


def _check_fallback(fallback: Any, caller: str) -> None:
  if not isinstance(fallback, PrecisionFallback):
    raise TypeError(
        f"{caller}: fallback must be the jaxmp.PrecisionFallback that watches "
        f"the run; got {fallback!r}."
    )


def resume_target(target: Any, saved: dict[str, Any] | None,
                  fallback: PrecisionFallback) -> tuple[Any, dict[str, Any]]:
  """``target`` switched as the saved run was, and the controller state to load.

  Args:
    target: the target given to :func:`jaxmp.flax.restore_checkpoint`, built
      in any policy of the ladder (usually the first).
    saved: the controller's state the checkpoint holds (``None`` if none).
    fallback: the controller of the resumed run.

  Raises:
    ValueError: if the checkpoint holds no controller state, its ladder
      differs, or an NNX target lacks its model.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  _check_fallback(fallback, "restore_checkpoint")
  if saved is None:
    raise ValueError(
        "restore_checkpoint: fallback= is given, but the checkpoint was saved "
        "without it, so it holds no state of a PrecisionFallback. Restore it "
        "without fallback=, and save with jaxmp.flax.save_checkpoint(..., "
        "fallback=fallback) from then on."
    )
  ladder = [str(p) for p in fallback.ladder]
  if list(saved["ladder"]) != ladder:
    raise ValueError(
        "restore_checkpoint: the checkpoint was written under a "
        f"PrecisionFallback with the ladder {list(saved['ladder'])}, but the "
        f"given one has {ladder}. Build the controller with the ladder of the "
        "run you resume."
    )
  state = dict(saved)
  state["policy"] = _decode_policy(saved["policy"], fallback.ladder)
  if not state["events"]:
    return target, state
  policy = state["policy"]
  if isinstance(target, nnx.Optimizer):
    raise ValueError(
        "restore_checkpoint: the saved run switched to the policy "
        f"{policy}, which sets the dtypes of the model's modules: restore "
        "into (model, optimizer), not the optimizer alone."
    )
  if isinstance(target, (tuple, list)) and any(
      isinstance(x, nnx.Optimizer) for x in target):
    optimizers = [x for x in target if isinstance(x, nnx.Optimizer)]
    models = [x for x in target if isinstance(x, nnx.Module)
              and not isinstance(x, nnx.Optimizer)]
    if len(optimizers) != 1 or len(models) != 1:
      raise ValueError(
          "restore_checkpoint: to follow the saved run's switch to "
          f"{policy}, the NNX target must hold one model and one "
          f"nnx.Optimizer, e.g. (model, optimizer); it holds "
          f"{len(models)} model(s) and {len(optimizers)} optimizer(s)."
      )
    switch_precision(optimizers[0], policy, model=models[0])
    return target, state
  return switch_precision(target, policy), state
