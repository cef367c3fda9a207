"""Orbax checkpoints of a training state, with the loss scale's static
configuration, the policy and a ``PrecisionFallback``'s state as JSON."""

from __future__ import annotations

import os
import pathlib
import pkgutil
import shutil
from typing import Any

import jax

from jaxmp._src.fallback import PrecisionFallback, switch_precision
from jaxmp._src.flax.module_policy import ModulePolicy
from jaxmp._src.frameworks import holds_nnx_objects
from jaxmp._src.loss_scaling import _find_states
from jaxmp._src.path_policy import PathPolicy
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import listing

_STATE, _CONFIG = "state", "jaxmp_config"  # the orbax items
_FALLBACK = "precision_fallback"  # the key of the controller's state


def _class_name(cls: type) -> str:
  name = f"{cls.__module__}:{cls.__qualname__}"
  try:
    found = pkgutil.resolve_name(name)
  except (ImportError, AttributeError, ValueError):
    found = None
  if found is not cls:
    raise ValueError(
        f"save_checkpoint: the policy names the module class {cls.__qualname__}, "
        "which cannot be imported by its name (a class defined inside a "
        "function?), so the checkpoint cannot record it. Define the class at "
        "the top level of a module, or name the modules by path ('head').")
  return name


def _encode_policy(policy: Any, ladder: tuple[Any, ...]) -> dict[str, Any]:
  """A policy as JSON: a rung of the ladder by its index, any other in full."""
  if policy in ladder:
    return {"rung": ladder.index(policy)}
  if isinstance(policy, Policy):
    return {"policy": str(policy)}
  key = lambda k: {"class": _class_name(k)} if isinstance(k, type) else k
  override = getattr(policy, "override_dtype", None)
  return {"rules": [[key(k), str(p)] for k, p in policy.rules],
          "default": None if policy.default is None else str(policy.default),
          "first_match": policy.first_match,
          "override_dtype": override if isinstance(override, (bool, type(None)))
                            else [_class_name(c) for c in override]}


def _decode_policy(data: dict[str, Any], ladder: tuple[Any, ...]) -> Any:
  if "rung" in data:
    return ladder[int(data["rung"])]
  if "policy" in data:
    return get_policy(data["policy"])
  key = lambda k: pkgutil.resolve_name(k["class"]) if isinstance(k, dict) else k
  rules = [(key(k), p) for k, p in data["rules"]]
  override = data["override_dtype"]
  if override is None:
    return PathPolicy(rules, default=data["default"], first_match=data["first_match"])
  return ModulePolicy(rules, default=data["default"], first_match=data["first_match"],
                      override_dtype=override if isinstance(override, bool)
                      else tuple(pkgutil.resolve_name(c) for c in override))


def _config(target: Any, fallback: Any = None) -> dict[str, Any]:
  """The configuration a checkpoint records and a restore compares."""
  states = _find_states(target)  # of a pytree, or of NNX objects (pytrees too)
  if len(states) > 1:
    raise ValueError(
        f"save_checkpoint: found {len(states)} loss-scaling states; wrap the "
        "whole optimizer once with jaxmp.loss_scaling.")
  config = {"loss_scale": states[0].loss_scale.config() if states else {}}
  policy = getattr(target, "policy", None)
  if policy is None and fallback is not None:
    policy = fallback.policy  # a target that carries no policy
  if policy is not None:
    config["policy"] = str(policy)
  if fallback is not None:
    state = fallback.state_dict()
    config[_FALLBACK] = {**state, "policy": _encode_policy(state["policy"], fallback.ladder)}
  return config


def _sibling(directory: pathlib.Path, role: str) -> pathlib.Path:
  """A hidden directory beside ``directory`` (a rename there is atomic): a
  forced save writes in ``"writing"`` and moves the old one to ``"replaced"``."""
  return directory.with_name(f".{directory.name}.jaxmp-{role}")


