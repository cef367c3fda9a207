"""The optax wrapper (unscale, check, update or skip, adjust), its state, ``keep_on_skip``,
and the one search for that state in any pytree (:func:`loss_scaling_states_with_path`)."""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.inplace_select import check_same_structure, update_or_keep
from jaxmp._src.loss_scale import LossScale, NoOpLossScale, all_finite
from jaxmp._src.validation import (
    caller_stacklevel, check_bool, check_number, jmp_loss_scale_fix)

AxisName = Any  # a hashable axis name or a tuple of them
KeyPath = tuple[Any, ...]


class LossScalingState(NamedTuple):
  """State of :func:`loss_scaling`.

  ``inner_state`` is the wrapped optimizer's (bit-identical on skipped
  steps), ``loss_scale`` the current :class:`jaxmp.LossScale`; the int32
  counters ``skipped_steps``, ``recovered_steps``, ``fallback_steps`` and
  ``lost_steps`` and the bool ``last_finite`` are what
  :func:`loss_scaling_metrics` reports.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> state = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale()).init(jnp.zeros(2))
    >>> isinstance(state, jaxmp.LossScalingState), int(state.skipped_steps)
    (True, 0)
  """

  inner_state: optax.OptState
  loss_scale: LossScale
  skipped_steps: jax.Array
  last_finite: jax.Array
  recovered_steps: jax.Array
  fallback_steps: jax.Array
  lost_steps: jax.Array


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: AxisName | None = None,
    clip_global_norm: float | None = None,
    guard: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps a whole optimizer for loss-scaled training; skips non-finite steps.

  ``update`` takes the gradients of the *scaled* loss, unscales and checks
  them, and runs ``inner`` (with ``update``'s extra keyword arguments); on inf
  or nan the updates are ``-0.0`` and the inner state is kept bit-identical,
  with no host synchronisation. Details: docs/loss-scaling.md.

  Args:
    inner: the bare optimizer (clipping, weight decay, schedules inside).
    loss_scale: the initial loss scale.
    axis_name: inside ``shard_map`` or ``pmap``, the axes the gradients are
      split over, so that every device takes the same skip.
    clip_global_norm: clip the unscaled gradients to this global norm, in the
      reduction that checks them.
    guard: ``False`` (with ``NoOpLossScale`` only) runs ``inner`` unchecked.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(2)}
    >>> updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params)
    >>> optax.apply_updates(params, updates)["w"]  # skipped
    Array([1., 1.], dtype=float32)
    >>> float(jaxmp.get_loss_scale(state).loss_scale), int(state.skipped_steps)
    (512.0, 1)
  """
  owner = "jaxmp.loss_scaling"
  wrapped, clip_global_norm, guard, init_fn = checked_wrapper(
      owner, inner, loss_scale, clip_global_norm, guard,
      nested_fix="Wrap the bare optimizer once: jaxmp.loss_scaling("
      "optax.adamw(1e-3), loss_scale). For gradient accumulation, use "
      "jaxmp.multi_steps(optax.adamw(1e-3), loss_scale, k), which wraps it "
      "for you.")

  def update_fn(updates, state, params=None, **extra_args):
    check_update(owner, state, isinstance(state, LossScalingState), "LossScalingState",
                 updates, params)
    current = state.loss_scale
    # unscale returns float16/bfloat16 leaves in float32; the check and the
    # inner optimizer see the gradients in their own dtypes.
    unscaled = jax.tree_util.tree_map(
        lambda u, g: u.astype(jnp.result_type(g)), current.unscale(updates), updates)
    grads, finite = clip_and_check(unscaled, clip_global_norm)
    if not guard:
      inner_updates, inner_state = wrapped.update(
          grads, state.inner_state, params, **extra_args)
      return inner_updates, state._replace(inner_state=inner_state)
    finite = agree_on_finite(finite, axis_name, owner)
    updates, inner_state = step_or_skip(
        lambda g, s, p: wrapped.update(g, s, p, **extra_args),
        finite, grads, state.inner_state, params)
    lost = jnp.logical_not(finite).astype(jnp.int32)
    return updates, state._replace(
        inner_state=inner_state, loss_scale=current.adjust(finite),
        skipped_steps=state.skipped_steps + lost, last_finite=finite,
        lost_steps=state.lost_steps + lost)

  return keyed_transformation(init_fn, update_fn, owner, inner, loss_scale,
                              axis_name, clip_global_norm, guard)


# Flax keeps the FP8 meta (scales, amax histories) in this collection; its
# "gradients" are the new values, which must not be unscaled nor optimized.
_FP8_META = "_overwrite_with_gradient"


def check_update(owner: str, state: Any, state_ok: bool, expected: str, grads: Any,
                 params: Any) -> None:
  """Refuses, in an ``update``, a state not the ``expected`` one ``init`` returned (unless
  ``state_ok``), gradients holding Flax's FP8 meta, and gradients unlike the params."""
  if not state_ok:
    raise TypeError(
        f"The state passed to the update of {owner} is a {type(state).__name__}, "
        f"not the {expected} its init returned. Pass the state returned by "
        "tx.init(params).")
  if isinstance(grads, dict) and _FP8_META in grads:
    raise ValueError(
        f"{owner}'s update: the gradients hold Flax's FP8 meta collection "
        f"{_FP8_META!r}, whose values are the new scales and amax histories, "
        "not gradients: the unscale would divide them by the loss scale and "
        "the optimizer would update them. Use jaxmp.flax.TrainState, whose "
        "apply_gradients keeps the meta out of the optimizer and guards it; "
        "or pass only grads['params'] to update and keep the meta with "
        "jaxmp.keep_on_skip(opt_state, new_meta, old_meta).")
  if params is not None:
    check_same_structure(
        grads, params, owner=f"{owner}'s update", names=("the gradients", "the params"),
        fix="Differentiate with respect to the same params you pass to update "
        "(e.g. jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params)).")


