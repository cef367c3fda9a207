"""Automatic mixed precision for any JAX function, at the level of operations.

:func:`autocast` traces a function and evaluates its jaxpr again with
``jaxpr.evaluate``, whose rule casts each operation's floating inputs by the
rule of its primitive (``autocast_rules``) and binds the primitive: ``grad``,
``jit``, ``vmap`` and ``checkpoint`` see an ordinary function, and the
backward pass is the autodiff of the casts.
"""

from __future__ import annotations

import collections
import functools
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.autocast_rules import KIND, autocast_rules, is_array, signature, trace
from jaxmp._src.frameworks import for_nnx_objects
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.rules import check_pattern, rule_table

_FLOAT32 = np.dtype(jnp.float32)
_CACHE_SIZE = 32  # the abstract signatures whose jaxprs an autocast function keeps
_CARRY_ROUNDS = 4  # how often a loop's carry dtypes are derived before they are fixed
# A consumer gives the operation that computes its input its own rule: the
# sub of softmax's x - max(x) takes exp's, a norm's x * x the sum's.
_FEEDING = {"exp": "sub", "exp2": "sub", "reduce_sum": "mul"}
_MASKING = ("add", "select_n")  # how a mask meets the scores before a softmax


def _is_floating(dtype: Any) -> bool:
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _widest(dtypes) -> np.dtype:
  """JAX's standard promotion, the only one autocast consults: every cast it
  inserts is explicit, so it builds the same program under strict promotion."""
  with jax.numpy_dtype_promotion("standard"):
    return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _at_least(dtype: Any, floor: Any) -> np.dtype:
  return np.dtype(floor if floor is not None
                  and np.dtype(dtype).itemsize < np.dtype(floor).itemsize else dtype)


class _Fact(NamedTuple):
  """What autocast knows of a value besides its dtype."""

  # No operation computed it: an input, a constant, or what promote and
  # as_is operations make of such alone. It takes the dtype of the computed
  # values it meets, as a weakly typed scalar does.
  flexible: bool = False
  magnitude: float | None = None  # the largest finite constant it carries
  widened: bool = False  # computed by a float32 rule, or elementwise from one
  # A move (KIND "move") of a flexible input: (eqn, params, inputs, index,
  # its fact). It is cast before the move, so a param is cast once.
  moved: Any = None


def _values(pairs):
  return [v for v, _ in pairs]


def _inside(pairs):
  """Values entering another trace level: a move recorded here is not there."""
  return [(v, f._replace(moved=None)) for v, f in pairs]


def _flexible(flags):
  return [_Fact(flexible=f) for f in flags]


def _program(jaxpr):
  return (jaxpr.jaxpr, jaxpr.consts) if jaxprs.is_closed(jaxpr) else (jaxpr, [])


def _resolve_policy(policy: Any) -> Policy:
  if policy is None:
    raise TypeError(
        "jaxmp.autocast needs a policy: pass policy='mixed_bfloat16' (or any "
        "spec jaxmp.get_policy accepts, or a jaxmp.Policy).")
  if not isinstance(policy, (Policy, str)) and hasattr(policy, "wrap_apply"):
    raise TypeError(
        f"jaxmp.autocast takes one jaxmp.Policy (or a spec jaxmp.get_policy "
        f"accepts), got a {type(policy).__name__}. Give per-part policies as "
        "scope_policies={'name_scope_pattern': policy} instead, and the "
        "default policy as policy=.")
  try:
    return get_policy(policy)
  except (TypeError, ValueError) as e:
    raise type(e)(f"jaxmp.autocast, policy: {e}") from None


def _check_scope_key(key: Any) -> None:
  try:
    check_pattern("jaxmp.autocast scope_policies", key)
  except ValueError as e:
    raise ValueError(
        f"{e} Patterns are regular expressions matched against whole scope "
        "names or paths, e.g. 'head' or 'Block_0/LayerNorm_\\d+'; wrap a "
        "literal name in re.escape(...).") from None


