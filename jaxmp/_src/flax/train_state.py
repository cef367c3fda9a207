"""A Flax ``TrainState`` for mixed-precision training with loss scaling."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from jaxmp._src.autocast import autocast
from jaxmp._src.flax.fp8 import (
  FP8_META,
  in_step_units,
  keep_meta_of_ops_that_did_not_run,
  skip_unless_meta_finite,
  split_fp8_grads,
)
from jaxmp._src.flax.module_policy import ModulePolicy, runs_fp8
from jaxmp._src.inplace_select import check_same_structure
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import (
  check_no_loss_scaling_state,
  get_loss_scale,
  keep_on_skip,
  loss_scaling,
  loss_scaling_metrics,
)
from jaxmp._src.precision_audit import warn_on_first_trace
from jaxmp._src.policy import Fp8Policy, as_policy, default_loss_scale
from jaxmp._src.validation import check_bool, jmp_loss_scale_fix
from jaxmp._src.value_and_grad import scale_then_differentiate


class TrainState(train_state.TrainState):
  """A Flax ``TrainState`` that trains with a dtype policy and loss scaling.

  :meth:`create` wraps ``tx`` with :func:`jaxmp.loss_scaling`, so
  :meth:`apply_gradients` takes the gradients of the *scaled* loss, unscales
  them and skips the update when any of them is inf or nan: the params, the
  inner optimizer state and every other field passed to ``apply_gradients``
  (BatchNorm ``batch_stats``, EMA params) stay bit-identical.
  :meth:`value_and_grad` produces those gradients from a loss function run
  under the policy.

  Subclass it to carry more state, as in Flax; the fields need no default:

  ```python
  class TrainState(jaxmp.flax.TrainState):
    batch_stats: Any
  ```

  **Steps.** ``step`` counts calls to ``apply_gradients``, as in Flax: it grows
  on skipped steps too. The number of skipped steps is
  ``state.metrics["skipped_steps"]``, so the number of applied updates is
  ``step - skipped_steps``. optax schedules and counters *inside* ``tx`` (e.g.
  the step count of ``optax.adam`` or of a learning-rate schedule) are part of
  the inner state and do not advance on skipped steps.

  **FP8.** Under a policy with FP8 matmuls (``"mixed_fp8"``, ``dot=fp8``),
  ``params`` is Flax's FP8 layout, the variables
  ``{"params": ..., "_overwrite_with_gradient": fp8_meta}``, as in Flax's own
  ``TrainState``: the loss function takes the variables and passes them to
  ``state.apply_fn``, the "gradient" of the meta is its new value, and only
  ``"params"`` reaches the optimizer. :meth:`apply_gradients` writes the new
  meta on finite steps and keeps it bit-identical on skipped ones; the
  output-gradient meta is stored in unscaled units (see the FP8 guide).

  Attributes:
    policy: the :class:`jaxmp.Policy` (or :class:`jaxmp.PathPolicy`, or
      :class:`jaxmp.flax.ModulePolicy`); static, not a pytree leaf, and
      keyword-only, so that subclass fields need no default.
    autocast: whether the loss runs under :func:`jaxmp.autocast`; static.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> import flax.linen as nn
    >>> model = nn.Dense(1)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> state = jaxmp.flax.TrainState.create(
    ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
    ...     tx=optax.sgd(0.1), policy="mixed_float16",
    ...     loss_scale=jaxmp.DynamicLossScale(2.0**10))
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    >>> loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
    >>> state = state.apply_gradients(grads=grads)
    >>> int(state.step), float(state.loss_scale.loss_scale), state.params["kernel"].dtype
    (1, 1024.0, dtype('float32'))
  """

  policy: Any = struct.field(pytree_node=False, default=None, kw_only=True)
  autocast: bool = struct.field(pytree_node=False, default=False, kw_only=True)

  @classmethod
  def create(
      cls,
      *,
      apply_fn: Callable[..., Any],
      params: Any,
      tx: optax.GradientTransformation,
      policy: Any = "float32",
      loss_scale: LossScale | None = None,
      axis_name: Hashable | None = None,
      autocast: bool = False,
      clip_global_norm: float | None = None,
      guard: bool = True,
      **kwargs,
  ) -> "TrainState":
    """Creates a state with ``step=0``; wraps ``tx`` with loss scaling.

    Args:
      apply_fn: usually ``model.apply``. It is wrapped by the policy's
        ``wrap_apply`` (which makes a :class:`jaxmp.flax.ModulePolicy` take
        effect; under ``autocast``, only its pinned modules), so call
        ``state.apply_fn`` (not ``model.apply``) in the loss function.
      params: the model's parameters; cast to the policy's ``param_dtype``
        (per path with a :class:`jaxmp.PathPolicy`; kept as they are with a
        module policy). With FP8 matmuls, the variables of
        ``policy.wrap_apply(model.init)(...)`` (or of a model that uses
        Flax's ``fp8_ops`` itself), ``{"params": ...,
        "_overwrite_with_gradient": ...}``: the FP8 meta rides along, out of
        the optimizer.
      tx: the optimizer, *not* yet wrapped with :func:`jaxmp.loss_scaling`
        (clipping, weight decay and schedules inside).
      policy: anything :func:`jaxmp.get_policy` takes (``"mixed_float16"``,
        ``"p=f32,c=bf16,o=f32"``, a :class:`jaxmp.Policy`), a
        :class:`jaxmp.PathPolicy` or a :class:`jaxmp.flax.ModulePolicy`.
        Default ``"float32"``. An FP8 policy (``dot=fp8``)
        (``"mixed_fp8"``) is applied as ``jaxmp.flax.ModulePolicy({},
        default=policy)``.
      loss_scale: the initial loss scale. Default:
        ``jaxmp.DynamicLossScale()`` when ``policy.needs_loss_scaling``
        (float16 compute), else ``jaxmp.NoOpLossScale()``.
      axis_name: inside ``pmap`` or ``shard_map``, the axis name (or tuple of
        names) over which the batch is split; passed to
        :func:`jaxmp.loss_scaling`, so that all devices agree on skipping.
        Not needed under plain ``jit``.
      autocast: run the loss under :func:`jaxmp.autocast`, which casts the
        inputs of each operation (matmuls and convolutions in the compute
        dtype, range-sensitive operations in float32) whatever dtype the
        model declares; ``state.apply_fn`` then casts nothing itself. With a
        :class:`jaxmp.flax.ModulePolicy`, the modules its rules match keep
        their own policy; a :class:`jaxmp.PathPolicy` is refused (autocast
        casts operations, not parameters).
      clip_global_norm: clip the unscaled gradients to this global norm,
        checking them in the same reduction; passed to
        :func:`jaxmp.loss_scaling`. Use it instead of
        ``optax.clip_by_global_norm`` inside ``tx``.
      guard: whether to check the gradients and skip non-finite steps;
        passed to :func:`jaxmp.loss_scaling`. ``guard=False`` needs a
        :class:`jaxmp.NoOpLossScale` (the default under bfloat16 and
        float32): the check then costs nothing, and a nan step is applied.
      **kwargs: further fields of a subclass (``batch_stats=...``), as in
        Flax.

    Returns:
      The new state.

    Raises:
      TypeError: if ``tx`` is not an optax transformation, or ``loss_scale``
        is not a loss scale.
      ValueError: if ``tx`` is already wrapped with :func:`jaxmp.loss_scaling`,
        or a rule-based ``policy`` has no default (the inputs and the loss
        need one); if the policy has FP8 matmuls and ``params`` holds no
        FP8 meta, or ``autocast`` is asked for with FP8 meta.
    """
    policy = as_policy(policy)
    if isinstance(policy, Fp8Policy):
      policy = ModulePolicy({}, default=policy)
    if "fp8_meta" in kwargs:
      raise TypeError(
          "TrainState.create takes the FP8 meta inside params, as Flax's "
          "TrainState does: create(params=variables) with variables = "
          f"{{'params': ..., {FP8_META!r}: ...}}, not fp8_meta=.")
    meta = _check_fp8_arguments(policy, params, autocast)
    policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
    if check_bool("TrainState.create", "autocast", autocast):
      policy, _ = policy.for_autocast()
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
      raise TypeError(
          "TrainState.create: tx must be an optax.GradientTransformation such "
          f"as optax.adamw(1e-3); got {tx!r}. Pass the bare optimizer: create "
          "wraps it with jaxmp.loss_scaling."
      )
    if loss_scale is None:
      loss_scale = default_loss_scale(policy)
    if not isinstance(loss_scale, LossScale):
      raise TypeError(
          "TrainState.create: loss_scale must be a jaxmp loss scale such as "
          f"jaxmp.DynamicLossScale(); got {loss_scale!r}."
          f"{jmp_loss_scale_fix(loss_scale)}"
      )
    apply_fn = wrap_apply(policy, apply_fn, autocast)
    params = policy.params_for_storage(params if meta is None else params["params"])
    check_no_loss_scaling_state(
        jax.eval_shape(tx.init, params), owner="TrainState.create",
        subject="tx", fix="Pass the bare optimizer (e.g. optax.adamw(1e-3)) "
        "and the loss scale as loss_scale=...; create wraps it for you.")
    guard = check_bool(
        "TrainState.create", "guard", guard, advice="guard=False turns the "
        "finiteness check off; it needs loss_scale=jaxmp.NoOpLossScale().")
    tx = loss_scaling(tx, loss_scale, axis_name=axis_name,
                      clip_global_norm=clip_global_norm, guard=guard)
    return cls(
        step=jnp.zeros([], jnp.int32),
        apply_fn=apply_fn,
        params=params if meta is None else {"params": params, FP8_META: meta},
        tx=tx,
        opt_state=tx.init(params),
        policy=policy,
        autocast=autocast,
        **kwargs,
    )

  def apply_gradients(self, *, grads: Any, **kwargs) -> "TrainState":
    """Applies the scaled gradients; on a skipped step changes nothing.

    Runs the loss-scaling optimizer on ``grads`` (the gradients of the
    *scaled* loss, from :meth:`value_and_grad`) and applies its updates, as
    Flax's ``apply_gradients`` does; ``step`` grows by one. The other fields
    in ``kwargs`` (``batch_stats=new_stats``, EMA params, anything the
    subclass declares) are written on a finite step and kept bit-identical on
    a skipped one, like the params: one inf pixel must not poison the
    BatchNorm statistics for good. The choice is a ``jnp.where`` on the flag
    the loss-scaling state records for this step (``last_finite``): no host
    synchronisation, no ``lax.cond``.

    Each such field keeps its structure, shapes and dtypes: a new value in
    another dtype is cast to the field's dtype (so that the jitted step does
    not retrace), and one of another structure or shape is refused. Static
    fields (``struct.field(pytree_node=False)``) are replaced as given.

    With FP8 matmuls, ``grads`` is Flax's layout, ``{"params": param_grads,
    "_overwrite_with_gradient": new_meta}``, as :meth:`value_and_grad`
    returns it: only ``param_grads`` go through the loss-scaling optimizer
    (the unscale, the check, the inner optimizer); the new meta replaces
    ``params["_overwrite_with_gradient"]`` on a finite step and is dropped
    on a skipped one (:func:`jaxmp.keep_on_skip`). A new meta that is not
    finite makes the step non-finite.

    Args:
      grads: the gradients of the scaled loss, with the structure of
        ``params`` (with FP8 matmuls, with the new FP8 meta beside them).
      **kwargs: other fields to replace, as in Flax.

    Returns:
      The new state.

    Raises:
      TypeError: if a name in ``kwargs`` is not a field of the state.
      ValueError: if a new field value differs from the current one in
        structure or shapes; if the state has FP8 meta and ``grads`` brings
        none (or the other way round).

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
    fields = {f.name: f for f in dataclasses.fields(self)}
    for name in kwargs:
      if name not in fields:
        raise TypeError(
            f"{type(self).__name__}.apply_gradients: {name!r} is not a field "
            f"of the state (its fields: {', '.join(fields)}). Declare it in a "
            "subclass (class TrainState(jaxmp.flax.TrainState): "
            f"{name}: Any) and give its first value to create(..., "
            f"{name}=...)."
        )
    old_meta = self._split_fp8(grads)
    if old_meta is not None:
      grads, new_meta = split_fp8_grads(grads)
      new_meta = keep_meta_of_ops_that_did_not_run(old_meta, new_meta)
      # Flax's ops saturate an inf output gradient to the FP8 maximum, so the
      # weight gradients may look finite while the new amax is not: a
      # non-finite new meta makes the step non-finite too.
      grads = {"params": skip_unless_meta_finite(grads, new_meta), FP8_META: new_meta}
    new_state = super().apply_gradients(grads=grads)  # Flax's own FP8 layout
    if old_meta is not None:
      new_state = new_state.replace(params={
          "params": new_state.params["params"],
          FP8_META: keep_on_skip(new_state.opt_state, new_meta, old_meta)})
    written = {}
    for name, value in kwargs.items():
      if not fields[name].metadata.get("pytree_node", True):
        written[name] = value
      else:
        check_same_structure(
            value, getattr(self, name),
            owner=f"{type(self).__name__}.apply_gradients({name}=...)",
            names=("the new value", "the state's value"),
            fix="A skipped step keeps the current value, so the new one must "
            "have its structure and shapes: give the first value to create "
            "(e.g. TrainState.create(..., batch_stats=variables['batch_stats'])) "
            "and pass the updated collection itself (updates['batch_stats'], not "
            "the dict that holds it).")
        written[name] = keep_on_skip(new_state.opt_state, value, getattr(self, name))
    return new_state.replace(**written) if written else new_state

  def _split_fp8(self, grads: Any) -> Any:
    """The state's FP8 meta when it has one (and ``grads`` a new one), else None."""
    owner = f"{type(self).__name__}.apply_gradients"
    new = split_fp8_grads(grads, owner=owner)
    old = split_fp8_grads(self.params)
    if new is not None and old is None:
      raise ValueError(
          f"{owner}: the gradients hold FP8 meta ({FP8_META!r}) but the state "
          "has none. Create the state with the variables, meta included: "
          f"TrainState.create(params={{'params': ..., {FP8_META!r}: ...}}).")
    if new is None and old is not None:
      raise ValueError(
          f"{owner}: the state has FP8 meta but the gradients bring no new "
          "meta, so the FP8 scales would never move. Differentiate the whole "
          "variables: state.value_and_grad(loss_fn)(state.params, ...) returns "
          f"{{'params': grads, {FP8_META!r}: new_meta}}.")
    return None if old is None else old[1]

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (from the optimizer state)."""
    return get_loss_scale(self.opt_state)

  @property
  def metrics(self) -> dict[str, jax.Array]:
    """:func:`jaxmp.loss_scaling_metrics` of the optimizer state; jit-safe."""
    return loss_scaling_metrics(self.opt_state)

  def value_and_grad(
      self, loss_fn: Callable[..., Any], has_aux: bool = False, *,
      audit: bool = False,
  ) -> Callable[..., Any]:
    """Returns a function of ``(params, *args, **kwargs)`` giving loss and grads.

    The returned function runs ``loss_fn(params, *args, **kwargs)`` under the
    policy: the params are cast to the compute dtype (per path with a
    :class:`jaxmp.PathPolicy`; inside each module with a
    :class:`jaxmp.flax.ModulePolicy`) and the loss (and aux) to the output
    dtype. The other arguments (the batch) are passed as they are:
    ``state.apply_fn`` casts the model's floating inputs to the compute dtype
    and returns its output in the output dtype, so the loss compares that
    output with targets in their own dtype (float32 targets are not rounded
    to float16, and no float32 output meets a float16 target). It returns the
    *unscaled* loss
    (``(loss, aux)`` when ``has_aux``) and the gradients of the *scaled* loss
    with respect to ``params``, in the params' own dtype, ready for
    :meth:`apply_gradients`.

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar loss,
        or ``(loss, aux)`` when ``has_aux``.
      has_aux: whether ``loss_fn`` returns auxiliary data.
      audit: if true, the first call with given shapes (under ``jit``: once
        per compilation) traces the forward pass once more, as
        :func:`jaxmp.precision_report` does (running nothing), and warns with
        a :class:`jaxmp.PrecisionWarning` when a 16-bit policy does not take
        effect (a float32 batch captured by ``loss_fn``'s closure, a layer's
        own ``dtype=jnp.float32``, which ``state.apply_fn`` reports anyway).
        Off by default: no extra trace.

    With FP8 meta, ``params`` is ``state.params``, the variables
    ``{"params": ..., "_overwrite_with_gradient": meta}``, and ``loss_fn``
    passes them to ``state.apply_fn(variables, x)``, as in Flax. For the
    step, the output-gradient meta is multiplied by the loss scale; its
    "gradient" is its new value, divided back to unscaled units, and
    ``grads`` has the layout of the variables.

    Returns:
      The function described above.

    Raises:
      ValueError: if the state has no policy.

    Example:
      >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
      >>> state = jaxmp.flax.TrainState.create(
      ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(2.0**-14),
      ...     policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**15))
      >>> loss_fn = lambda params: jnp.sum(params["w"])
      >>> loss, grads = state.value_and_grad(loss_fn)(state.params)
      >>> float(loss), grads["w"]  # the gradients of the scaled loss
      (2.0, Array([32768., 32768.], dtype=float32))
    """
    policy = self.policy
    if policy is None:
      raise ValueError(
          "This TrainState has no policy: build it with "
          "jaxmp.flax.TrainState.create(..., policy='mixed_float16'), not with "
          "the constructor."
      )
    io_policy = policy.io_policy
    loss_scale = self.loss_scale
    cast_params, run_loss = policy.params_for_compute, loss_fn
    if self.autocast:
      # Each operation is cast by its rule: the float32 master params and the
      # inputs go in as they are (docs/autocast.md).
      _, scopes = policy.for_autocast()
      cast_params = lambda params: params
      run_loss = autocast(loss_fn, io_policy, scope_policies=scopes)

    def run(params, *args, **kwargs):  # the batch as it is: see the docstring
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
    # If asked, at trace time, once per compilation: warn if the policy does
    # not take effect (docs/diagnostics.md).
    return warn_on_first_trace(
        grad_fn, run, compute_dtype=io_policy.compute_dtype,
        names_from=loss_fn) if audit else grad_fn


def wrap_apply(policy: Any, apply_fn: Callable[..., Any], autocast: bool) -> Any:
  """``apply_fn`` under ``policy``; under ``autocast``, which casts each
  operation itself, only the modules a :class:`ModulePolicy` pins."""
  if not autocast:
    return policy.wrap_apply(apply_fn)
  if isinstance(policy, ModulePolicy) and policy.rules:
    pins = ModulePolicy(policy.rules, default=None, first_match=policy.first_match)
    return pins.for_autocast()[0].wrap_apply(apply_fn)
  return apply_fn


def _check_fp8_arguments(policy: Any, params: Any, autocast: Any) -> Any:
  """The FP8 meta in ``params`` (Flax's layout) or None; refuses FP8 matmuls
  without meta, and autocast with meta."""
  owner = "TrainState.create"
  meta = split_fp8_grads(params, owner=owner)
  if runs_fp8(policy) and meta is None:
    raise ValueError(
        f"{owner}: the policy {policy} runs FP8 matmuls, whose scales and "
        "amax histories must be given: create the variables with the policy "
        "(variables = policy.wrap_apply(model.init)(key, x), or "
        "jaxmp.flax.ModulePolicy({}, default=policy) for a preset) and pass "
        f"them whole, params=variables ({{'params': ..., {FP8_META!r}: ...}}).")
  if (runs_fp8(policy) or meta is not None) and autocast is True:
    raise ValueError(
        f"{owner}(autocast=True) cannot run FP8 matmuls: autocast casts each "
        "operation, and the FP8 ops keep per-tensor scales. Leave autocast "
        "off with an FP8 policy.")
  return None if meta is None else meta[1]