def checked_wrapper(owner: str, inner: Any, loss_scale: Any, clip_global_norm: Any,
                    guard: Any, nested_fix: str) -> tuple[Any, float | None, bool, Any]:
  """The checked ``(inner, clip_global_norm, guard)`` of a wrapper, and its ``init``.

  ``init`` refuses an ``inner`` already wrapped, saying ``nested_fix``.
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"{owner} expects a loss scale such as jaxmp.DynamicLossScale(), "
        f"jaxmp.StaticLossScale(2.0**15) or jaxmp.NoOpLossScale(); got "
        f"{loss_scale!r}.{jmp_loss_scale_fix(loss_scale)}")
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"{owner} expects an optax.GradientTransformation to wrap, e.g. "
        f"optax.adamw(1e-3); got {inner!r}.")
  if clip_global_norm is not None:
    clip_global_norm = check_number(
        owner, "clip_global_norm", clip_global_norm, minimum=0.0,
        exclusive_minimum=True,
        advice="Pass the max global norm of the unscaled gradients, e.g. "
        "1.0, or None for no clipping.")
  guard = check_bool(owner, "guard", guard, advice="guard=False turns the "
                     "finiteness check off; it needs jaxmp.NoOpLossScale().")
  if not guard and not isinstance(loss_scale, NoOpLossScale):
    raise ValueError(
        f"{owner}(guard=False) needs jaxmp.NoOpLossScale(), got "
        f"{type(loss_scale).__name__}: a loss scale that adjusts or that "
        "scales float16 gradients needs the finiteness check to skip their "
        "overflows. Keep guard=True, or train in bfloat16 with "
        "jaxmp.NoOpLossScale().")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    check_no_loss_scaling_state(
        inner_state, owner=owner, subject="the optimizer it wraps", fix=nested_fix)
    zero = lambda: jnp.zeros([], jnp.int32)  # distinct buffers, donated apart
    return LossScalingState(
        inner_state=inner_state,
        loss_scale=jax.tree_util.tree_map(jnp.asarray, loss_scale),
        skipped_steps=zero(), last_finite=jnp.ones([], jnp.bool_),
        recovered_steps=zero(), fallback_steps=zero(), lost_steps=zero())

  return inner, clip_global_norm, guard, init_fn


def _by_value(x: Any) -> bool:  # as a key part: hashable, and no tracer
  try:
    hash(x)
  except TypeError:
    return False
  return not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))


class _Keyed:
  """A function equal to another built from equal arguments (by identity where
  not hashable or traced), so a pytree holding it as static data (a
  TrainState's ``tx``) has one structure however often it is built."""

  def __init__(self, fn: Any, key: tuple[Any, ...]):
    self._fn, self._key = fn, key

  def __call__(self, *args, **kwargs):
    return self._fn(*args, **kwargs)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Keyed) and len(self._key) == len(other._key) and all(
        a is b or (_by_value(a) and _by_value(b) and a == b)
        for a, b in zip(self._key, other._key))

  def __hash__(self) -> int:
    return hash(tuple(part for part in self._key if _by_value(part)))


