"""Automatic mixed precision for any JAX function, at the level of operations.

:func:`autocast` traces a function and evaluates its jaxpr again with
:func:`jaxprs.evaluate`, whose rule casts each operation's floating inputs by
the rule of its primitive and binds ordinary primitives: ``grad``, ``jit``,
``vmap`` and ``checkpoint`` see an ordinary function, and the backward pass is
the autodiff of the casts.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.autocast_rules import autocast_rules
from jaxmp._src.frameworks import for_nnx_objects
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.rules import check_pattern, rule_table

_FLOAT32 = np.dtype(jnp.float32)
# How many abstract signatures an autocast function remembers the jaxpr of.
_CACHE_SIZE = 32
# How often the carry dtypes of a loop are re-derived before they are fixed.
_CARRY_ROUNDS = 4
# Operations that only move the values of one floating input, and whose
# transposes only move them back: casting their output is casting their input
# first, exactly, forward and backward. A flexible value made by one of them (a
# transposed or reshaped kernel) is cast at its source, so each param is cast
# once however it is reshaped. Broadcasts and gathers are not among them: their
# transposes sum (a bias's gradient over the batch, an embedding's over the
# tokens), and casting after them keeps those sums in float32.
_MOVEMENTS = frozenset({
    "reshape", "transpose", "squeeze", "slice", "dynamic_slice", "rev", "copy",
})
# Operations whose input another operation computes, and which give that
# operation their rule (see _Evaluator._shifts_before_exp).
_FEEDING = {"exp": "sub", "exp2": "sub", "reduce_sum": "mul"}
# How a mask meets the scores before a softmax: added, or selected.
_MASKING = frozenset({"add", "select_n"})
# Elementwise operations that broadcast size-1 dimensions of their inputs. A
# flexible input they broadcast (a bias, a layer norm's scale) is broadcast to
# the full shape before it is cast: the cast fuses into the operation, and the
# gradient of the param, a sum over the broadcast dimensions, is summed in its
# own dtype (float32) rather than in the compute dtype.
_BROADCASTING = frozenset({
    "add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem",
    "nextafter", "select_n", "clamp",
})


def _is_floating(dtype: Any) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes) -> np.dtype:
  """The dtype that holds every one of ``dtypes``: JAX's standard promotion.

  Autocast decides each operation's dtypes itself and casts to them
  explicitly, so this is the only place it consults the promotion lattice. It
  uses the standard lattice whatever the user configured: under
  ``jax_numpy_dtype_promotion="strict"``, bfloat16 and float32 would have no
  common type, and every cast autocast inserts is explicit anyway.
  """
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _at_least(dtype: np.dtype, floor: np.dtype | None) -> np.dtype:
  if floor is not None and np.dtype(dtype).itemsize < np.dtype(floor).itemsize:
    return np.dtype(floor)
  return np.dtype(dtype)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def _resolve_policy(policy: Any) -> Policy:
  if policy is None:
    raise TypeError(
        "jaxmp.autocast needs a policy: pass policy='mixed_bfloat16' (or any "
        "spec jaxmp.get_policy accepts, or a jaxmp.Policy)."
    )
  if not isinstance(policy, (Policy, str)) and hasattr(policy, "wrap_apply"):
    raise TypeError(
        f"jaxmp.autocast takes one jaxmp.Policy (or a spec jaxmp.get_policy "
        f"accepts), got a {type(policy).__name__}. Give per-part policies as "
        "scope_policies={'name_scope_pattern': policy} instead, and the "
        "default policy as policy=."
    )
  try:
    return get_policy(policy)
  except (TypeError, ValueError) as e:
    raise type(e)(f"jaxmp.autocast, policy: {e}") from None


def _check_scope_key(key: Any) -> None:
  if not isinstance(key, str):
    raise TypeError(
        "jaxmp.autocast scope_policies map name-scope patterns (regular "
        "expressions on jax.named_scope names or Flax module names, e.g. "
        f"'LayerNorm_\\d+' or 'head') to policies; got the key {key!r} of type "
        f"{type(key).__name__}."
    )
  try:
    check_pattern("jaxmp.autocast scope_policies", key)
  except ValueError as e:
    raise ValueError(
        f"{e} Patterns are regular expressions matched against whole scope "
        "names or paths, e.g. 'head' or 'Block_0/LayerNorm_\\d+'; wrap a "
        "literal name in re.escape(...)."
    ) from None


class _ScopePolicies:
  """Which policy each name stack runs under: the innermost matching scope's."""

  def __init__(self, scope_policies: Mapping[str, Any] | None, default: Policy):
    rules = () if scope_policies is None else rule_table(
        "jaxmp.autocast scope_policies", scope_policies, None, False,
        check_key=_check_scope_key, key_description="name-scope pattern",
    ).rules
    self.rules = tuple((re.compile(k), k, p) for k, p in rules)
    self.default = default
    self._memo: dict[tuple[str, ...], tuple[Policy, bool]] = {}

  def __call__(self, scopes: tuple[str, ...]) -> tuple[Policy, bool]:
    """Returns ``(policy, pinned)`` for an operation under ``scopes``."""
    if not self.rules:
      return self.default, False
    if scopes not in self._memo:
      self._memo[scopes] = self._resolve(scopes)
    return self._memo[scopes]

  def _resolve(self, scopes):
    best_end, found = -1, []
    for end in range(len(scopes), 0, -1):
      for start in range(end - 1, -1, -1):
        path = "/".join(scopes[start:end])
        for compiled, key, policy in self.rules:
          if compiled.fullmatch(path) and (key, policy) not in found:
            found.append((key, policy))
      if found:
        best_end = end
        break
    if best_end < 0:
      return self.default, False
    policies = {policy for _, policy in found}
    if len(policies) > 1:
      raise ValueError(
          f"jaxmp.autocast scope_policies: the scope {'/'.join(scopes)!r} is "
          f"matched by {', '.join(repr(k) for k, _ in found)} with different "
          "policies. Make the patterns match different scopes (the innermost "
          "matching scope wins; a tie is ambiguous)."
      )
    return found[0][1], True


