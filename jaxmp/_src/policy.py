"""Dtype policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is a frozen, hashable triple of floating dtypes with methods
that cast the floating leaves of a pytree. :func:`get_policy` parses jmp's
string grammar (``"p=f32,c=bf16,o=f32"``), a few presets and plain dtype names.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.hardware import recommended_preset
from jaxmp._src.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from jaxmp._src.validation import caller_stacklevel, check_number

T = TypeVar("T")

# The first name of each dtype is the short one ``str(policy)`` writes;
# "half" depends on the platform and is resolved at call time.
_DTYPE_NAMES = {
    **dict.fromkeys(("f32", "float32", "fp32", "full"), jnp.float32),
    **dict.fromkeys(("bf16", "bfloat16"), jnp.bfloat16),
    **dict.fromkeys(("f16", "float16", "fp16"), jnp.float16),
    **dict.fromkeys(("f64", "float64", "fp64"), jnp.float64),
    **dict.fromkeys(("f8e4m3", "float8_e4m3fn"), jnp.float8_e4m3fn),
    **dict.fromkeys(("f8e5m2", "float8_e5m2"), jnp.float8_e5m2),
    "half": None,
}
VALID_DTYPE_NAMES = tuple(sorted(_DTYPE_NAMES))
_SHORT_NAMES = {np.dtype(d): n for n, d in reversed(_DTYPE_NAMES.items()) if d}
_FIELDS = ("param_dtype", "compute_dtype", "output_dtype")
_KEYS = {"p": _FIELDS[0], "params": _FIELDS[0], "c": _FIELDS[1],
         "compute": _FIELDS[1], "o": _FIELDS[2], "output": _FIELDS[2],
         "dot": "dot", "amax_history": "amax_history"}
PRESETS = {
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_float16": "p=f32,c=f16,o=f32",
    "float32": "p=f32,c=f32,o=f32",
    "mixed_fp8": "p=f32,c=bf16,o=f32,dot=fp8",
}
VALID_PRESETS = (*PRESETS, "auto")
DEFAULT_AMAX_HISTORY_LENGTH = 1024  # Flax's default
# Each FP8 matmul keeps three float32 histories of this length, allocated at
# model init: beyond this, memory runs out there, far from the policy.
MAX_AMAX_HISTORY_LENGTH = 2**16

_DTYPE_HELP = f"Valid dtype names are: {', '.join(VALID_DTYPE_NAMES)}."
_GRAMMAR_HELP = (
    f"Valid keys are {', '.join(list(_KEYS)[:6])}. {_DTYPE_HELP} Presets are "
    f"{', '.join(VALID_PRESETS)}. E.g. 'p=f32,c=bf16,o=f32'; add ',dot=fp8' "
    "(and optionally ',amax_history=N') for FP8 matmuls."
)
# What a float8 dtype would cast, in the refusal of one.
_ROLES = dict(zip(_FIELDS, ("the parameters (the master copy)",
                            "every activation and matmul input", "the outputs")))


def half_dtype() -> Any:
  """Returns the platform's half-precision type, as jmp does.

  ``jnp.bfloat16`` on TPU, ``jnp.float16`` elsewhere: the JAX scalar type,
  equal to the NumPy dtype and callable (``jmp.half_dtype()(2 ** 15)``).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.half_dtype() is jnp.float16  # on the CPU
    True
  """
  return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def _did_you_mean(word: str, candidates: Any) -> str:
  close = difflib.get_close_matches(word, list(candidates), n=1)
  return f" Did you mean {close[0]!r}?" if close else ""


def _unknown_dtype(name: str, candidates: Any) -> str:
  """The message for an unknown dtype name: the name and a guess."""
  hint = (" Separate the parts of a policy with ',' as in 'p=f32,c=bf16,o=f32'."
          if ";" in name or "," in name else "")
  return f"Unknown dtype {name!r}.{_did_you_mean(name, candidates)}{hint}"


def is_floating_array(x: Any, *, include_complex: bool = False) -> bool:
  """True for a JAX or NumPy array (or NumPy scalar) of a floating dtype.

  The one test of the package for a floating leaf (complex ones too with
  ``include_complex=True``); Python numbers are not arrays.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  return bool(jnp.issubdtype(x.dtype, jnp.inexact if include_complex else jnp.floating))