def keyed_transformation(init_fn: Any, update_fn: Any, *key: Any
                         ) -> optax.GradientTransformationExtraArgs:
  """The transformation of ``init_fn`` and ``update_fn``, equal to any with an equal ``key``."""
  return optax.GradientTransformationExtraArgs(
      _Keyed(init_fn, ("init", *key)), _Keyed(update_fn, ("update", *key)))


def agree_on_finite(finite: jax.Array, axis_name: AxisName | None,
                    owner: str) -> jax.Array:
  """The flag ``finite``, true only where true on every device of ``axis_name``."""
  if axis_name is None:
    return finite
  try:
    return jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
  except NameError:
    raise ValueError(
        f"{owner}(axis_name={axis_name!r}): that axis name is "
        "not bound where update runs. Call update inside jax.shard_map or "
        "jax.pmap over that axis, or drop axis_name under plain jax.jit, "
        "where the finiteness check over sharded arrays is already global.") from None


def step_or_skip(update: Any, applies: jax.Array, grads: Any, inner_state: Any,
                 params: Any) -> tuple[Any, Any]:
  """``update(grads, inner_state, params)`` where ``applies``; else updates of
  ``-0.0`` (``p + u`` is ``p`` bit for bit) and ``inner_state``, selected in place."""
  inner_updates, inner_state = update_or_keep(
      update, applies, grads, inner_state, params)
  updates = jax.tree_util.tree_map(
      lambda u: jnp.where(applies, u, jnp.asarray(-0.0, u.dtype)), inner_updates)
  return updates, inner_state


# Scales finite float32 values down before squaring: their sum of squares
# overflows only beyond a global norm of 2**134 (small values underflow).
_HUGE_NORM_SCALE = 2.0**-70


def _sum_once(parts: list[jax.Array]) -> jax.Array:
  """The sum of scalars as the last of a cumulative sum: XLA copies a chain of
  scalar adds into every kernel reading it (each then compiled apart), not a
  reduce-window."""
  return jnp.cumsum(jnp.stack(parts))[-1]


def _add_pairwise(a, b):
  # Defined once, so an un-jitted call finds the reduce it compiled before.
  return a[0] + b[0], a[1] + b[1]