def _scope_policies(scope_policies: Mapping[str, Any] | None, default: Policy):
  """``scopes -> (policy, pinned)``: the policy of the innermost matching scope."""
  rules = () if scope_policies is None else rule_table(
      "jaxmp.autocast scope_policies", scope_policies, None, False,
      check_key=_check_scope_key, key_description="name-scope pattern").rules
  compiled = [(re.compile(key), key, policy) for key, policy in rules]

  @functools.cache
  def resolve(scopes: tuple[str, ...]) -> tuple[Policy, bool]:
    for end in range(len(scopes), 0, -1):
      found = {key: policy for start in range(end - 1, -1, -1)
               for pattern, key, policy in compiled
               if pattern.fullmatch("/".join(scopes[start:end]))}
      if len(set(found.values())) > 1:
        raise ValueError(
            f"jaxmp.autocast scope_policies: the scope {'/'.join(scopes)!r} is "
            f"matched by {', '.join(map(repr, found))} with different policies. "
            "Make the patterns match different scopes (the innermost matching "
            "scope wins; a tie is ambiguous).")
      if found:
        return next(iter(found.values())), True
    return default, False

  return resolve


class _Evaluator:
  """Evaluates jaxprs with the dtype rules; one per trace level."""

  def __init__(self, table: Mapping[str, str], scopes: Callable[..., Any]):
    self.table, self.scopes = table, scopes
    # (id(value), dtype) -> (value, its cast): each value is cast once per dtype.
    self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}

  def child(self) -> _Evaluator:
    """An evaluator for a program traced at another level (a loop body)."""
    return _Evaluator(self.table, self.scopes)

  @staticmethod
  def constant(value: Any) -> tuple[Any, _Fact]:
    """A constant of the program (a literal, a captured array), flexible."""
    magnitude = None
    if (isinstance(value, (np.ndarray, np.generic, float))
        and _is_floating(jnp.result_type(value))):
      finite = np.abs(np.asarray(value, np.float64))
      finite = finite[np.isfinite(finite)]
      magnitude = float(finite.max()) if finite.size else None
    return value, _Fact(flexible=True, magnitude=magnitude)

  def cast(self, value: Any, dtype: Any, fact: _Fact) -> Any:
    dtype = np.dtype(dtype)
    if dtype == jnp.result_type(value):
      return value
    key = (id(value), dtype)
    if key not in self._casts:
      if fact.moved:
        eqn, params, inputs, index, source = fact.moved
        inputs = list(inputs)
        inputs[index] = self.cast(inputs[index], dtype, source)
        cast = jaxprs.bind(eqn, inputs, params)[0]
      else:
        cast = self.convert(value, dtype, fact.magnitude)
      self._casts[key] = (value, cast)
    return self._casts[key][1]

  @staticmethod
  def convert(value: Any, dtype: np.dtype, magnitude: float | None) -> Any:
    """``value`` in ``dtype``; if it carries a constant, saturated.

    A constant keeps its meaning in a narrower dtype: a fill value such as
    ``jnp.finfo(jnp.float32).min`` becomes the narrower dtype's most
    negative finite number, not ``-inf``, and a nonzero one does not become
    zero; infinities and NaNs stay. A host constant is converted on the host;
    a value computed at run time is clamped only if its constant is out of
    range.
    """
    if magnitude is None or not _is_floating(jnp.result_type(value)):
      return lax.convert_element_type(value, dtype)
    info, source = jnp.finfo(dtype), jnp.result_type(value)
    if isinstance(value, (np.ndarray, np.generic, float)):
      x = np.asarray(value, source).astype(np.float64)
      x = np.where(np.isfinite(x), np.clip(x, float(info.min), float(info.max)), x)
      vanishes = (x != 0) & (x.astype(dtype) == 0)
      return np.where(vanishes, np.sign(x) * float(info.smallest_normal), x).astype(dtype)
    if magnitude <= float(info.max):
      return lax.convert_element_type(value, dtype)
    low, high = np.array(info.min, source), np.array(info.max, source)
    return lax.convert_element_type(
        lax.select(lax.is_finite(value), lax.clamp(low, value, high), value), dtype)

  def run(self, jaxpr, consts, ins, stack) -> list[tuple[Any, _Fact]]:
    """Evaluates an open ``jaxpr`` on ``(value, fact)`` pairs under the name
    stack ``stack``; returns its outputs as pairs."""
    shifts = self._shifts(jaxpr)

    def rule(eqn, eqn_ins, eqn_stack):
      with jaxprs.equation_context(eqn):
        return self.eqn(eqn, eqn_ins, eqn_stack, shifts)

    return jaxprs.evaluate(jaxpr, [self.constant(c) for c in consts], ins, rule,
                           literal=self.constant, name_stack=stack)

  def _shifts(self, jaxpr) -> dict[int, tuple[str, bool]]:
    """``{id(eqn): (rule, only with a flexible input)}`` for the operations
    that take the rule of their consumer (``_FEEDING``), so that neither
    overflows before that rule applies; and for the ``add`` and ``select_n``
    that compute softmax's ``x`` where a flexible value (a mask, given or a
    constant) meets the scores: a fully masked row stays as float32 makes it.
    """
    producers = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name in (
        *_MASKING, *_FEEDING.values(), "convert_element_type")}

    def producer(atom):
      eqn = None if jaxprs.is_literal(atom) else producers.get(atom)
      if eqn is not None and eqn.primitive.name == "convert_element_type":
        return producer(eqn.invars[0])
      return eqn

    shifts = {}

    def masks(atom, rule):
      eqn = producer(atom)
      if eqn is not None and eqn.primitive.name in _MASKING and id(eqn) not in shifts:
        shifts[id(eqn)] = (rule, True)
        for a in eqn.invars:
          masks(a, rule)

    for eqn in jaxpr.eqns:
      fed = _FEEDING.get(eqn.primitive.name)
      source = producer(eqn.invars[0]) if fed else None
      if source is not None and source.primitive.name == fed:
        shifts[id(source)] = (self.table.get(eqn.primitive.name, "promote"), False)
        if fed == "sub":
          masks(source.invars[0], shifts[id(source)][0])
    return shifts

  def eqn(self, eqn, ins, stack, shifts) -> list[tuple[Any, _Fact]]:
    name = eqn.primitive.name
    if KIND.get(name) == "program":
      return _PROGRAMS[name](self, eqn, ins, stack)
    rule, flexible_only = shifts.get(id(eqn), (None, False))
    if flexible_only and not any(
        f.flexible for v, f in ins if _is_floating(jnp.result_type(v))):
      rule = None
    rule = rule or self.table.get(name) or (
        "original" if jaxprs.inner_jaxprs(eqn.params) else "promote")
    new = eqn.params.get("new_dtype")
    if (name == "convert_element_type" and rule != "original" and ins[0][1].widened
        and _is_floating(new) and np.dtype(new).itemsize == 2):
      # A cast to 16 bits of what a float32 rule computed: the float32 rules
      # hold for half-precision values too (a float16 sum is a float32 sum),
      # so it stays float32, as PyTorch's autocast returns it.
      return [(ins[0][0], ins[0][1]._replace(flexible=False))]
    return self.apply(rule, eqn, ins, *self.scopes(jaxprs.name_parts(stack)[0]))

  def apply(self, rule, eqn, ins, policy, pinned) -> list[tuple[Any, _Fact]]:
    """Casts the inputs of ``eqn`` by ``rule`` and binds its primitive."""
    floor = policy.compute_dtype if pinned else None
    targets = self._targets(rule, eqn, ins, policy, floor)
    out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    spreads = rule == "promote" and KIND.get(eqn.primitive.name) == "elementwise"
    values = []
    for (v, f), t in zip(ins, targets):
      if t is None or t == jnp.result_type(v):
        values.append(v)
      elif spreads and f.flexible and jnp.ndim(v) == len(out_shape) and jnp.shape(v) != out_shape:
        # A flexible input it broadcasts (a bias, a norm's scale) is cast
        # after the broadcast, which fuses: the param's gradient, a sum over
        # the broadcast dimensions, is summed in the param's dtype.
        full = lax.broadcast_in_dim(v, out_shape, tuple(range(len(out_shape))))
        values.append(self.convert(full, t, f.magnitude))
      else:
        values.append(self.cast(v, t, f))
    params = dict(eqn.params)
    preferred = params.get("preferred_element_type")
    if rule != "original" and _is_floating(preferred):
      traced = [a.aval.dtype for a in eqn.invars if _is_floating(a.aval.dtype)]
      dtypes = [jnp.result_type(v) for v in values if _is_floating(jnp.result_type(v))]
      # JAX sets it to the inputs' dtype by default; wider was asked for, and is kept.
      if dtypes and not (traced and np.dtype(preferred).itemsize > max(
          np.dtype(d).itemsize for d in traced)):
        params["preferred_element_type"] = _widest(dtypes)
    outs = jaxprs.bind(eqn, values, params)
    if rule == "float32":
      return [(o, _Fact(widened=_is_floating(jnp.result_type(o)))) for o in outs]
    if rule not in ("promote", "as_is"):
      return [(o, _Fact()) for o in outs]
    in_facts = [f for v, (_, f) in zip(values, ins) if _is_floating(jnp.result_type(v))]
    # An explicit cast between floating dtypes computes its output.
    flexible = all(f.flexible for f in in_facts) and not (
        in_facts and eqn.primitive.name == "convert_element_type")
    magnitude = max((f.magnitude for _, f in ins if f.magnitude is not None), default=None)
    widened = any(f.widened for _, f in ins)
    moved = None
    if (flexible and len(in_facts) == 1 and len(outs) == 1
        and KIND.get(eqn.primitive.name) == "move"):
      index = next(i for i, v in enumerate(values) if _is_floating(jnp.result_type(v)))
      moved = (eqn, params, tuple(values), index, ins[index][1])
    return [(o, _Fact(flexible, magnitude, widened and np.dtype(d).itemsize >= 4, moved)
             if _is_floating(d) else _Fact(flexible))
            for o, d in ((o, jnp.result_type(o)) for o in outs)]

  @staticmethod
  def _targets(rule, eqn, ins, policy, floor) -> list[Any]:
    dtypes = [jnp.result_type(v) for v, _ in ins]
    floating = [_is_floating(d) for d in dtypes]
    if rule == "as_is":
      return [None] * len(ins)
    if rule == "original":
      return [a.aval.dtype if fl and a.aval.dtype != d else None
              for a, d, fl in zip(eqn.invars, dtypes, floating)]
    if rule == "compute":
      # float8 inputs (quantized on purpose) are left alone but in a pinned scope.
      c = policy.compute_dtype
      return [c if fl and (floor is not None or np.dtype(d).itemsize > 1
                           or np.dtype(c).itemsize == 1) else None
              for d, fl in zip(dtypes, floating)]
    if rule == "float32":
      return [_at_least(_at_least(d, _FLOAT32), floor) if fl else None
              for d, fl in zip(dtypes, floating)]
    # "promote": inputs traced in one dtype share the widest of the computed
    # ones now; flexible inputs follow.
    groups = collections.defaultdict(list)
    for i, atom in enumerate(eqn.invars):
      if floating[i]:
        groups[atom.aval.dtype].append(i)
    targets = [None] * len(ins)
    for members in groups.values():
      computed = [dtypes[i] for i in members if not ins[i][1].flexible]
      target = _at_least(_widest(computed or [dtypes[i] for i in members]), floor)
      for i in members:
        targets[i] = target
    return targets


