"""The one table of JAX primitives that autocast and the precision audit read:
each primitive's kind (:data:`KIND`), whose rule autocast casts its inputs by
(:func:`autocast_rules`) and by which the audit follows what values are made
of, and the one trace of a function that both evaluate."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jaxpr as jaxprs

# What autocast does with an operation's floating inputs (docs/autocast.md).
RULES = ("compute", "float32", "promote", "as_is", "original")
# kind: (its rule, its primitives).
_KINDS = {
    # Matrix products and convolutions, in the compute dtype.
    "matmul": ("compute", "dot_general conv_general_dilated ragged_dot_general"),
    # In at least float32: exponentials and logarithms, powers and roots (x**3
    # overflows float16 from 40), sums, special functions, functions with
    # poles or steep slopes, linear algebra and FFTs.
    "float32": ("float32", """exp exp2 expm1 log log1p logistic reciprocal pow
        integer_pow square sqrt rsqrt cbrt reduce_sum reduce_prod cumsum cumprod
        cumlogsumexp reduce_window_sum erf erfc erf_inv lgamma digamma polygamma
        zeta igamma igammac igamma_grad_a bessel_i0e bessel_i1e
        regularized_incomplete_beta tan acos asin sinh cosh asinh acosh atanh
        cholesky eig eigh lu qr svd schur hessenberg householder_product
        triangular_solve tridiagonal tridiagonal_solve fft"""),
    # Elementwise, broadcasting size-1 dimensions.
    "elementwise": ("promote", """add add_any sub mul div rem neg abs sign max min
        nextafter floor ceil round is_finite eq ne lt le gt ge eq_to le_to lt_to
        select_n clamp atan2 sin cos atan tanh real imag complex conj and or not
        xor shift_left shift_right_arithmetic shift_right_logical
        population_count clz mulhi"""),
    # Only move their one input's values, and transpose to moves.
    "move": ("promote", "reshape transpose squeeze slice dynamic_slice rev copy"),
    # Outputs made of their first input's values.
    "follow": ("promote", """broadcast_in_dim broadcast_to gather reduce_precision
        sharding_constraint reshard"""),
    "cast": ("promote", "convert_element_type"),
    # The rest that computes: reductions exact in any dtype, creators.
    "promote": ("promote", """concatenate stack unstack split tile pad
        dynamic_update_slice stop_gradient zeros_like reduce_max reduce_min argmax
        argmin cummax cummin reduce_and reduce_or reduce_xor reduce_window_max
        reduce_window_min sort top_k approx_top_k iota rng_uniform random_bits
        random_seed random_wrap random_unwrap random_fold_in random_split
        threefry2x32 rng_bit_generator random_gamma create_token after_all"""),
    # Outputs are the inputs.
    "as_is": ("as_is", """optimization_barrier device_put psum pmax pmin ppermute
        all_gather all_to_all reduce_scatter pbroadcast pvary debug_callback
        debug_print name"""),
    # The output's bits depend on the input's dtype.
    "original": ("original", "bitcast_convert_type"),
    # Hold programs, entered by both (a custom_vjp function runs as written).
    "program": (None, """jit pjit closed_call core_call checkpoint remat2 scan
        while cond custom_jvp_call custom_vjp_call"""),
}
KIND = {name: kind for kind, (_, names) in _KINDS.items() for name in names.split()}
_DEFAULT = {name: _KINDS[kind][0] for name, kind in KIND.items() if kind != "program"}


def is_float(dtype: Any) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_array(x: Any) -> bool:
  """Whether a leaf is traced: a JAX or NumPy array, a tracer or an abstract value."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