def global_norm_and_finite(tree: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  """``(scale, scaled_norm, finite)``: the float32 global norm is ``scaled_norm / scale``.

  One pass sums the squares as they are (optax's norm, where finite) and
  scaled by ``2**-70`` (where huge finite values overflowed the first);
  ``finite`` is :func:`jaxmp.all_finite`'s decision, false beyond ``2**134``.
  """
  plain, scaled = [], []
  zero = jnp.zeros([], jnp.float32)
  for x in jax.tree_util.tree_leaves(tree):
    x = jnp.asarray(x)
    parts = (jnp.real(x), jnp.imag(x)) if jnp.iscomplexobj(x) else (x,)
    for part in parts:
      part = part.astype(jnp.float32)
      # One variadic reduction: XLA reads the leaf once for both sums.
      plain_sum, scaled_sum = jax.lax.reduce(
          (jnp.square(part), jnp.square(part * _HUGE_NORM_SCALE)),
          (zero, zero), _add_pairwise, tuple(range(part.ndim)))
      plain.append(plain_sum)
      scaled.append(scaled_sum)
  if not plain:
    return jnp.ones([], jnp.float32), jnp.zeros([], jnp.float32), jnp.array(True)
  plain_sum, scaled_sum = _sum_once(plain), _sum_once(scaled)
  use_plain = jnp.isfinite(plain_sum)
  scale = jnp.where(use_plain, 1.0, _HUGE_NORM_SCALE).astype(jnp.float32)
  scaled_norm = jnp.sqrt(jnp.where(use_plain, plain_sum, scaled_sum))
  return scale, scaled_norm, jnp.isfinite(scaled_sum)


def clip_and_check(grads: Any, clip_global_norm: float | None
                   ) -> tuple[Any, jax.Array]:
  """``(grads, all_finite(grads))``, or clipped as by ``optax.clip_by_global_norm``."""
  if clip_global_norm is None:
    return grads, all_finite(grads)
  scale, scaled_norm, finite = global_norm_and_finite(grads)
  keep = scaled_norm < clip_global_norm * scale
  # One scalar division: an elementwise division is an expensive op to XLA,
  # whose result it then writes to memory instead of fusing it.
  factor = clip_global_norm / scaled_norm

  def clip(t):
    if not jnp.issubdtype(t.dtype, jnp.inexact):
      return t
    wide = t if t.dtype == jnp.float32 else t.astype(jnp.float32)
    clipped = (wide * scale) * factor
    return jax.lax.select(keep, t, clipped.astype(t.dtype))

  return jax.tree_util.tree_map(clip, grads), finite


def loss_scaling_states_with_path(tree: Any) -> list[tuple[KeyPath, LossScalingState]]:
  """Every :class:`LossScalingState` in ``tree`` (optax states, a ``TrainState``,
  NNX objects) with its path, outermost first."""
  return optax.tree_utils.tree_get_all_with_path(
      tree, LossScalingState.__name__,
      filtering=lambda _, value: isinstance(value, LossScalingState))


def _find_states(tree: Any) -> list[LossScalingState]:  # without their paths
  return [state for _, state in loss_scaling_states_with_path(tree)]


def _path_text(path: KeyPath) -> str:
  return jax.tree_util.keystr(path) or "the top"


def check_no_loss_scaling_state(state: Any, *, owner: str, subject: str,
                                fix: str) -> None:
  """Refuses an optimizer ``state`` (or its ``eval_shape``) holding a loss-scaling
  state: wrapping twice would unscale twice. ``subject`` is what was given."""
  found = loss_scaling_states_with_path(state)
  if found:
    path = jax.tree_util.keystr(found[0][0])
    where = f" at {path}" if path else ""
    raise ValueError(
        f"{owner}: {subject} is already wrapped with jaxmp.loss_scaling (its "
        f"state holds a LossScalingState{where}), so the gradients would be "
        "unscaled twice and get_loss_scale would report only one of the "
        f"scales. {fix}")


def _find_state(opt_state: Any, caller: str) -> LossScalingState:
  """The one loss-scaling state in ``opt_state``; warns where it is misplaced."""
  found = loss_scaling_states_with_path(opt_state)
  if not found:
    raise ValueError(
        f"{caller}: no jaxmp.loss_scaling state found in the given optimizer "
        f"state (a {type(opt_state).__name__}). Wrap the optimizer with "
        "jaxmp.loss_scaling(optax.adamw(...), jaxmp.DynamicLossScale()) and pass "
        "the state its init returned.")
  if len(found) > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {len(found)} jaxmp.loss_scaling "
        "states (at "
        + ", ".join(_path_text(path) for path, _ in found)
        + "), so the loss scale is ambiguous. Wrap the whole optimizer once "
        "with jaxmp.loss_scaling instead of wrapping its parts.")
  path, state = found[0]
  problem = _placement_problem(opt_state, path)
  if problem is not None:
    warnings.warn(
        f"{caller}: the jaxmp.loss_scaling state sits at {_path_text(path)} of "
        f"the optimizer state, {problem}. A transformation outside the wrapper "
        "sees the scaled gradients (optax.clip_by_global_norm(1.0) would clip "
        "gradients 2**15 times too large) or still changes the parameters on "
        "a skipped step (optax.add_decayed_weights still moves them). Put "
        "every transformation inside and wrap the whole optimizer once: "
        "jaxmp.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), "
        "optax.adamw(1e-3)), loss_scale). (optax.MultiSteps, jaxmp.multi_steps, "
        "optax.inject_hyperparams, nnx.Optimizer and jaxmp.flax.TrainState "
        "around the wrapper are fine.)", UserWarning, stacklevel=caller_stacklevel())
  return state


