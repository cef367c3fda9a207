"""The optax wrapper: unscale, check, update or skip, adjust the loss scale.

Also the one search for the wrapper's state in a nested optimizer state
(:func:`loss_scaling_states_with_path`), which :func:`get_loss_scale`,
:func:`loss_scaling_metrics`, :func:`jaxmp.check_loss_scale` and the
checkpoints use, and the check that refuses wrapping twice
(:func:`check_no_loss_scaling_state`).
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.inplace_select import check_same_structure, update_or_keep
from jaxmp._src.loss_scale import LossScale, NoOpLossScale, agree_across, all_finite
from jaxmp._src.validation import (
    caller_stacklevel, check_bool, check_number, jmp_loss_scale_fix)

AxisName = Any  # a hashable axis name or a tuple of them
KeyPath = tuple[Any, ...]


class LossScalingState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    inner_state: the wrapped optimizer's state; kept bit-identical on skipped
      steps.
    loss_scale: the current loss scale (a :class:`jaxmp.LossScale`).
    skipped_steps: int32, the number of steps skipped so far.
    last_finite: bool, whether the last step's gradients were finite.
    recovered_steps: int32, the steps whose batch was recovered inside the
      step (by a retry or the fallback of :func:`jaxmp.retry_skipped`).
    fallback_steps: int32, the steps among those recovered by the fallback.
    lost_steps: int32, the steps whose batch was lost: still non-finite after
      any recovery, so skipped (equal to ``skipped_steps``; the name says
      what a skip costs).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale())
    >>> state = tx.init(jnp.zeros(2))
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


def _to_device_state(loss_scale: LossScale) -> LossScale:
  return jax.tree_util.tree_map(jnp.asarray, loss_scale)


def check_grads_match_params(grads: Any, params: Any, owner: str) -> None:
  """Refuses gradients of another structure than the params (None: no check)."""
  if params is not None:
    check_same_structure(
        grads, params, owner=f"{owner}'s update",
        names=("the gradients", "the params"),
        fix="Differentiate with respect to the same params you pass to "
        "update (e.g. jaxmp.scaled_value_and_grad(loss_fn, loss_scale)"
        "(params)).")


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: AxisName | None = None,
    clip_global_norm: float | None = None,
    guard: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optimizer for loss-scaled training; skips non-finite steps.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`jaxmp.scaled_value_and_grad`). It unscales them, checks that they
  are all finite, runs ``inner`` on the unscaled gradients, and returns the
  inner updates when finite. When any gradient is inf or nan the step is
  skipped: the returned updates are ``-0.0`` (so ``optax.apply_updates``
  leaves every parameter bit-identical, signed zeros included), the inner state
  (moments, step counts, schedules) is kept bit-identical, and
  ``skipped_steps`` grows by one. In both cases the loss scale is then adjusted.

  The choice is made with ``jnp.where`` inside the inner update's elementwise
  pass: no host synchronisation, no ``lax.cond``, no extra copy of the
  parameters or of the optimizer state. (On a CPU the select is placed inside
  the inner update, where XLA would otherwise copy the state; on a GPU a plain
  ``optax.tree.where`` over the new state, which XLA fuses there.
  ``JAXMP_INPLACE_SELECT=1`` or ``0`` chooses one everywhere.)

  Wrap the whole optimizer (clipping, weight decay and schedules inside), so
  that clipping sees the unscaled gradients and nothing moves the parameters
  on a skipped step; :func:`get_loss_scale` warns when it finds the wrapper
  inside ``optax.chain`` next to other transformations.

  Args:
    inner: the optimizer to wrap. It must not hold a loss-scaling state
      itself.
    loss_scale: the initial loss scale (:class:`jaxmp.DynamicLossScale`,
      :class:`jaxmp.StaticLossScale` or :class:`jaxmp.NoOpLossScale`).
    axis_name: inside ``pmap`` or ``shard_map``, the axis name (or tuple of
      names) over which the gradients are split, so that all devices agree on
      skipping. Not needed under plain ``jit`` with sharded arrays, where the
      finiteness check is already global.
    clip_global_norm: if given, the unscaled gradients are clipped to this
      global norm before ``inner`` runs (as
      ``optax.chain(optax.clip_by_global_norm(clip_global_norm), inner)``
      would), and the finiteness flag is taken from the same reduction: the
      check costs no extra read of the gradients. Use it instead of
      ``optax.clip_by_global_norm`` inside ``inner``. The norm is summed in
      float32 and is safe against overflow (see docs/loss-scaling.md).
    guard: whether to check the gradients and skip non-finite steps (default
      True). ``guard=False`` is only allowed with a
      :class:`jaxmp.NoOpLossScale` (bfloat16 or float32 training): the step
      then runs the inner update unchecked, a nan step included, and costs
      what the bare optimizer costs.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra keyword arguments of
    ``update`` are passed through to ``inner``. Its state is a ``NamedTuple``
    with ``inner_state`` (``inner``'s state, bit-identical after a skipped
    step), ``loss_scale``, and the int32/bool counters that
    :func:`loss_scaling_metrics` reads (``skipped_steps``, ``last_finite``,
    ``recovered_steps``, ``fallback_steps``, ``lost_steps``).

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale or ``inner`` not an optax
      transformation, ``clip_global_norm`` not a number or ``guard`` not a
      bool.
    ValueError: if ``clip_global_norm`` is not a finite number above 0, or
      ``guard=False`` with a loss scale other than ``NoOpLossScale``.
    ValueError: from ``init``, if ``inner``'s state already holds a
      loss-scaling state (wrapping twice would unscale twice).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([jnp.inf, 1.0])}  # an overflow: skipped
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([1., 1.], dtype=float32)
    >>> float(jaxmp.get_loss_scale(state).loss_scale), int(state.skipped_steps)
    (512.0, 1)
  """
  return wrap_with_loss_scaling(
      inner, loss_scale, axis_name=axis_name, owner="jaxmp.loss_scaling",
      clip_global_norm=clip_global_norm, guard=guard,
      nested_fix="Wrap the bare optimizer once: jaxmp.loss_scaling("
      "optax.adamw(1e-3), loss_scale). For gradient accumulation, use "
      "jaxmp.multi_steps(optax.adamw(1e-3), loss_scale, k), which wraps it "
      "for you.")