def _check_arrays(directory: pathlib.Path, items: Any) -> None:
  """Compares the saved arrays' paths and shapes with the target's (from the
  metadata alone), before orbax reads them and explains with a tree dump."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  try:
    metadata = ocp.StandardCheckpointHandler().metadata(directory).tree
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ValueError(
        f"restore_checkpoint: cannot read the array metadata in {directory} "
        f"({type(e).__name__}: {e}). The checkpoint is incomplete or was not "
        "written by orbax: save it again with jaxmp.flax.save_checkpoint.") from None
  arrays = lambda tree: {jax.tree_util.keystr(k, simple=True, separator="/"): leaf
                         for k, leaf in jax.tree_util.tree_leaves_with_path(tree)}
  saved, target = arrays(metadata), arrays(items)
  only_saved = [path for path in saved if path not in target]
  only_target = [path for path in target if path not in saved]
  if only_saved or only_target:
    parts = ([f"only in the checkpoint: {listing(only_saved)}"] if only_saved else []) + (
        [f"only in the target: {listing(only_target)}"] if only_target else [])
    raise ValueError(
        "restore_checkpoint: the checkpoint and the target hold different "
        f"arrays ({'; '.join(parts)}), so it was saved for another model or "
        "optimizer (optax.adam's mu and nu against optax.sgd's trace, say). "
        "Build the target with the model and optimizer that wrote it. To "
        "change the optimizer, restore into that target, then start the new "
        "one from its params: TrainState.create(..., params=restored.params, "
        "tx=new_optimizer).")
  shapes = [f"{path}: {tuple(saved[path].shape)} in the checkpoint, "
            f"{tuple(leaf.shape)} in the target" for path, leaf in target.items()
            if hasattr(leaf, "shape") and tuple(saved[path].shape) != tuple(leaf.shape)]
  if shapes:
    raise ValueError(
        "restore_checkpoint: the arrays of the checkpoint and of the target "
        f"have different shapes ({listing(shapes, '; ')}), so it was saved for a "
        "model of another size. Build the target with the model configuration "
        "that wrote it (layer sizes, vocabulary, batch dimensions of the state).")


def save_checkpoint(directory: str | os.PathLike[str], target: Any, *,
                    force: bool = False, fallback: Any = None) -> None:
  """Saves a training state with orbax, its loss-scale configuration included.

  ``target`` is a :class:`jaxmp.flax.TrainState`, any pytree of arrays, or
  NNX objects (``(model, optimizer)``). ``directory`` must not exist unless
  ``force``: the new checkpoint is then written beside the old one and
  replaces it once complete, so a save that fails or is killed leaves the old
  one restorable. With ``fallback``, the run's :class:`jaxmp.PrecisionFallback`,
  its state (the current policy, the switches) is saved too.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(period=7))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_0")
    >>> jaxmp.flax.save_checkpoint(path, tx.init(jnp.ones(2)))
    >>> jaxmp.get_loss_scale(jaxmp.flax.restore_checkpoint(path, tx.init(jnp.ones(2)))).period
    7
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  if holds_nnx_objects(target):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    items = nnx.state(target)
  else:
    items = target
  config = _config(target, fallback)

  def write(path: pathlib.Path) -> None:
    # Directories made before the writes start: orbax's default makes them
    # in threads that a failed save leaves waiting, and the process with them.
    sync = ocp.CompositeOptions(async_options=ocp.options.AsyncOptions(
        create_directories_asynchronously=False))
    ocp.Checkpointer(ocp.CompositeCheckpointHandler(composite_options=sync)).save(
        path, args=ocp.args.Composite(state=ocp.args.StandardSave(items),
                                      jaxmp_config=ocp.args.JsonSave(config)))

  directory = pathlib.Path(os.path.abspath(os.fspath(directory)))
  aside = _sibling(directory, "replaced")
  if not force and directory.exists():
    raise ValueError(
        f"save_checkpoint: {directory} already exists. Pass force=True to "
        "overwrite it: the new checkpoint is written beside the old one and "
        "replaces it only once complete (an atomic rename), so a save that "
        "fails or is killed leaves the old one restorable. Or save each step "
        "to a directory of its own (.../step_1000).")
  if not (directory.exists() or aside.exists()):
    write(directory)  # orbax writes beside it and renames: atomic
    return
  # orbax's force deletes the old checkpoint before it writes the new one:
  # write the new one beside it instead, and swap them once it is complete.
  work, primary = _sibling(directory, "writing"), jax.process_index() == 0
  if primary:
    # What a killed save left, or a failed one (whose threads may still add
    # to it: they write beside the new checkpoint, and it all goes below).
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(exist_ok=True)
  try:
    write(work / "checkpoint")
  except BaseException:
    if primary:
      shutil.rmtree(work, ignore_errors=True)
    raise
  if primary:
    if directory.exists():
      shutil.rmtree(aside, ignore_errors=True)  # stale: directory is complete
      os.rename(directory, aside)
    # A kill here leaves the old checkpoint in `aside`: restore reads it.
    os.rename(work / "checkpoint", directory)
    shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    multihost_utils.sync_global_devices("jaxmp.flax.save_checkpoint")