# Where the wrapper may sit: optax wrappers that pass every gradient to the
# wrapper and apply its updates as they are.
_ACCEPTED_WRAPPERS = frozenset({
    ("MultiStepsState", "inner_opt_state"),  # optax.MultiSteps, jaxmp.multi_steps
    ("InjectHyperparamsState", "inner_state"),  # optax.inject_hyperparams
    ("InjectStatefulHyperparamsState", "inner_state"),
})


def _is_optax_state(x: Any) -> bool:
  """Whether ``x`` is the state of an optax transformation (or of a chain)."""
  if isinstance(x, LossScalingState):
    return True
  if isinstance(x, tuple) and hasattr(x, "_fields"):  # a named tuple
    return type(x).__module__.split(".")[0] == "optax"
  if type(x) is tuple:  # pylint: disable=unidiomatic-typecheck
    return bool(x) and all(_is_optax_state(y) for y in x)
  return False


def _placement_problem(tree: Any, path: KeyPath) -> str | None:
  """Why the state at ``path`` is misplaced (inside an optax wrapper not accepted,
  or next to other transformations in a chain), or None."""
  node = tree
  for entry in path:
    if isinstance(node, tuple) and hasattr(node, "_fields"):
      name = getattr(entry, "name", None)
      kind = type(node).__name__
      if (_is_optax_state(node) and not isinstance(node, LossScalingState)
          and (kind, name) not in _ACCEPTED_WRAPPERS):
        return f"inside the state of an optax wrapper ({kind})"
      node = getattr(node, name)
    elif isinstance(node, dict) and hasattr(entry, "key") or (
        type(node) in (tuple, list) and hasattr(entry, "idx")):
      named = isinstance(node, dict)
      chain, here = ("optax.named_chain", entry.key) if named else ("optax.chain", entry.idx)
      items = node.items() if named else enumerate(node)
      if any(_is_optax_state(x) for k, x in items if k != here):
        return f"inside {chain}, next to other transformations"
      node = node[here]
    elif hasattr(entry, "name"):  # a dataclass field, an NNX attribute
      node = getattr(node, entry.name)
    elif hasattr(entry, "key"):
      node = node[entry.key]
    else:  # a custom node that names no keys: nothing to tell
      return None
  return None


def get_loss_scale(opt_state: Any) -> LossScale:
  """The current loss scale in an optimizer state, wherever the wrapper's state sits.

  Warns where the wrapper sits inside ``optax.chain`` or another optax wrapper.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = optax.MultiSteps(
    ...     jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.StaticLossScale(8.0)), 4)
    >>> float(jaxmp.get_loss_scale(tx.init(jnp.ones(3))).loss_scale)
    8.0
  """
  return plain_loss_scale(_find_state(opt_state, "get_loss_scale"))


