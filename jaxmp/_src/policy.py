"""Dtype policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is a frozen, hashable triple of floating dtypes with methods
that cast the floating leaves of a pytree. :func:`get_policy` parses jmp's
string grammar (``"p=f32,c=bf16,o=f32"``), a few presets and plain dtype names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.hardware import recommended_preset

T = TypeVar("T")

# Canonical short name of each supported dtype, used by ``str(policy)``.
_SHORT_NAMES = {
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float64): "f64",
    np.dtype(jnp.float8_e4m3fn): "f8e4m3",
    np.dtype(jnp.float8_e5m2): "f8e5m2",
}

_DTYPE_NAMES = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "full": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "f64": jnp.float64,
    "float64": jnp.float64,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "f8e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "f8e5m2": jnp.float8_e5m2,
}
# "half" is resolved at call time, since it depends on the platform.
VALID_DTYPE_NAMES = tuple(sorted([*_DTYPE_NAMES, "half"]))

_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
}
VALID_KEYS = ("p", "params", "c", "compute", "o", "output")

PRESETS = {
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_float16": "p=f32,c=f16,o=f32",
    "float32": "p=f32,c=f32,o=f32",
}
VALID_PRESETS = (*PRESETS, "auto")


def half_dtype() -> Any:
  """Returns the platform's half-precision type, as jmp does.

  ``jnp.bfloat16`` on TPU, ``jnp.float16`` everywhere else. Like jmp's, the
  result is the JAX scalar type: it compares equal to the NumPy dtype and can
  be called, as in ``jmp.half_dtype()(2 ** 15)``.

  Example:
    >>> import jax.numpy as jnp, numpy as np, jaxmp
    >>> jaxmp.half_dtype() is jnp.float16  # on the CPU
    True
    >>> jaxmp.half_dtype() == np.dtype("float16")
    True
  """
  platform = jax.local_devices()[0].platform
  return jnp.bfloat16 if platform == "tpu" else jnp.float16


def parse_dtype(name: Any) -> np.dtype:
  """Returns the floating dtype named by ``name`` (a name, a dtype or a type).

  Raises:
    ValueError: if ``name`` is not a known floating dtype; the message lists
      the valid names.
  """
  if isinstance(name, str):
    key = name.strip()
    if key == "half":
      return np.dtype(half_dtype())
    if key not in _DTYPE_NAMES:
      hint = ""
      if ";" in key or "," in key:
        hint = " Separate the parts of a policy with ',' as in 'p=f32,c=bf16,o=f32'."
      raise ValueError(
          f"Unknown dtype {name!r}. Valid dtype names are: "
          f"{', '.join(VALID_DTYPE_NAMES)}.{hint}"
      )
    return np.dtype(_DTYPE_NAMES[key])
  try:
    dtype = np.dtype(name)
  except TypeError:
    raise TypeError(
        f"Expected a dtype or a dtype name, got {name!r} of type "
        f"{type(name).__name__}. Valid dtype names are: "
        f"{', '.join(VALID_DTYPE_NAMES)}."
    ) from None
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(
        f"A policy dtype must be floating, got {dtype}. Valid dtype names "
        f"are: {', '.join(VALID_DTYPE_NAMES)}."
    )
  return dtype


def short_name(dtype: Any) -> str:
  """Returns the short name of a floating dtype (``f32``, ``bf16`` ...)."""
  dtype = np.dtype(dtype)
  return _SHORT_NAMES.get(dtype, dtype.name)


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts every floating array leaf (JAX or NumPy) of ``tree`` to ``dtype``.

  Integer, boolean and non-array leaves are returned unchanged.
  """
  dtype = np.dtype(dtype)

  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.floating
    ):
      return x.astype(dtype)
    return x

  return jax.tree_util.tree_map(cast, tree)


