"""Loss scales: no-op, static and dynamic, as pytrees; ``all_finite``, ``select_tree``.

State (the scale, counters) is arrays with explicit dtypes: float32 for the
scale, int32 for counters. Configuration (period, factors, bounds, hysteresis)
is static pytree metadata. A loss scale therefore passes through ``jax.jit``
with every field intact and a jitted step does not retrace on its next call.

Validation runs once, in the constructor (and so in ``dataclasses.replace``),
on the values the user gives: Python and NumPy numbers and concrete arrays
are checked by value; traced arrays, which cannot be read, by shape and dtype.
It never runs when JAX rebuilds a loss scale from its leaves. JAX, and the
libraries built on it, rebuild pytrees with leaves that are not state arrays:
``jax.eval_shape`` with ``ShapeDtypeStruct``s, ``jit`` with shardings and
``None``s, Equinox's ``filter_jit`` and ``partition`` with bool masks and
``None``s, NNX with its variables. ``jax.tree_util.register_dataclass``
rebuilds through the constructor, which would validate those leaves (and
refuse them), so the loss scales are registered by :func:`_register_pytree`
instead: it derives the children (the state fields) and the auxiliary data
(the fields marked static) from the dataclass fields, so no field can be
forgotten (jmp's hand-written flattening forgot ``min_loss_scale``), and its
unflatten sets the fields directly, without calling ``__init__``.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src.inplace_select import GROUPED_CHECK_ENV, cpu_form
from jaxmp._src.validation import check_bool, check_number, check_state_value

T = TypeVar("T")

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal

_SCALE_ADVICE = (
    "Pass a Python float or a float32 array; powers of two such as 2.0**15 "
    "are typical. Scales below 2**-126, the smallest normal float32, are "
    "flushed to 0 by XLA, which would skip every step."
)


def _static(**kwargs):
  """A dataclass field that is configuration: pytree auxiliary data."""
  return dataclasses.field(metadata={"static": True}, **kwargs)


def _build(cls: type, values: dict[str, Any]) -> Any:
  """An instance of ``cls`` with the given fields, without running ``__init__``."""
  obj = object.__new__(cls)
  for name, value in values.items():
    object.__setattr__(obj, name, value)
  return obj


def _register_pytree(cls: type[T]) -> type[T]:
  """Registers the dataclass ``cls`` as a pytree whose unflatten skips ``__init__``.

  Fields declared with :func:`_static` are auxiliary data (they must be
  hashable); all others are children, keyed by attribute name as
  ``jax.tree_util.register_dataclass`` keys them. Apply it above
  ``@dataclasses.dataclass(frozen=True, eq=False)`` (``eq=False`` keeps
  :meth:`LossScale.__eq__`).
  """
  fields = dataclasses.fields(cls)
  children = tuple(f.name for f in fields if not f.metadata.get("static"))
  static = tuple(f.name for f in fields if f.metadata.get("static"))
  keys = tuple(jax.tree_util.GetAttrKey(name) for name in children)

  def flatten(obj):
    return (tuple(getattr(obj, name) for name in children),
            tuple(getattr(obj, name) for name in static))

  def flatten_with_keys(obj):
    leaves, aux = flatten(obj)
    return tuple(zip(keys, leaves)), aux

  def unflatten(aux, leaves):
    return _build(cls, {**dict(zip(static, aux)), **dict(zip(children, leaves))})

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  return cls


def _warn_if_integer_array(owner: str, name: str, value: Any) -> None:
  """jmp's warning for an integer-typed array given where a float is expected.

  Python ints are taken silently, as everywhere in jaxmp; an array whose dtype
  is an integer dtype is converted to float32, and this says so.
  """
  dtype = getattr(value, "dtype", None)
  if dtype is not None and np.dtype(dtype).kind in "iu":
    warnings.warn(
        f"Expected floating type for {name}, got {np.dtype(dtype)}: {owner} "
        "converts it to float32. Pass a float value, e.g. jnp.float32(2**15).",
        stacklevel=4,
    )


def _multiply(x: jax.Array, factor: float) -> jax.Array:
  """``x * factor`` for a float32 ``x`` and a Python float, rounded as PyTorch.

  PyTorch multiplies its float32 scale by a Python float in double precision
  and stores the result as float32. When ``factor`` is exactly a float32
  number (2, 0.5 ...) one float32 product gives that result; otherwise (0.1,
  1.1 ...) the product is formed in float64, locally, whatever the global
  ``jax_enable_x64`` setting.
  """
  if float(np.float32(factor)) == factor:
    return x * np.float32(factor)
  with jax.enable_x64(True):
    product = jnp.asarray(x, jnp.float64) * jnp.asarray(factor, jnp.float64)
    return product.astype(jnp.float32)


def at_least_float32(dtype: Any) -> np.dtype:
  """The dtype jaxmp computes in for values of ``dtype``: at least float32.

  Floating dtypes of 32 bits or more (float32, float64) and the complex
  dtypes (complex64, complex128) are kept; anything narrower or not floating
  (float16, bfloat16, float8, integers, bools) gives float32.
  """
  dtype = np.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4:
    return dtype
  return np.dtype(np.float32)


def _times(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` for a real float32 scalar ``factor``, in at least float32.

  A complex ``x`` is multiplied part by part in its own precision, so its
  imaginary part is kept and an infinite part stays infinite (a complex
  product with ``factor + 0j`` would turn ``inf * 0`` into nan).
  """
  dtype = at_least_float32(x.dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    factor = factor.astype(jnp.finfo(dtype).dtype)
    return jax.lax.complex(jnp.real(x) * factor, jnp.imag(x) * factor)
  return x.astype(dtype) * factor.astype(dtype)


def _check_scalar_bool(caller: str, value: Any) -> jax.Array:
  """``value`` as a scalar bool array, or a TypeError naming ``caller``."""
  flag = jnp.asarray(value)
  if flag.shape != () or flag.dtype != jnp.bool_:
    raise TypeError(
        f"{caller} expects a scalar boolean, got an array of shape "
        f"{flag.shape} and dtype {flag.dtype}. Pass e.g. "
        "jaxmp.all_finite(grads), or reduce an array first with jnp.all(x)."
    )
  return flag


def _same_value(a: Any, b: Any) -> bool:
  """Whether two state leaves are equal, for ``LossScale.__eq__``."""
  if a is b:
    return True
  if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
    raise TypeError(
        "Loss scales holding traced arrays (inside jit, grad or vmap) cannot "
        "be compared with ==: the result would have to be a Python bool. "
        "Compare their arrays instead, e.g. "
        "jnp.array_equal(a.loss_scale, b.loss_scale)."
    )
  array_like = (np.ndarray, np.generic, jax.Array, int, float)
  if isinstance(a, array_like) and isinstance(b, array_like):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
  return bool(a == b)


class LossScale:
  """Base class of the loss scales: ``scale``, ``unscale`` and ``adjust``.

  Subclasses provide ``loss_scale`` (a float32 scalar array) and ``adjust``.

  Two loss scales are equal (``==``) when they are of the same type, have
  the same configuration and hold equal state (the same values, nan equal to
  nan); comparing loss scales whose state is traced raises ``TypeError``.
  The hash is that of the type and the configuration, so loss scales can be
  dict keys or static arguments while their state changes.
  """

  loss_scale: Any

  def _state_fields(self) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(self)
                 if not f.metadata.get("static"))

  def __eq__(self, other: Any) -> bool:
    if type(other) is not type(self):
      return NotImplemented
    if self.config() != other.config():
      return False
    return all(_same_value(getattr(self, name), getattr(other, name))
               for name in self._state_fields())

  def __hash__(self) -> int:
    return hash(tuple(self.config().items()))

  def scale(self, tree: T) -> T:
    """Multiplies each leaf by the loss scale, computing in at least float32.

    A float16 or bfloat16 loss is promoted to float32 before the product, so
    the scaled loss cannot overflow here. Complex leaves are scaled in their
    own precision (complex64 stays complex64), real and imaginary parts alike.
    """
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    return jax.tree_util.tree_map(lambda x: _times(jnp.asarray(x), scale), tree)

  def unscale(self, tree: T) -> T:
    """Divides each leaf by the loss scale, returning it in at least float32.

    float32, float64 and complex leaves keep their dtype (complex ones are
    divided part by part); float16 and bfloat16 leaves come back in float32,
    as jmp's ``unscale`` (a float32 scale times the leaf) returns them, so
    that no small gradient underflows: a float16 gradient of ``2**-10`` under
    a scale of ``2**15`` is ``2**-25``, below float16's smallest subnormal.
    :func:`jaxmp.loss_scaling` casts the result back to the gradients' dtype
    before its inner optimizer sees it.
    """
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    # XLA divides by a scalar as a product with its reciprocal, and above
    # 2**126 that reciprocal is a float32 subnormal, which the CPU and TPU
    # flush to zero. There, multiply by 1 / (scale / 4) and then by 1 / 4
    # (behind a barrier, so that a constant scale is not folded back).
    rest = jnp.where(scale > np.float32(2.0**126), np.float32(0.25), np.float32(1))
    inverse, rest = jax.lax.optimization_barrier((1.0 / (scale * rest), rest))

    def unscale_leaf(x):
      return _times(_times(jnp.asarray(x), inverse), rest)

    return jax.tree_util.tree_map(unscale_leaf, tree)

  def adjust(self, grads_finite: Any) -> LossScale:
    raise NotImplementedError

  def metrics(self) -> dict[str, jax.Array]:
    """Scalar arrays describing this loss scale, for logging; jit-safe.

    Keys: ``loss_scale`` (float32), ``overflows_at_min`` (int32: overflows
    that found the scale at its minimum; 0 for scales that never change) and
    ``steps_since_adjustment`` (int32: the dynamic scale's counter, else 0).
    """
    zero = jnp.zeros([], jnp.int32)
    return {
        "loss_scale": jnp.asarray(self.loss_scale, jnp.float32),
        "overflows_at_min": zero,
        "steps_since_adjustment": zero,
    }

  def config(self) -> dict[str, Any]:
    """The static configuration: ``{"type": class name, field: value, ...}``.

    The fields are those that a checkpoint must agree on to resume
    (``period``, ``factor`` ... for :class:`DynamicLossScale`); the state
    (the scale, the counters) is not part of it.
    """
    config: dict[str, Any] = {"type": type(self).__name__}
    for field in dataclasses.fields(self):
      if field.metadata.get("static"):
        config[field.name] = getattr(self, field.name)
    return config


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """A loss scale of 1 that never changes: for float32 and bfloat16.

  It has no state and no configuration: ``scale`` and ``unscale`` return the
  tree they are given, and all instances are equal.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.NoOpLossScale().scale(jnp.float32(3.0))
    Array(3., dtype=float32)
  """

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones((), jnp.float32)

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    _check_scalar_bool("adjust", grads_finite)
    return self


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
  """A constant loss scale.

  The scale is pytree state (a float32 array), not part of the tree structure,
  so a new value does not recompile a jitted step.

  Args:
    loss_scale: the scale: a Python or NumPy number or a scalar array
      (concrete ones are checked by value, traced ones by shape and dtype),
      finite and at least ``2**-126``, the smallest normal float32. It is
      stored as float32.

  Raises:
    TypeError: if ``loss_scale`` is not a real number (a string, ``None``, a
      bool, a complex number, an array of another shape).
    ValueError: if it is nan, infinite, or below ``2**-126`` (0, negative,
      or a float32 subnormal such as ``1e-40``, which XLA flushes to 0).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.StaticLossScale(128.0).scale(jnp.float16(2.0))
    Array(256., dtype=float32)
  """

  loss_scale: Any

  def __post_init__(self):
    owner = type(self).__name__
    _warn_if_integer_array(owner, "loss_scale", self.loss_scale)
    object.__setattr__(self, "loss_scale", check_state_value(
        owner, "loss_scale", self.loss_scale, np.float32,
        minimum=FLOAT32_TINY, maximum=FLOAT32_MAX, advice=_SCALE_ADVICE))

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    _check_scalar_bool("adjust", grads_finite)
    return self


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
  """A loss scale that backs off on overflow and grows after clean steps.

  The first five arguments match ``jmp.DynamicLossScale`` positionally.

  The update rule of :meth:`adjust`:

  * finite step: ``counter += 1``; with ``consecutive_hysteresis`` the
    hysteresis budget is refilled. If ``counter == period``: ``counter = 0``,
    the budget is refilled, and the scale is multiplied by ``factor`` unless
    the result would exceed ``max_loss_scale`` (or be inf), in which case the
    scale is kept.
  * non-finite step: ``counter = 0``. If more than one unit of hysteresis
    budget is left, one is used and the scale is kept; otherwise
    ``loss_scale = max(loss_scale * backoff_factor, min_loss_scale)``. An
    overflow that finds the scale already at ``min_loss_scale`` with no budget
    left is counted in ``overflows_at_min`` (:func:`jaxmp.check_loss_scale`
    reads it).

  With ``hysteresis=1`` this is jmp's and PyTorch's ``GradScaler`` rule.

  Every argument is validated here, once. Configuration values (``period``
  ... ``consecutive_hysteresis``) are Python or NumPy numbers or concrete
  0-d arrays and are stored as Python numbers. State values (``loss_scale``,
  ``counter``, ``hysteresis_left``, ``overflows_at_min``) may also be traced
  arrays, which are checked by shape and dtype only; they are stored as
  float32 and int32 arrays.

  Args:
    loss_scale: the initial scale (default ``2**15``), within
      ``[min_loss_scale, max_loss_scale]`` and at least ``2**-126``.
    counter: finite steps since the last growth or overflow (state), in
      ``[0, period)``.
    period: number of consecutive finite steps before the scale grows, in
      ``[1, 2**31 - 1]``.
    factor: the growth factor, a finite number > 1.
    min_loss_scale: the scale never backs off below this (>= 0), nor below
      ``2**-126``, the smallest normal float32, so it never becomes 0.
    backoff_factor: multiplier on overflow, in (0, 1); default ``1/factor``.
    max_loss_scale: the scale never grows above this (at least
      ``min_loss_scale``); default (or ``inf``) the largest finite float32,
      so the scale never becomes inf.
    hysteresis: how many overflows are tolerated before the scale backs off
      (DeepSpeed's ``hysteresis``), in ``[1, 2**31 - 1]``; 1 backs off on
      every overflow.
    consecutive_hysteresis: refill the hysteresis budget on every finite
      step, not only when the scale grows (DeepSpeed's option of that name).
    hysteresis_left: the remaining hysteresis budget (state), in
      ``[1, hysteresis]``; default ``hysteresis``.
    overflows_at_min: overflows seen at the minimum scale (state), >= 0.

  Raises:
    TypeError: for a value of the wrong kind: a string, ``None``, a bool
      where a number is expected, a non-whole number where an integer is
      expected, an array that is not a scalar, a traced floating counter.
    ValueError: for a value out of range: a nan, infinite, non-positive or
      subnormal scale, a scale outside ``[min_loss_scale, max_loss_scale]``,
      ``period < 1``, ``factor <= 1``, ``backoff_factor`` outside (0, 1),
      ``hysteresis < 1``, a counter outside its range, an integer that does
      not fit int32.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.DynamicLossScale(2.0**15, period=2)
    >>> ls = ls.adjust(jnp.array(False))
    >>> float(ls.loss_scale)
    16384.0
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    32768.0
  """

  loss_scale: Any = 2.0**15
  counter: Any = 0
  period: int = _static(default=2000)
  factor: float = _static(default=2.0)
  min_loss_scale: float = _static(default=1.0)
  backoff_factor: float | None = _static(default=None, kw_only=True)
  max_loss_scale: float | None = _static(default=None, kw_only=True)
  hysteresis: int = _static(default=1, kw_only=True)
  consecutive_hysteresis: bool = _static(default=False, kw_only=True)
  hysteresis_left: Any = dataclasses.field(default=None, kw_only=True)
  overflows_at_min: Any = dataclasses.field(default=0, kw_only=True)

  def __post_init__(self):
    owner = type(self).__name__
    setf = lambda name, value: object.__setattr__(self, name, value)
    # Configuration.
    period = check_number(
        owner, "period", self.period, integer=True, minimum=1, maximum=INT32_MAX,
        advice="It is the number of finite steps before the scale grows; "
        "2000 is the usual choice.")
    factor = check_number(
        owner, "factor", self.factor, minimum=1, exclusive_minimum=True,
        advice="It is the growth factor; 2.0 is the usual choice. Use "
        "StaticLossScale for a scale that never changes.")
    backoff = 1.0 / factor if self.backoff_factor is None else self.backoff_factor
    backoff = check_number(
        owner, "backoff_factor", backoff, minimum=0, maximum=1,
        exclusive_minimum=True, exclusive_maximum=True,
        advice="It multiplies the scale on each overflow; 0.5 halves it.")
    _warn_if_integer_array(owner, "min_loss_scale", self.min_loss_scale)
    min_scale = check_number(
        owner, "min_loss_scale", self.min_loss_scale, minimum=0,
        maximum=FLOAT32_MAX,
        advice="The scale never backs off below it; 1.0 is the usual choice.")
    max_scale = math.inf
    if self.max_loss_scale is not None:
      max_scale = check_number(
          owner, "max_loss_scale", self.max_loss_scale,
          minimum=max(min_scale, FLOAT32_TINY), maximum=math.inf,
          advice=f"The scale never grows above it, so it must be positive "
          f"and at least min_loss_scale ({min_scale}). Pass None for no "
          "limit but the largest finite float32.")
    max_scale = min(max_scale, FLOAT32_MAX)
    hysteresis = check_number(
        owner, "hysteresis", self.hysteresis, integer=True, minimum=1,
        maximum=INT32_MAX,
        advice="It is how many overflows are tolerated before the scale backs "
        "off: 1 backs off on every overflow; DeepSpeed's default is 2.")
    consecutive = check_bool(owner, "consecutive_hysteresis",
                             self.consecutive_hysteresis)
    for name, value in [("period", period), ("factor", factor),
                        ("backoff_factor", backoff), ("min_loss_scale", min_scale),
                        ("max_loss_scale", max_scale), ("hysteresis", hysteresis),
                        ("consecutive_hysteresis", consecutive)]:
      setf(name, value)
    # State.
    _warn_if_integer_array(owner, "loss_scale", self.loss_scale)
    setf("loss_scale", check_state_value(
        owner, "loss_scale", self.loss_scale, np.float32,
        minimum=max(min_scale, FLOAT32_TINY), maximum=max_scale,
        advice=f"The initial scale must lie within [min_loss_scale, "
        f"max_loss_scale] = [{min_scale:g}, {max_scale:g}]: change "
        f"loss_scale or those bounds. {_SCALE_ADVICE}"))
    setf("counter", check_state_value(
        owner, "counter", self.counter, np.int32, minimum=0, maximum=period - 1,
        advice="It counts the finite steps since the last growth or overflow, "
        "so it lies in [0, period); start with 0."))
    left = hysteresis if self.hysteresis_left is None else self.hysteresis_left
    setf("hysteresis_left", check_state_value(
        owner, "hysteresis_left", left, np.int32, minimum=1, maximum=hysteresis,
        advice="It is the overflows still tolerated, so it lies in "
        "[1, hysteresis]; leave it out to start with hysteresis."))
    setf("overflows_at_min", check_state_value(
        owner, "overflows_at_min", self.overflows_at_min, np.int32, minimum=0,
        advice="It counts the overflows at the minimum scale; start with 0."))

  def metrics(self) -> dict[str, jax.Array]:
    metrics = super().metrics()
    metrics["overflows_at_min"] = jnp.asarray(self.overflows_at_min)
    metrics["steps_since_adjustment"] = jnp.asarray(self.counter)
    return metrics

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """Returns the loss scale for the next step, given this step's finiteness.

    Args:
      grads_finite: scalar bool, e.g. ``jaxmp.all_finite(grads)``.

    Returns:
      A :class:`DynamicLossScale` with the same configuration and the next
      state.

    Raises:
      TypeError: if ``grads_finite`` is not a scalar boolean.
    """
    finite = _check_scalar_bool("adjust", grads_finite)
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    left = jnp.asarray(self.hysteresis_left)
    overflows = jnp.asarray(self.overflows_at_min)
    full = jnp.int32(self.hysteresis)

    # Finite step.
    next_counter = counter + 1
    grow = next_counter >= self.period
    grown = _multiply(scale, self.factor)
    can_grow = jnp.isfinite(grown) & (grown <= np.float32(self.max_loss_scale))
    finite_scale = jnp.where(grow & can_grow, grown, scale)
    finite_counter = jnp.where(grow, jnp.int32(0), next_counter)
    refill = grow | self.consecutive_hysteresis
    finite_left = jnp.where(refill, full, left)

    # Non-finite step.
    use_budget = left > 1
    # Never below the smallest normal float32: smaller scales are flushed to 0.
    floor = np.float32(max(self.min_loss_scale, FLOAT32_TINY))
    backed_off = jnp.maximum(_multiply(scale, self.backoff_factor), floor)
    overflow_scale = jnp.where(use_budget, scale, backed_off)
    overflow_left = jnp.where(use_budget, left - 1, left)
    at_min = jnp.logical_not(use_budget) & (scale <= floor)

    # The next state follows from a valid one by the rule, so it is built
    # without the constructor's checks (which would read it back to the host
    # when not under jit).
    return _build(type(self), {
        **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
        "loss_scale": jnp.where(finite, finite_scale, overflow_scale),
        "counter": jnp.where(finite, finite_counter, jnp.int32(0)),
        "hysteresis_left": jnp.where(finite, finite_left, overflow_left),
        "overflows_at_min": overflows
        + jnp.logical_and(jnp.logical_not(finite), at_min).astype(jnp.int32),
    })


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: true iff no leaf of ``tree`` holds inf or nan.

  An empty tree (``{}``, ``None``) is finite. A complex value is finite when
  both its real and imaginary parts are; integer and bool leaves are always
  finite. Works under ``jit``; under ``jit`` with sharded arrays the
  reduction is global (XLA inserts the all-reduce). On a CPU the leaves of one
  shape and dtype are reduced together, in one pass that reads each leaf once
  and writes no intermediate mask; elsewhere each leaf is reduced on its own,
  as jmp does, which XLA:GPU can fuse with the kernel that produces the leaf.
  ``JAXMP_GROUPED_CHECK=1`` or ``0`` picks one form everywhere.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> bool(jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(jaxmp.all_finite({}))
    True
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if cpu_form(GROUPED_CHECK_ENV):
    flags = leaf_finite_flags(leaves)
  else:
    flags = [jnp.isfinite(x).all() for x in leaves]
  if not flags:
    return jnp.array(True)
  return jnp.stack(flags).all()


# The most leaves one variadic reduce of the check takes. XLA:CPU compiles
# the fusion of a variadic reduce in a time that grows faster than its
# operands: 1000 leaves of one shape in one reduce took 163 CPU s to compile,
# in reduces of 64 or 32 leaves 4.5 and 4.0 s. 64 keeps the largest groups of
# the benchmark transformers (33 leaves at 4M parameters, 62 at 30M) whole.
_MAX_REDUCE_OPERANDS = 64


def _and_each(accumulated, values):
  return [jnp.logical_and(a, v) for a, v in zip(accumulated, values)]


def leaf_finite_flags(leaves: list[Any]) -> list[jax.Array]:
  """A scalar bool per leaf: true iff the leaf holds no inf or nan.

  Integer and bool leaves are always finite (``jnp.isfinite`` of them is
  true). The floating leaves are grouped by shape and dtype, and the
  ``isfinite`` of each group's leaves (at most 64 at a time) is reduced by
  one variadic ``lax.reduce``: XLA:CPU's tree-reduction rewriter splits a
  one-operand reduce over more than 32 elements into a reduce-window and a
  reduce, with the ``isfinite`` mask written to memory between them, and it
  leaves a variadic reduce alone, which reads each leaf once and writes only
  the flags. A lone leaf is reduced as two operands, both results used (XLA
  drops an unused output, and a one-operand reduce is not variadic).

  Args:
    leaves: a list of arrays (or numbers), e.g. a pytree's leaves.

  Returns:
    A list of scalar bool arrays, one per leaf, in the order of ``leaves``.
  """
  flags: list[jax.Array | None] = [None] * len(leaves)
  groups: dict[tuple[Any, Any], list[int]] = {}
  arrays = [jnp.asarray(x) for x in leaves]
  for i, x in enumerate(arrays):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      groups.setdefault((x.shape, x.dtype), []).append(i)
    else:
      flags[i] = jnp.ones([], jnp.bool_)
  chunks = [(shape, indices[start:start + _MAX_REDUCE_OPERANDS])
            for (shape, _), indices in groups.items()
            for start in range(0, len(indices), _MAX_REDUCE_OPERANDS)]
  for shape, indices in chunks:
    operands = [jnp.isfinite(arrays[i]) for i in indices]
    lone = len(operands) == 1
    if lone:
      operands = operands * 2
    reduced = jax.lax.reduce(operands, [np.bool_(True)] * len(operands),
                             _and_each, tuple(range(len(shape))))
    if lone:
      reduced = [jnp.logical_and(*reduced)]
    for i, flag in zip(indices, reduced):
      flags[i] = flag
  return flags


def select_tree(pred: Any, a: T, b: T) -> T:
  """Returns ``a`` where the scalar bool ``pred`` is true, else ``b``, leafwise.

  As jmp's ``select_tree``: the two trees must have the same structure, and
  their leaves the same shapes and dtypes (nothing is broadcast or
  promoted), so the result has the dtypes of ``a`` and ``b``.

  Args:
    pred: a scalar boolean (array).
    a: a pytree.
    b: a pytree of the same structure, shapes and dtypes as ``a``.

  Returns:
    A pytree of the structure of ``a``.

  Raises:
    TypeError: if ``pred`` is not a scalar boolean, or two leaves have
      different dtypes.
    ValueError: if ``a`` and ``b`` do not have the same structure and shapes.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = _check_scalar_bool("select_tree", pred)
  struct_a = jax.tree_util.tree_structure(a)
  struct_b = jax.tree_util.tree_structure(b)
  if struct_a != struct_b:
    raise ValueError(
        "select_tree expects two pytrees of the same structure, got "
        f"{struct_a} and {struct_b}."
    )
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    where = jax.tree_util.keystr(path)
    if jnp.shape(x) != jnp.shape(y):
      raise ValueError(
          f"select_tree: the leaves at {where} have shapes {jnp.shape(x)} and "
          f"{jnp.shape(y)}. Pass two pytrees of the same shapes, e.g. the new "
          "and the old value of the same state."
      )
    if jnp.result_type(x) != jnp.result_type(y):
      raise TypeError(
          f"select_tree: the leaves at {where} have dtypes "
          f"{jnp.result_type(x)} and {jnp.result_type(y)}. Pass two pytrees of "
          "the same dtypes, e.g. the new and the old value of the same state."
      )
  return optax.tree.where(pred, a, b)


def agree_across(flag: jax.Array, axis_name: Any, unbound_error: str) -> jax.Array:
  """A scalar bool ``flag`` made true only where it is true on every device.

  Reduced with ``pmin`` over ``axis_name`` (inside ``shard_map`` or ``pmap``);
  returned as is when ``axis_name`` is None.

  Raises:
    ValueError: with ``unbound_error`` when the axis name is not bound.
  """
  if axis_name is None:
    return flag
  try:
    flag = jax.lax.pmin(flag.astype(jnp.int32), axis_name)
  except NameError:
    raise ValueError(unbound_error) from None
  return flag.astype(jnp.bool_)