def plain_loss_scale(state: LossScalingState) -> LossScale:
  """The loss scale of ``state`` as plain arrays (not NNX Variables)."""
  return jax.tree_util.tree_map(
      jnp.asarray, state.loss_scale, is_leaf=lambda x: hasattr(x, "__jax_array__"))


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalar arrays describing loss scaling, for logging; jit-safe (keys: docs/loss-scaling.md).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    >>> _, state = tx.update(jnp.array([jnp.nan, 1.0]), tx.init(jnp.ones(2)))
    >>> metrics = jaxmp.loss_scaling_metrics(state)
    >>> int(metrics["skipped"]), int(metrics["skipped_steps"]), float(metrics["loss_scale"])
    (1, 1, 16384.0)
  """
  return metrics_of(_find_state(opt_state, "loss_scaling_metrics"))


def metrics_of(state: LossScalingState) -> dict[str, jax.Array]:
  """The dict of :func:`loss_scaling_metrics` for one loss-scaling state."""
  last_finite = jnp.asarray(state.last_finite)
  return {**state.loss_scale.metrics(),
          "skipped": jnp.logical_not(last_finite).astype(jnp.int32),
          "skipped_steps": jnp.asarray(state.skipped_steps), "last_finite": last_finite,
          **{name: jnp.asarray(getattr(state, name))
             for name in ("recovered_steps", "fallback_steps", "lost_steps")}}


def with_loss_scale(tree: Any, loss_scale: LossScale) -> Any:
  """``tree`` with the loss scale of its loss-scaling state replaced; every other leaf kept."""
  is_state = lambda x: isinstance(x, LossScalingState)
  return jax.tree_util.tree_map(
      lambda x: x._replace(loss_scale=loss_scale) if is_state(x) else x,
      tree, is_leaf=is_state)


def with_initial_loss_scale(
    tx: optax.GradientTransformation, loss_scale: LossScale
) -> optax.GradientTransformationExtraArgs:
  """``tx`` (built on :func:`loss_scaling`), whose ``init`` starts from ``loss_scale``."""
  device_scale = jax.tree_util.tree_map(jnp.asarray, loss_scale)
  return keyed_transformation(
      lambda params: with_loss_scale(tx.init(params), device_scale),
      optax.with_extra_args_support(tx).update, "with_initial_loss_scale",
      tx, loss_scale)


def keep_on_skip(opt_state: Any, new: Any, old: Any) -> Any:
  """``new`` where the last update was applied, ``old`` (bit-identical) where it was skipped.

  The one guard of state the optimizer does not own (BatchNorm statistics,
  EMA params, FP8 meta, NNX variables), on the flag of the loss-scaling state
  in ``opt_state``; under accumulation, this micro-batch's
  ``skip_state["should_skip"]`` (a plain ``optax.MultiSteps`` is refused).
  ``new`` is cast to ``old``'s dtypes; for NNX, ``old`` is a copy (docs/nnx.md).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    >>> _, opt_state = tx.update(jnp.array([jnp.inf, 0.0]), tx.init(jnp.ones(2)))
    >>> jaxmp.keep_on_skip(opt_state, {"mean": jnp.full(2, jnp.inf)}, {"mean": jnp.zeros(2)})
    {'mean': Array([0., 0.], dtype=float32)}
  """
  applied = jnp.asarray(_find_state(opt_state, "jaxmp.keep_on_skip").last_finite)
  [(path, _)] = loss_scaling_states_with_path(opt_state)
  for outer, state in optax.tree_utils.tree_get_all_with_path(
      opt_state, optax.MultiStepsState.__name__,
      filtering=lambda _, x: isinstance(x, optax.MultiStepsState)):
    if path[:len(outer)] != outer:  # not around the loss-scaling state
      continue
    skip = state.skip_state
    if not (isinstance(skip, dict) and "should_skip" in skip
            and set(skip) <= {"should_skip", "num_not_finite"}):
      raise ValueError(
          "jaxmp.keep_on_skip: the loss-scaling state sits inside "
          "optax.MultiSteps, whose state does not record whether this "
          f"micro-batch's gradients were finite (its skip_state is {skip!r}); "
          "the flag of the last completed step would write the values of a "
          "nan micro-batch. Use jaxmp.multi_steps(optax.adamw(1e-3), "
          "loss_scale, k), which records it, or optax.MultiSteps(..., "
          "should_skip_update_fn=optax.skip_not_finite).")
    applied = ~jnp.asarray(skip["should_skip"])  # this micro-batch's
  # nnx.state(model) taken before the step holds the model's own Variables,
  # which the step updated in place: nothing would be kept.
  is_variable = lambda x: hasattr(x, "get_value") and hasattr(x, "set_value")
  if any(is_variable(a) and a is b for a, b in zip(
      jax.tree_util.tree_leaves(new, is_leaf=is_variable),
      jax.tree_util.tree_leaves(old, is_leaf=is_variable))):
    raise ValueError(
        "jaxmp.keep_on_skip: the old value holds the model's own NNX "
        "variables, which the step has updated in place, so it already holds "
        "the new values and nothing would be kept. Take a copy before the "
        "step: old = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat)).")
  check_same_structure(
      new, old, owner="jaxmp.keep_on_skip",
      names=("the new value", "the old value"),
      fix="A skipped step keeps the old value, so the new one must have its "
      "structure and shapes: pass the updated collection itself (e.g. "
      "updates['batch_stats'], not the dict that holds it).")

  def select(new_leaf, old_leaf):
    new_leaf, old_leaf = jnp.asarray(new_leaf), jnp.asarray(old_leaf)
    if new_leaf.dtype != old_leaf.dtype:  # (a typed PRNG key has no astype)
      new_leaf = new_leaf.astype(old_leaf.dtype)
    return jnp.where(applied, new_leaf, old_leaf)

  return jax.tree_util.tree_map(select, new, old)
