"""Checkpoints with orbax: the training state plus the loss scale's configuration.

The arrays of a loss scale (scale, counters) are pytree leaves and are saved
with the rest of the state. Its configuration (period, factor, hysteresis,
min/max) is static: it lives in the *target* you restore into, i.e. in your
code. :func:`save_checkpoint` also writes that configuration (and the policy)
as JSON next to the arrays, and :func:`restore_checkpoint` checks that the
target has the same, so that a changed ``period`` or ``min_loss_scale`` does
not slip through a resume unnoticed.

With ``fallback=`` (a :class:`jaxmp.PrecisionFallback`), the checkpoint also
records the controller's state: its current policy and the switches so far.
Restoring with the controller then switches the target, built in the ladder's
first policy as at the start of the run, to the policy the saved run had
reached, and the controller resumes where it was.
"""

from __future__ import annotations

import os
import pathlib
import shutil
from typing import Any

import jax

from jaxmp._src.flax.fallback import fallback_config, resume_target
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import LossScalingState, _find_states
from jaxmp._src.validation import listing

# The items of a checkpoint written by save_checkpoint (orbax subdirectories).
_STATE = "state"
_CONFIG = "jaxmp_config"
# The key of the configuration that holds a PrecisionFallback's state.
_FALLBACK = "precision_fallback"


def _is_nnx_node(x: Any) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return False
  return isinstance(x, (nnx.Module, nnx.Optimizer)) or (
      isinstance(x, (tuple, list)) and x and all(_is_nnx_node(y) for y in x)
  )


def _loss_scales(target: Any) -> list[LossScale]:
  """The loss scales of the loss-scaling states in a pytree or NNX graph."""
  if _is_nnx_node(target):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    # nnx.state would turn the LossScalingState into a plain mapping.
    states = [node for _, node in nnx.iter_graph(target)
              if isinstance(node, LossScalingState)]
  else:
    states = _find_states(target)
  return [state.loss_scale for state in states]


def loss_scale_config(target: Any) -> dict[str, Any]:
  """Returns the static configuration of the loss scale held in ``target``.

  Args:
    target: a :class:`jaxmp.flax.TrainState`, an optimizer state, an
      ``nnx.Optimizer`` (or a tuple of NNX objects), or a loss scale.

  Returns:
    ``{"type": class name, field: value, ...}`` with the static fields
    (``period``, ``factor``, ``min_loss_scale``, ``backoff_factor``,
    ``max_loss_scale``, ``hysteresis``, ``consecutive_hysteresis`` for a
    :class:`jaxmp.DynamicLossScale`); ``{}`` when there is no loss scale.

  Raises:
    ValueError: if ``target`` holds more than one loss-scaling state.
  """
  if isinstance(target, LossScale):
    scales = [target]
  else:
    scales = _loss_scales(target)
  if not scales:
    return {}
  if len(scales) > 1:
    raise ValueError(
        f"loss_scale_config: found {len(scales)} loss-scaling states; wrap the "
        "whole optimizer once with jaxmp.loss_scaling."
    )
  return scales[0].config()


def _config(target: Any, fallback: Any = None) -> dict[str, Any]:
  config = {"loss_scale": loss_scale_config(target)}
  policy = getattr(target, "policy", None)
  if policy is None and fallback is not None:
    policy = fallback.policy  # a target that carries no policy
  if policy is not None:
    config["policy"] = str(policy)
  if fallback is not None:
    config[_FALLBACK] = fallback_config(fallback)
  return config


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def _sibling(directory: pathlib.Path, role: str) -> pathlib.Path:
  """A hidden directory beside ``directory``, where a rename is atomic.

  A forced save writes the new checkpoint in ``"writing"`` and moves the old
  one to ``"replaced"`` while it swaps them.
  """
  return directory.with_name(f".{directory.name}.jaxmp-{role}")


def _restorable(directory: pathlib.Path) -> pathlib.Path:
  """``directory``, or the old checkpoint a forced save killed mid-swap moved aside."""
  aside = _sibling(directory, "replaced")
  return aside if not directory.exists() and aside.is_dir() else directory


def _path(key_path: tuple[Any, ...]) -> str:
  """``opt_state/inner_state/0/mu/kernel``: a key path as orbax names it."""
  return jax.tree_util.keystr(key_path, simple=True, separator="/")


