"""Dtype policies: which dtype parameters, computation and outputs use.

A :class:`Policy` is a frozen, hashable triple of floating dtypes with methods
that cast the floating leaves of a pytree. :func:`get_policy` parses jmp's
string grammar (``"p=f32,c=bf16,o=f32"``), a few presets and plain dtype names.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.hardware import recommended_preset
from jaxmp._src.validation import caller_stacklevel, check_number

T = TypeVar("T")

_DTYPE_NAMES = {
    "f32": jnp.float32,
    "float32": jnp.float32,
    "fp32": jnp.float32,
    "full": jnp.float32,
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "f16": jnp.float16,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "f64": jnp.float64,
    "float64": jnp.float64,
    "fp64": jnp.float64,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "f8e4m3": jnp.float8_e4m3fn,
    "float8_e5m2": jnp.float8_e5m2,
    "f8e5m2": jnp.float8_e5m2,
}
# "half" is resolved at call time, since it depends on the platform.
VALID_DTYPE_NAMES = tuple(sorted([*_DTYPE_NAMES, "half"]))

# Canonical short name of each named dtype, used by ``str(policy)``.
_SHORT_NAMES = {
    np.dtype(jnp.float32): "f32",
    np.dtype(jnp.bfloat16): "bf16",
    np.dtype(jnp.float16): "f16",
    np.dtype(jnp.float64): "f64",
    np.dtype(jnp.float8_e4m3fn): "f8e4m3",
    np.dtype(jnp.float8_e5m2): "f8e5m2",
}

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
    "mixed_fp8": "p=f32,c=bf16,o=f32,dot=fp8",
}
VALID_PRESETS = (*PRESETS, "auto")

# The FP8 part of the grammar: ``dot=fp8`` runs the matmuls of the Dense and
# Linear layers (Linen, NNX) and NNX Einsums in FP8 (an :class:`Fp8Policy`), and
# ``amax_history=N`` sets the length of its amax histories.
_FP8_KEYS = ("dot", "amax_history")
_FP8_DOT_NAMES = ("fp8", "f8")
DEFAULT_AMAX_HISTORY_LENGTH = 1024  # Flax's default
# Each FP8 matmul keeps three float32 histories of this length, allocated at
# model init: beyond this, memory runs out there, far from the policy.
MAX_AMAX_HISTORY_LENGTH = 2**16

_DTYPE_HELP = f"Valid dtype names are: {', '.join(VALID_DTYPE_NAMES)}."
# Appended to every error about a policy string: what each part may be.
_GRAMMAR_HELP = (
    f"Valid keys are {', '.join(VALID_KEYS)}. {_DTYPE_HELP} Presets are "
    f"{', '.join(VALID_PRESETS)}. E.g. 'p=f32,c=bf16,o=f32'; add ',dot=fp8' "
    "(and optionally ',amax_history=N') for FP8 matmuls."
)


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


def _did_you_mean(word: str, candidates: Any) -> str:
  close = difflib.get_close_matches(word, list(candidates), n=1)
  return f" Did you mean {close[0]!r}?" if close else ""


def _unknown_dtype(name: str, candidates: Any, help_text: str) -> str:
  """The message for an unknown dtype name: the name, a guess, what is valid."""
  hint = ""
  if ";" in name or "," in name:
    hint = " Separate the parts of a policy with ',' as in 'p=f32,c=bf16,o=f32'."
  return (f"Unknown dtype {name!r}.{_did_you_mean(name, candidates)} "
          f"{help_text}{hint}")


def is_floating_array(x: Any, *, include_complex: bool = False) -> bool:
  """True for a JAX or NumPy array (or NumPy scalar) of a floating dtype.

  The one test of the package for "is this a floating leaf": policies cast
  such leaves, the diagnostics inspect them (complex ones too, with
  ``include_complex=True``). Python numbers, integer and boolean arrays are
  not floating arrays.
  """
  if not isinstance(x, (jax.Array, np.ndarray, np.generic)):
    return False
  kind = jnp.inexact if include_complex else jnp.floating
  return bool(jnp.issubdtype(x.dtype, kind))


def floating_dtype(dtype: Any, owner: str, name: str = "dtype", *,
                   hint: str = "") -> np.dtype:
  """Returns ``dtype`` (a dtype or a scalar type) as a floating NumPy dtype.

  The one check of the package for a dtype argument that must be floating
  (policies and the diagnostics alike).

  Raises:
    TypeError: if ``dtype`` is not a dtype at all (``None``, a number ...).
    ValueError: if it is a dtype but not a floating one (``jnp.int8``).
  """
  expected = f"{owner}: {name} must be a floating dtype such as jnp.float16 or jnp.bfloat16"
  tail = f" {hint}" if hint else ""
  try:
    if dtype is None:  # np.dtype(None) would be float64
      raise TypeError
    target = np.dtype(dtype)
  except TypeError:
    raise TypeError(
        f"{expected}, got {dtype!r} of type {type(dtype).__name__}.{tail}"
    ) from None
  if not jnp.issubdtype(target, jnp.floating):
    raise ValueError(f"{expected}, got {target.name}.{tail}")
  return target


def scalar_type(dtype: Any) -> Any:
  """The JAX scalar type of a dtype (``jnp.float16`` for ``np.dtype("float16")``).

  jmp's policies hold these types, so policies do too: they compare equal to
  NumPy dtypes, hash like NumPy's scalar types, and can be called
  (``policy.compute_dtype(1.0)``).
  """
  dtype = np.dtype(dtype)
  return getattr(jnp, dtype.name, dtype.type)


def parse_dtype(name: Any, owner: str = "Policy", field: str = "dtype") -> Any:
  """Returns the floating dtype named by ``name`` as a JAX scalar type.

  ``name`` is a dtype name (``"bf16"``, ``"fp16"``, ``"half"``), a dtype or a
  scalar type (``jnp.bfloat16``, ``np.float16``).

  Raises:
    ValueError: if ``name`` is not a known floating dtype; the message lists
      the valid names.
    TypeError: if ``name`` is neither a name nor a dtype.
  """
  if isinstance(name, str):
    key = name.strip()
    if key == "half":
      return half_dtype()
    if key not in _DTYPE_NAMES:
      raise ValueError(_unknown_dtype(key, VALID_DTYPE_NAMES, _DTYPE_HELP))
    return _DTYPE_NAMES[key]
  return scalar_type(floating_dtype(name, owner, field, hint=_DTYPE_HELP))


def short_name(dtype: Any) -> str:
  """Returns the short name of a floating dtype (``f32``, ``bf16`` ...)."""
  dtype = np.dtype(dtype)
  return _SHORT_NAMES.get(dtype, dtype.name)


def cast_floating(tree: T, dtype: Any) -> T:
  """Casts every floating array leaf (JAX or NumPy) of ``tree`` to ``dtype``.

  Integer, boolean, complex and non-array leaves are returned unchanged.
  """
  dtype = np.dtype(dtype)
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if is_floating_array(x) else x, tree
  )


# The policies whose 16-bit param dtype was already warned about.
_WARNED_PARAM_DTYPE: set[tuple[Any, Any, Any]] = set()


def _warn_narrow_params(policy: "Policy") -> None:
  """Warns, once per policy and process, that its params are 16-bit or less."""
  dtype = np.dtype(policy.param_dtype)
  key = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  if dtype.itemsize >= 4 or key in _WARNED_PARAM_DTYPE:
    return
  _WARNED_PARAM_DTYPE.add(key)
  mixed = {np.dtype(jnp.bfloat16): "mixed_bfloat16", np.dtype(jnp.float16): "mixed_float16"}
  suggestion = mixed.get(np.dtype(policy.compute_dtype), "mixed_bfloat16")
  smallest = float(jnp.finfo(dtype).eps) / 2
  warnings.warn(
      f"jaxmp: the policy {policy} keeps the parameters (the master copy the "
      f"optimizer updates) in {dtype.name}: an update smaller than {smallest:g} "
      "of a weight is rounded away, so training can stall. Mixed precision "
      "keeps float32 master params and computes in 16 bits (DeepSpeed's "
      f"\"bf16\" and \"fp16\" modes mean that): you probably want "
      f"{suggestion!r}. If 16-bit params are what you want, silence this "
      "with warnings.filterwarnings('ignore', message='jaxmp: the policy').",
      UserWarning,
      stacklevel=caller_stacklevel(),
  )


@dataclasses.dataclass(frozen=True)
class Policy:
  """The dtypes of parameters, computation and outputs.

  Frozen and hashable, so it can be a static argument of :func:`jax.jit`.
  Each dtype may be given as a dtype, a scalar type or a name (``"bf16"``,
  ``"float32"``); it is stored as the JAX scalar type (``jnp.bfloat16``), as
  in jmp, which compares equal to the NumPy dtype and can be called
  (``policy.compute_dtype(1.0)``).

  Attributes:
    param_dtype: the dtype parameters are stored in (the master copy).
    compute_dtype: the dtype the forward and backward passes run in.
    output_dtype: the dtype outputs (e.g. logits before the loss) are cast to.

  Raises:
    ValueError: for an unknown dtype name or a non-floating dtype.
    TypeError: for something that is neither a dtype nor a name.

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
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      object.__setattr__(
          self, field, parse_dtype(getattr(self, field), "Policy", field)
      )
    _refuse_float8(self)

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating leaves of ``tree`` to ``param_dtype``.

    When ``param_dtype`` is 16-bit (or narrower) this warns once per policy
    (a ``UserWarning``): small updates of 16-bit master params are rounded
    away; you probably want ``"mixed_bfloat16"``.
    """
    _warn_narrow_params(self)
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

  def for_autocast(self) -> tuple[Policy, None]:
    """``(self, None)``: one policy everywhere, no scopes to pin."""
    return self, None

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (e.g. a Linen ``model.apply``) running under the policy.

    It casts ``variables["params"]`` and the floating inputs (not token
    ids) to the compute dtype, and the output to the output dtype (with
    ``mutable=[...]``, only the output, not the updated collections). A
    Linen layer's own ``dtype=`` still wins inside the model, and is
    reported with a :class:`jaxmp.PrecisionWarning` once per trace (see
    :class:`jaxmp.flax.ModulePolicy`, ``override_dtype=True``).

    Args:
      apply_fn: a function of ``(variables, *args, **kwargs)``.

    Returns:
      The wrapped function.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> import flax.linen as nn
      >>> model = nn.Dense(2)
      >>> x = jnp.ones((1, 3))
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
    """True when the compute dtype is float16.

    (A float8 compute dtype is refused; an :class:`Fp8Policy` needs loss
    scaling when its base compute dtype is float16: its FP8 matmuls scale
    each tensor themselves.)
    """
    return np.dtype(self.compute_dtype) == np.dtype(jnp.float16)

  def __str__(self) -> str:
    return "p={},c={},o={}".format(
        short_name(self.param_dtype),
        short_name(self.compute_dtype),
        short_name(self.output_dtype),
    )


@dataclasses.dataclass(frozen=True)
class Fp8Policy(Policy):
  """A policy whose Dense, Linear and NNX Einsum matmuls run in FP8.

  What ``get_policy("mixed_fp8")`` (``"p=f32,c=bf16,o=f32,dot=fp8"``)
  returns. The three dtypes are those of the base policy: the master params
  stay in ``param_dtype`` (float32), everything but the chosen matmuls runs in
  ``compute_dtype`` (bfloat16), and outputs are cast to ``output_dtype``. The
  matmul of each ``nn.Dense`` and ``nn.DenseGeneral`` that runs under this
  policy is Flax's ``fp8_ops.Fp8DirectDotGeneralOp``: its inputs and kernel
  are cast to float8 E4M3 and its output gradient to float8 E5M2, each with a
  float32 scale per tensor computed from a history of the tensor's absolute
  maximum (delayed scaling). That meta state lives in the Flax collection
  ``"_overwrite_with_gradient"``, which a :class:`jaxmp.flax.TrainState`
  keeps next to the params, as Flax's own ``TrainState`` does, out of the
  optimizer and guarded like the params (see the FP8 guide). A Linen
  ``nn.Einsum`` takes no ``dot_general_cls`` and is refused. In an NNX model, ``nnx.Linear``,
  ``nnx.LinearGeneral`` and ``nnx.Einsum`` get ops on Flax's
  ``fp8_scaled_dot_general`` from
  :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`, their meta in
  :class:`jaxmp.flax.Fp8Meta` variables.

  The FP8 matmuls are injected into the Linen modules by
  :class:`jaxmp.flax.ModulePolicy` (a rule or the default may be an
  ``Fp8Policy``) and by :meth:`jaxmp.flax.TrainState.create`, which applies
  an ``Fp8Policy`` through a ``ModulePolicy`` for you; its own
  :meth:`wrap_apply` refuses, since it cannot reach inside the modules.
  ``needs_loss_scaling`` is that of the base policy: the FP8 matmuls scale
  each tensor themselves, so a bfloat16 base needs no loss scale (a float16
  base does).

  Attributes:
    amax_history_length: the length of each amax history (keyword-only;
      Flax's default, 1024). In the policy string, ``amax_history=N``.

  Raises:
    ValueError: for a float8 dtype among the three (the FP8 matmuls choose
      their float8 types themselves), or a history length below 1.
    TypeError: for a history length that is not an integer.

  Example:
    >>> import jaxmp
    >>> policy = jaxmp.get_policy("mixed_fp8")
    >>> type(policy).__name__, str(policy), policy.amax_history_length
    ('Fp8Policy', 'p=f32,c=bf16,o=f32,dot=fp8', 1024)
    >>> str(jaxmp.get_policy("mixed_fp8").base), policy.needs_loss_scaling
    ('p=f32,c=bf16,o=f32', False)
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
        advice=f"Flax's default is {DEFAULT_AMAX_HISTORY_LENGTH}; short "
        "histories (16) react faster to a changing range."))

  @property
  def base(self) -> Policy:
    """The same dtypes without FP8 matmuls: a plain :class:`Policy`."""
    return Policy(self.param_dtype, self.compute_dtype, self.output_dtype)

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Refuses: the FP8 matmuls are injected by a module policy.

    Raises:
      ValueError: always; the message names the module policy.
    """
    raise ValueError(
        f"{self}: the FP8 matmuls are injected into the Linen Dense and "
        "DenseGeneral modules by a module interceptor, which a plain policy "
        "cannot install. Use jaxmp.flax.ModulePolicy({}, default=policy)"
        ".wrap_apply(model.apply) (and .wrap_apply(model.init) to create the "
        "FP8 meta), or jaxmp.flax.TrainState.create(..., policy=policy), "
        "which does it for you.")

  def __str__(self) -> str:
    text = super().__str__() + ",dot=fp8"
    if self.amax_history_length != DEFAULT_AMAX_HISTORY_LENGTH:
      text += f",amax_history={self.amax_history_length}"
    return text


def get_policy(spec: Any) -> Policy:
  """Returns the :class:`Policy` described by ``spec``.

  Args:
    spec: a :class:`Policy`, a ``jmp.Policy``, or a string:

      * jmp's grammar: ``"p=f32,c=bf16,o=f32"`` or
        ``"params=float32,compute=bfloat16,output=float32"``. Unspecified
        params default to float32, compute follows params and output follows
        compute. Spaces around ``,`` and ``=`` are accepted; each key may be
        given once.
      * a single dtype name (``"bf16"``, ``"fp16"``, ``"half"``, ``"full"``)
        for all three. Note that ``"bf16"`` and ``"fp16"`` keep the params in
        16 bits too (this warns once when the params are cast): mixed
        precision is ``"mixed_bfloat16"`` / ``"mixed_float16"``.
      * a preset: ``"mixed_bfloat16"``, ``"mixed_float16"``, ``"float32"``,
        ``"mixed_fp8"`` or ``"auto"`` (:func:`jaxmp.auto_policy`).
      * FP8 matmuls: ``",dot=fp8"`` after the dtypes (``"mixed_fp8"`` is
        ``"p=f32,c=bf16,o=f32,dot=fp8"``), optionally with
        ``",amax_history=N"``, gives an FP8 policy (``dot=fp8``). A float8
        dtype for params, compute or output is refused: it would cast without
        scaling.

  Returns:
    The policy (an FP8 one with ``dot=fp8``).

  Raises:
    ValueError: naming the offending part and listing the valid keys, dtype
      names and presets; for a float8 dtype, pointing to ``"mixed_fp8"``.
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
    raise ValueError(f"Empty policy string. {_GRAMMAR_HELP}")
  if text == "auto":
    return auto_policy()
  if text in PRESETS:
    text = PRESETS[text]
  if "=" not in text:
    if text not in _DTYPE_NAMES and text != "half":
      # 'mixed_fp16' means float16, however close it is to 'mixed_fp8'.
      presets = [p for p in VALID_PRESETS if "8" in text or "8" not in p]
      raise ValueError(
          f"Unknown policy {spec!r}: not a preset. " + _unknown_dtype(
              text, [*presets, *VALID_DTYPE_NAMES], _GRAMMAR_HELP)
      )
    dtype = parse_dtype(text)
    if np.dtype(dtype).itemsize == 1:
      raise ValueError(_float8_refusal("compute_dtype", dtype, spec))
    return Policy(dtype, dtype, dtype)

  values: dict[str, Any] = {}
  fp8: dict[str, Any] = {}
  for part in text.split(","):
    part = part.strip()
    if "=" not in part:
      raise ValueError(
          f"Policy part {part!r} of {spec!r} is not of the form key=dtype. "
          f"{_GRAMMAR_HELP}"
      )
    key, value = (s.strip() for s in part.split("=", 1))
    if key in _FP8_KEYS:
      _parse_fp8_part(spec, key, value, fp8)
      continue
    if key not in _KEYS:
      raise ValueError(
          f"Unknown key {key!r} in policy {spec!r}."
          f"{_did_you_mean(key, (*VALID_KEYS, *_FP8_KEYS))} {_GRAMMAR_HELP}"
      )
    field = _KEYS[key]
    if field in values:
      method = "with_" + field
      raise ValueError(
          f"Key {key!r} in policy {spec!r} sets {field} a second time; give "
          "each of params, compute and output at most once (jmp would keep "
          f"the last one silently). To change one dtype of a policy, use "
          f"policy.{method}(...)."
      )
    if not value:
      raise ValueError(
          f"Missing dtype after {key}= in policy {spec!r}. {_GRAMMAR_HELP}"
      )
    if value not in _DTYPE_NAMES and value != "half":
      raise ValueError(
          f"In policy {spec!r}, key {key!r}: "
          + _unknown_dtype(value, VALID_DTYPE_NAMES, _GRAMMAR_HELP)
      )
    values[field] = parse_dtype(value)
    if np.dtype(values[field]).itemsize == 1:
      raise ValueError(_float8_refusal(field, values[field], spec))
  param = values.get("param_dtype", jnp.float32)
  compute = values.get("compute_dtype", param)
  output = values.get("output_dtype", compute)
  if "amax_history" in fp8 and "dot" not in fp8:
    raise ValueError(
        f"Policy {spec!r} sets amax_history without dot=fp8: the amax "
        "histories belong to the FP8 matmuls. Add ',dot=fp8' (or use the "
        "preset 'mixed_fp8').")
  if "dot" in fp8:
    return Fp8Policy(param, compute, output, amax_history_length=fp8.get(
        "amax_history", DEFAULT_AMAX_HISTORY_LENGTH))
  return Policy(param, compute, output)


def _parse_fp8_part(spec: str, key: str, value: str, fp8: dict[str, Any]) -> None:
  """Parses ``dot=fp8`` or ``amax_history=N`` of policy ``spec`` into ``fp8``."""
  if key in fp8:
    raise ValueError(
        f"Key {key!r} in policy {spec!r} is given a second time; give it at "
        "most once.")
  if key == "dot":
    if value not in _FP8_DOT_NAMES:
      raise ValueError(
          f"In policy {spec!r}, key 'dot': {value!r} is not a matmul format. "
          "The only one is 'fp8' (E4M3 inputs, E5M2 gradients, delayed "
          "scaling): 'dot=fp8'. Leave 'dot' out to run the matmuls in the "
          "compute dtype.")
    fp8[key] = True
    return
  try:
    length = int(value)
  except ValueError:
    length = 0
  if not 1 <= length <= MAX_AMAX_HISTORY_LENGTH or str(length) != value:
    raise ValueError(
        f"In policy {spec!r}, key 'amax_history': {value!r} is not a whole "
        f"number >= 1 and <= {MAX_AMAX_HISTORY_LENGTH} (each FP8 matmul keeps "
        "three histories of that length). Give the length of the amax "
        "histories of the FP8 matmuls, e.g. 'amax_history=16' (Flax's default "
        f"is {DEFAULT_AMAX_HISTORY_LENGTH}).")
  fp8[key] = length


def _float8_refusal(field: str, dtype: Any, spec: Any) -> str:
  """The message that refuses a float8 dtype as a policy's ``field``."""
  where = f"In policy {spec!r}: " if spec is not None else "Policy: "
  role = {"param_dtype": "the parameters (the master copy)",
          "compute_dtype": "every activation and matmul input",
          "output_dtype": "the outputs"}[field]
  return (
      f"{where}{field}={np.dtype(dtype).name} would cast {role} to float8 "
      "with no per-tensor scaling, which cannot train (float8 has 2 or 3 "
      "mantissa bits and a narrow range). FP8 training scales each matmul's "
      "inputs and gradients per tensor instead: use the policy 'mixed_fp8' "
      "(= 'p=f32,c=bf16,o=f32,dot=fp8'), which runs the Dense and "
      "DenseGeneral matmuls in FP8 with delayed scaling, everything else in "
      "bfloat16 and keeps float32 params; apply it with "
      "jaxmp.flax.TrainState.create(policy='mixed_fp8') or "
      "jaxmp.flax.ModulePolicy (see the FP8 guide).")


def _refuse_float8(policy: Policy) -> None:
  """Refuses a policy with a float8 dtype: it would cast without scaling."""
  for field in ("param_dtype", "compute_dtype", "output_dtype"):
    dtype = getattr(policy, field)
    if np.dtype(dtype).itemsize == 1:
      raise ValueError(_float8_refusal(field, dtype, None))


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