@runtime_checkable
class PolicyLike(Protocol):
  """What every policy kind offers: :class:`Policy`, :class:`jaxmp.PathPolicy`
  and :class:`jaxmp.flax.ModulePolicy`.

  :class:`jaxmp.flax.TrainState` (and anything else that trains under a
  policy) uses only these members, so a new policy kind that provides them
  works there unchanged. (:class:`Policy` and :class:`jaxmp.PathPolicy` also
  cast any pytree with ``cast_to_param``/``cast_to_compute``/
  ``cast_to_output``; a module policy casts inside the modules instead.)
  """

  @property
  def needs_loss_scaling(self) -> bool: ...

  @property
  def io_policy(self) -> Policy:
    """The policy of a model's inputs and outputs (the loss included)."""
    ...

  def params_for_storage(self, params: Any) -> Any:
    """The params as they are stored: the master copy the optimizer updates."""
    ...

  def params_for_compute(self, params: Any) -> Any:
    """The params as the forward pass receives them."""
    ...

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """``apply_fn`` (e.g. a Linen ``model.apply``) running under the policy."""
    ...


@dataclasses.dataclass(frozen=True)
class Policy:
  """The dtypes of parameters, computation and outputs.

  Frozen and hashable, so it can be a static argument of :func:`jax.jit`.
  Each dtype may be given as a dtype or a name (``"bf16"``, ``"float32"``).

  Attributes:
    param_dtype: the dtype parameters are stored in (the master copy).
    compute_dtype: the dtype the forward and backward passes run in.
    output_dtype: the dtype outputs (e.g. logits before the loss) are cast to.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> policy = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
    >>> policy.cast_to_compute({"w": jnp.ones(2), "step": 3})["w"].dtype
    dtype(bfloat16)
  """

  param_dtype: np.dtype
  compute_dtype: np.dtype
  output_dtype: np.dtype

  def __post_init__(self):
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(self, field, parse_dtype(getattr(self, field)))

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``param_dtype``."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_param_dtype(self, dtype: Any) -> "Policy":
    """Returns a copy with ``param_dtype`` replaced."""
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype: Any) -> "Policy":
    """Returns a copy with ``compute_dtype`` replaced."""
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype: Any) -> "Policy":
    """Returns a copy with ``output_dtype`` replaced."""
    return dataclasses.replace(self, output_dtype=dtype)

  @property
  def io_policy(self) -> Policy:
    """The policy of a model's inputs and outputs: this policy itself."""
    return self

  def params_for_storage(self, params: Any) -> Any:
    """Casts the params to ``param_dtype``, the dtype of the master copy."""
    return self.cast_to_param(params)

  def params_for_compute(self, params: Any) -> Any:
    """Casts the params to ``compute_dtype`` for the forward pass."""
    return self.cast_to_compute(params)

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` unchanged; the casts are made around the call."""
    return apply_fn

  @property
  def needs_loss_scaling(self) -> bool:
    """True when the compute dtype is float16 or a float8 type."""
    return self.compute_dtype == np.dtype(jnp.float16) or (
        self.compute_dtype.itemsize == 1
    )

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
        short_name(self.param_dtype),
        short_name(self.compute_dtype),
        short_name(self.output_dtype),
    )


def get_policy(spec: Any) -> Policy:
  """Returns the :class:`Policy` described by ``spec``.

  Args:
    spec: a :class:`Policy`, a ``jmp.Policy``, or a string:

      * jmp's grammar: ``"p=f32,c=bf16,o=f32"`` or
        ``"params=float32,compute=bfloat16,output=float32"``. Unspecified
        params default to float32, compute follows params and output follows
        compute. Spaces around ``,`` and ``=`` are accepted.
      * a single dtype name (``"bf16"``, ``"half"``, ``"full"``) for all three.
      * a preset: ``"mixed_bfloat16"``, ``"mixed_float16"``, ``"float32"`` or
        ``"auto"`` (:func:`jaxmp.auto_policy`).

  Returns:
    The policy.

  Raises:
    ValueError: naming the offending part and listing the valid keys, presets
      and dtype names.
    TypeError: if ``spec`` is neither a policy nor a string.

  Example:
    >>> import jaxmp
    >>> str(jaxmp.get_policy("params=float32, compute=float16"))
    'p=f32,c=f16,o=f16'
    >>> str(jaxmp.get_policy("mixed_bfloat16"))
    'p=f32,c=bf16,o=f32'
  """
  if isinstance(spec, Policy):
    return spec
  if _is_jmp_policy(spec):
    return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
  if not isinstance(spec, str):
    raise TypeError(
        f"get_policy expects a jaxmp.Policy, a jmp.Policy or a string such as "
        f"'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'; got {spec!r} of type "
        f"{type(spec).__name__}."
    )
  text = spec.strip()
  if not text:
    raise ValueError(
        "Empty policy string. Use a preset (" + ", ".join(VALID_PRESETS) +
        "), a dtype name, or 'p=f32,c=bf16,o=f32'."
    )
  if text == "auto":
    return auto_policy()
  if text in PRESETS:
    text = PRESETS[text]
  if "=" not in text:
    try:
      dtype = parse_dtype(text)
    except ValueError:
      raise ValueError(
          f"Unknown policy {spec!r}. Use a preset ({', '.join(VALID_PRESETS)}),"
          f" a dtype name ({', '.join(VALID_DTYPE_NAMES)}), or key=dtype pairs "
          f"with keys {', '.join(VALID_KEYS)}, e.g. 'p=f32,c=bf16,o=f32'."
      ) from None
    return Policy(dtype, dtype, dtype)

  values: dict[str, np.dtype] = {}
  for part in text.split(","):
    part = part.strip()
    if "=" not in part:
      raise ValueError(
          f"Policy part {part!r} of {spec!r} is not of the form key=dtype. "
          f"Valid keys are {', '.join(VALID_KEYS)}; e.g. 'p=f32,c=bf16,o=f32'."
      )
    key, value = (s.strip() for s in part.split("=", 1))
    if key not in _KEYS:
      raise ValueError(
          f"Unknown key {key!r} in policy {spec!r}. Valid keys are "
          f"{', '.join(VALID_KEYS)}."
      )
    field = _KEYS[key]
    if field in values:
      raise ValueError(
          f"Key {key!r} in policy {spec!r} sets {field} a second time; give "
          "each of params, compute and output at most once."
      )
    if not value:
      raise ValueError(
          f"Missing dtype after {key}= in policy {spec!r}. Valid dtype names "
          f"are: {', '.join(VALID_DTYPE_NAMES)}."
      )
    try:
      values[field] = parse_dtype(value)
    except ValueError as e:
      raise ValueError(f"In policy {spec!r}, key {key!r}: {e}") from None
  param = values.get("param_dtype", np.dtype(jnp.float32))
  compute = values.get("compute_dtype", param)
  output = values.get("output_dtype", compute)
  return Policy(param, compute, output)


def _is_jmp_policy(spec: Any) -> bool:
  cls = type(spec)
  return cls.__name__ == "Policy" and cls.__module__.startswith("jmp")


def cast_to_full(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to float32, as ``jmp.cast_to_full``.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.cast_to_full(jnp.ones(2, jnp.float16)).dtype
    dtype('float32')
  """
  return cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Casts the floating leaves of ``tree`` to :func:`half_dtype`, as jmp does.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.cast_to_half(jnp.ones(2)).dtype == jaxmp.half_dtype()
    True
  """
  return cast_floating(tree, half_dtype())


def auto_policy(device: Any = None) -> Policy:
  """Returns the recommended policy for ``device`` (default: the first device).

  * TPU, NVIDIA GPUs of compute capability 8.0 or more (Ampere, Hopper ...)
    and AMD GPUs: ``mixed_bfloat16``, which needs no loss scaling.
  * Older NVIDIA GPUs: ``mixed_float16``; pair it with a
    :class:`jaxmp.DynamicLossScale`.
  * CPU: ``float32``, since low precision brings no speed there.

  Raises:
    TypeError: if ``device`` is not a JAX device (e.g. a platform name).

  Example:
    >>> import jaxmp
    >>> str(jaxmp.auto_policy())  # on the CPU
    'p=f32,c=f32,o=f32'
  """
  device = jax.devices()[0] if device is None else device
  return get_policy(recommended_preset(device))