def wrap_with_loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: AxisName | None,
    owner: str,
    nested_fix: str,
    clip_global_norm: float | None = None,
    guard: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """:func:`loss_scaling`, with the errors of an ``owner`` that wraps for you.

  ``nested_fix`` is what the refusal of a wrapped ``inner`` tells the user to
  do instead (``jaxmp.multi_steps`` names its own composition).
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"{owner} expects a loss scale such as jaxmp.DynamicLossScale(), "
        f"jaxmp.StaticLossScale(2.0**15) or jaxmp.NoOpLossScale(); got "
        f"{loss_scale!r}.{jmp_loss_scale_fix(loss_scale)}"
    )
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        f"{owner} expects an optax.GradientTransformation to wrap, e.g. "
        f"optax.adamw(1e-3); got {inner!r}."
    )
  clip_global_norm, guard = check_guard_options(
      owner, loss_scale, clip_global_norm, guard)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    inner_state = inner.init(params)
    check_no_loss_scaling_state(
        inner_state, owner=owner, subject="the optimizer it wraps",
        fix=nested_fix)
    return LossScalingState(
        inner_state=inner_state,
        loss_scale=_to_device_state(loss_scale),
        skipped_steps=jnp.zeros([], jnp.int32),
        last_finite=jnp.ones([], jnp.bool_),
        recovered_steps=jnp.zeros([], jnp.int32),
        fallback_steps=jnp.zeros([], jnp.int32),
        lost_steps=jnp.zeros([], jnp.int32),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          f"The state passed to the update of {owner} is a "
          f"{type(state).__name__}, not the LossScalingState its init "
          "returned. Pass the state returned by tx.init(params)."
      )
    _refuse_fp8_meta(updates, owner)
    check_grads_match_params(updates, params, owner)
    current = state.loss_scale
    # unscale returns float16/bfloat16 leaves in float32; the check and the
    # inner optimizer see the gradients in their own dtypes.
    unscaled = jax.tree_util.tree_map(
        lambda u, g: u.astype(jnp.result_type(g)), current.unscale(updates), updates)
    grads, finite = clip_and_check(unscaled, clip_global_norm)
    if not guard:
      inner_updates, inner_state = inner.update(
          grads, state.inner_state, params, **extra_args)
      return inner_updates, state._replace(inner_state=inner_state)
    finite = agree_on_finite(finite, axis_name, owner)
    updates, inner_state = step_or_skip(
        lambda g, s, p: inner.update(g, s, p, **extra_args),
        finite, grads, state.inner_state, params)
    lost = jnp.logical_not(finite).astype(jnp.int32)
    new_state = state._replace(
        inner_state=inner_state,
        loss_scale=current.adjust(finite),
        skipped_steps=state.skipped_steps + lost,
        last_finite=finite,
        lost_steps=state.lost_steps + lost,
    )
    return updates, new_state

  return keyed_transformation(init_fn, update_fn, owner, inner, loss_scale,
                              axis_name, clip_global_norm, guard)


class _Keyed:
  """A function that compares and hashes by the arguments it was built from.

  Two transformations built from equal arguments then compare equal, so a
  pytree that holds one as static data (a TrainState's ``tx``) has the same
  structure whenever it is built, as Flax's own TrainState has.
  """

  def __init__(self, fn: Any, key: tuple[Any, ...]):
    self._fn, self._key = fn, key

  def __call__(self, *args, **kwargs):
    return self._fn(*args, **kwargs)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Keyed) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)


class _Same:
  """A key part equal only to one holding the same object."""

  def __init__(self, x: Any):
    self.x = x

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Same) and other.x is self.x

  def __hash__(self) -> int:
    return id(self.x)


def _key_part(x: Any) -> Any:
  """``x`` as a key part: by its own equality where it holds no tracer and
  is hashable (a loss scale by its value), else by identity."""
  try:
    hash(x)
  except TypeError:
    return _Same(x)
  traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(x))
  return _Same(x) if traced else x


def keyed_transformation(init_fn: Any, update_fn: Any, *key: Any
                         ) -> optax.GradientTransformationExtraArgs:
  """``GradientTransformationExtraArgs(init_fn, update_fn)``, equal to any
  other built from an equal ``key`` (see :class:`_Keyed`)."""
  key = tuple(_key_part(part) for part in key)
  return optax.GradientTransformationExtraArgs(
      _Keyed(init_fn, ("init", *key)), _Keyed(update_fn, ("update", *key)))


# Flax keeps the FP8 meta (scales, amax histories) in this collection; its
# "gradients" are the new values, which must not be unscaled nor optimized.
_FP8_META = "_overwrite_with_gradient"


def _refuse_fp8_meta(updates: Any, owner: str) -> None:
  """Refuses gradients that hold Flax's FP8 meta collection."""
  if isinstance(updates, dict) and _FP8_META in updates:
    raise ValueError(
        f"{owner}'s update: the gradients hold Flax's FP8 meta collection "
        f"{_FP8_META!r}, whose values are the new scales and amax histories, "
        "not gradients: the unscale would divide them by the loss scale and "
        "the optimizer would update them. Use jaxmp.flax.TrainState, whose "
        "apply_gradients keeps the meta out of the optimizer and guards it; "
        "or pass only grads['params'] to update and keep the meta with "
        "jaxmp.keep_on_skip(opt_state, new_meta, old_meta).")


def agree_on_finite(finite: jax.Array, axis_name: AxisName | None,
                    owner: str) -> jax.Array:
  """The finiteness flag, made one across ``axis_name`` (see agree_across)."""
  return agree_across(
      finite, axis_name,
      f"{owner}(axis_name={axis_name!r}): that axis name is "
      "not bound where update runs. Call update inside jax.shard_map or "
      "jax.pmap over that axis, or drop axis_name under plain jax.jit, "
      "where the finiteness check over sharded arrays is already global.")


def step_or_skip(update: Any, applies: jax.Array, grads: Any, inner_state: Any,
                 params: Any) -> tuple[Any, Any]:
  """``update(grads, inner_state, params)`` where ``applies``, else a skip.

  Where ``applies`` is false, the updates are ``-0.0`` (the exact identity of
  ``p + u``, even for ``p = -0.0``) and the state is ``inner_state``,
  bit-identical. The old state is selected where each new leaf is produced,
  so that XLA writes it once, in place (see inplace_select.py).
  """
  inner_updates, inner_state = update_or_keep(
      update, applies, grads, inner_state, params)
  updates = jax.tree_util.tree_map(
      lambda u: jnp.where(applies, u, jnp.asarray(-0.0, u.dtype)), inner_updates)
  return updates, inner_state


# The check, and the clipping that shares its reduction.

# A power of two that scales finite float32 values down before squaring, so
# that their sum of squares overflows only when the global norm exceeds
# 2**134 (about 2e40, beyond float32's largest value); small values underflow
# in this sum, which is used only when the plain one overflowed.
_HUGE_NORM_SCALE = 2.0**-70


def check_guard_options(owner: str, loss_scale: LossScale,
                        clip_global_norm: Any, guard: Any
                        ) -> tuple[float | None, bool]:
  """Validates ``clip_global_norm`` and ``guard``; returns them."""
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
  return clip_global_norm, guard


def _add_pairs(a, b):
  return a[0] + b[0], a[1] + b[1]


def _sum_once(parts: list[jax.Array]) -> jax.Array:
  """The sum of scalars, computed once, by an op that XLA does not copy.

  A chain of scalar adds (or a ``jnp.sum`` of them, which XLA splits back
  into one) is cheap, so XLA copies it into every kernel that reads the
  result: with one reader per leaf, each kernel then takes every leaf's
  partial sum, no two are alike, and each is compiled apart. The last
  element of a cumulative sum (a reduce-window, which XLA does not copy)
  is the same sum, read by every kernel as one scalar.
  """
  return jnp.cumsum(jnp.stack(parts))[-1]


def global_norm_and_finite(tree: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The global norm of ``tree`` in float32, safe against overflow.

  Returns ``(scale, scaled_norm, finite)``: the global norm is
  ``scaled_norm / scale``, and ``finite`` is true iff every leaf is finite
  (the decision of :func:`jaxmp.all_finite`). Both come from one pass over
  the leaves: each is squared and summed in float32, once as it is and once
  scaled down by ``2**-70``. Where the plain sum is finite, ``scale`` is 1 and
  ``scaled_norm`` is exactly ``sqrt`` of it (optax's ``tree.norm`` in float32);
  where only huge finite values made it overflow, the scaled sum gives the
  norm. Non-finite leaves make both sums inf or nan. Gradients are called
  non-finite also when their global norm exceeds ``2**134``, which float32
  cannot represent.
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
          (zero, zero), _add_pairs, tuple(range(part.ndim)))
      plain.append(plain_sum)
      scaled.append(scaled_sum)
  if not plain:
    one = jnp.ones([], jnp.float32)
    return one, jnp.zeros([], jnp.float32), jnp.array(True)
  plain_sum, scaled_sum = _sum_once(plain), _sum_once(scaled)
  use_plain = jnp.isfinite(plain_sum)
  scale = jnp.where(use_plain, 1.0, _HUGE_NORM_SCALE).astype(jnp.float32)
  scaled_norm = jnp.sqrt(jnp.where(use_plain, plain_sum, scaled_sum))
  return scale, scaled_norm, jnp.isfinite(scaled_sum)


def clip_and_check(grads: Any, clip_global_norm: float | None
                   ) -> tuple[Any, jax.Array]:
  """``(grads, all_finite(grads))``, or the clipped grads and the norm's flag.

  With ``clip_global_norm``, each leaf ``t`` becomes ``t * (max_norm / norm)``
  where the global norm is at least ``max_norm`` (as
  ``optax.clip_by_global_norm`` computes it), and the flag comes from the
  same reduction (:func:`global_norm_and_finite`).
  """
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


# Finding the state.


def loss_scaling_states_with_path(
    tree: Any,
) -> list[tuple[KeyPath, LossScalingState]]:
  """Every :class:`LossScalingState` in ``tree``, with its path, outermost first.

  Searches with ``optax.tree_utils.tree_get_all_with_path``, so it looks
  inside ``optax.chain``, ``optax.MultiSteps``, ``optax.inject_hyperparams``,
  a Flax ``TrainState``, an ``nnx.Optimizer`` and its ``opt_state`` (whose
  leaves are NNX variables), and any container of those (e.g. a tuple of NNX
  model and optimizer). A state nested in another is found too. Paths print
  with ``jax.tree_util.keystr``.
  """
  return optax.tree_utils.tree_get_all_with_path(
      tree, LossScalingState.__name__,
      filtering=lambda _, value: isinstance(value, LossScalingState))


def _find_states(tree: Any) -> list[LossScalingState]:
  """The loss-scaling states in ``tree``, outermost first (no paths)."""
  return [state for _, state in loss_scaling_states_with_path(tree)]


def _path_text(path: KeyPath) -> str:
  return jax.tree_util.keystr(path) or "the top"


def check_no_loss_scaling_state(state: Any, *, owner: str, subject: str,
                                fix: str) -> None:
  """Refuses an optimizer whose state already holds a loss-scaling state.

  Wrapping twice (``loss_scaling(loss_scaling(tx, ls), ls)``, or
  ``multi_steps(loss_scaling(tx, ls), ls, k)``) would unscale the gradients
  twice. ``state`` may be a real state or ``jax.eval_shape`` of ``init``.

  Args:
    state: the optimizer state to inspect.
    owner: who refuses, e.g. ``"TrainState.create"``; starts the message.
    subject: what was given, e.g. ``"tx"``.
    fix: the sentence that names the right composition.

  Raises:
    ValueError: ``"{owner}: {subject} is already wrapped with
      jaxmp.loss_scaling ..."``, ending with ``fix``.
  """
  found = loss_scaling_states_with_path(state)
  if found:
    path = jax.tree_util.keystr(found[0][0])
    where = f" at {path}" if path else ""
    raise ValueError(
        f"{owner}: {subject} is already wrapped with jaxmp.loss_scaling (its "
        f"state holds a LossScalingState{where}), so the gradients would be "
        "unscaled twice and get_loss_scale would report only one of the "
        f"scales. {fix}"
    )


def _find_state(opt_state: Any, caller: str) -> LossScalingState:
  """The one loss-scaling state in ``opt_state``; warns where it is misplaced."""
  found = loss_scaling_states_with_path(opt_state)
  if not found:
    raise ValueError(
        f"{caller}: no jaxmp.loss_scaling state found in the given optimizer "
        f"state (a {type(opt_state).__name__}). Wrap the optimizer with "
        "jaxmp.loss_scaling(optax.adamw(...), jaxmp.DynamicLossScale()) and pass "
        "the state its init returned."
    )
  if len(found) > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {len(found)} jaxmp.loss_scaling "
        "states (at "
        + ", ".join(_path_text(path) for path, _ in found)
        + "), so the loss scale is ambiguous. Wrap the whole optimizer once "
        "with jaxmp.loss_scaling instead of wrapping its parts."
    )
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
        "around the wrapper are fine.)",
        UserWarning,
        stacklevel=caller_stacklevel(),
    )
  return state


