"""Checkpoints with orbax: the training state plus the loss scale's configuration.

The arrays of a loss scale (scale, counters) are pytree leaves and are saved
with the rest of the state. Its configuration (period, factor, hysteresis,
min/max) is static: it lives in the *target* you restore into, i.e. in your
code. :func:`save_checkpoint` also writes that configuration (and the policy)
as JSON next to the arrays, and :func:`restore_checkpoint` checks that the
target has the same, so that a changed ``period`` or ``min_loss_scale`` does
not slip through a resume unnoticed.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import LossScalingState


def _is_nnx_node(x: Any) -> bool:
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return False
  return isinstance(x, (nnx.Module, nnx.Optimizer)) or (
      isinstance(x, (tuple, list)) and x and all(_is_nnx_node(y) for y in x)
  )


def _loss_scales(target: Any) -> list[LossScale]:
  is_state = lambda x: isinstance(x, LossScalingState)
  if _is_nnx_node(target):
    from flax import nnx  # pylint: disable=g-import-not-at-top

    nodes = [node for _, node in nnx.iter_graph(target)]
  else:
    nodes = jax.tree_util.tree_leaves(target, is_leaf=is_state)
  return [node.loss_scale for node in nodes if is_state(node)]


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

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(period=7))
    >>> jaxmp.flax.loss_scale_config(tx.init(jnp.ones(2)))["period"]
    7
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


def _config(target: Any) -> dict[str, Any]:
  config = {"loss_scale": loss_scale_config(target)}
  policy = getattr(target, "policy", None)
  if policy is not None:
    config["policy"] = str(policy)
  return config


def _checkpointer():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def save_checkpoint(directory: str | os.PathLike[str], target: Any, *,
                    force: bool = False) -> None:
  """Saves a training state with orbax, loss scale and its configuration included.

  Args:
    directory: the checkpoint directory (created; it must not exist unless
      ``force``).
    target: a :class:`jaxmp.flax.TrainState` or any pytree of arrays, or NNX
      objects (an ``nnx.Optimizer``, or a tuple such as ``(model,
      optimizer)``), whose ``nnx.state`` is saved.
    force: overwrite an existing checkpoint.

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
  checkpointer.save(
      os.path.abspath(os.fspath(directory)),
      args=ocp.args.Composite(
          state=ocp.args.StandardSave(items),
          jaxmp_config=ocp.args.JsonSave(_config(target)),
      ),
      force=force,
  )


def restore_checkpoint(directory: str | os.PathLike[str], target: Any, *,
                       check_config: bool = True) -> Any:
  """Restores a checkpoint written by :func:`save_checkpoint` into ``target``.

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

  Returns:
    The restored state.

  Raises:
    ValueError: if ``check_config`` and the loss scale's configuration or the
      policy of ``target`` differ from the saved ones; and, whatever
      ``check_config``, if the target holds a different kind of loss scale
      (e.g. a float32 run's ``NoOpLossScale`` restored into a
      ``mixed_float16`` target with a ``DynamicLossScale``), whose arrays
      cannot be restored into it.

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
  directory = os.path.abspath(os.fspath(directory))
  nnx_target = _is_nnx_node(target)
  if nnx_target:
    from flax import nnx  # pylint: disable=g-import-not-at-top

    items = nnx.state(target)
  else:
    items = target
  # The configuration is checked before the arrays are read, so that a
  # mismatch is explained here rather than by orbax's tree comparison.
  saved = checkpointer.restore(
      directory, args=ocp.args.Composite(jaxmp_config=ocp.args.JsonRestore())
  ).jaxmp_config
  expected = _config(target)
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
  restored = checkpointer.restore(
      directory,
      args=ocp.args.Composite(
          state=ocp.args.StandardRestore(items),
          jaxmp_config=ocp.args.JsonRestore(),
      ),
  )
  if nnx_target:
    nnx.update(target, restored.state)
    return target
  return restored.state
