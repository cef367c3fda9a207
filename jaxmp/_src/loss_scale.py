"""Loss scales (no-op, static, dynamic) as pytrees; ``all_finite``, ``select_tree``.

State is float32/int32 arrays, configuration static pytree metadata; arguments
are checked once, in the constructor, never on unflatten (:func:`_register_pytree`).
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

from jaxmp._src.inplace_select import GROUPED_CHECK_ENV, check_same_structure, cpu_form
from jaxmp._src.validation import check_bool, check_number, check_state_value

T = TypeVar("T")

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal

_SCALE_ADVICE = (
    "Pass a Python float or a float32 array; powers of two such as 2.0**15 "
    "are typical. Scales below 2**-126, the smallest normal float32, are "
    "flushed to 0 by XLA, which would skip every step.")


def _static(**kwargs):  # a configuration field: pytree auxiliary data
  return dataclasses.field(metadata={"static": True}, **kwargs)


def _build(cls: type, values: dict[str, Any]) -> Any:  # without __init__'s checks
  obj = object.__new__(cls)
  obj.__dict__.update(values)  # (frozen: no setattr)
  return obj


def _register_pytree(cls: type[T]) -> type[T]:
  """Registers the dataclass ``cls`` as a pytree: :func:`_static` fields are aux data,
  the others children keyed by name; unflatten skips ``__init__``, so JAX may
  rebuild it from any leaves (``eval_shape``, shardings, Equinox masks, NNX)."""
  fields = dataclasses.fields(cls)
  children = tuple(f.name for f in fields if not f.metadata.get("static"))
  static = tuple(f.name for f in fields if f.metadata.get("static"))
  keys = tuple(jax.tree_util.GetAttrKey(name) for name in children)
  flatten = lambda obj: (tuple(getattr(obj, name) for name in children),
                         tuple(getattr(obj, name) for name in static))
  jax.tree_util.register_pytree_with_keys(
      cls, lambda obj: (tuple(zip(keys, flatten(obj)[0])), flatten(obj)[1]),
      lambda aux, leaves: _build(cls, {**dict(zip(static, aux)),
                                       **dict(zip(children, leaves))}), flatten)
  return cls


def _warn_if_integer_array(owner: str, name: str, value: Any) -> None:  # as jmp warns
  dtype = getattr(value, "dtype", None)
  if dtype is not None and np.dtype(dtype).kind in "iu":
    warnings.warn(
        f"Expected floating type for {name}, got {np.dtype(dtype)}: {owner} "
        "converts it to float32. Pass a float value, e.g. jnp.float32(2**15).", stacklevel=4)


def _multiply(x: jax.Array, factor: float) -> jax.Array:
  """``x * factor`` for a float32 ``x``, rounded as PyTorch's float64 product is."""
  if float(np.float32(factor)) == factor:
    return x * np.float32(factor)
  with jax.enable_x64(True):
    product = jnp.asarray(x, jnp.float64) * jnp.asarray(factor, jnp.float64)
    return product.astype(jnp.float32)


def at_least_float32(dtype: Any) -> np.dtype:
  """``dtype`` if it is a float of 32 bits or more or complex, else float32."""
  dtype = np.dtype(dtype)
  wide = jnp.issubdtype(dtype, jnp.complexfloating) or (
      jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize >= 4)
  return dtype if wide else np.dtype(np.float32)


def _times(x: jax.Array, factor: jax.Array) -> jax.Array:
  """``x * factor`` in at least float32; complex ``x`` part by part (no ``inf * 0``)."""
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
        "jaxmp.all_finite(grads), or reduce an array first with jnp.all(x).")
  return flag


def _same_value(a: Any, b: Any) -> bool:
  """Whether two state leaves are equal (nan equal to nan), for ``==``."""
  if a is b:
    return True
  if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
    raise TypeError(
        "Loss scales holding traced arrays (inside jit, grad or vmap) cannot "
        "be compared with ==: the result would have to be a Python bool. "
        "Compare their arrays instead, e.g. "
        "jnp.array_equal(a.loss_scale, b.loss_scale).")
  array_like = (np.ndarray, np.generic, jax.Array, int, float)
  if isinstance(a, array_like) and isinstance(b, array_like):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
  return bool(a == b)