def _check_arrays(directory: pathlib.Path, items: Any) -> None:
  """Compares the saved arrays' paths and shapes with the target's; explains.

  Orbax would refuse the same mismatches, with a tree dump, a TensorStore
  spec and tracebacks on stderr; this reads only the checkpoint's metadata.
  """
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  try:
    metadata = ocp.StandardCheckpointHandler().metadata(directory).tree
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise ValueError(
        f"restore_checkpoint: cannot read the array metadata in {directory} "
        f"({type(e).__name__}: {e}). The checkpoint is incomplete or was not "
        "written by orbax: save it again with jaxmp.flax.save_checkpoint."
    ) from None
  saved = {_path(k): leaf for k, leaf in jax.tree_util.tree_leaves_with_path(metadata)}
  target = {_path(k): leaf for k, leaf in jax.tree_util.tree_leaves_with_path(items)}
  only_saved = [path for path in saved if path not in target]
  only_target = [path for path in target if path not in saved]
  if only_saved or only_target:
    parts = []
    if only_saved:
      parts.append(f"only in the checkpoint: {listing(only_saved)}")
    if only_target:
      parts.append(f"only in the target: {listing(only_target)}")
    raise ValueError(
        "restore_checkpoint: the checkpoint and the target hold different "
        f"arrays ({'; '.join(parts)}), so it was saved for another model or "
        "optimizer (optax.adam's mu and nu against optax.sgd's trace, say). "
        "Build the target with the model and optimizer that wrote it. To "
        "change the optimizer, restore into that target, then start the new "
        "one from its params: TrainState.create(..., params=restored.params, "
        "tx=new_optimizer)."
    )
  shapes = [
      f"{path}: {tuple(saved[path].shape)} in the checkpoint, "
      f"{tuple(leaf.shape)} in the target"
      for path, leaf in target.items()
      if hasattr(leaf, "shape") and tuple(saved[path].shape) != tuple(leaf.shape)
  ]
  if shapes:
    raise ValueError(
        "restore_checkpoint: the arrays of the checkpoint and of the target "
        f"have different shapes ({listing(shapes, '; ')}), so it was saved for a "
        "model of another size. Build the target with the model "
        "configuration that wrote it (layer sizes, vocabulary, batch "
        "dimensions of the state)."
    )


def _kind_of_checkpoint(directory: pathlib.Path) -> str:
  """``"jaxmp"``, ``"orbax"`` (a plain pytree checkpoint), or raises."""
  if not directory.exists():
    raise FileNotFoundError(
        f"restore_checkpoint: there is no checkpoint at {directory}. Pass the "
        "directory given to jaxmp.flax.save_checkpoint (one per step, e.g. "
        ".../step_1000)."
    )
  if (directory / _STATE).is_dir() and (directory / _CONFIG).is_dir():
    return "jaxmp"
  if (directory / "_METADATA").exists():
    return "orbax"
  raise ValueError(
      f"restore_checkpoint: {directory} is not a checkpoint written by "
      "jaxmp.flax.save_checkpoint or by orbax (it has no "
      f"'{_STATE}' and '{_CONFIG}' items and no orbax metadata; its entries: "
      f"{listing(sorted(p.name for p in directory.iterdir())) or 'none'}). "
      "Pass the directory of one checkpoint (e.g. .../step_1000), not its "
      "parent."
  )


