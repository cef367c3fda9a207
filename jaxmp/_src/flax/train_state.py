"""Flax's ``TrainState`` with a policy and loss scaling, and the precision
switch of a Flax training state (a ``TrainState``, an ``nnx.Optimizer``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from flax.training import train_state

from jaxmp._src.autocast import autocast
from jaxmp._src.flax.apply import WrappedApply
from jaxmp._src.flax.fp8 import (
    FP8_META, in_step_units, keep_meta_of_ops_that_did_not_run,
    skip_unless_meta_finite, split_fp8_grads)
from jaxmp._src.flax.module_policy import ModulePolicy, runs_fp8, set_model_policy
from jaxmp._src.inplace_select import check_same_structure
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import (
    check_no_loss_scaling_state, get_loss_scale, keep_on_skip, loss_scaling,
    loss_scaling_metrics, with_initial_loss_scale, with_loss_scale)
from jaxmp._src.precision_audit import warn_on_first_trace
from jaxmp._src.policy import Fp8Policy, as_policy, default_loss_scale
from jaxmp._src.validation import check_bool, jmp_loss_scale_fix, listing
from jaxmp._src.value_and_grad import scale_then_differentiate


class TrainState(train_state.TrainState):
  """A Flax ``TrainState`` that trains with a dtype policy and loss scaling.

  :meth:`value_and_grad` runs the loss under ``policy`` (a static field) and
  returns the gradients of the scaled loss; :meth:`apply_gradients` unscales
  them and skips a non-finite step, keeping the params, the optimizer state
  and every other field it is given bit-identical. ``step`` counts calls,
  skipped ones included. Subclass it to carry more state, as in Flax.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> import flax.linen as nn
    >>> model, x = nn.Dense(1), jnp.ones((4, 3))
    >>> state = jaxmp.flax.TrainState.create(
    ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
    ...     tx=optax.sgd(0.1), policy="mixed_float16",
    ...     loss_scale=jaxmp.DynamicLossScale(2.0**10))
    >>> loss_fn = lambda params, x: jnp.mean(state.apply_fn({"params": params}, x) ** 2)
    >>> loss, grads = state.value_and_grad(loss_fn)(state.params, x)
    >>> state = state.apply_gradients(grads=grads)
    >>> int(state.step), float(state.loss_scale.loss_scale)
    (1, 1024.0)
  """

  policy: Any = struct.field(pytree_node=False, default=None, kw_only=True)
  autocast: bool = struct.field(pytree_node=False, default=False, kw_only=True)

  @classmethod
  def create(cls, *, apply_fn: Callable[..., Any], params: Any,
             tx: optax.GradientTransformation, policy: Any = "float32",
             loss_scale: LossScale | None = None, axis_name: Hashable | None = None,
             autocast: bool = False, clip_global_norm: float | None = None,
             guard: bool = True, **kwargs) -> "TrainState":
    """Creates a state with ``step=0``, ``tx`` wrapped with loss scaling.

    ``axis_name``, ``clip_global_norm`` and ``guard`` go to
    :func:`jaxmp.loss_scaling`.

    Args:
      apply_fn: usually ``model.apply``; ``state.apply_fn`` runs it under the
        policy (call it in the loss function).
      params: cast to the policy's ``param_dtype``; under FP8, the variables
        ``{"params": ..., "_overwrite_with_gradient": ...}``.
      tx: the bare optimizer.
      policy: anything :func:`jaxmp.get_policy` takes, a
        :class:`jaxmp.PathPolicy` or a :class:`jaxmp.flax.ModulePolicy`.
      loss_scale: default :class:`jaxmp.DynamicLossScale` when the policy
        computes in float16, else :class:`jaxmp.NoOpLossScale`.
      autocast: run the loss under :func:`jaxmp.autocast`.
      **kwargs: fields of a subclass (``batch_stats=...``).
    """
    owner = "TrainState.create"
    policy = as_policy(policy)
    if isinstance(policy, Fp8Policy):
      policy = ModulePolicy({}, default=policy)
    if "fp8_meta" in kwargs:
      raise TypeError(
          f"{owner} takes the FP8 meta inside params, as Flax's TrainState "
          "does: create(params=variables) with variables = {'params': ..., "
          f"{FP8_META!r}: ...}}, not fp8_meta=.")
    meta = split_fp8_grads(params, owner=owner)
    if runs_fp8(policy) and meta is None:
      raise ValueError(
          f"{owner}: the policy {policy} runs FP8 matmuls, whose scales and "
          "amax histories must be given: create the variables with the policy "
          "(variables = policy.wrap_apply(model.init)(key, x), or "
          "jaxmp.flax.ModulePolicy({}, default=policy) for a preset) and pass "
          f"them whole, params=variables ({{'params': ..., {FP8_META!r}: ...}}).")
    policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
    if check_bool(owner, "autocast", autocast):
      if runs_fp8(policy) or meta is not None:
        raise ValueError(
            f"{owner}(autocast=True) cannot run FP8 matmuls: autocast casts "
            "each operation, and the FP8 ops keep per-tensor scales. Leave "
            "autocast off with an FP8 policy.")
      policy, _ = policy.for_autocast()
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(
          f"{owner}: tx must be an optax.GradientTransformation such as "
          f"optax.adamw(1e-3); got {tx!r}. Pass the bare optimizer: create "
          "wraps it with jaxmp.loss_scaling.")
    loss_scale = default_loss_scale(policy) if loss_scale is None else loss_scale
    if not isinstance(loss_scale, LossScale):
      raise TypeError(
          f"{owner}: loss_scale must be a jaxmp loss scale such as "
          f"jaxmp.DynamicLossScale(); got {loss_scale!r}.{jmp_loss_scale_fix(loss_scale)}")
    apply_fn = wrap_apply(policy, apply_fn, autocast)
    params = policy.params_for_storage(params if meta is None else meta[0])
    check_no_loss_scaling_state(
        jax.eval_shape(tx.init, params), owner=owner, subject="tx",
        fix="Pass the bare optimizer (e.g. optax.adamw(1e-3)) and the loss "
        "scale as loss_scale=...; create wraps it for you.")
    guard = check_bool(owner, "guard", guard, advice="guard=False turns the "
                       "finiteness check off; it needs loss_scale=jaxmp.NoOpLossScale().")
    tx = loss_scaling(tx, loss_scale, axis_name=axis_name,
                      clip_global_norm=clip_global_norm, guard=guard)
    return cls(step=jnp.zeros([], jnp.int32), apply_fn=apply_fn,
               params=params if meta is None else {"params": params, FP8_META: meta[1]},
               tx=tx, opt_state=tx.init(params), policy=policy, autocast=autocast,
               **kwargs)

  def apply_gradients(self, *, grads: Any, **kwargs) -> "TrainState":
    """Applies the scaled gradients; a skipped step changes nothing.

    The other fields given (``batch_stats=``, EMA params) are written on a
    finite step and kept bit-identical on a skipped one
    (:func:`jaxmp.keep_on_skip`); a new value is cast to the field's dtypes
    and must have its structure and shapes. Under FP8, ``grads`` holds the
    new meta beside the gradients, as :meth:`value_and_grad` returns them.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> from typing import Any
      >>> class State(jaxmp.flax.TrainState):
      ...   ema: Any
      >>> params = {"w": jnp.ones(2)}
      >>> state = State.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
      ...                      policy="mixed_float16", ema=params)
      >>> bad = {"w": jnp.array([jnp.inf, 1.0])}  # an overflow: skipped
      >>> state = state.apply_gradients(grads=bad, ema={"w": jnp.full(2, jnp.inf)})
      >>> state.ema["w"], int(state.metrics["skipped_steps"])
      (Array([1., 1.], dtype=float32), 1)
    """
    owner = f"{type(self).__name__}.apply_gradients"
    fields = {f.name: f for f in dataclasses.fields(self)}
    for field in kwargs:
      if field not in fields:
        raise TypeError(
            f"{owner}: {field!r} is not a field of the state (its fields: "
            f"{', '.join(fields)}). Declare it in a subclass (class "
            f"TrainState(jaxmp.flax.TrainState): {field}: Any) and give its "
            f"first value to create(..., {field}=...).")
    new, old = split_fp8_grads(grads, owner=owner), split_fp8_grads(self.params)
    if (new is None) != (old is None):
      raise ValueError(
          f"{owner}: the gradients hold FP8 meta ({FP8_META!r}) but the state has "
          "none. Create the state with the variables, meta included: "
          f"TrainState.create(params={{'params': ..., {FP8_META!r}: ...}})."
          if old is None else
          f"{owner}: the state has FP8 meta but the gradients bring no new meta, "
          "so the FP8 scales would never move. Differentiate the whole "
          "variables: state.value_and_grad(loss_fn)(state.params, ...) returns "
          f"{{'params': grads, {FP8_META!r}: new_meta}}.")
    if old is not None:
      new_meta = keep_meta_of_ops_that_did_not_run(old[1], new[1])
      grads = {"params": skip_unless_meta_finite(new[0], new_meta), FP8_META: new_meta}
    new_state = super().apply_gradients(grads=grads)  # Flax's own FP8 layout
    written = {}
    if old is not None:
      written["params"] = {"params": new_state.params["params"], FP8_META: keep_on_skip(
          new_state.opt_state, new_meta, old[1])}
    for field, value in kwargs.items():
      if fields[field].metadata.get("pytree_node", True):
        check_same_structure(
            value, getattr(self, field), owner=f"{owner}({field}=...)",
            names=("the new value", "the state's value"),
            fix="A skipped step keeps the current value, so the new one must "
            "have its structure and shapes: give the first value to create "
            "(e.g. TrainState.create(..., batch_stats=variables['batch_stats'])) "
            "and pass the updated collection itself (updates['batch_stats'], not "
            "the dict that holds it).")
        value = keep_on_skip(new_state.opt_state, value, getattr(self, field))
      written[field] = value
    return new_state.replace(**written) if written else new_state

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (from the optimizer state)."""
    return get_loss_scale(self.opt_state)

  @property
  def metrics(self) -> dict[str, jax.Array]:
    """:func:`jaxmp.loss_scaling_metrics` of the optimizer state; jit-safe."""
    return loss_scaling_metrics(self.opt_state)

  def value_and_grad(self, loss_fn: Callable[..., Any], has_aux: bool = False, *,
                     audit: bool = False) -> Callable[..., Any]:
    """Returns a function of ``(params, *args, **kwargs)`` giving loss and grads.

    It runs ``loss_fn`` with the params cast for compute and the loss (and
    aux) cast to the output dtype; the batch is passed as it is
    (``state.apply_fn`` casts the model's inputs). It returns the *unscaled*
    loss and the gradients of the *scaled* loss in the params' dtype. With
    ``audit=True``, the first trace warns with a
    :class:`jaxmp.PrecisionWarning` when a 16-bit policy does not take effect.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> state = jaxmp.flax.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(2.0**-14),
      ...     policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**15))
      >>> loss, grads = state.value_and_grad(lambda p: jnp.sum(p["w"]))(state.params)
      >>> float(loss), grads["w"]  # the gradients of the scaled loss
      (2.0, Array([32768., 32768.], dtype=float32))
    """
    if self.policy is None:
      raise ValueError(
          "This TrainState has no policy: build it with "
          "jaxmp.flax.TrainState.create(..., policy='mixed_float16'), not with "
          "the constructor.")
    io_policy, loss_scale = self.policy.io_policy, self.loss_scale
    cast_params, run_loss = self.policy.params_for_compute, loss_fn
    if self.autocast:  # each operation is cast by its rule
      cast_params = lambda params: params
      run_loss = autocast(loss_fn, io_policy,
                          scope_policies=self.policy.for_autocast()[1])

    def run(params, *args, **kwargs):
      if split_fp8_grads(params) is None:
        params = cast_params(params)
      else:  # Flax's FP8 layout: the meta in the step's units
        params = {"params": cast_params(params["params"]), FP8_META: in_step_units(
            params[FP8_META], loss_scale.loss_scale)}
      return io_policy.cast_to_output(run_loss(params, *args, **kwargs))

    audit = check_bool("TrainState.value_and_grad", "audit", audit)
    grad_fn = scale_then_differentiate(
        jax.value_and_grad, run, loss_scale, argnums=0, has_aux=has_aux,
        caller="TrainState.value_and_grad",
        state_hint="It reads the state's own loss scale.")
    return warn_on_first_trace(grad_fn, run, compute_dtype=io_policy.compute_dtype,
                               names_from=loss_fn) if audit else grad_fn