class LossScale:
  """Base class of the loss scales: equal when type, configuration and state
  agree (nan equal to nan), hashed by the configuration."""

  loss_scale: Any

  def __eq__(self, other: Any) -> bool:
    if type(other) is not type(self):
      return NotImplemented
    return self.config() == other.config() and all(
        _same_value(getattr(self, f.name), getattr(other, f.name))
        for f in dataclasses.fields(self) if not f.metadata.get("static"))

  def __hash__(self) -> int:
    return hash(tuple(self.config().items()))

  def scale(self, tree: T) -> T:
    """Multiplies each leaf by the loss scale, in at least float32."""
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    return jax.tree_util.tree_map(lambda x: _times(jnp.asarray(x), scale), tree)

  def unscale(self, tree: T) -> T:
    """Divides each leaf by the loss scale; float16/bfloat16 leaves come back float32."""
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    # XLA divides by a scalar as a product with its reciprocal, which above
    # 2**126 is a float32 subnormal, flushed to zero: there, multiply by
    # 1 / (scale / 4) and by 1 / 4, behind a barrier (no constant folding).
    rest = jnp.where(scale > np.float32(2.0**126), np.float32(0.25), np.float32(1))
    inverse, rest = jax.lax.optimization_barrier((1.0 / (scale * rest), rest))
    return jax.tree_util.tree_map(
        lambda x: _times(_times(jnp.asarray(x), inverse), rest), tree)

  def adjust(self, grads_finite: Any) -> LossScale:
    """The loss scale of the next step, given this step's scalar bool finiteness."""
    _check_scalar_bool("adjust", grads_finite)
    return self

  def metrics(self) -> dict[str, jax.Array]:
    """``loss_scale``, ``overflows_at_min`` and ``steps_since_adjustment`` (the counter)."""
    int32 = lambda name: jnp.asarray(getattr(self, name, 0), jnp.int32)
    return {"loss_scale": jnp.asarray(self.loss_scale, jnp.float32),
            "overflows_at_min": int32("overflows_at_min"),
            "steps_since_adjustment": int32("counter")}

  def config(self) -> dict[str, Any]:
    """``{"type": class name, field: value, ...}`` of the static fields."""
    return {"type": type(self).__name__, **{
        f.name: getattr(self, f.name) for f in dataclasses.fields(self)
        if f.metadata.get("static")}}


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class NoOpLossScale(LossScale):
  """A loss scale of 1 that never changes: for float32 and bfloat16.

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


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
  """A constant loss scale, at least ``2**-126`` (a float32 array: a new value does not recompile).

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