def signature(tree: Any) -> Any:
  """What a trace of a function of ``tree`` depends on: its structure, the
  types of its arrays and its other leaves; ``None`` if one is unhashable."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  key = (treedef, tuple(
      x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) if is_array(x) else x
      for x in leaves))
  try:
    hash(key)
  except TypeError:
    return None
  return key


def trace(fn: Any, tree: Any) -> tuple[Any, Any, list[bool]]:
  """``fn(tree)`` traced over the array leaves of ``tree`` (the others stay
  static, as ``jax.jit``'s static arguments); nothing runs. Returns its
  ``ClosedJaxpr``, its output's shape and which leaves are its inputs."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  dynamic = [is_array(x) for x in leaves]

  def flat_fn(*arrays):
    it = iter(arrays)
    return fn(jax.tree_util.tree_unflatten(
        treedef, [next(it) if d else x for x, d in zip(leaves, dynamic)]))

  closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(
      *(x for x, d in zip(leaves, dynamic) if d))
  return closed, out_shape, dynamic


def autocast_rules(overrides: Mapping[Any, str] | None = None) -> dict[str, str]:
  """Returns :func:`jaxmp.autocast`'s rule table, with ``overrides`` applied.

  The table maps primitive names to rules: ``"compute"`` (matmuls),
  ``"float32"`` (``exp``, ``rsqrt``, ``reduce_sum`` ...), ``"promote"`` (the
  widest input wins; the function's inputs and constants follow what they
  meet), ``"as_is"`` and ``"original"`` (as traced). Others follow
  ``"promote"``, or ``"original"`` if they hold a program (``shard_map``).
  ``overrides`` maps names (or ``jax.extend.core.Primitive`` objects) to
  rules; a ``TypeError`` or ``ValueError`` names a wrong one (an unknown
  primitive or rule, or one autocast enters such as ``scan``).

  Example:
    >>> import jaxmp
    >>> rules = jaxmp.autocast_rules({"tanh": "float32"})
    >>> rules["dot_general"], rules["exp"], rules["tanh"]
    ('compute', 'float32', 'float32')
  """
  table = dict(_DEFAULT)
  if overrides is None:
    return table
  if not isinstance(overrides, Mapping):
    raise TypeError(
        "jaxmp.autocast rules must be a mapping from primitive names to rule "
        f"kinds, e.g. {{'exp': 'promote'}}; got {overrides!r} of type "
        f"{type(overrides).__name__}.")
  for key, rule in overrides.items():
    name = key.name if jaxprs.is_primitive(key) else key  # names even a library's
    if not isinstance(name, str):
      raise TypeError(
          "jaxmp.autocast rules map primitive names (strings such as "
          "'dot_general' or 'exp', or jax.extend.core.Primitive objects) to rule "
          f"kinds; got the key {key!r} of type {type(key).__name__}.")
    known = set(KIND) | jaxprs.primitive_names()
    if name not in known and not jaxprs.is_primitive(key):
      close = difflib.get_close_matches(name, sorted(known), n=3)
      raise ValueError(
          f"jaxmp.autocast rules: {name!r} is not the name of a JAX primitive."
          + (f" Did you mean {', '.join(map(repr, close))}?" if close else "")
          + " Use the names that jax.make_jaxpr prints (e.g. 'dot_general', "
          "'exp', 'reduce_sum'); for a primitive of another library, pass the "
          "jax.extend.core.Primitive object itself as the key.")
    if KIND.get(name) == "program":
      raise ValueError(
          f"jaxmp.autocast rules: {name!r} cannot be given a rule: autocast "
          f"enters {name} and applies the table to the operations inside it. To "
          "run a part of a model in another dtype, put it under "
          "jax.named_scope(...) and pass scope_policies={'that_name': 'float32'}.")
    if not isinstance(rule, str) or rule not in RULES:
      raise ValueError(
          f"jaxmp.autocast rules: the rule for {name!r} is {rule!r}, which is "
          f"not a rule kind. Valid kinds are {', '.join(map(repr, RULES))}: e.g. "
          f"{{{name!r}: 'float32'}} runs {name} in float32.")
    table[name] = rule
  return table