# Where the wrapper may sit: optax wrappers that pass every gradient to the
# wrapper and apply its updates as they are.
_ACCEPTED_WRAPPERS = frozenset({
    ("MultiStepsState", "inner_opt_state"),  # optax.MultiSteps, jaxmp.multi_steps
    ("InjectHyperparamsState", "inner_state"),  # optax.inject_hyperparams
    ("InjectStatefulHyperparamsState", "inner_state"),
})


def _is_named_tuple(x: Any) -> bool:
  return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_optax_state(x: Any) -> bool:
  """Whether ``x`` is the state of an optax transformation (or of a chain)."""
  if isinstance(x, LossScalingState):
    return True
  if _is_named_tuple(x):
    return type(x).__module__.split(".")[0] == "optax"
  if type(x) is tuple:  # pylint: disable=unidiomatic-typecheck
    return bool(x) and all(_is_optax_state(y) for y in x)
  return False


def _placement_problem(tree: Any, path: KeyPath) -> str | None:
  """Why the state at ``path`` of ``tree`` is not the outermost, or None.

  The wrapper is misplaced inside an optax transformation's state other than
  the accepted wrappers (``optax.masked``, ``optax.multi_transform``,
  ``optax.apply_if_finite``, ...), and next to other transformations' states
  in a plain tuple or dict (``optax.chain``, ``optax.named_chain``). Other
  containers (a ``TrainState``, an ``nnx.Optimizer``, a user's tuple of model
  and optimizer) are fine.
  """
  node = tree
  for entry in path:
    if _is_named_tuple(node):
      name = getattr(entry, "name", None)
      kind = type(node).__name__
      if (_is_optax_state(node) and not isinstance(node, LossScalingState)
          and (kind, name) not in _ACCEPTED_WRAPPERS):
        return f"inside the state of an optax wrapper ({kind})"
      node = getattr(node, name)
    elif type(node) in (tuple, list) and hasattr(entry, "idx"):
      others = [x for i, x in enumerate(node) if i != entry.idx]
      if any(_is_optax_state(x) for x in others):
        return "inside optax.chain, next to other transformations"
      node = node[entry.idx]
    elif isinstance(node, dict) and hasattr(entry, "key"):
      others = [x for k, x in node.items() if k != entry.key]
      if any(_is_optax_state(x) for x in others):
        return "inside optax.named_chain, next to other transformations"
      node = node[entry.key]
    elif hasattr(entry, "name"):  # a dataclass field, an NNX attribute
      node = getattr(node, entry.name)
    elif hasattr(entry, "key"):
      node = node[entry.key]
    else:  # a custom node that names no keys: nothing to tell
      return None
  return None