# -- Programs inside programs: each rebuilt with the public API that made it.


def _cast_all(ev, pairs, dtypes):
  return [ev.cast(v, d, f) if _is_floating(d) else v for (v, f), d in zip(pairs, dtypes)]


def _constrain(pairs, shardings):
  if not shardings:
    return pairs
  return [(v, f) if s is None or type(s).__name__ == "UnspecifiedValue" else
          (lax.with_sharding_constraint(v, s), f._replace(moved=None))
          for (v, f), s in zip(pairs, shardings)]


def _inline(ev, eqn, ins, stack):
  """``jit`` and ``closed_call``: evaluated in place, shardings kept."""
  p = eqn.params
  ins = _constrain(ins, p.get("in_shardings", ()))
  outs = ev.run(*_program(p.get("jaxpr", p.get("call_jaxpr"))), ins, stack)
  return _constrain(outs, p.get("out_shardings", ()))


def _checkpoint(ev, eqn, ins, stack):
  """``jax.checkpoint``: the body is evaluated under a new checkpoint."""
  flags, inside = [], _inside(ins)

  def body(*args):
    outs = ev.child().run(eqn.params["jaxpr"], [], [
        (a, f) for a, (_, f) in zip(args, inside)], stack)
    flags[:] = [f.flexible for _, f in outs]
    return _values(outs)

  outs = jax.checkpoint(body, prevent_cse=eqn.params["prevent_cse"],
                        policy=eqn.params["policy"])(*_values(ins))
  return list(zip(outs, _flexible(flags)))


