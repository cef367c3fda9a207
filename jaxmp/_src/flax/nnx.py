"""NNX training with loss scaling: the scaled ``nnx.value_and_grad``, and
BatchNorm statistics kept on skipped steps."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp

from jaxmp._src import autocast as autocasting
from jaxmp._src.flax.fp8 import (
    in_step_units, keep_meta_of_ops_that_did_not_run, skip_unless_meta_finite)
from jaxmp._src.flax.fp8_nnx import Fp8Meta
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import _find_state
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.precision_audit import warn_on_first_trace
from jaxmp._src.value_and_grad import scale_then_differentiate


def nnx_scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    autocast: Any = False,
) -> Callable[..., Any]:
  """Like ``nnx.value_and_grad``, but differentiates the scaled loss.

  The NNX counterpart of :func:`jaxmp.scaled_value_and_grad`: ``fun`` takes
  NNX modules (or other arguments), the gradients are taken with respect to
  the ``nnx.Param`` variables of the argument(s) ``argnums`` and are those of
  ``loss_scale.scale(loss)``, which is what an ``nnx.Optimizer`` built on
  :func:`jaxmp.loss_scaling` expects. The returned value is the *unscaled*
  loss (with aux when ``has_aux``).

  The first call with given shapes (under ``jit``: once per compilation)
  also traces ``fun`` on a copy of the model, running nothing, and warns with
  a :class:`jaxmp.PrecisionWarning` when the model's 16-bit dtype does not
  take effect (see :func:`jaxmp.precision_report`).

  **FP8.** When the arguments hold FP8 meta (:class:`jaxmp.flax.Fp8Meta`
  variables, from :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes` under
  ``"mixed_fp8"``), the meta is differentiated too: the "gradient" of a meta
  variable is its new value, as in Flax's FP8 ops. The returned gradients
  are still those of the params alone; the new meta is written into the
  model, as a BatchNorm writes its statistics, its output-gradient part
  stored in unscaled units (used at ``loss_scale`` for the step). Where the
  new meta is not finite, the gradients are nan, so that the optimizer skips
  the step. Call it inside :func:`jaxmp.flax.nnx_keep_on_skip`, which puts
  the old meta back on a skipped step; outside one it refuses.

  **Autocast.** ``autocast="mixed_bfloat16"`` runs ``fun`` under
  :func:`jaxmp.autocast`, as ``TrainState.create(..., autocast=True)`` does
  for Linen: each operation's inputs are cast by its rule (matmuls and
  convolutions in the compute dtype, softmax, norms and the loss in float32),
  whatever ``dtype=`` the layers declare, while the params stay float32 and
  their gradients come back float32. An NNX model has no policy of its own, so
  the option takes the policy itself rather than ``True``. The variables
  ``fun`` updates in place (BatchNorm statistics, RNG counts) are carried out
  of the autocast evaluation and written back to the model in their own
  dtypes.

  Args:
    fun: the loss function; returns a scalar (and aux when ``has_aux``).
    loss_scale: the current loss scale,
      ``jaxmp.get_loss_scale(optimizer.opt_state)``.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    autocast: ``False`` (the default) to run ``fun`` as written, or the
      policy to run it under :func:`jaxmp.autocast` with: a
      :class:`jaxmp.Policy` or anything :func:`jaxmp.get_policy` accepts
      (``"mixed_bfloat16"``, ``"mixed_float16"``). The loss (and aux) come
      back in the policy's output dtype.

  Returns:
    A function with the signature of ``fun`` returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale, or ``autocast`` is
      ``True`` or not a policy.
    ValueError: if ``autocast`` is a string :func:`jaxmp.get_policy` does
      not accept; when called with FP8 meta, outside
      :func:`jaxmp.flax.nnx_keep_on_skip` or with ``autocast``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()),
    ...     wrt=nnx.Param)
    >>> x = jnp.ones((4, 2))
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...   loss_fn = lambda model: jnp.mean(model(x) ** 2)
    ...   loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
    ...       loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model)
    ...   optimizer.update(model, grads)
    ...   return loss, jaxmp.loss_scaling_metrics(optimizer.opt_state)
    >>> loss, metrics = train_step(model, optimizer, x)
    >>> int(metrics["skipped_steps"]), float(metrics["loss_scale"])
    (0, 32768.0)
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  autocast_policy = _autocast_policy(autocast)
  model_fun = fun
  if autocast_policy is not None:
    fun = autocasting.autocast(fun, autocast_policy)
  grad_fn = scale_then_differentiate(
      nnx.value_and_grad, fun, loss_scale, argnums=argnums, has_aux=has_aux,
      caller=_CALLER, state_hint=_STATE_HINT)
  # A model with FP8 ops (set_nnx_dtypes under "mixed_fp8") takes another way.
  grad_fn = _with_fp8_meta(grad_fn, model_fun, loss_scale, argnums, has_aux,
                           refused=_fp8_refusal(autocast_policy))

  def on_a_copy(args, kwargs):  # the audit traces a copy: the model is untouched
    graphdef, state = nnx.split((args, kwargs))
    return lambda state: (lambda a, k: fun(*a, **k))(*nnx.merge(graphdef, state)), state

  # At trace time, once per compilation: warn if the 16-bit dtype the model
  # computes in does not take effect (docs/precision-audit.md).
  return warn_on_first_trace(
      grad_fn, fun,
      compute_dtype=None if autocast_policy is None else autocast_policy.compute_dtype,
      caller=_CALLER, prepare=on_a_copy)


_CALLER = "nnx_scaled_value_and_grad"
_STATE_HINT = "With an nnx.Optimizer, pass jaxmp.get_loss_scale(optimizer.opt_state)."

# The FP8 meta variables that the nnx_keep_on_skip blocks now open keep.
_KEEPING = threading.local()


def _kept_meta() -> list[Any]:
  if not hasattr(_KEEPING, "stack"):
    _KEEPING.stack = []
  return _KEEPING.stack


def _fp8_refusal(autocast_policy: Any) -> str | None:
  """Why a model with FP8 meta cannot take these options, or None."""
  if autocast_policy is not None:
    return ("autocast cannot run FP8 matmuls: it casts each operation, and "
            "the FP8 ops keep per-tensor scales. Leave autocast off; "
            "set_nnx_dtypes has set the layers' dtypes already.")
  return None


def _with_fp8_meta(grad_fn, fun, loss_scale, argnums, has_aux, refused):
  """``grad_fn``, or for arguments holding FP8 meta, the FP8 value-and-grad.

  The FP8 meta of the arguments (:class:`jaxmp.flax.Fp8Meta` variables) is
  differentiated too, as an extra leading argument: inside, it is put into
  the model in the step's units (:func:`in_step_units`), and its cotangents
  are its new values, back in unscaled units. The param gradients are made
  nan where the new meta is not finite (the optimizer then skips the step),
  and the new meta is written into the model, where ``nnx_keep_on_skip``
  (which must be open around the step) keeps the old one on a skipped step.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(argnums, int) or isinstance(argnums, nnx.DiffState):
    with_meta, single = (0, _shifted(argnums)), True
  else:
    with_meta, single = (0, *(_shifted(a) for a in argnums)), False

  def fun_with_meta(stored_meta, *args, **kwargs):
    nnx.update((args, kwargs), in_step_units(stored_meta, loss_scale.loss_scale))
    return fun(*args, **kwargs)

  meta_grad_fn = scale_then_differentiate(
      nnx.value_and_grad, fun_with_meta, loss_scale, argnums=with_meta,
      has_aux=has_aux, caller=_CALLER, state_hint=_STATE_HINT)

  def value_and_grad_fn(*args, **kwargs):
    meta = nnx.state((args, kwargs), Fp8Meta)
    if not meta:
      return grad_fn(*args, **kwargs)
    if refused is not None:
      raise ValueError(f"{_CALLER}: the model has FP8 meta; {refused}")
    _check_kept(meta)
    stored_meta = nnx.as_pure(meta)
    out, (new_meta, *grads) = meta_grad_fn(stored_meta, *args, **kwargs)
    new_meta = keep_meta_of_ops_that_did_not_run(stored_meta, new_meta)
    grads = skip_unless_meta_finite(grads[0] if single else tuple(grads), new_meta)
    nnx.update((args, kwargs), new_meta)
    return out, grads

  return value_and_grad_fn


def _shifted(argnum: Any) -> Any:
  """``argnum`` (an int or an ``nnx.DiffState``) one position later."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(argnum, nnx.DiffState):
    return nnx.DiffState(argnum.argnum + 1, argnum.filter)
  return argnum + 1 if argnum >= 0 else argnum


def _check_kept(meta: Any) -> None:
  """Refuses FP8 meta that no open ``nnx_keep_on_skip`` block keeps."""
  kept = {id(v) for block in _kept_meta() for v in block}
  if not all(id(v) in kept for v in _variables(meta)):
    raise ValueError(
        f"{_CALLER}: the model has FP8 meta (jaxmp.flax.Fp8Meta), whose new "
        "values this call writes into the model; a skipped step must put the "
        "old ones back, which nnx_keep_on_skip does. Call it inside the block "
        "around the step: with jaxmp.flax.nnx_keep_on_skip(model, optimizer): "
        "loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(...)(model); "
        "optimizer.update(model, grads).")


def _variables(state: Any) -> list[Any]:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  return jax.tree_util.tree_leaves(
      state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _autocast_policy(autocast: Any) -> Policy | None:
  """The policy of ``nnx_scaled_value_and_grad(..., autocast=...)``, or None."""
  if autocast is False or autocast is None:
    return None
  if autocast is True:
    raise TypeError(
        "nnx_scaled_value_and_grad: autocast takes the policy to run the loss "
        "under, e.g. autocast='mixed_bfloat16'; got True. (An NNX model has "
        "no policy of its own for autocast=True to use, as "
        "TrainState.create(..., autocast=True) uses the state's.)")
  try:
    return get_policy(autocast)
  except (TypeError, ValueError) as e:
    raise type(e)(
        f"nnx_scaled_value_and_grad, autocast: {e} Pass False (no autocast) "
        "or a policy, e.g. autocast='mixed_bfloat16'.") from None


def on_a_copy(fn: Callable[..., Any], evaluate: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` over NNX objects, run by ``evaluate`` on a copy, written back.

  ``evaluate(pure_fn)`` returns a function of ``pure_fn``'s arguments (for
  :func:`jaxmp.autocast`, one that traces and evaluates it again), where
  ``pure_fn(graphdef, state) -> (out, variables)`` merges a copy of the
  objects, runs ``fn`` and returns what it computed and the variables it
  left. The objects' in-place updates (BatchNorm statistics, RNG counts) are
  then written back to the caller's objects.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def pure_fn(graphdef, state):
    args, kwargs = nnx.merge(graphdef, state, copy=True)
    out = fn(*args, **kwargs)
    return out, nnx.state((args, kwargs), nnx.Variable)

  evaluated = evaluate(pure_fn)

  @functools.wraps(fn)
  def on_objects(*args, **kwargs):
    graphdef, state = nnx.split((args, kwargs))
    out, variables = evaluated(graphdef, state)
    nnx.update((args, kwargs), variables)
    return out

  return on_objects