# Reading the state.


def get_loss_scale(opt_state: Any) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Finds the state of :func:`loss_scaling` anywhere in a nested optax state
  (``chain``, ``MultiSteps``, ``inject_hyperparams``, an NNX optimizer's
  state). Works inside ``jit``.

  Warns (``UserWarning``) when the wrapper sits inside ``optax.chain`` next to
  other transformations, or inside another optax wrapper than ``MultiSteps``
  or ``inject_hyperparams``: those transformations see the scaled gradients,
  or act on skipped steps. Wrap the whole optimizer instead.

  Raises:
    ValueError: if the state holds no (or more than one) loss-scaling state.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = optax.MultiSteps(
    ...     jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.StaticLossScale(8.0)), 4)
    >>> float(jaxmp.get_loss_scale(tx.init(jnp.ones(3))).loss_scale)
    8.0
  """
  return plain_loss_scale(_find_state(opt_state, "get_loss_scale"))


def plain_loss_scale(state: LossScalingState) -> LossScale:
  """The loss scale of ``state`` as plain arrays (an NNX optimizer wraps each
  leaf of its state in a Variable)."""
  return jax.tree_util.tree_map(
      jnp.asarray, state.loss_scale, is_leaf=lambda x: hasattr(x, "__jax_array__"))


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Returns scalar arrays describing loss scaling, for logging; jit-safe.

  Keys:

  * ``loss_scale`` (float32): the scale the next step will use;
  * ``skipped`` (int32): 1 if the last step was skipped, else 0: a per-step
    figure that loggers may average (the skip rate);
  * ``skipped_steps`` (int32): the steps skipped so far (cumulative);
  * ``last_finite`` (bool): whether the last step's gradients were finite;
  * ``overflows_at_min`` (int32): overflows that found the scale at its
    minimum (0 for static and no-op scales);
  * ``steps_since_adjustment`` (int32): the dynamic scale's counter (0 for
    the others);
  * ``recovered_steps`` (int32): steps whose batch was recovered inside the
    step, by a retry or the fallback of :func:`jaxmp.retry_skipped` (0
    without it), cumulative;
  * ``fallback_steps`` (int32): those recovered by the fallback, cumulative;
  * ``lost_steps`` (int32): steps whose batch was lost (non-finite even
    after recovery, so skipped); without recovery, the skipped steps.

  Warns as :func:`get_loss_scale` does.

  Raises:
    ValueError: if the state holds no (or more than one) loss-scaling state.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    >>> state = tx.init(jnp.ones(2))
    >>> _, state = tx.update(jnp.array([jnp.nan, 1.0]), state)
    >>> metrics = jaxmp.loss_scaling_metrics(state)
    >>> int(metrics["skipped"]), int(metrics["skipped_steps"]), float(metrics["loss_scale"])
    (1, 1, 16384.0)
  """
  return metrics_of(_find_state(opt_state, "loss_scaling_metrics"))