def save_checkpoint(directory: str | os.PathLike[str], target: Any, *,
                    force: bool = False, fallback: Any = None) -> None:
  """Saves a training state with orbax, loss scale and its configuration included.

  Args:
    directory: the checkpoint directory (created; it must not exist unless
      ``force``).
    target: a :class:`jaxmp.flax.TrainState` or any pytree of arrays, or NNX
      objects (an ``nnx.Optimizer``, or a tuple such as ``(model,
      optimizer)``), whose ``nnx.state`` is saved.
    force: overwrite an existing checkpoint. The new checkpoint is written
      beside the old one, which it replaces only once complete: a save that
      fails or is killed leaves the old one restorable. Without it, an
      existing ``directory`` is refused.
    fallback: the :class:`jaxmp.PrecisionFallback` that watches the run, if
      any: its state (the current policy, the switches) is saved too, and
      its policy is recorded for targets that carry none (an optax state,
      NNX objects).

  Raises:
    ValueError: if ``directory`` exists and ``force`` is false.

  Example:
    >>> import os, tempfile, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(period=7))
    >>> state = tx.init(jnp.ones(2))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_0")
    >>> jaxmp.flax.save_checkpoint(path, state)
    >>> restored = jaxmp.flax.restore_checkpoint(path, state)
    >>> jaxmp.get_loss_scale(restored).period
    7
  """
  ocp, checkpointer = _checkpointer()
  items = target
  if _is_nnx_node(target):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    items = nnx.state(target)

  def write(path: pathlib.Path) -> None:
    checkpointer.save(path, args=ocp.args.Composite(
        state=ocp.args.StandardSave(items),
        jaxmp_config=ocp.args.JsonSave(_config(target, fallback)),
    ))

  directory = pathlib.Path(os.path.abspath(os.fspath(directory)))
  if not force and directory.exists():
    raise ValueError(
        f"save_checkpoint: {directory} already exists. Pass force=True to "
        "overwrite it: the new checkpoint is written beside the old one and "
        "replaces it only once complete (an atomic rename), so a save that "
        "fails or is killed leaves the old one restorable. Or save each step "
        "to a directory of its own (.../step_1000).")
  aside = _sibling(directory, "replaced")
  if not force or not (directory.exists() or aside.exists()):
    write(directory)  # orbax writes beside it and renames: atomic
    return
  # orbax's force deletes the old checkpoint before it writes the new one.
  # Write the new one beside it instead, and swap them once it is complete.
  work = _sibling(directory, "writing")
  primary = jax.process_index() == 0
  if primary:
    shutil.rmtree(work, ignore_errors=True)  # what a killed save left
    work.mkdir()
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
  """Restores a checkpoint written by :func:`save_checkpoint` into ``target``.

  A plain orbax checkpoint (written by ``ocp.StandardCheckpointer``) has no
  configuration to check: it is restored with ``check_config=False`` and
  refused otherwise. Before any array is read, the paths and shapes of the
  saved arrays are compared with the target's, so that a checkpoint of
  another optimizer or model size is refused with the differing paths named,
  not with orbax's tree dump. Arrays are cast to the target's dtypes, as
  orbax does.

  Args:
    directory: the checkpoint directory.
    target: what to restore into. A pytree (e.g. the
      :class:`jaxmp.flax.TrainState` built by your code, or
      ``jax.eval_shape`` of it) gives the structure, dtypes and static
      configuration; a new pytree is returned. NNX objects (an
      ``nnx.Optimizer``, or a tuple such as ``(model, optimizer)``) are
      updated in place and returned.
    check_config: compare the saved loss-scale configuration and policy with
      the target's, and raise if they differ.
    fallback: the :class:`jaxmp.PrecisionFallback` of the resumed run, for a
      checkpoint saved with one. When the saved run had switched precision,
      the target (built in the ladder's first policy, as at the start of the
      run) is switched to the saved policy with
      :func:`jaxmp.switch_precision` before the arrays are read (an NNX
      target must then be ``(model, optimizer)``), and once the restore
      succeeded the controller resumes the saved state (policy, rung,
      switches). With a plain optax state, train on under
      ``fallback.policy``.

  Returns:
    The restored state.

  Raises:
    FileNotFoundError: if ``directory`` does not exist.
    ValueError: if ``check_config`` and the loss scale's configuration or the
      policy of ``target`` differ from the saved ones (or the checkpoint is a
      plain orbax one, which has none, or was saved with a
      ``PrecisionFallback`` and none is given); if ``fallback`` is given and
      the checkpoint holds no controller state or one of another ladder;
      and, whatever ``check_config``, if
      the target holds a different kind of loss scale (e.g. a float32 run's
      ``NoOpLossScale`` restored into a ``mixed_float16`` target with a
      ``DynamicLossScale``), other arrays (another optimizer or model) or
      other shapes, or if ``directory`` is not a checkpoint.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> make = lambda period: jaxmp.loss_scaling(
    ...     optax.sgd(0.1), jaxmp.DynamicLossScale(period=period)).init(jnp.ones(2))
    >>> path = os.path.join(tempfile.mkdtemp(), "step_0")
    >>> jaxmp.flax.save_checkpoint(path, make(7))
    >>> restored = jaxmp.flax.restore_checkpoint(path, jax.eval_shape(lambda: make(7)))
    >>> float(jaxmp.get_loss_scale(restored).loss_scale)
    32768.0
    >>> try:
    ...   jaxmp.flax.restore_checkpoint(path, make(2000))
    ... except ValueError as e:
    ...   print(str(e)[:49])
    restore_checkpoint: the checkpoint was saved with
  """
  ocp, checkpointer = _checkpointer()
  directory = _restorable(pathlib.Path(os.path.abspath(os.fspath(directory))))
  nnx_target = _is_nnx_node(target)
  fallback_state = None
  if nnx_target:
    from flax import nnx  # pylint: disable=g-import-not-at-top

    items = nnx.state(target)
  else:
    items = target
  if _kind_of_checkpoint(directory) == "orbax":
    if fallback is not None:
      resume_target(target, None, fallback)  # raises: no controller state saved
    if check_config:
      raise ValueError(
          f"restore_checkpoint: {directory} is a plain orbax checkpoint (e.g. "
          "from ocp.StandardCheckpointer), not one written by "
          "jaxmp.flax.save_checkpoint, so it holds no loss-scale "
          "configuration or policy to check. Pass check_config=False to "
          "restore its arrays (the configuration then comes from the target, "
          "unchecked), and save with jaxmp.flax.save_checkpoint from then on."
      )
    _check_arrays(directory, items)
    restored = ocp.StandardCheckpointer().restore(directory, items)
  else:
    # The configuration and the arrays' paths and shapes are checked before
    # the arrays are read, so that a mismatch is explained here rather than
    # by orbax's tree comparison.
    saved = checkpointer.restore(
        directory, args=ocp.args.Composite(jaxmp_config=ocp.args.JsonRestore())
    ).jaxmp_config
    saved = dict(saved or {})
    saved_fallback = saved.get(_FALLBACK)
    if fallback is not None:
      target, fallback_state = resume_target(target, saved_fallback, fallback)
      if _is_nnx_node(target):
        items = nnx.state(target)  # the switched optimizer state
      else:
        items = target
    elif saved_fallback is not None and check_config:
      raise ValueError(
          "restore_checkpoint: the checkpoint was saved with a "
          "jaxmp.PrecisionFallback, whose run is in the policy "
          f"{saved.get('policy')} after {len(saved_fallback['events'])} "
          "switch(es). Pass the run's controller: restore_checkpoint(..., "
          "fallback=jaxmp.PrecisionFallback(ladder)), which switches the "
          "target to that policy; or check_config=False to restore into the "
          "target as it is."
      )
    else:
      saved.pop(_FALLBACK, None)
    expected = _config(target)
    if fallback is not None:
      expected.setdefault("policy", str(fallback_state["policy"]))
      expected[_FALLBACK] = saved_fallback
    saved_type = (saved or {}).get("loss_scale", {}).get("type")
    expected_type = expected["loss_scale"].get("type")
    if saved_type != expected_type:
      raise ValueError(
          f"restore_checkpoint: the checkpoint holds a {saved_type or 'no loss scale'}"
          f" and the target a {expected_type or 'no loss scale'}, so their arrays "
          "differ (as when switching between float32 and mixed_float16), and "
          "check_config=False cannot bridge that. Restore into a target built "
          f"with the saved configuration {saved}, then start the new run from "
          "its params (TrainState.create(..., params=restored.params, "
          "policy=...)), keeping "
          "the optimizer moments with opt_state._replace(inner_state="
          "restored.opt_state.inner_state) if you wish."
      )
    if check_config and saved != expected:
      raise ValueError(
          "restore_checkpoint: the checkpoint was saved with the configuration "
          f"{saved}, but the target has {expected}. The loss scale's "
          "configuration and the policy come from the target (your code). "
          "Build the target with the saved configuration, or pass "
          "check_config=False to resume under the new one."
      )
    _check_arrays(directory / _STATE, items)
    restored = checkpointer.restore(
        directory,
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(items),
            jaxmp_config=ocp.args.JsonRestore(),
        ),
    ).state
  if fallback_state is not None:
    fallback.load_state_dict(fallback_state)
  if nnx_target:
    nnx.update(target, restored)
    return target
  return restored