def wrap_apply(policy: Any, apply_fn: Callable[..., Any], autocast: bool) -> Any:
  """``apply_fn`` under ``policy``; under autocast, which casts each operation,
  only the modules a :class:`ModulePolicy` pins."""
  if not autocast:
    return policy.wrap_apply(apply_fn)
  if isinstance(policy, ModulePolicy) and policy.rules:
    pins = ModulePolicy(policy.rules, default=None, first_match=policy.first_match)
    return pins.for_autocast()[0].wrap_apply(apply_fn)
  return apply_fn


# The precision switch (jaxmp.switch_precision) of a Flax training state.


def flax_switch(target: Any) -> Callable[[Any], tuple[Any, Any]] | None:
  """For a :class:`TrainState` or an ``nnx.Optimizer`` (None for another
  pytree), ``of(model) -> (params, switch)`` (None: it takes no model): the
  params a switch keeps, and ``switch(policy, loss_scale)`` (``loss_scale``
  None: kept)."""
  if isinstance(target, TrainState):

    def of(model):
      if model is not None:
        return None
      split = split_fp8_grads(target.params)
      return (target.params if split is None else split[0],
              lambda policy, loss_scale: _switch_train_state(target, policy, loss_scale))

    return of
  if isinstance(target, nnx.Optimizer):

    def of(model):
      if not isinstance(model, nnx.Module) or isinstance(model, nnx.Optimizer):
        raise TypeError(
            "switch_precision: an nnx.Optimizer needs its model, whose modules' "
            "dtype the policy sets: switch_precision(optimizer, policy, "
            f"model=model); got model={model!r}.")
      return (nnx.state(model, nnx.Param),
              lambda policy, loss_scale: _switch_nnx(target, model, policy, loss_scale))

    return of
  return None