def restore_checkpoint(directory: str | os.PathLike[str], target: Any, *,
                       check_config: bool = True, fallback: Any = None) -> Any:
  """Restores a checkpoint of :func:`save_checkpoint` into ``target``.

  ``target`` (a pytree or its ``jax.eval_shape``; NNX objects are updated in
  place) must have the saved loss-scale configuration and policy unless
  ``check_config=False``, which also reads a plain orbax checkpoint; the
  saved arrays' paths and shapes are compared with its own before any is
  read. With ``fallback``, the run's :class:`jaxmp.PrecisionFallback`, the
  target (built in the ladder's first policy; NNX: ``(model, optimizer)``)
  is switched to the saved run's policy and the controller resumes.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> make = lambda period: jaxmp.loss_scaling(
    ...     optax.sgd(0.1), jaxmp.DynamicLossScale(period=period)).init(jnp.ones(2))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_0")
    >>> jaxmp.flax.save_checkpoint(path, make(7))
    >>> restored = jaxmp.flax.restore_checkpoint(path, jax.eval_shape(lambda: make(7)))
    >>> float(jaxmp.get_loss_scale(restored).loss_scale)
    32768.0
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  directory = pathlib.Path(os.path.abspath(os.fspath(directory)))
  if not directory.exists() and _sibling(directory, "replaced").is_dir():
    directory = _sibling(directory, "replaced")  # a forced save killed mid-swap
  if fallback is not None and not isinstance(fallback, PrecisionFallback):
    raise TypeError("restore_checkpoint: fallback must be the jaxmp.PrecisionFallback "
                    f"that watches the run; got {fallback!r}.")
  if not directory.exists():
    raise FileNotFoundError(
        f"restore_checkpoint: there is no checkpoint at {directory}. Pass the "
        "directory given to jaxmp.flax.save_checkpoint (one per step, e.g. "
        ".../step_1000).")
  plain = not ((directory / _STATE).is_dir() and (directory / _CONFIG).is_dir())
  if plain and not (directory / "_METADATA").exists():
    raise ValueError(
        f"restore_checkpoint: {directory} is not a checkpoint written by "
        f"jaxmp.flax.save_checkpoint or by orbax (it has no '{_STATE}' and "
        f"'{_CONFIG}' items and no orbax metadata; its entries: "
        f"{listing(sorted(p.name for p in directory.iterdir())) or 'none'}). "
        "Pass the directory of one checkpoint (e.g. .../step_1000), not its parent.")
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  saved = {} if plain else dict(checkpointer.restore(directory, args=ocp.args.Composite(
      jaxmp_config=ocp.args.JsonRestore())).jaxmp_config or {})
  controller = saved.get(_FALLBACK)
  if fallback is not None:
    if controller is None:
      raise ValueError(
          "restore_checkpoint: fallback= is given, but the checkpoint was saved "
          "without it, so it holds no state of a PrecisionFallback. Restore it "
          "without fallback=, and save with jaxmp.flax.save_checkpoint(..., "
          "fallback=fallback) from then on.")
    fallback._same_ladder(controller["ladder"], "restore_checkpoint")  # pylint: disable=protected-access
    controller = {**controller, "policy": _decode_policy(controller["policy"], fallback.ladder)}
    if controller["events"]:  # the saved run switched: so does the target
      target = _switched(target, controller["policy"])
  elif controller is not None and check_config:
    raise ValueError(
        "restore_checkpoint: the checkpoint was saved with a "
        "jaxmp.PrecisionFallback, whose run is in the policy "
        f"{saved.get('policy')} after {len(controller['events'])} switch(es). "
        "Pass the run's controller: restore_checkpoint(..., "
        "fallback=jaxmp.PrecisionFallback(ladder)), which switches the target "
        "to that policy; or check_config=False to restore into the target as it is.")
  if plain and check_config:
    raise ValueError(
        f"restore_checkpoint: {directory} is a plain orbax checkpoint (e.g. "
        "from ocp.StandardCheckpointer), not one written by "
        "jaxmp.flax.save_checkpoint, so it holds no loss-scale configuration or "
        "policy to check. Pass check_config=False to restore its arrays (the "
        "configuration then comes from the target, unchecked), and save with "
        "jaxmp.flax.save_checkpoint from then on.")
  nnx_target = holds_nnx_objects(target)
  if nnx_target:
    from flax import nnx  # pylint: disable=g-import-not-at-top

    items = nnx.state(target)
  else:
    items = target
  if not plain:
    expected = _config(target)
    if fallback is not None:
      expected.setdefault("policy", str(controller["policy"]))
      expected[_FALLBACK] = saved[_FALLBACK]
    else:
      saved.pop(_FALLBACK, None)
    kinds = [config.get("loss_scale", {}).get("type") for config in (saved, expected)]
    if kinds[0] != kinds[1]:
      raise ValueError(
          f"restore_checkpoint: the checkpoint holds a {kinds[0] or 'no loss scale'}"
          f" and the target a {kinds[1] or 'no loss scale'}, so their arrays "
          "differ (as when switching between float32 and mixed_float16), and "
          "check_config=False cannot bridge that. Restore into a target built "
          f"with the saved configuration {saved}, then start the new run from "
          "its params (TrainState.create(..., params=restored.params, "
          "policy=...)), keeping the optimizer moments with opt_state._replace("
          "inner_state=restored.opt_state.inner_state) if you wish.")
    if check_config and saved != expected:
      raise ValueError(
          "restore_checkpoint: the checkpoint was saved with the configuration "
          f"{saved}, but the target has {expected}. The loss scale's "
          "configuration and the policy come from the target (your code). "
          "Build the target with the saved configuration, or pass "
          "check_config=False to resume under the new one.")
  _check_arrays(directory if plain else directory / _STATE, items)
  if plain:
    restored = ocp.StandardCheckpointer().restore(directory, items)
  else:
    restored = checkpointer.restore(directory, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(items), jaxmp_config=ocp.args.JsonRestore())).state
  if fallback is not None:
    fallback.load_state_dict(controller)
  if nnx_target:
    nnx.update(target, restored)
    return target
  return restored


def _switched(target: Any, policy: Any) -> Any:
  """``target`` switched to ``policy``; NNX objects as ``(model, optimizer)``."""
  if not holds_nnx_objects(target):
    return switch_precision(target, policy)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  nodes = target if isinstance(target, (tuple, list)) else (target,)
  optimizers = [x for x in nodes if isinstance(x, nnx.Optimizer)]
  models = [x for x in nodes if isinstance(x, nnx.Module) and not isinstance(x, nnx.Optimizer)]
  if len(optimizers) != 1 or len(models) != 1:
    raise ValueError(
        f"restore_checkpoint: the saved run switched to the policy {policy}, "
        "which sets the dtypes of the model's modules: restore into (model, "
        f"optimizer), not {len(models)} model(s) and {len(optimizers)} optimizer(s).")
  switch_precision(optimizers[0], policy, model=models[0])
  return target