def _loop_body(ev, program, consts, n_carry, extra_facts, stack):
  """``make(carry flags, carry dtypes or None, record)``: a loop body
  ``(carry, extra=()) -> (new carry, other outputs)`` that evaluates
  ``program`` on the consts, the carry and the extra inputs (a scan's
  slices), casts the new carry to the dtypes and records its flexibility."""
  def make(flags, dtypes, record):
    def body(carry, extra=()):
      inner = ev.child()
      outs = inner.run(*_program(program), [
          *_inside(consts), *zip(carry, _flexible(flags)),
          *zip(extra, extra_facts)], stack)
      record["flags"] = [f.flexible for _, f in outs[:n_carry]]
      new = outs[:n_carry]
      return (_values(new) if dtypes is None else _cast_all(inner, new, dtypes),
              _values(outs[n_carry:]))
    return body
  return make


def _carry_types(make, init, slices):
  """The dtype and flexibility of each loop carry. A carry starts as its
  initial value; a flexible one takes the dtype the body computes for it, a
  computed one the widest of what it starts as and what the body makes."""
  dtypes, flags = [jnp.result_type(v) for v, _ in init], [f.flexible for _, f in init]
  for _ in range(_CARRY_ROUNDS):
    record = {}
    shapes = jax.eval_shape(make(flags, None, record), [
        jax.ShapeDtypeStruct(jnp.shape(v), d) for (v, _), d in zip(init, dtypes)],
        slices)[0]
    new = [(d, f) if not _is_floating(d) else
           (np.dtype(s.dtype), False) if f and not of else
           (_widest([d, s.dtype]), f and of)
           for d, f, s, of in zip(dtypes, flags, shapes, record["flags"])]
    if new == list(zip(dtypes, flags)):
      break
    dtypes, flags = [d for d, _ in new], [f for _, f in new]
  return dtypes, flags