def _switch_train_state(state: TrainState, policy: Any, loss_scale: Any) -> TrainState:
  if isinstance(policy, Fp8Policy):
    policy = ModulePolicy({}, default=policy)  # as create does
  has_meta = split_fp8_grads(state.params) is not None
  if runs_fp8(policy) and not has_meta:
    raise ValueError(
        f"switch_precision: the policy {policy} runs FP8 matmuls, but the "
        "state has no FP8 meta for them. A switch goes towards wider dtypes "
        "and keeps the state it finds; to train in FP8, build a new state "
        "with the FP8 policy: variables = policy.wrap_apply(model.init)(key, "
        "x), then TrainState.create(..., params=variables, policy=policy).")
  if has_meta and not runs_fp8(policy):
    warnings.warn(
        f"switch_precision: the policy {policy} runs no FP8 matmuls: the "
        "Dense layers compute in the new policy's dtype, and the state's FP8 "
        "meta stays in params unused (kept as it is), so the loss function "
        "keeps its variables.", UserWarning, stacklevel=4)
  tx, opt_state = state.tx, state.opt_state
  if loss_scale is not None:
    tx = with_initial_loss_scale(tx, loss_scale)
    opt_state = with_loss_scale(opt_state, loss_scale)
  apply_fn = state.apply_fn
  if isinstance(apply_fn, WrappedApply):
    apply_fn = apply_fn.apply_fn  # the model's own apply
  return state.replace(policy=policy, tx=tx, opt_state=opt_state,
                       apply_fn=wrap_apply(policy, apply_fn, state.autocast))


def _switch_nnx(optimizer: Any, model: Any, policy: Any, loss_scale: Any) -> Any:
  _, dropped = set_model_policy(model, policy, switching=True)
  if dropped:
    warnings.warn(
        f"switch_precision: the policy {policy} runs {len(dropped)} layer(s) "
        f"that had FP8 matmuls without them ({listing(map(repr, dropped))}): "
        "their FP8 ops, and the jaxmp.flax.Fp8Meta in them, are removed from "
        "the model, which computes those matmuls in the new policy's dtype.",
        UserWarning, stacklevel=4)
  if loss_scale is not None:
    optimizer.opt_state = with_loss_scale(optimizer.opt_state, loss_scale)
    optimizer.tx = with_initial_loss_scale(optimizer.tx, loss_scale)
  return optimizer