class _Evaluator:
  """Evaluates jaxprs with the dtype rules; one per trace level.

  ``flexible`` marks the values that no operation computed: the function's
  inputs, captured constants and what is derived from them only by
  ``promote`` operations. They take the dtype of the computed values they
  meet, as weakly typed Python scalars do in JAX's type promotion.
  """

  def __init__(self, table: Mapping[str, str], scopes: _ScopePolicies,
               magnitudes=None, widened=None):
    self.table = table
    self.scopes = scopes
    # (id(value), dtype) -> (value, its cast): each value is cast once per dtype.
    self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}
    # id(value) -> how a movement made it from a flexible value (see _MOVEMENTS).
    self._moved: dict[int, tuple[Any, ...]] = {}
    # id(value) -> (value, the largest finite magnitude of the constants it
    # carries): constants and the flexible values computed from them. Shared
    # with child evaluators: values keep their identity across levels.
    self._magnitudes: dict[int, tuple[Any, float]] = (
        {} if magnitudes is None else magnitudes)
    # id(value) -> value: what a float32 rule computed, and the values
    # computed from it elementwise: explicit casts to 16 bits leave them alone.
    self._widened: dict[int, Any] = {} if widened is None else widened

  def child(self) -> "_Evaluator":
    """An evaluator for a program traced at another level (a loop body)."""
    return _Evaluator(self.table, self.scopes, self._magnitudes, self._widened)

  def constant(self, value: Any) -> Any:
    """Records the magnitude of a constant of the program (a literal, a const)."""
    if (isinstance(value, (np.ndarray, np.generic, float))
        and _is_floating(jnp.result_type(value))):
      finite = np.abs(np.asarray(value, np.float64))
      finite = finite[np.isfinite(finite)]
      if finite.size:
        self._magnitudes[id(value)] = (value, float(finite.max()))
    return value

  def cast(self, value: Any, dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if dtype == jnp.result_type(value):
      return value
    key = (id(value), dtype)
    if key not in self._casts:
      if id(value) in self._moved:
        _, primitive, bind_params, inputs, index = self._moved[id(value)]
        inputs = list(inputs)
        inputs[index] = self.cast(inputs[index], dtype)
        cast = primitive.bind(*inputs, **bind_params)
      else:
        cast = self.convert(value, value, dtype)
      self._casts[key] = (value, cast)
    return self._casts[key][1]

  def convert(self, value: Any, source: Any, dtype: np.dtype) -> Any:
    """``value`` in ``dtype``, saturated where ``source`` carries a constant.

    A constant of the program, or a flexible value computed from one, keeps
    its meaning in a narrower dtype: a fill value such as
    ``jnp.finfo(jnp.float32).min`` becomes the most negative finite number of
    the narrower dtype, not ``-inf`` (so a padded attention row stays finite),
    and a nonzero constant does not become zero. Infinities and NaNs stay
    what they are. A constant is converted on the host; a value computed at
    run time is clamped only if a constant it carries is out of range.
    """
    entry = self._magnitudes.get(id(source))
    if entry is None or not _is_floating(jnp.result_type(value)):
      return lax.convert_element_type(value, dtype)
    info = jnp.finfo(dtype)
    source_dtype = jnp.result_type(value)
    if isinstance(value, (np.ndarray, np.generic, float)):
      x = np.asarray(value, source_dtype).astype(np.float64)
      finite = np.isfinite(x)
      x = np.where(finite, np.clip(x, float(info.min), float(info.max)), x)
      vanishes = (x != 0) & (x.astype(dtype) == 0)
      return np.where(
          vanishes, np.sign(x) * float(info.smallest_normal), x).astype(dtype)
    if entry[1] <= float(info.max):
      return lax.convert_element_type(value, dtype)
    low = np.array(info.min, source_dtype)
    high = np.array(info.max, source_dtype)
    saturated = lax.select(
        lax.is_finite(value), lax.clamp(low, value, high), value)
    return lax.convert_element_type(saturated, dtype)

  # -- Programs ----------------------------------------------------------------

  def run(self, jaxpr, consts, args, arg_flexible, stack):
    """Evaluates ``jaxpr`` under the name stack ``stack``; returns its outputs
    and their flexibility. Constants are flexible."""
    shifts = self._shifts_before_exp(jaxpr)

    def rule(eqn, ins, eqn_stack):
      values, flags = zip(*ins) if ins else ((), ())
      with jaxprs.equation_context(eqn):
        outs, out_flags = self.eqn(eqn, list(values), list(flags), eqn_stack, shifts)
      return list(zip(outs, out_flags))

    outs = jaxprs.evaluate(
        jaxpr, [(self.constant(c), True) for c in consts],
        list(zip(args, arg_flexible)), rule,
        literal=lambda value: (self.constant(value), True), name_stack=stack)
    return [v for v, _ in outs], [f for _, f in outs]

  def run_closed(self, closed, args, flags, stack):
    return self.run(closed.jaxpr, closed.consts, args, flags, stack)

  def _shifts_before_exp(self, jaxpr) -> dict[Any, tuple[str, bool]]:
    """The operations that compute the input of another: they take its rule.

    The ``sub`` whose result feeds ``exp`` (softmax's ``x - max(x)``), and
    the ``mul`` whose result a ``reduce_sum`` adds up (a norm's ``x * x``,
    through the cast to float32 that ``jnp`` puts before a half-precision
    sum), so that neither overflows before the rule of its consumer applies.
    So do the ``add`` and ``select_n`` that compute ``x`` there, where a
    flexible value meets the scores (a mask, given or a constant): a mask is
    added in float32 whatever its value, and a fully masked row stays what
    float32 makes it. Returns ``{id(eqn): (rule, only with a flexible input)}``.
    """
    producers = {
        eqn.outvars[0]: eqn
        for eqn in jaxpr.eqns
        if eqn.primitive.name in _MASKING.union(_FEEDING.values())
        or eqn.primitive.name == "convert_element_type"
    }

    def producer(atom):
      eqn = None if jaxprs.is_literal(atom) else producers.get(atom)
      if eqn is not None and eqn.primitive.name == "convert_element_type":
        return producer(eqn.invars[0])
      return eqn

    shifts = {}

    def masks(atom, kind):
      eqn = producer(atom)
      if eqn is not None and eqn.primitive.name in _MASKING and id(eqn) not in shifts:
        shifts[id(eqn)] = (kind, True)
        for a in eqn.invars:
          masks(a, kind)

    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      if name in _FEEDING:
        source = producer(eqn.invars[0])
        if source is not None and source.primitive.name == _FEEDING[name]:
          kind = self.table.get(name, "promote")
          shifts[id(source)] = (kind, False)
          if _FEEDING[name] == "sub":
            masks(source.invars[0], kind)
    return shifts

  # -- One equation --------------------------------------------------------------

  def eqn(self, eqn, values, flags, stack, shifts):
    name = eqn.primitive.name
    handler = _STRUCTURAL_HANDLERS.get(name)
    if handler is not None:
      return handler(self, eqn, values, flags, stack)
    kind, flexible_only = shifts.get(id(eqn), (None, False))
    if flexible_only and not any(
        f for v, f in zip(values, flags) if _is_floating(jnp.result_type(v))):
      kind = None
    kind = kind or self.table.get(name)
    if kind is None:
      has_program = bool(jaxprs.inner_jaxprs(eqn.params))
      kind = "original" if has_program else "promote"
    if (name == "convert_element_type" and kind != "original"
        and id(values[0]) in self._widened
        and np.dtype(eqn.params["new_dtype"]).itemsize == 2
        and _is_floating(eqn.params["new_dtype"])):
      # A cast to 16 bits of what a float32 rule computed: the float32 rules
      # hold for half-precision values too (a float16 sum is a float32 sum),
      # so the value stays float32, as PyTorch's autocast returns it.
      return [values[0]], [False]
    policy, pinned = self.scopes(jaxprs.name_parts(stack)[0])
    return self.apply(kind, eqn, values, flags, policy, pinned)

  def apply(self, kind, eqn, values, flags, policy, pinned):
    """Casts the inputs of ``eqn`` by rule ``kind`` and binds its primitive."""
    floor = policy.compute_dtype if pinned else None
    targets = self._targets(kind, eqn, values, flags, policy, floor)
    out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    broadcasts = kind == "promote" and eqn.primitive.name in _BROADCASTING
    originals, cast_values = values, []
    for v, t, f in zip(values, targets, flags):
      shape = jnp.shape(v)
      if t is None or t == jnp.result_type(v):
        cast_values.append(v)
      elif (broadcasts and f and shape != out_shape
            and len(shape) == len(out_shape)):
        full = lax.broadcast_in_dim(v, out_shape, tuple(range(len(out_shape))))
        cast_values.append(self.convert(full, v, t))
      else:
        cast_values.append(self.cast(v, t))
    values = cast_values
    params = dict(eqn.params)
    preferred = params.get("preferred_element_type")
    if kind != "original" and _is_floating(preferred):
      traced = [a.aval.dtype for a in eqn.invars if _is_floating(a.aval.dtype)]
      dtypes = [v.dtype for v in values if _is_floating(jnp.result_type(v))]
      # JAX sets preferred_element_type to the inputs' dtype by default; one
      # wider than the traced inputs was asked for, and is kept.
      asked = traced and np.dtype(preferred).itemsize > max(
          np.dtype(d).itemsize for d in traced)
      if dtypes and not asked:
        params["preferred_element_type"] = _widest(dtypes)
    bind_params = jaxprs.bind_params(eqn, params)
    out = eqn.primitive.bind(*values, **bind_params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    self._track(kind, originals, outs)
    if kind in ("promote", "as_is"):
      floating_inputs = [
          f for v, f in zip(values, flags) if _is_floating(jnp.result_type(v))
      ]
      is_flexible = all(floating_inputs)
      if eqn.primitive.name == "convert_element_type" and floating_inputs:
        is_flexible = False  # an explicit cast between floating dtypes
      if (is_flexible and len(floating_inputs) == 1 and len(outs) == 1
          and eqn.primitive.name in _MOVEMENTS):
        index = next(i for i, v in enumerate(values)
                     if _is_floating(jnp.result_type(v)))
        self._moved[id(outs[0])] = (
            outs[0], eqn.primitive, bind_params, tuple(values), index)
    else:
      is_flexible = False
    return outs, [is_flexible] * len(outs)

  def _track(self, kind, inputs, outs):
    """Records what the outputs of an operation carry (see ``__init__``)."""
    floating_outs = [o for o in outs if _is_floating(jnp.result_type(o))]
    if kind == "float32":
      self._widened.update((id(o), o) for o in floating_outs)
      return
    if kind not in ("promote", "as_is"):
      return
    if any(id(v) in self._widened for v in inputs):
      self._widened.update(
          (id(o), o) for o in floating_outs
          if np.dtype(jnp.result_type(o)).itemsize >= 4)
    magnitudes = [self._magnitudes[id(v)][1] for v in inputs
                  if id(v) in self._magnitudes]
    if magnitudes:
      self._magnitudes.update((id(o), (o, max(magnitudes))) for o in floating_outs)

  def _targets(self, kind, eqn, values, flags, policy, floor):
    dtypes = [jnp.result_type(v) for v in values]
    floating = [_is_floating(d) for d in dtypes]
    if kind == "as_is":
      return [None] * len(values)
    if kind == "original":
      return [
          atom.aval.dtype if f and atom.aval.dtype != d else None
          for atom, d, f in zip(eqn.invars, dtypes, floating)
      ]
    if kind == "compute":
      # float8 inputs (deliberately quantized) are left alone, except in a
      # pinned scope, where everything runs in at least its compute dtype.
      compute = policy.compute_dtype
      return [
          compute if f and (floor is not None or np.dtype(d).itemsize > 1
                            or np.dtype(compute).itemsize == 1) else None
          for d, f in zip(dtypes, floating)
      ]
    if kind == "float32":
      return [
          _at_least(_at_least(d, _FLOAT32), floor) if f else None
          for d, f in zip(dtypes, floating)
      ]
    # "promote": inputs that shared a dtype when traced share the widest one
    # of the computed inputs now; inputs and constants follow.
    groups: dict[Any, list[int]] = collections.defaultdict(list)
    for i, atom in enumerate(eqn.invars):
      if floating[i]:
        groups[atom.aval.dtype].append(i)
    targets = [None] * len(values)
    for members in groups.values():
      computed = [dtypes[i] for i in members if not flags[i]]
      if computed:
        target = _widest(computed)
      else:
        target = _widest([dtypes[i] for i in members])
      target = _at_least(target, floor)
      for i in members:
        targets[i] = target
    return targets


# -- Programs inside programs ------------------------------------------------------


def _inline(evaluator, eqn, values, flags, stack):
  """``jit`` and ``closed_call``: evaluated in place, shardings kept."""
  closed = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  in_shardings = eqn.params.get("in_shardings", ())
  out_shardings = eqn.params.get("out_shardings", ())
  values = _constrain(values, in_shardings)
  if jaxprs.is_closed(closed):
    outs, out_flags = evaluator.run_closed(closed, values, flags, stack)
  else:
    outs, out_flags = evaluator.run(closed, [], values, flags, stack)
  return _constrain(outs, out_shardings), out_flags


def _constrain(values, shardings):
  if not shardings:
    return values
  return [
      v if type(s).__name__ == "UnspecifiedValue" or s is None
      else lax.with_sharding_constraint(v, s)
      for v, s in zip(values, shardings)
  ]


def _checkpoint(evaluator, eqn, values, flags, stack):
  """``jax.checkpoint``: the body is evaluated under a new checkpoint."""
  jaxpr = eqn.params["jaxpr"]
  seen = {}

  def body(*args):
    outs, seen["flags"] = evaluator.child().run(jaxpr, [], args, flags, stack)
    return outs

  outs = jax.checkpoint(
      body, prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"]
  )(*values)
  return list(outs), seen["flags"]


def _carry_types(step, init_dtypes, init_flags):
  """The dtype and flexibility of each loop carry.

  A carry starts as its initial value; a flexible one (a param, a constant)
  takes the dtype the loop body computes for it, and a computed one the
  widest of what it starts as and what the body makes of it.
  """
  dtypes, carry_flags = list(init_dtypes), list(init_flags)
  for _ in range(_CARRY_ROUNDS):
    out_dtypes, out_flags = step(dtypes, carry_flags)
    new_dtypes, new_flags = [], []
    for d, f, od, of in zip(dtypes, carry_flags, out_dtypes, out_flags):
      if not _is_floating(d):
        new_dtypes.append(d)
        new_flags.append(f)
      elif f and not of:
        new_dtypes.append(np.dtype(od))
        new_flags.append(False)
      else:
        new_dtypes.append(_widest([d, od]))
        new_flags.append(f and of)
    if new_dtypes == dtypes and new_flags == carry_flags:
      break
    dtypes, carry_flags = new_dtypes, new_flags
  return dtypes, carry_flags


def _cast_all(evaluator, values, dtypes):
  return [
      evaluator.cast(v, d) if _is_floating(d) else v for v, d in zip(values, dtypes)
  ]


def _split(seq, *sizes):
  """``seq`` cut into pieces of ``sizes``, and the rest."""
  pieces, start = [], 0
  for size in sizes:
    pieces.append(list(seq[start:start + size]))
    start += size
  return [*pieces, list(seq[start:])]


def _shape_dtype(values, dtypes):
  return [jax.ShapeDtypeStruct(jnp.shape(v), d) for v, d in zip(values, dtypes)]


def _scan(evaluator, eqn, values, flags, stack):
  p = eqn.params
  n_consts, n_carry = p["num_consts"], p["num_carry"]
  consts, init, xs = _split(values, n_consts, n_carry)
  c_flags, i_flags, x_flags = _split(flags, n_consts, n_carry)
  closed = p["jaxpr"]

  def make_body(carry_flags, carry_dtypes, record):
    def body(carry, x):
      inner = evaluator.child()
      outs, out_flags = inner.run_closed(
          closed, [*consts, *carry, *x], [*c_flags, *carry_flags, *x_flags], stack
      )
      record["flags"] = out_flags
      new_carry = outs[:n_carry]
      if carry_dtypes is not None:
        new_carry = _cast_all(inner, new_carry, carry_dtypes)
      return new_carry, outs[n_carry:]
    return body

  def step(dtypes, carry_flags):
    record = {}
    x_slices = [
        jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x in xs
    ]
    carry_shape, _ = jax.eval_shape(
        make_body(carry_flags, None, record), _shape_dtype(init, dtypes), x_slices
    )
    return [s.dtype for s in carry_shape], record["flags"][:n_carry]

  init_dtypes = [jnp.result_type(v) for v in init]
  dtypes, carry_flags = _carry_types(step, init_dtypes, i_flags)
  record = {}
  carry, ys = lax.scan(
      make_body(carry_flags, dtypes, record), _cast_all(evaluator, init, dtypes),
      xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"],
  )
  return [*carry, *ys], [*carry_flags, *([False] * len(ys))]


def _while(evaluator, eqn, values, flags, stack):
  p = eqn.params
  n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, init = _split(values, n_cond, n_body)
  cc_flags, bc_flags, i_flags = _split(flags, n_cond, n_body)

  def make_body(carry_flags, carry_dtypes, record):
    def body(carry):
      inner = evaluator.child()
      outs, out_flags = inner.run_closed(
          p["body_jaxpr"], [*body_consts, *carry], [*bc_flags, *carry_flags], stack
      )
      record["flags"] = out_flags
      return outs if carry_dtypes is None else _cast_all(inner, outs, carry_dtypes)
    return body

  def make_cond(carry_flags):
    def cond(carry):
      outs, _ = evaluator.child().run_closed(
          p["cond_jaxpr"], [*cond_consts, *carry], [*cc_flags, *carry_flags], stack
      )
      return outs[0]
    return cond

  def step(dtypes, carry_flags):
    record = {}
    shapes = jax.eval_shape(
        make_body(carry_flags, None, record), _shape_dtype(init, dtypes)
    )
    return [s.dtype for s in shapes], record["flags"]

  init_dtypes = [jnp.result_type(v) for v in init]
  dtypes, carry_flags = _carry_types(step, init_dtypes, i_flags)
  outs = lax.while_loop(
      make_cond(carry_flags), make_body(carry_flags, dtypes, {}),
      _cast_all(evaluator, init, dtypes),
  )
  return list(outs), carry_flags


def _cond(evaluator, eqn, values, flags, stack):
  index, operands = values[0], values[1:]
  op_flags = flags[1:]
  branches = eqn.params["branches"]

  def make_branch(closed, out_dtypes, record):
    def branch(*args):
      inner = evaluator.child()
      outs, out_flags = inner.run_closed(closed, list(args), op_flags, stack)
      record.append(out_flags)
      return outs if out_dtypes is None else _cast_all(inner, outs, out_dtypes)
    return branch

  records: list[list[bool]] = []
  shapes = [
      jax.eval_shape(make_branch(b, None, records), *operands) for b in branches
  ]
  out_dtypes = [
      _widest([s[i].dtype for s in shapes]) if _is_floating(shapes[0][i].dtype)
      else shapes[0][i].dtype
      for i in range(len(shapes[0]))
  ]
  out_flags = [all(r[i] for r in records) for i in range(len(out_dtypes))]
  outs = lax.switch(
      index, [make_branch(b, out_dtypes, []) for b in branches], *operands
  )
  return list(outs), out_flags


def _custom_jvp(evaluator, eqn, values, flags, stack):
  """A ``custom_jvp`` function: its primal and its JVP rule both follow the table."""
  p = eqn.params
  n_consts = p["num_consts"]
  consts, primals = values[:n_consts], values[n_consts:]
  c_flags, p_flags = flags[:n_consts], flags[n_consts:]
  closed = p["call_jaxpr"]
  jvp_jaxpr_fun = p["jvp_jaxpr_fun"]
  record = {}

  def primal_fn(*xs):
    outs, record["flags"] = evaluator.child().run_closed(
        closed, [*consts, *xs], [*c_flags, *p_flags], stack
    )
    return outs

  out_shapes = jax.eval_shape(primal_fn, *primals)
  fun = jax.custom_jvp(primal_fn)

  def jvp_rule(primals_in, tangents_in):
    jvp_jaxpr, jvp_consts, out_zeros = jvp_jaxpr_fun.call_wrapped(
        *([False] * len(primals_in))
    )
    inner = evaluator.child()
    outs, _ = inner.run(
        jvp_jaxpr, jvp_consts, [*primals_in, *tangents_in],
        [*p_flags, *([False] * len(tangents_in))], stack)
    n_out = len(out_zeros)
    primals_out = _cast_all(inner, outs[:n_out], [s.dtype for s in out_shapes])
    nonzero = iter(outs[n_out:])
    tangents_out = []
    for primal, zero in zip(primals_out, out_zeros):
      if not jnp.issubdtype(primal.dtype, jnp.inexact):
        tangent = np.zeros(primal.shape, jax.dtypes.float0)
        if not zero:
          next(nonzero)
      elif zero:
        tangent = jnp.zeros_like(primal)
      else:
        tangent = inner.cast(next(nonzero), primal.dtype)
      tangents_out.append(tangent)
    return primals_out, tangents_out

  fun.defjvp(jvp_rule)
  outs = fun(*primals)
  return list(outs), [False] * len(outs)


def _custom_vjp(evaluator, eqn, values, flags, stack):
  """A ``custom_vjp`` function runs as written: inputs in their traced dtypes."""
  policy, pinned = evaluator.scopes(jaxprs.name_parts(stack)[0])
  return evaluator.apply("original", eqn, values, flags, policy, pinned)


_STRUCTURAL_HANDLERS: dict[str, Callable[..., Any]] = {
    "jit": _inline,
    "pjit": _inline,
    "closed_call": _inline,
    "core_call": _inline,
    "checkpoint": _checkpoint,
    "remat2": _checkpoint,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
}


# -- The public function --------------------------------------------------------------


def autocast(
    fn: Callable[..., Any] | None = None,
    policy: Any = None,
    *,
    rules: Mapping[Any, str] | None = None,
    scope_policies: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
  """Returns ``fn`` running in mixed precision, operation by operation.

  When called, the returned function traces ``fn`` to a jaxpr (once per
  abstract signature of its arguments) and evaluates it again, casting the
  floating inputs of each operation by the rule of its primitive
  (:func:`jaxmp.autocast_rules`): matrix products and convolutions in the
  policy's compute dtype, range-sensitive operations (``exp``, ``log``,
  softmax's ``x - max(x)``, ``reduce_sum`` ...) in float32, everything else
  in the widest dtype of its inputs, where the function's own inputs and
  captured constants take the dtype of the computed values they meet. A
  constant is not narrowed into ``-inf``, ``inf`` or 0, and a mask that
  meets a softmax's input is added in float32. Floating outputs are
  cast to ``policy.output_dtype``; each value is cast at most once per dtype.
  The result is an ordinary JAX function (``grad``, ``jit``, ``vmap``,
  ``checkpoint`` work on it), and autocast enters ``jit``, ``scan``,
  ``while_loop``, ``cond``, ``checkpoint`` and ``custom_jvp`` functions; a
  ``custom_vjp`` function runs as written. The autocast guide
  (``docs/autocast.md``) gives the details.

  Args:
    fn: the function, e.g. a loss ``loss_fn(params, batch)``. Array arguments
      (JAX or NumPy) are traced; other arguments (Python numbers, strings,
      callables) are static, as with ``eqx.filter_jit``. Left out, ``autocast``
      returns a decorator.
    policy: a :class:`jaxmp.Policy` or anything :func:`jaxmp.get_policy`
      accepts (``"mixed_bfloat16"``, ``"p=f32,c=f16,o=f32"``).
    rules: overrides of the rule table, ``{primitive name: rule kind}``
      (see :func:`jaxmp.autocast_rules`).
    scope_policies: policies for named parts of the program:
      ``{pattern: policy}``, where each pattern is a regular expression that
      must match the whole of a ``jax.named_scope`` name (Flax Linen module
      names are scopes: ``"LayerNorm_0"``, ``"head"``) or the whole of a path
      of nested scopes (``"Block_0/LayerNorm_\\d+"``). Operations under the
      innermost matching scope use its policy, and run in at least its compute
      dtype: ``{"head": "float32"}`` keeps the head in float32.

  Returns:
    A function with ``fn``'s signature and outputs, the floating ones in
    ``policy.output_dtype``.

  Raises:
    TypeError: if ``fn`` is not callable, the policy is missing or of the
      wrong kind, or ``rules``/``scope_policies`` are not mappings of the
      right keys.
    ValueError: for an unknown policy, primitive name or rule kind, or an
      invalid scope pattern.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> w = jnp.ones((4, 4))  # float32, captured by the closure
    >>> def loss(x):
    ...   return jax.nn.log_softmax(x @ w).sum()
    >>> fast_loss = jaxmp.autocast(loss, "mixed_bfloat16")
    >>> jaxpr = jax.make_jaxpr(fast_loss)(jnp.ones((2, 4)))
    >>> [[str(v.aval) for v in eqn.invars] for eqn in jaxpr.eqns
    ...  if eqn.primitive.name == "dot_general"]
    [['bfloat16[2,4]', 'bfloat16[4,4]']]
    >>> fast_loss(jnp.ones((2, 4))).dtype
    dtype('float32')
  """
  if fn is None:
    return functools.partial(
        autocast, policy=policy, rules=rules, scope_policies=scope_policies
    )
  if not callable(fn):
    raise TypeError(
        f"jaxmp.autocast expects a function, got {fn!r} of type "
        f"{type(fn).__name__}. Call it as jaxmp.autocast(loss_fn, "
        "'mixed_bfloat16'), or as a decorator: "
        "@jaxmp.autocast(policy='mixed_bfloat16')."
    )
  resolved = _resolve_policy(policy)
  table = autocast_rules(rules)
  scopes = _ScopePolicies(scope_policies, resolved)
  def on_objects():
    # The NNX variables fn updates in place (BatchNorm statistics, RNG
    # counts) come out of the evaluation, in their own dtypes, and are
    # written back to the caller's objects.
    from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

    return nnx_adapter.on_a_copy(fn, lambda pure_fn: _autocast_function(
        pure_fn, resolved, table, scopes, returns_state=True))

  return for_nnx_objects(
      fn, _autocast_function(fn, resolved, table, scopes, returns_state=False),
      on_objects)


def _check_arguments_unchanged(fn, arguments, treedef, leaves) -> None:
  """Raises if ``fn`` changed the arguments it was traced with in place."""
  after, after_treedef = jax.tree_util.tree_flatten(arguments)
  if after_treedef == treedef and all(a is b for a, b in zip(after, leaves)):
    return
  name = getattr(fn, "__name__", type(fn).__name__)
  raise TypeError(
      f"jaxmp.autocast: {name} changed its arguments in place. autocast "
      "traces the function and evaluates the trace again, so those updates "
      "would be lost. Return the new values instead of assigning them (NNX "
      "modules are the exception: autocast writes their variables back)."
  )


def _autocast_function(fn, resolved, table, scopes, *, returns_state):
  """The function :func:`autocast` returns (see there and above)."""
  cache: collections.OrderedDict[Any, Any] = collections.OrderedDict()

  @functools.wraps(fn)
  def autocast_fn(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    is_dynamic = tuple(_is_array(x) for x in leaves)
    dynamic = [x for x, d in zip(leaves, is_dynamic) if d]
    static = tuple(x for x, d in zip(leaves, is_dynamic) if not d)
    key = (treedef, is_dynamic, static, tuple(jax.typeof(x) for x in dynamic))
    try:
      hash(key)
    except TypeError:
      key = None  # an unhashable static argument: trace on every call
    entry = cache.get(key) if key is not None else None
    if entry is None:
      def flat_fn(*dynamic_leaves):
        it, st = iter(dynamic_leaves), iter(static)
        rebuilt = [next(it) if d else next(st) for d in is_dynamic]
        a, kw = jax.tree_util.tree_unflatten(treedef, rebuilt)
        out = fn(*a, **kw)
        _check_arguments_unchanged(fn, (a, kw), treedef, rebuilt)
        return out

      closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*dynamic)
      # How many leading outputs take the output dtype (the rest, the state
      # of returns_state, keep the dtypes they were traced with).
      n_outputs = (len(jax.tree_util.tree_leaves(out_shape[0])) if returns_state
                   else len(closed.out_avals))
      entry = closed, jax.tree_util.tree_structure(out_shape), n_outputs
      has_tracers = any(isinstance(c, jax.core.Tracer) for c in closed.consts)
      if key is not None and not has_tracers:
        cache[key] = entry
        if len(cache) > _CACHE_SIZE:
          cache.popitem(last=False)
    closed, out_tree, n_outputs = entry
    evaluator = _Evaluator(table, scopes)
    outs, _ = evaluator.run_closed(closed, dynamic, [True] * len(dynamic),
                                   jaxprs.current_name_stack())
    outs = [
        evaluator.cast(x, resolved.output_dtype if i < n_outputs else aval.dtype)
        if _is_floating(jnp.result_type(x)) else x
        for i, (x, aval) in enumerate(zip(outs, closed.out_avals))
    ]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return autocast_fn