def metrics_of(state: LossScalingState) -> dict[str, jax.Array]:
  """The dict of :func:`loss_scaling_metrics` for one loss-scaling state."""
  metrics = state.loss_scale.metrics()
  last_finite = jnp.asarray(state.last_finite)
  metrics["skipped"] = jnp.logical_not(last_finite).astype(jnp.int32)
  metrics["skipped_steps"] = jnp.asarray(state.skipped_steps)
  metrics["last_finite"] = last_finite
  metrics["recovered_steps"] = jnp.asarray(state.recovered_steps)
  metrics["fallback_steps"] = jnp.asarray(state.fallback_steps)
  metrics["lost_steps"] = jnp.asarray(state.lost_steps)
  return metrics


# Replacing the loss scale.


def with_loss_scale(tree: Any, loss_scale: LossScale) -> Any:
  """``tree`` with the loss scale of its loss-scaling state replaced.

  ``tree`` is any pytree holding a :class:`LossScalingState`: an optimizer
  state, ``(params, opt_state)``, a ``TrainState``, an ``nnx.Optimizer``'s
  ``opt_state``. Every other leaf is the same object: the inner state
  (moments, counts, schedules) and the counters (``skipped_steps``) are kept
  bit-identical.
  """
  is_state = lambda x: isinstance(x, LossScalingState)
  return jax.tree_util.tree_map(
      lambda x: x._replace(loss_scale=loss_scale) if is_state(x) else x,
      tree, is_leaf=is_state)


def with_initial_loss_scale(
    tx: optax.GradientTransformation, loss_scale: LossScale
) -> optax.GradientTransformationExtraArgs:
  """``tx`` (built on :func:`loss_scaling`) starting from ``loss_scale``.

  ``update`` is ``tx``'s own: the wrapper reads the loss scale from the state
  it is given. ``init`` returns the state ``tx.init`` returns with
  ``loss_scale`` in it, so that a state built afresh from the switched
  optimizer has the structure of the switched state.
  """
  device_scale = _to_device_state(loss_scale)
  return keyed_transformation(
      lambda params: with_loss_scale(tx.init(params), device_scale),
      optax.with_extra_args_support(tx).update, "with_initial_loss_scale",
      tx, loss_scale)
