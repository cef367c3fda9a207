"""Loss scales: no-op, static and dynamic, as pytrees.

State (the scale, counters) is arrays with explicit dtypes: float32 for the
scale, int32 for counters. Configuration (period, factors, bounds, hysteresis)
is static pytree metadata. A loss scale therefore passes through ``jax.jit``
with every field intact and a jitted step does not retrace on its next call.

Configuration is validated at construction, outside ``jit``. Values given as
Python or NumPy numbers are checked and stored as NumPy arrays; JAX arrays
(and tracers) are only checked for shape and dtype, so that rebuilding a loss
scale from device arrays never synchronises with the host.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")

FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_MAX = int(np.iinfo(np.int32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126


class _Default:
  """Marks a state field left to its default. Not ``None``: JAX rebuilds
  pytrees with ``None`` leaves (``jit``'s shardings and layouts), and those
  must stay ``None``."""

  def __repr__(self):
    return "<default>"


_DEFAULT = _Default()


def _static(**kwargs):
  return dataclasses.field(metadata={"static": True}, **kwargs)


def _state_value(value: Any, dtype: Any, name: str, cls: str) -> Any:
  """Stores a state field as an array of ``dtype``.

  Python and NumPy numbers become NumPy arrays (and are returned together with
  their value for validation). JAX arrays and tracers are checked for dtype
  only: they may carry leading axes, as the per-device copies that ``pmap``
  stacks do. Anything else (e.g. placeholders that JAX puts in pytrees) is
  passed through untouched.
  """
  dtype = np.dtype(dtype)
  if isinstance(value, jax.Array):
    if value.dtype != dtype:
      raise TypeError(
          f"{cls}.{name} must be a scalar {dtype} array (or per-device "
          f"copies of one, stacked by pmap), got dtype {value.dtype}. Pass a "
          f"Python number or jnp.asarray(value, jnp.{dtype.name})."
      )
    return value
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{cls}.{name} must be a number, got the bool {value!r}.")
  if isinstance(value, (numbers.Number, np.ndarray, np.generic)):
    arr = np.asarray(value)
    if arr.shape != ():
      raise TypeError(f"{cls}.{name} must be a scalar, got shape {arr.shape}.")
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 4:
      raise TypeError(
          f"{cls}.{name} was given as {arr.dtype}, whose range is too small "
          "for a loss scale (float16 overflows above 65504). Pass a Python "
          "float or a float32 value."
      )
    if dtype.kind == "i":
      if arr.dtype.kind not in "iu" and not float(arr).is_integer():
        raise TypeError(f"{cls}.{name} must be an integer, got {value!r}.")
    return np.asarray(arr, dtype)
  return value


def _concrete(value: Any) -> float | None:
  """The value of a NumPy state field, or None for JAX arrays and tracers."""
  if isinstance(value, np.ndarray):
    return value.item()
  return None


def _check_number(value: Any, name: str, cls: str, *, integer: bool = False):
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    kind = "an integer" if integer else "a number"
    raise TypeError(f"{cls}: {name} must be {kind}, got {value!r}.")
  if integer and not float(value).is_integer():
    raise TypeError(f"{cls}: {name} must be an integer, got {value!r}.")
  if math.isnan(value):
    raise ValueError(f"{cls}: {name} must not be nan.")


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


def _leaf_dtype(x: jax.Array) -> np.dtype:
  """The dtype in which a leaf is scaled: its own, but at least float32."""
  if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize >= 4:
    return x.dtype
  return np.dtype(jnp.float32)


class LossScale:
  """Base class of the loss scales: ``scale``, ``unscale`` and ``adjust``.

  Subclasses provide ``loss_scale`` (a float32 scalar array) and ``adjust``.
  """

  loss_scale: Any

  def scale(self, tree: T) -> T:
    """Multiplies each leaf by the loss scale, computing in at least float32.

    A float16 or bfloat16 loss is promoted to float32 before the product, so
    the scaled loss cannot overflow here.
    """
    scale = jnp.asarray(self.loss_scale)

    def scale_leaf(x):
      x = jnp.asarray(x)
      dtype = _leaf_dtype(x)
      return x.astype(dtype) * scale.astype(dtype)

    return jax.tree_util.tree_map(scale_leaf, tree)

  def unscale(self, tree: T) -> T:
    """Divides each leaf by the loss scale; each leaf keeps its own dtype."""
    scale = jnp.asarray(self.loss_scale)
    # XLA divides by a scalar as a product with its reciprocal, and above
    # 2**126 that reciprocal is a float32 subnormal, which the CPU and TPU
    # flush to zero. There, multiply by 1 / (scale / 4) and then by 1 / 4
    # (behind a barrier, so that a constant scale is not folded back).
    rest = jnp.where(scale > np.float32(2.0**126), np.float32(0.25), np.float32(1))
    inverse, rest = jax.lax.optimization_barrier((1.0 / (scale * rest), rest))

    def unscale_leaf(x):
      x = jnp.asarray(x)
      dtype = _leaf_dtype(x)
      unscaled = x.astype(dtype) * inverse.astype(dtype) * rest.astype(dtype)
      return unscaled.astype(x.dtype)

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


def _check_finite_flag(grads_finite: Any) -> jax.Array:
  flag = jnp.asarray(grads_finite)
  if flag.shape != () or flag.dtype != jnp.bool_:
    raise TypeError(
        "adjust expects a scalar boolean, e.g. jaxmp.all_finite(grads); got "
        f"shape {flag.shape} and dtype {flag.dtype}."
    )
  return flag


@jax.tree_util.register_dataclass
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

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    _check_finite_flag(grads_finite)
    return self


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(LossScale):
  """A constant loss scale.

  The scale is pytree state (a float32 array), not part of the tree structure,
  so a new value does not recompile a jitted step.

  Args:
    loss_scale: the scale, a positive finite number.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.StaticLossScale(128.0).scale(jnp.float16(2.0))
    Array(256., dtype=float32)
  """

  loss_scale: Any

  def __post_init__(self):
    cls = type(self).__name__
    value = _state_value(self.loss_scale, np.float32, "loss_scale", cls)
    object.__setattr__(self, "loss_scale", value)
    scale = _concrete(value)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
      raise ValueError(
          f"{cls}: loss_scale must be positive and finite, got {scale}. "
          "Typical values are powers of two such as 2.0**15."
      )

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    _check_finite_flag(grads_finite)
    return self


@jax.tree_util.register_dataclass
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

  Args:
    loss_scale: the initial scale (default ``2**15``).
    counter: finite steps since the last growth or overflow (state).
    period: number of consecutive finite steps before the scale grows.
    factor: the growth factor, > 1.
    min_loss_scale: the scale never backs off below this (>= 0), nor below
      ``2**-126``, the smallest normal float32, so it never becomes 0.
    backoff_factor: multiplier on overflow, in (0, 1); default ``1/factor``.
    max_loss_scale: the scale never grows above this; default the largest
      finite float32, so the scale never becomes inf.
    hysteresis: how many overflows are tolerated before the scale backs off
      (DeepSpeed's ``hysteresis``); 1 backs off on every overflow.
    consecutive_hysteresis: refill the hysteresis budget on every finite
      step, not only when the scale grows (DeepSpeed's option of that name).
    hysteresis_left: the remaining hysteresis budget (state); default
      ``hysteresis``.
    overflows_at_min: overflows seen at the minimum scale (state).

  Raises:
    ValueError: for a non-positive or non-finite scale, ``period < 1``,
      ``factor <= 1``, ``backoff_factor`` outside (0, 1),
      ``min_loss_scale > loss_scale``, ``hysteresis < 1`` and the like.

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
  hysteresis_left: Any = dataclasses.field(default=_DEFAULT, kw_only=True)
  overflows_at_min: Any = dataclasses.field(default=0, kw_only=True)

  def __post_init__(self):
    cls = type(self).__name__
    setf = lambda name, value: object.__setattr__(self, name, value)
    _check_number(self.period, "period", cls, integer=True)
    if not 1 <= self.period <= INT32_MAX:
      raise ValueError(
          f"{cls}: period must be an integer between 1 and {INT32_MAX} "
          f"(the number of finite steps before the scale grows), got "
          f"{self.period}. 2000 is the usual choice."
      )
    setf("period", int(self.period))
    _check_number(self.factor, "factor", cls)
    if not (self.factor > 1 and math.isfinite(self.factor)):
      raise ValueError(
          f"{cls}: factor must be a finite number > 1 (the growth factor), got "
          f"{self.factor}. 2.0 is the usual choice; use StaticLossScale for a "
          "scale that never changes."
      )
    setf("factor", float(self.factor))
    backoff = 1.0 / self.factor if self.backoff_factor is None else self.backoff_factor
    _check_number(backoff, "backoff_factor", cls)
    if not 0 < backoff < 1:
      raise ValueError(
          f"{cls}: backoff_factor must lie strictly between 0 and 1, got "
          f"{backoff}. 0.5 halves the scale on each overflow."
      )
    setf("backoff_factor", float(backoff))
    _check_number(self.min_loss_scale, "min_loss_scale", cls)
    if not (self.min_loss_scale >= 0 and math.isfinite(self.min_loss_scale)):
      raise ValueError(
          f"{cls}: min_loss_scale must be finite and >= 0, got "
          f"{self.min_loss_scale}."
      )
    setf("min_loss_scale", float(self.min_loss_scale))
    max_scale = FLOAT32_MAX if self.max_loss_scale is None else self.max_loss_scale
    _check_number(max_scale, "max_loss_scale", cls)
    if not max_scale >= max(self.min_loss_scale, np.finfo(np.float32).tiny):
      raise ValueError(
          f"{cls}: max_loss_scale ({max_scale}) must be positive and at least "
          f"min_loss_scale ({self.min_loss_scale})."
      )
    setf("max_loss_scale", float(min(max_scale, FLOAT32_MAX)))
    _check_number(self.hysteresis, "hysteresis", cls, integer=True)
    if self.hysteresis < 1:
      raise ValueError(
          f"{cls}: hysteresis must be an integer >= 1, got {self.hysteresis}. "
          "1 backs off on every overflow; DeepSpeed's default is 2."
      )
    setf("hysteresis", int(self.hysteresis))
    if not isinstance(self.consecutive_hysteresis, (bool, np.bool_)):
      raise TypeError(
          f"{cls}: consecutive_hysteresis must be a bool, got "
          f"{self.consecutive_hysteresis!r}."
      )
    setf("consecutive_hysteresis", bool(self.consecutive_hysteresis))

    scale = _state_value(self.loss_scale, np.float32, "loss_scale", cls)
    counter = _state_value(self.counter, np.int32, "counter", cls)
    left = self.hysteresis if self.hysteresis_left is _DEFAULT else self.hysteresis_left
    left = _state_value(left, np.int32, "hysteresis_left", cls)
    overflows = _state_value(self.overflows_at_min, np.int32, "overflows_at_min", cls)
    setf("loss_scale", scale)
    setf("counter", counter)
    setf("hysteresis_left", left)
    setf("overflows_at_min", overflows)

    value = _concrete(scale)
    if value is not None:
      if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"{cls}: loss_scale must be positive and finite, got {value}. "
            "Typical initial values are powers of two such as 2.0**15."
        )
      if value < np.float32(self.min_loss_scale):
        raise ValueError(
            f"{cls}: min_loss_scale ({self.min_loss_scale}) is above the "
            f"initial loss_scale ({value}); lower min_loss_scale or raise "
            "loss_scale."
        )
      if value > self.max_loss_scale:
        raise ValueError(
            f"{cls}: the initial loss_scale ({value}) is above max_loss_scale "
            f"({self.max_loss_scale}); lower loss_scale or raise max_loss_scale."
        )
    value = _concrete(counter)
    if value is not None and not 0 <= value < self.period:
      raise ValueError(
          f"{cls}: counter must lie in [0, period), got {value} with period "
          f"{self.period}."
      )
    value = _concrete(left)
    if value is not None and not 1 <= value <= self.hysteresis:
      raise ValueError(
          f"{cls}: hysteresis_left must lie in [1, hysteresis], got {value} "
          f"with hysteresis {self.hysteresis}."
      )
    value = _concrete(overflows)
    if value is not None and value < 0:
      raise ValueError(f"{cls}: overflows_at_min must be >= 0, got {value}.")

  def metrics(self) -> dict[str, jax.Array]:
    metrics = super().metrics()
    metrics["overflows_at_min"] = jnp.asarray(self.overflows_at_min)
    metrics["steps_since_adjustment"] = jnp.asarray(self.counter)
    return metrics

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """Returns the loss scale for the next step, given this step's finiteness.

    Args:
      grads_finite: scalar bool, e.g. ``jaxmp.all_finite(grads)``.
    """
    finite = _check_finite_flag(grads_finite)
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
    floor = np.float32(max(self.min_loss_scale, _FLOAT32_TINY))
    backed_off = jnp.maximum(_multiply(scale, self.backoff_factor), floor)
    overflow_scale = jnp.where(use_budget, scale, backed_off)
    overflow_left = jnp.where(use_budget, left - 1, left)
    at_min = jnp.logical_not(use_budget) & (scale <= floor)

    return dataclasses.replace(
        self,
        loss_scale=jnp.where(finite, finite_scale, overflow_scale),
        counter=jnp.where(finite, finite_counter, jnp.int32(0)),
        hysteresis_left=jnp.where(finite, finite_left, overflow_left),
        overflows_at_min=overflows
        + jnp.logical_and(jnp.logical_not(finite), at_min).astype(jnp.int32),
    )


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: true iff no leaf of ``tree`` holds inf or nan.

  An empty tree is finite. Works under ``jit``; under ``jit`` with sharded
  arrays the reduction is global (XLA inserts the all-reduce).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> bool(jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(jaxmp.all_finite({}))
    True
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.array(True)
  flags = [jnp.all(jnp.isfinite(x)) for x in leaves]
  return jnp.stack(flags).all()


def select_tree(pred: Any, a: T, b: T) -> T:
  """Returns ``a`` where the scalar bool ``pred`` is true, else ``b``, leafwise.

  Args:
    pred: a scalar boolean (array).
    a: a pytree.
    b: a pytree of the same structure, shapes and dtypes as ``a``.

  Raises:
    TypeError: if ``pred`` is not a scalar boolean.
    ValueError: if ``a`` and ``b`` do not have the same structure and shapes.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise TypeError(
        "select_tree expects a scalar boolean predicate, got an array of "
        f"shape {pred.shape} and dtype {pred.dtype}. Reduce it first, e.g. "
        "with jaxmp.all_finite(tree) or jnp.all(x)."
    )
  struct_a = jax.tree_util.tree_structure(a)
  struct_b = jax.tree_util.tree_structure(b)
  if struct_a != struct_b:
    raise ValueError(
        "select_tree expects two pytrees of the same structure, got "
        f"{struct_a} and {struct_b}."
    )
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if jnp.shape(x) != jnp.shape(y):
      raise ValueError(
          f"select_tree: the leaves at {jax.tree_util.keystr(path)} have shapes "
          f"{jnp.shape(x)} and {jnp.shape(y)}. Pass two pytrees of the same "
          "shapes, e.g. the new and the old value of the same state."
      )
  return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)