def floating_dtype(dtype: Any, owner: str, name: str = "dtype", *,
                   hint: str = "") -> np.dtype:
  """Returns ``dtype`` as a floating NumPy dtype: the package's one such check.

  Raises:
    TypeError: if ``dtype`` is not a dtype at all (``None``, a number ...).
    ValueError: if it is not a floating one (``jnp.int8``).
  """
  expected = f"{owner}: {name} must be a floating dtype such as jnp.float16 or jnp.bfloat16"
  tail = f" {hint}" if hint else ""
  try:
    if dtype is None:  # np.dtype(None) would be float64
      raise TypeError
    target = np.dtype(dtype)
  except TypeError:
    raise TypeError(
        f"{expected}, got {dtype!r} of type {type(dtype).__name__}.{tail}") from None
  if not jnp.issubdtype(target, jnp.floating):
    raise ValueError(f"{expected}, got {target.name}.{tail}")
  return target


def parse_dtype(name: Any, owner: str = "Policy", field: str = "dtype") -> Any:
  """Returns the floating dtype named by ``name`` (a name or a dtype) as a JAX scalar type.

  Raises:
    ValueError: for an unknown name or a non-floating dtype.
    TypeError: if ``name`` is neither a name nor a dtype.
  """
  if isinstance(name, str):
    if name.strip() not in _DTYPE_NAMES:
      raise ValueError(f"{_unknown_dtype(name.strip(), VALID_DTYPE_NAMES)} {_DTYPE_HELP}")
    return _DTYPE_NAMES[name.strip()] or half_dtype()
  dtype = floating_dtype(name, owner, field, hint=_DTYPE_HELP)
  return getattr(jnp, dtype.name, dtype.type)


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts every floating array leaf (JAX or NumPy) of ``tree`` to ``dtype``."""
  dtype = np.dtype(dtype)
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if is_floating_array(x) else x, tree)


@functools.cache
def _warn_narrow_params(policy: Policy) -> None:
  """Warns, once per policy and process, that its params are 16-bit or less."""
  dtype = np.dtype(policy.param_dtype)
  if dtype.itemsize >= 4:
    return
  preset = ("mixed_float16" if np.dtype(policy.compute_dtype) == np.float16
            else "mixed_bfloat16")
  warnings.warn(
      f"jaxmp: the policy {policy} keeps the parameters (the master copy the "
      f"optimizer updates) in {dtype.name}: an update smaller than "
      f"{float(jnp.finfo(dtype).eps) / 2:g} of a weight is rounded away, so "
      "training can stall. Mixed precision keeps float32 master params: you "
      f"probably want {preset!r}. If 16-bit params are what you want, silence "
      "this with warnings.filterwarnings('ignore', message='jaxmp: the policy').",
      UserWarning, stacklevel=caller_stacklevel())


@dataclasses.dataclass(frozen=True)
class Policy:
  """The dtypes of parameters, computation and outputs.

  Frozen and hashable (a static argument of :func:`jax.jit`). Each dtype may
  be a dtype, a scalar type or a name (``"bf16"``); it is stored as the JAX
  scalar type (``jnp.bfloat16``), as in jmp. A float8 dtype is refused: it
  would cast without scaling (FP8 matmuls are ``"mixed_fp8"``).

  Attributes:
    param_dtype: the dtype parameters are stored in (the master copy).
    compute_dtype: the dtype the forward and backward passes run in.
    output_dtype: the dtype outputs (e.g. logits before the loss) are cast to.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> policy = jaxmp.Policy(jnp.float32, "bf16", jnp.float32)
    >>> str(policy), policy.compute_dtype is jnp.bfloat16
    ('p=f32,c=bf16,o=f32', True)
    >>> policy.cast_to_compute({"w": jnp.ones(2), "step": 3})["w"].dtype
    dtype(bfloat16)
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for field, role in _ROLES.items():
      dtype = parse_dtype(getattr(self, field), "Policy", field)
      if np.dtype(dtype).itemsize == 1:
        raise ValueError(
            f"Policy: {field}={np.dtype(dtype).name} would cast {role} to float8 "
            "with no per-tensor scaling, which cannot train. FP8 training "
            "scales each matmul's inputs and gradients per tensor: use the "
            "policy 'mixed_fp8' (= 'p=f32,c=bf16,o=f32,dot=fp8') through "
            "jaxmp.flax.TrainState.create(policy='mixed_fp8') or "
            "jaxmp.flax.ModulePolicy (see the FP8 guide).")
      object.__setattr__(self, field, dtype)

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating leaves to ``param_dtype``; 16-bit params warn once."""
    _warn_narrow_params(self)
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``compute_dtype``."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``output_dtype``."""
    return cast_floating(tree, self.output_dtype)

  def with_param_dtype(self, dtype: Any) -> Policy:
    """Returns a copy with ``param_dtype`` replaced."""
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype: Any) -> Policy:
    """Returns a copy with ``compute_dtype`` replaced."""
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype: Any) -> Policy:
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

  def for_autocast(self) -> tuple[Policy, None]:
    """``(self, None)``: one policy everywhere, no scopes to pin."""
    return self, None

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (e.g. a Linen ``model.apply``) running under the policy.

    The params and the floating inputs (not token ids) are cast to the
    compute dtype, the output to the output dtype (with ``mutable=[...]``,
    not the updated collections). A Linen layer's own ``dtype=`` still wins
    inside the model, and is reported with a :class:`jaxmp.PrecisionWarning`
    once per trace (see
    :class:`jaxmp.flax.ModulePolicy`, ``override_dtype=True``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> import flax.linen as nn
      >>> model, x = nn.Dense(2), jnp.ones((1, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> apply = jaxmp.get_policy("mixed_bfloat16").wrap_apply(model.apply)
      >>> jaxpr = jax.make_jaxpr(apply)(variables, x)
      >>> [tuple(str(v.aval.dtype) for v in e.invars)
      ...  for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      [('bfloat16', 'bfloat16')]
      >>> apply(variables, x).dtype  # the output dtype
      dtype('float32')
    """
    from jaxmp._src.flax.apply import apply_under_policy  # pylint: disable=g-import-not-at-top

    return apply_under_policy(self, apply_fn)

  @property
  def needs_loss_scaling(self) -> bool:
    """True when the compute dtype is float16."""
    return np.dtype(self.compute_dtype) == np.float16

  def __str__(self) -> str:
    return "p={},c={},o={}".format(*(
        _SHORT_NAMES.get(np.dtype(getattr(self, f)), np.dtype(getattr(self, f)).name)
        for f in _FIELDS))


@dataclasses.dataclass(frozen=True)
class Fp8Policy(Policy):
  """A policy whose Dense, Linear and NNX Einsum matmuls run in FP8.

  What ``get_policy("mixed_fp8")`` returns. The three dtypes are those of the
  base policy; the chosen matmuls cast their inputs and kernel to float8 E4M3
  and the output gradient to E5M2, each with a float32 scale per tensor from
  a history of its absolute maximum (delayed scaling; the FP8 guide says
  where that meta state lives). The matmuls are injected by
  :class:`jaxmp.flax.ModulePolicy` and :meth:`jaxmp.flax.TrainState.create`;
  the policy's own :meth:`wrap_apply` refuses. ``needs_loss_scaling`` is the
  base policy's.

  Attributes:
    amax_history_length: the length of each amax history (keyword-only;
      Flax's default, 1024). In the policy string, ``amax_history=N``.

  Example:
    >>> import jaxmp
    >>> policy = jaxmp.get_policy("mixed_fp8")
    >>> type(policy).__name__, str(policy.base), policy.amax_history_length
    ('Fp8Policy', 'p=f32,c=bf16,o=f32', 1024)
    >>> str(jaxmp.get_policy("p=f32,c=bf16,o=f32,dot=fp8,amax_history=16"))
    'p=f32,c=bf16,o=f32,dot=fp8,amax_history=16'
  """

  amax_history_length: int = dataclasses.field(
      default=DEFAULT_AMAX_HISTORY_LENGTH, kw_only=True)

  def __post_init__(self):
    super().__post_init__()
    object.__setattr__(self, "amax_history_length", check_number(
        "Fp8Policy", "amax_history_length", self.amax_history_length,
        integer=True, minimum=1, maximum=MAX_AMAX_HISTORY_LENGTH,
        advice="It is the length of the amax histories (amax_history=N in a "
        f"policy string), e.g. 16, which reacts fast; Flax's default is "
        f"{DEFAULT_AMAX_HISTORY_LENGTH}."))

  @property
  def base(self) -> Policy:
    """The same dtypes without FP8 matmuls: a plain :class:`Policy`."""
    return Policy(self.param_dtype, self.compute_dtype, self.output_dtype)

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Refuses: the FP8 matmuls are injected by a module policy."""
    raise ValueError(
        f"{self}: the FP8 matmuls are injected into the Linen Dense and "
        "DenseGeneral modules by a module interceptor, which a plain policy "
        "cannot install. Use jaxmp.flax.ModulePolicy({}, default=policy)"
        ".wrap_apply(model.apply) (and .wrap_apply(model.init) to create the "
        "FP8 meta), or jaxmp.flax.TrainState.create(..., policy=policy), "
        "which does it for you.")

  def __str__(self) -> str:
    history = self.amax_history_length
    return super().__str__() + ",dot=fp8" + (
        "" if history == DEFAULT_AMAX_HISTORY_LENGTH else f",amax_history={history}")


def get_policy(spec: Any) -> Policy:
  """Returns the :class:`Policy` described by ``spec``.

  Args:
    spec: a :class:`Policy`, a ``jmp.Policy``, or a string: jmp's grammar
      (``"p=f32,c=bf16,o=f32"``, ``"params=float32,compute=bfloat16"``;
      params default to float32, compute follows params, output follows
      compute; each key at most once), one dtype name for all three
      (``"bf16"``, ``"half"``), a preset (``"mixed_bfloat16"``,
      ``"mixed_float16"``, ``"float32"``, ``"mixed_fp8"``, ``"auto"``), and
      ``",dot=fp8"`` (optionally ``",amax_history=N"``) for FP8 matmuls.

  Raises:
    ValueError: naming the offending part and listing the valid keys, dtype
      names and presets.
    TypeError: if ``spec`` is neither a policy nor a string.

  Example:
    >>> import jaxmp
    >>> str(jaxmp.get_policy("params=float32, compute=float16"))
    'p=f32,c=f16,o=f16'
  """
  if isinstance(spec, Policy):
    return spec
  if type(spec).__name__ == "Policy" and type(spec).__module__.startswith("jmp"):
    return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
  if not isinstance(spec, str):
    raise TypeError(
        "get_policy expects a jaxmp.Policy, a jmp.Policy or a string such as "
        f"'mixed_bfloat16' or 'p=f32,c=bf16,o=f32'; got {spec!r} of type "
        f"{type(spec).__name__}.")
  bad = lambda problem: ValueError(f"{problem} {_GRAMMAR_HELP}")
  text = PRESETS.get(spec.strip(), spec.strip())
  if not text:
    raise bad("Empty policy string.")
  if text == "auto":
    return auto_policy()
  if "=" not in text:
    if text not in _DTYPE_NAMES:
      # 'mixed_fp16' means float16, however close it is to 'mixed_fp8'.
      presets = [p for p in VALID_PRESETS if "8" in text or "8" not in p]
      raise bad(f"Unknown policy {spec!r}: not a preset. " + _unknown_dtype(
          text, [*presets, *VALID_DTYPE_NAMES]))
    text = f"p={text}"  # compute and output follow params
  values = {}
  for part in text.split(","):
    key, eq, value = (s.strip() for s in part.partition("="))
    if not eq:
      raise bad(f"Policy part {part.strip()!r} of {spec!r} is not of the form key=dtype.")
    if key not in _KEYS:
      raise bad(f"Unknown key {key!r} in policy {spec!r}.{_did_you_mean(key, _KEYS)}")
    field = _KEYS[key]
    if field in values:
      fix = f" To change one dtype of a policy, use policy.with_{field}(...)."
      raise ValueError(
          f"Key {key!r} in policy {spec!r} sets {field} a second time; give "
          "each key at most once (jmp would keep the last one silently)."
          + (fix if field in _FIELDS else ""))
    if not value:
      raise bad(f"Missing value after {key}= in policy {spec!r}.")
    if field in _FIELDS and value not in _DTYPE_NAMES:
      raise bad(f"In policy {spec!r}, key {key!r}: " + _unknown_dtype(
          value, VALID_DTYPE_NAMES))
    if field == "dot" and value not in ("fp8", "f8"):
      raise ValueError(
          f"In policy {spec!r}, key 'dot': {value!r} is not a matmul format. "
          "The only one is 'fp8' (E4M3 inputs, E5M2 gradients, delayed "
          "scaling): 'dot=fp8'. Leave 'dot' out to run the matmuls in the "
          "compute dtype.")
    values[field] = value
  if "amax_history" in values and "dot" not in values:
    raise ValueError(
        f"Policy {spec!r} sets amax_history without dot=fp8: the amax "
        "histories belong to the FP8 matmuls. Add ',dot=fp8' (or use the "
        "preset 'mixed_fp8').")
  param = values.get("param_dtype", "f32")
  compute = values.get("compute_dtype", param)
  output = values.get("output_dtype", compute)
  try:
    if "dot" not in values:
      return Policy(param, compute, output)
    history = values.get("amax_history", str(DEFAULT_AMAX_HISTORY_LENGTH))
    return Fp8Policy(param, compute, output, amax_history_length=int(history)
                     if history.isdigit() else history)
  except (TypeError, ValueError) as e:
    raise ValueError(f"In policy {spec!r}: {e}") from None


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

  ``mixed_bfloat16`` on TPU, NVIDIA GPUs of compute capability 8.0 or more
  and AMD GPUs; ``mixed_float16`` (with a :class:`jaxmp.DynamicLossScale`) on
  older NVIDIA GPUs; ``float32`` on the CPU.

  Example:
    >>> import jaxmp
    >>> str(jaxmp.auto_policy())  # on the CPU
    'p=f32,c=f32,o=f32'
  """
  return get_policy(recommended_preset(jax.devices()[0] if device is None else device))


# The members of every policy kind: all that TrainState and the rest use.
_POLICY_MEMBERS = ("needs_loss_scaling", "io_policy", "params_for_storage",
                   "params_for_compute", "wrap_apply", "for_autocast")


def as_policy(spec: Any) -> Any:
  """Returns ``spec`` as a policy: any policy kind as is, else ``get_policy(spec)``."""
  # Looked up on the class: ``io_policy`` raises for rules without a default.
  if not isinstance(spec, str) and all(
      hasattr(type(spec), name) for name in _POLICY_MEMBERS):
    return spec
  return get_policy(spec)


def default_loss_scale(policy: Any) -> LossScale:
  """``DynamicLossScale()`` when ``policy`` computes in float16, else ``NoOpLossScale()``."""
  return DynamicLossScale() if as_policy(policy).needs_loss_scaling else NoOpLossScale()
