"""The state of a :class:`jaxmp.PrecisionFallback` in checkpoints.

For :func:`jaxmp.flax.save_checkpoint` and
:func:`jaxmp.flax.restore_checkpoint`: the controller's state as JSON (the
policy included), and a resumed target switched as the saved run was.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxmp._src.fallback import PrecisionFallback, switch_precision
from jaxmp._src.flax.module_policy import ModulePolicy
from jaxmp._src.path_policy import PathPolicy
from jaxmp._src.policy import Policy, get_policy


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