def _scan(ev, eqn, ins, stack):
  p = eqn.params
  n, k = p["num_consts"], p["num_carry"]
  init, xs = ins[n:n + k], ins[n + k:]
  make = _loop_body(ev, p["jaxpr"], ins[:n], k, [f for _, f in _inside(xs)], stack)
  slices = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x, _ in xs]
  dtypes, flags = _carry_types(make, init, slices)
  carry, ys = lax.scan(make(flags, dtypes, {}), _cast_all(ev, init, dtypes), _values(xs),
                       length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
  return [*zip(carry, _flexible(flags)), *((y, _Fact()) for y in ys)]


def _while(ev, eqn, ins, stack):
  p = eqn.params
  n_cond, n_body = p["cond_nconsts"], p["body_nconsts"]
  init = ins[n_cond + n_body:]
  make = _loop_body(ev, p["body_jaxpr"], ins[n_cond:n_cond + n_body], len(init), [], stack)
  dtypes, flags = _carry_types(make, init, [])

  def cond(carry):
    return _values(ev.child().run(*_program(p["cond_jaxpr"]), [
        *_inside(ins[:n_cond]), *zip(carry, _flexible(flags))], stack))[0]

  outs = lax.while_loop(cond, lambda carry: make(flags, dtypes, {})(carry)[0],
                        _cast_all(ev, init, dtypes))
  return list(zip(outs, _flexible(flags)))


def _cond(ev, eqn, ins, stack):
  operands = _inside(ins[1:])
  branches = eqn.params["branches"]

  def make(closed, dtypes, records):
    def branch(*args):
      inner = ev.child()
      outs = inner.run(*_program(closed), [
          (a, f) for a, (_, f) in zip(args, operands)], stack)
      records.append([f.flexible for _, f in outs])
      return _values(outs) if dtypes is None else _cast_all(inner, outs, dtypes)
    return branch

  records = []
  shapes = [jax.eval_shape(make(b, None, records), *_values(operands)) for b in branches]
  dtypes = [_widest([s[i].dtype for s in shapes]) if _is_floating(shapes[0][i].dtype)
            else shapes[0][i].dtype for i in range(len(shapes[0]))]
  outs = lax.switch(ins[0][0], [make(b, dtypes, []) for b in branches], *_values(operands))
  return [(o, _Fact(flexible=all(r[i] for r in records))) for i, o in enumerate(outs)]


def _custom_jvp(ev, eqn, ins, stack):
  """A ``custom_jvp`` function: its primal and its JVP rule both follow the table."""
  p = eqn.params
  consts, primals = _inside(ins[:p["num_consts"]]), _inside(ins[p["num_consts"]:])

  def primal_fn(*xs):
    return _values(ev.child().run(*_program(p["call_jaxpr"]), [
        *consts, *((x, f) for x, (_, f) in zip(xs, primals))], stack))

  out_shapes = jax.eval_shape(primal_fn, *_values(primals))
  fun = jax.custom_jvp(primal_fn)

  @fun.defjvp
  def _(primals_in, tangents_in):
    jvp_jaxpr, jvp_consts, zeros = p["jvp_jaxpr_fun"].call_wrapped(
        *([False] * len(primals_in)))
    inner = ev.child()
    outs = inner.run(jvp_jaxpr, jvp_consts, [
        *((x, f) for x, (_, f) in zip(primals_in, primals)),
        *((t, _Fact()) for t in tangents_in)], stack)
    primals_out = _cast_all(inner, outs[:len(zeros)], [s.dtype for s in out_shapes])
    nonzero, tangents = iter(outs[len(zeros):]), []
    for primal, zero in zip(primals_out, zeros):
      if not jnp.issubdtype(primal.dtype, jnp.inexact):
        tangents.append(np.zeros(primal.shape, jax.dtypes.float0))
        if not zero:
          next(nonzero)
      elif zero:
        tangents.append(jnp.zeros_like(primal))
      else:
        tangent, fact = next(nonzero)
        tangents.append(inner.cast(tangent, primal.dtype, fact))
    return primals_out, tangents

  return [(o, _Fact()) for o in fun(*_values(primals))]


def _custom_vjp(ev, eqn, ins, stack):
  """A ``custom_vjp`` function runs as written: inputs in their traced dtypes."""
  return ev.apply("original", eqn, ins, *ev.scopes(jaxprs.name_parts(stack)[0]))


_PROGRAMS = {
    "jit": _inline, "pjit": _inline, "closed_call": _inline, "core_call": _inline,
    "checkpoint": _checkpoint, "remat2": _checkpoint, "scan": _scan,
    "while": _while, "cond": _cond, "custom_jvp_call": _custom_jvp,
    "custom_vjp_call": _custom_vjp,
}


def autocast(
    fn: Callable[..., Any] | None = None,
    policy: Any = None,
    *,
    rules: Mapping[Any, str] | None = None,
    scope_policies: Mapping[str, Any] | None = None,
) -> Callable[..., Any]:
  """Returns ``fn`` running in mixed precision, operation by operation.

  The returned function traces ``fn`` (once per abstract signature) and
  evaluates its jaxpr again, casting each operation's floating inputs by the
  rule of its primitive (:func:`jaxmp.autocast_rules`): matmuls and
  convolutions in the compute dtype, range-sensitive operations (``exp``,
  ``log``, softmax's ``x - max(x)``, sums) in float32, the rest in the widest
  dtype of its inputs, where the function's inputs and constants follow what
  they meet. The result is an ordinary JAX function; the autocast guide
  (``docs/autocast.md``) gives the details.

  Args:
    fn: the function, e.g. ``loss_fn(params, batch)``. Array arguments are
      traced, others are static. Left out, ``autocast`` returns a decorator.
    policy: a :class:`jaxmp.Policy` or anything :func:`jaxmp.get_policy`
      accepts; floating outputs are cast to its ``output_dtype``.
    rules: overrides of the rule table, ``{primitive name: rule}``.
    scope_policies: ``{pattern: policy}``: operations under the innermost
      ``jax.named_scope`` (or Linen module) whose name or path the regular
      expression matches wholly run under its policy, in at least its compute
      dtype: ``{"head": "float32"}`` keeps the head in float32.

  Raises:
    TypeError: if ``fn`` is not callable, or the policy, ``rules`` or
      ``scope_policies`` are of the wrong kind.
    ValueError: for an unknown policy, primitive or rule, or a bad pattern.

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
    return functools.partial(autocast, policy=policy, rules=rules,
                             scope_policies=scope_policies)
  if not callable(fn):
    raise TypeError(
        f"jaxmp.autocast expects a function, got {fn!r} of type "
        f"{type(fn).__name__}. Call it as jaxmp.autocast(loss_fn, "
        "'mixed_bfloat16'), or as a decorator: "
        "@jaxmp.autocast(policy='mixed_bfloat16').")
  resolved = _resolve_policy(policy)
  table = autocast_rules(rules)
  scopes = _scope_policies(scope_policies, resolved)

  def on_objects():
    # NNX variables fn updates in place (BatchNorm statistics, RNG counts)
    # come out of the evaluation and are written back to the caller's objects.
    from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

    return nnx_adapter.on_a_copy(fn, lambda pure_fn: _autocast_function(
        pure_fn, resolved, table, scopes, returns_state=True))

  return for_nnx_objects(
      fn, _autocast_function(fn, resolved, table, scopes, returns_state=False),
      on_objects)


def _autocast_function(fn, policy, table, scopes, *, returns_state):
  """The function :func:`autocast` returns."""
  cache: dict[Any, Any] = {}

  def call(tree):
    before = jax.tree_util.tree_flatten(tree)
    out = fn(*tree[0], **tree[1])
    after = jax.tree_util.tree_flatten(tree)
    if after[1] != before[1] or any(a is not b for a, b in zip(after[0], before[0])):
      raise TypeError(
          f"jaxmp.autocast: {getattr(fn, '__name__', type(fn).__name__)} "
          "changed its arguments in place. autocast traces the function and "
          "evaluates the trace again, so those updates would be lost. Return "
          "the new values instead of assigning them (NNX modules are the "
          "exception: autocast writes their variables back).")
    return out

  @functools.wraps(fn)
  def autocast_fn(*args, **kwargs):
    key = signature((args, kwargs))
    entry = cache.get(key) if key is not None else None
    if entry is None:
      closed, out_shape, _ = trace(call, (args, kwargs))
      # The leading outputs take the output dtype; the state of
      # returns_state keeps the dtypes it was traced with.
      n_outputs = (len(jax.tree_util.tree_leaves(out_shape[0])) if returns_state
                   else len(closed.out_avals))
      entry = closed, jax.tree_util.tree_structure(out_shape), n_outputs
      if key is not None and not any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        cache[key] = entry
        if len(cache) > _CACHE_SIZE:
          del cache[next(iter(cache))]
    closed, out_tree, n_outputs = entry
    ev = _Evaluator(table, scopes)
    arrays = [x for x in jax.tree_util.tree_leaves((args, kwargs)) if is_array(x)]
    outs = ev.run(closed.jaxpr, closed.consts, [(x, _Fact(flexible=True)) for x in arrays],
                  jaxprs.current_name_stack())
    outs = [ev.cast(x, policy.output_dtype if i < n_outputs else aval.dtype, f)
            if _is_floating(jnp.result_type(x)) else x
            for i, ((x, f), aval) in enumerate(zip(outs, closed.out_avals))]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return autocast_fn
