"""The rule table of :func:`jaxmp.autocast`: which dtype each primitive runs in.

A rule table maps a JAX primitive's name (``"dot_general"``, ``"exp"``) to one
of the rule kinds of :data:`RULE_KINDS`. :data:`DEFAULT_RULES` is the table
autocast uses; :func:`autocast_rules` returns it with a user's overrides,
validated. The page ``docs/autocast.md`` publishes the same table beside
PyTorch's autocast op lists (a test keeps the two equal).
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Mapping
from typing import Any

from jaxmp._src import jaxpr as jaxprs

# What each rule kind does with the floating inputs of an operation. Integer
# and boolean inputs are never cast.
RULE_KINDS = types.MappingProxyType({
    "compute": (
        "inputs in the policy's compute dtype; the output in the compute dtype "
        "too (matrix products, convolutions)"
    ),
    "float32": (
        "inputs in at least float32, so the output is float32 (range- and "
        "precision-sensitive operations)"
    ),
    "promote": (
        "the widest input wins; the function's own inputs and captured "
        "constants follow the other inputs (everything else)"
    ),
    "as_is": (
        "inputs as they come, each on its own (operations that only pass "
        "values through)"
    ),
    "original": (
        "inputs cast back to the dtypes they were traced with: the operation "
        "runs exactly as written"
    ),
})

# Primitives autocast does not apply a rule to but enters: their inner
# programs follow the table. (custom_vjp_call is entered as a whole: it runs as
# written, see docs/autocast.md.)
STRUCTURAL = frozenset({
    "jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2", "scan",
    "while", "cond", "custom_jvp_call", "custom_vjp_call",
})


def _table(**kinds: tuple[str, ...]) -> dict[str, str]:
  table = {}
  for kind, names in kinds.items():
    for name in names:
      table[name] = kind
  return table


DEFAULT_RULES: Mapping[str, str] = types.MappingProxyType(_table(
    compute=(
        "dot_general", "conv_general_dilated", "ragged_dot_general",
    ),
    float32=(
        # Exponentials and logarithms. The subtraction that computes the
        # argument of exp/exp2 (softmax's x - max(x)) takes exp's rule too,
        # and so does the add or select of a mask that computes its x.
        "exp", "exp2", "expm1", "log", "log1p", "logistic", "reciprocal",
        # Powers and roots: x**3 overflows float16 from x = 40.
        "pow", "integer_pow", "square", "sqrt", "rsqrt", "cbrt",
        # Reductions and scans that accumulate.
        "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp",
        "reduce_window_sum",
        # Special functions.
        "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "zeta",
        "igamma", "igammac", "igamma_grad_a",
        "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta",
        # Trigonometric and hyperbolic functions with poles or steep slopes.
        "tan", "acos", "asin", "sinh", "cosh", "asinh", "acosh", "atanh",
        # Linear algebra and FFTs: unstable in half precision, and most back
        # ends have no half-precision kernels for them.
        "cholesky", "eig", "eigh", "lu", "qr", "svd", "schur", "hessenberg",
        "householder_product", "triangular_solve", "tridiagonal",
        "tridiagonal_solve", "fft",
    ),
    promote=(
        # Elementwise arithmetic and comparisons.
        "add", "add_any", "sub", "mul", "div", "rem", "neg", "abs", "sign",
        "max", "min", "nextafter", "floor", "ceil", "round",
        "is_finite", "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to",
        "lt_to", "select_n", "clamp", "atan2", "sin", "cos", "atan", "tanh",
        "real", "imag", "complex", "conj", "and", "or", "not", "xor",
        "shift_left", "shift_right_arithmetic", "shift_right_logical",
        "population_count", "clz", "mulhi",
        # Moving data around.
        "reshape", "broadcast_in_dim", "broadcast_to", "transpose", "squeeze",
        "concatenate", "stack", "unstack", "split", "tile", "pad", "slice", "dynamic_slice",
        "dynamic_update_slice", "gather", "rev", "copy",
        "convert_element_type", "reduce_precision", "stop_gradient",
        "sharding_constraint", "reshard", "zeros_like",
        # Reductions that do not accumulate (exact in any dtype).
        "reduce_max", "reduce_min", "argmax", "argmin", "cummax", "cummin",
        "reduce_and", "reduce_or", "reduce_xor", "reduce_window_max",
        "reduce_window_min",
        "sort", "top_k", "approx_top_k",
        # Random numbers and constants.
        "iota", "rng_uniform", "random_bits", "random_seed", "random_wrap",
        "random_unwrap", "random_fold_in", "random_split", "threefry2x32",
        "rng_bit_generator", "random_gamma", "create_token", "after_all",
    ),
    as_is=(
        "optimization_barrier", "device_put", "psum", "pmax", "pmin",
        "ppermute", "all_gather", "all_to_all", "reduce_scatter", "pbroadcast",
        "pvary", "debug_callback", "debug_print", "name",
    ),
    original=(
        # The output's bits depend on the input's dtype.
        "bitcast_convert_type",
    ),
))


def _known_primitive_names() -> frozenset[str]:
  return frozenset(DEFAULT_RULES) | jaxprs.primitive_names()


def _kind_error(key: str, kind: Any) -> ValueError:
  valid = ", ".join(repr(k) for k in RULE_KINDS)
  return ValueError(
      f"jaxmp.autocast rules: the rule for {key!r} is {kind!r}, which is not a "
      f"rule kind. Valid kinds are {valid}: e.g. {{{key!r}: 'float32'}} runs "
      f"{key} in float32."
  )


def _check_key(key: Any) -> str:
  if jaxprs.is_primitive(key):
    key = key.name  # a primitive object names any primitive, even a library's
  elif not isinstance(key, str):
    raise TypeError(
        "jaxmp.autocast rules map primitive names (strings such as "
        "'dot_general' or 'exp', or jax.extend.core.Primitive objects) to rule "
        f"kinds; got the key {key!r} of type {type(key).__name__}."
    )
  elif key not in _known_primitive_names():
    close = difflib.get_close_matches(key, sorted(_known_primitive_names()), n=3)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise ValueError(
        f"jaxmp.autocast rules: {key!r} is not the name of a JAX primitive.{hint}"
        " Use the names that jax.make_jaxpr prints (e.g. 'dot_general', 'exp', "
        "'reduce_sum'); for a primitive of another library, pass the "
        "jax.extend.core.Primitive object itself as the key."
    )
  if key in STRUCTURAL:
    raise ValueError(
        f"jaxmp.autocast rules: {key!r} cannot be given a rule: autocast enters "
        f"{key} and applies the table to the operations inside it. To run a "
        "part of a model in another dtype, put it under jax.named_scope(...) "
        "and pass scope_policies={'that_name': 'float32'}."
    )
  return key


def autocast_rules(overrides: Mapping[Any, str] | None = None) -> dict[str, str]:
  """Returns :func:`jaxmp.autocast`'s rule table, with ``overrides`` applied.

  The table maps each primitive's name to a rule kind:

  * ``"compute"``: floating inputs in the policy's compute dtype, so the
    output is in it too (``dot_general``, ``conv_general_dilated``);
  * ``"float32"``: floating inputs in at least float32 (``exp``, ``log``,
    ``rsqrt``, ``reduce_sum``, ``cumsum`` ...). The subtraction that computes
    the argument of ``exp`` (the ``x - max(x)`` of softmax) follows ``exp``'s
    rule, and so does an ``add`` or ``select_n`` that computes its ``x``
    from an input or constant (an attention mask);
  * ``"promote"``: the widest floating input wins; the function's own inputs
    and captured constants (its params, its batch) take the dtype of the
    computed inputs they meet (``add``, ``mul``, ``reshape`` ...);
  * ``"as_is"``: inputs as they come (``optimization_barrier``, collectives);
  * ``"original"``: inputs cast back to the dtypes they were traced with.

  Primitives not in the table follow ``"promote"``, or ``"original"`` if they
  hold a program of their own (``shard_map``, ``pallas_call``).

  Args:
    overrides: a mapping from primitive names (or
      ``jax.extend.core.Primitive`` objects) to rule kinds, applied over the
      default table.

  Returns:
    A new dict from primitive name to rule kind.

  Raises:
    TypeError: if ``overrides`` is not a mapping, or a key is neither a string
      nor a primitive.
    ValueError: if a key is not a primitive's name (the message suggests
      close names), names a primitive autocast enters (``scan``, ``jit`` ...),
      or a kind is not one of the five.

  Example:
    >>> import jaxmp
    >>> rules = jaxmp.autocast_rules({"tanh": "float32"})
    >>> rules["dot_general"], rules["exp"], rules["tanh"]
    ('compute', 'float32', 'float32')
  """
  table = dict(DEFAULT_RULES)
  if overrides is None:
    return table
  if not isinstance(overrides, Mapping):
    raise TypeError(
        "jaxmp.autocast rules must be a mapping from primitive names to rule "
        f"kinds, e.g. {{'exp': 'promote'}}; got {overrides!r} of type "
        f"{type(overrides).__name__}."
    )
  for key, kind in overrides.items():
    name = _check_key(key)
    if not isinstance(kind, str) or kind not in RULE_KINDS:
      raise _kind_error(name, kind)
    table[name] = kind
  return table