@_register_pytree
@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(LossScale):
  """A loss scale that backs off on overflow and grows after ``period`` clean steps.

  The first five arguments are jmp's; ``hysteresis`` overflows are tolerated
  before backing off (DeepSpeed's, refilled on every finite step with
  ``consecutive_hysteresis``). ``loss_scale``, ``counter``,
  ``hysteresis_left`` and ``overflows_at_min`` are state, the others static.
  The rule and the settings: docs/loss-scaling.md.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.DynamicLossScale(2.0**15, period=2)
    >>> float(ls.adjust(jnp.array(False)).loss_scale)
    16384.0
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
    number = lambda name, advice, value=None, **bounds: check_number(
        owner, name, getattr(self, name) if value is None else value,
        advice=advice, **bounds)
    state = lambda name, value, dtype, advice, **bounds: check_state_value(
        owner, name, value, dtype, advice=advice, **bounds)
    period = number("period", "It is the number of finite steps before the "
                    "scale grows; 2000 is the usual choice.",
                    integer=True, minimum=1, maximum=INT32_MAX)
    factor = number("factor", "It is the growth factor; 2.0 is the usual "
                    "choice. Use StaticLossScale for a scale that never changes.",
                    minimum=1, exclusive_minimum=True)
    backoff = number("backoff_factor", "It multiplies the scale on each "
                     "overflow; 0.5 halves it.", 1.0 / factor
                     if self.backoff_factor is None else self.backoff_factor,
                     minimum=0, maximum=1, exclusive_minimum=True,
                     exclusive_maximum=True)
    _warn_if_integer_array(owner, "min_loss_scale", self.min_loss_scale)
    min_scale = number("min_loss_scale", "The scale never backs off below it; "
                       "1.0 is the usual choice.", minimum=0, maximum=FLOAT32_MAX)
    max_scale = FLOAT32_MAX if self.max_loss_scale is None else min(FLOAT32_MAX, number(
        "max_loss_scale", "The scale never grows above it, so it must be "
        f"positive and at least min_loss_scale ({min_scale}). Pass None for "
        "no limit but the largest finite float32.",
        minimum=max(min_scale, FLOAT32_TINY), maximum=math.inf))
    hysteresis = number(
        "hysteresis", "It is how many overflows are tolerated before the scale "
        "backs off: 1 backs off on every overflow; DeepSpeed's default is 2.",
        integer=True, minimum=1, maximum=INT32_MAX)
    _warn_if_integer_array(owner, "loss_scale", self.loss_scale)
    values = dict(
        period=period, factor=factor, backoff_factor=backoff,
        min_loss_scale=min_scale, max_loss_scale=max_scale, hysteresis=hysteresis,
        consecutive_hysteresis=check_bool(owner, "consecutive_hysteresis",
                                          self.consecutive_hysteresis),
        loss_scale=state(
            "loss_scale", self.loss_scale, np.float32, "The initial scale must "
            f"lie within [min_loss_scale, max_loss_scale] = [{min_scale:g}, "
            f"{max_scale:g}]: change loss_scale or those bounds. {_SCALE_ADVICE}",
            minimum=max(min_scale, FLOAT32_TINY), maximum=max_scale),
        counter=state(
            "counter", self.counter, np.int32, "It counts the finite steps since "
            "the last growth or overflow, so it lies in [0, period); start with 0.",
            minimum=0, maximum=period - 1),
        hysteresis_left=state(
            "hysteresis_left", hysteresis if self.hysteresis_left is None
            else self.hysteresis_left, np.int32, "It is the overflows still "
            "tolerated, so it lies in [1, hysteresis]; leave it out to start "
            "with hysteresis.", minimum=1, maximum=hysteresis),
        overflows_at_min=state(
            "overflows_at_min", self.overflows_at_min, np.int32, "It counts the "
            "overflows at the minimum scale; start with 0.", minimum=0))
    for name, value in values.items():
      object.__setattr__(self, name, value)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    finite = _check_scalar_bool("adjust", grads_finite)
    scale = jnp.asarray(self.loss_scale)
    counter = jnp.asarray(self.counter)
    left = jnp.asarray(self.hysteresis_left)
    overflows = jnp.asarray(self.overflows_at_min)
    full = jnp.int32(self.hysteresis)
    # A finite step, then a non-finite one.
    next_counter = counter + 1
    grow = next_counter >= self.period
    grown = _multiply(scale, self.factor)
    can_grow = jnp.isfinite(grown) & (grown <= np.float32(self.max_loss_scale))
    finite_scale = jnp.where(grow & can_grow, grown, scale)
    finite_counter = jnp.where(grow, jnp.int32(0), next_counter)
    refill = grow | self.consecutive_hysteresis
    finite_left = jnp.where(refill, full, left)
    use_budget = left > 1
    # Never below the smallest normal float32: smaller scales are flushed to 0.
    floor = np.float32(max(self.min_loss_scale, FLOAT32_TINY))
    backed_off = jnp.maximum(_multiply(scale, self.backoff_factor), floor)
    overflow_scale = jnp.where(use_budget, scale, backed_off)
    overflow_left = jnp.where(use_budget, left - 1, left)
    at_min = jnp.logical_not(use_budget) & (scale <= floor)
    # The next state follows from a valid one by the rule: no checks (which
    # would read it back to the host outside jit).
    return _build(type(self), {
        **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
        "loss_scale": jnp.where(finite, finite_scale, overflow_scale),
        "counter": jnp.where(finite, finite_counter, jnp.int32(0)),
        "hysteresis_left": jnp.where(finite, finite_left, overflow_left),
        "overflows_at_min": overflows
        + jnp.logical_and(jnp.logical_not(finite), at_min).astype(jnp.int32),
    })


def all_finite(tree: Any) -> jax.Array:
  """A scalar bool array: true iff no leaf of ``tree`` holds inf or nan (global under ``jit``).

  Its form follows the backend (``JAXMP_GROUPED_CHECK``, docs/loss-scaling.md).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> bool(jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if cpu_form(GROUPED_CHECK_ENV):
    flags = leaf_finite_flags(leaves)
  else:
    flags = [jnp.isfinite(x).all() for x in leaves]
  return jnp.stack(flags).all() if flags else jnp.array(True)


# The most leaves one variadic reduce takes: XLA:CPU compiled 1000 leaves in
# one reduce in 163 CPU s, in reduces of 64 in 4.5 s; 64 keeps the largest
# groups of the benchmark transformers (62 leaves at 30M parameters) whole.
_MAX_REDUCE_OPERANDS = 64


def _and_pairwise(acc, values):
  # Defined once, so an un-jitted call finds the reduce it compiled before.
  return [jnp.logical_and(a, v) for a, v in zip(acc, values)]


def leaf_finite_flags(leaves: list[Any]) -> list[jax.Array]:
  """A scalar bool per leaf (true iff finite), from variadic reduces of leaves alike.

  XLA:CPU writes the mask of a one-operand reduce to memory, not of a
  variadic one: a lone leaf is reduced as two operands, both results used.
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
    reduced = jax.lax.reduce(
        operands, [np.bool_(True)] * len(operands),
        _and_pairwise,
        tuple(range(len(shape))))
    if lone:
      reduced = [jnp.logical_and(*reduced)]
    for i, flag in zip(indices, reduced):
      flags[i] = flag
  return flags


def select_tree(pred: Any, a: T, b: T) -> T:
  """``a`` where the scalar bool ``pred`` is true, else ``b``: trees alike, as jmp's.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = _check_scalar_bool("select_tree", pred)
  fix = "Pass two pytrees alike, e.g. the new and the old value of the same state."
  check_same_structure(a, b, owner="jaxmp.select_tree", names=("a", "b"), fix=fix)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if jnp.result_type(x) != jnp.result_type(y):
      raise TypeError(
          f"jaxmp.select_tree: a and b differ in dtype at "
          f"{jax.tree_util.keystr(path)}: {jnp.result_type(x)} against "
          f"{jnp.result_type(y)}. {fix}")
  return optax.tree.where(pred, a, b)