@contextlib.contextmanager
def nnx_keep_on_skip(
    model: Any, optimizer: Any, keep: Any = None
) -> Iterator[None]:
  """Keeps the model's ``nnx.BatchStat`` variables as they were on a skipped step.

  A context manager for an NNX train step (``with
  jaxmp.flax.nnx_keep_on_skip(model, optimizer): ...``). On entry it records
  the values of the model's variables that ``keep`` selects (by default the
  BatchNorm statistics, ``nnx.BatchStat``); the forward pass then updates
  them, as NNX does, and ``optimizer.update`` skips the step when the
  gradients are not finite. On exit, where the step was skipped, the recorded values are put
  back, bit-identical: one inf pixel does not poison the running statistics.
  Where it was applied, the new values stay. The choice is a ``jnp.where`` on
  the flag the loss-scaling state records for this step (``last_finite``):
  no host synchronisation, no ``lax.cond``. The parameters and the optimizer
  state need no help: :func:`jaxmp.loss_scaling` keeps them already.

  Call ``optimizer.update`` inside the block, after the forward pass.

  Args:
    model: the NNX module the forward pass updates.
    optimizer: the ``nnx.Optimizer`` built on :func:`jaxmp.loss_scaling`.
    keep: an NNX filter choosing the variables to keep: a ``Variable`` type
      (default ``nnx.BatchStat``), a tuple of them, or any filter
      ``nnx.state`` takes (e.g. ``(nnx.BatchStat, EmaParam)``). The FP8
      meta (:class:`jaxmp.flax.Fp8Meta`, which
      :func:`jaxmp.flax.nnx_scaled_value_and_grad` writes) is kept whatever
      ``keep`` says.

  Raises:
    ValueError: on entry, if ``optimizer`` holds no loss-scaling state; on
      exit, if ``optimizer.update`` was not called inside the block (the
      flag would be the previous step's).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
    ...                        nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    >>> optimizer = nnx.Optimizer(
    ...     model, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()),
    ...     wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...   with jaxmp.flax.nnx_keep_on_skip(model, optimizer):
    ...     loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
    ...         lambda m: jnp.mean(m(x) ** 2),
    ...         jaxmp.get_loss_scale(optimizer.opt_state))(model)
    ...     optimizer.update(model, grads)
    >>> mean_before = model.layers[1].mean[...]
    >>> train_step(model, optimizer, jnp.ones((8, 2)).at[0, 0].set(jnp.inf))
    >>> bool(jnp.all(model.layers[1].mean[...] == mean_before))
    True
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  keep = nnx.Any(nnx.BatchStat if keep is None else keep, Fp8Meta)
  flag_before = _last_finite(optimizer)
  # New Variables around the current values: the model's own Variables are
  # updated in place by the forward pass.
  before = jax.tree_util.tree_map(lambda x: x, nnx.state(model, keep))
  # nnx_scaled_value_and_grad writes the FP8 meta only inside such a block.
  stack = _kept_meta()
  stack.append(_variables(nnx.state(model, Fp8Meta)))
  try:
    yield
  finally:
    stack.pop()
  flag = _last_finite(optimizer)
  if flag is flag_before:
    raise ValueError(
        "nnx_keep_on_skip: optimizer.update was not called inside the `with` "
        "block, so whether this step was skipped is not known yet. Call "
        "optimizer.update(model, grads) inside it, after the forward pass."
    )
  kept = jax.tree_util.tree_map(
      lambda new, old: jnp.where(flag, new, old), nnx.state(model, keep), before)
  nnx.update(model, kept)


def _last_finite(optimizer: Any) -> Any:
  """The ``last_finite`` value of the optimizer's loss-scaling state, as stored."""
  state = _find_state(getattr(optimizer, "opt_state", optimizer), "nnx_keep_on_skip")
  flag = state.last_finite
  return flag.get_value() if hasattr(flag, "get_value") else flag


def split_for_loop(objects: Any) -> tuple[Any, Callable[..., Any], Callable[[Any], Any]]:
  """NNX objects as arrays that a ``lax.while_loop`` can carry.

  Returns ``(state, as_pure_step, write_back)``: the ``nnx.State`` of
  ``objects``; ``as_pure_step(step)``, which turns ``step(objects) ->
  (objects, aux)`` into a function of that state, merging fresh objects for
  each call (a loop body owns its Variables); and ``write_back(state)``, which
  updates the caller's objects in place and returns them. Used by
  :func:`jaxmp.retry_skipped`.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  graphdef, state = nnx.split(objects)

  def as_pure_step(step):
    def pure_step(pure_state):
      out, aux = step(nnx.merge(graphdef, pure_state))
      return nnx.state(out), aux
    return pure_step

  def write_back(pure_state):
    nnx.update(objects, pure_state)
    return objects

  return state, as_pure_step, write_back
