"""Automatic mixed precision for any JAX function, at the level of operations:
:func:`autocast` evaluates a function's jaxpr again (``jaxpr.evaluate``),
casting each operation's floating inputs by its primitive's rule."""

from __future__ import annotations

import collections
import functools
import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.autocast_rules import (
    KIND, autocast_rules, is_array, is_float, signature, trace)
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

  # An input, a constant, or what promote and as_is operations make of such:
  # it follows the computed values it meets, as a weakly typed scalar does.
  flexible: bool = False
  magnitude: float | None = None  # the largest finite constant it carries
  widened: bool = False  # computed by a float32 rule, or elementwise from one
  moved: Any = None  # a move of a flexible input: (eqn, params, inputs, index, fact)


def _values(pairs):
  return [v for v, _ in pairs]


def _facts(pairs):
  """The facts of values that enter another trace as new values."""
  return [f._replace(moved=None) for _, f in pairs]


def _policies(policy: Any, scope_policies: Mapping[str, Any] | None):
  """The policy, and ``scopes -> (policy, pinned)``: the policy of the
  innermost scope a pattern matches, else the policy."""
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
    policy = get_policy(policy)
  except (TypeError, ValueError) as e:
    raise type(e)(f"jaxmp.autocast, policy: {e}") from None

  def check_key(key):
    try:
      check_pattern("jaxmp.autocast scope_policies", key)
    except ValueError as e:
      raise ValueError(
          f"{e} Patterns are regular expressions matched against whole scope "
          "names or paths, e.g. 'head' or 'Block_0/LayerNorm_\\d+'; wrap a "
          "literal name in re.escape(...).") from None

  rules = () if scope_policies is None else rule_table(
      "jaxmp.autocast scope_policies", scope_policies, None, False,
      check_key=check_key, key_description="name-scope pattern").rules
  compiled = [(re.compile(key), key, p) for key, p in rules]

  @functools.cache
  def resolve(scopes: tuple[str, ...]) -> tuple[Policy, bool]:
    for end in range(len(scopes), 0, -1):
      found = {key: p for start in range(end - 1, -1, -1) for pattern, key, p in compiled
               if pattern.fullmatch("/".join(scopes[start:end]))}
      if len(set(found.values())) > 1:
        raise ValueError(
            f"jaxmp.autocast scope_policies: the scope {'/'.join(scopes)!r} is "
            f"matched by {', '.join(map(repr, found))} with different policies. "
            "Make the patterns match different scopes (the innermost matching "
            "scope wins; a tie is ambiguous).")
      if found:
        return next(iter(found.values())), True
    return policy, False

  return policy, resolve


class _Evaluator:
  """Evaluates jaxprs with the dtype rules; one per trace level."""

  def __init__(self, table: Mapping[str, str], scopes: Callable[..., Any]):
    self.table, self.scopes = table, scopes
    self._casts = {}  # (id(value), dtype) -> (value, its cast): one cast per dtype

  def child(self) -> _Evaluator:  # for a program traced at another level
    return _Evaluator(self.table, self.scopes)

  @staticmethod
  def constant(value: Any) -> tuple[Any, _Fact]:
    """A constant of the program (a literal, a captured array), flexible."""
    magnitude = None
    if (isinstance(value, (np.ndarray, np.generic, float))
        and is_float(jnp.result_type(value))):
      finite = np.abs(np.asarray(value, np.float64))
      finite = finite[np.isfinite(finite)]
      magnitude = float(finite.max()) if finite.size else None
    return value, _Fact(flexible=True, magnitude=magnitude)

  def cast(self, value: Any, dtype: Any, fact: _Fact) -> Any:
    key = (id(value), np.dtype(dtype))
    if key[1] != jnp.result_type(value) and key not in self._casts:
      if fact.moved:  # cast before the move
        eqn, params, inputs, index, source = fact.moved
        inputs = [self.cast(x, dtype, source) if i == index else x
                  for i, x in enumerate(inputs)]
        self._casts[key] = value, jaxprs.bind(eqn, inputs, params)[0]
      else:
        self._casts[key] = value, self.convert(value, key[1], fact.magnitude)
    return self._casts[key][1] if key in self._casts else value

  @staticmethod
  def convert(value: Any, dtype: np.dtype, magnitude: float | None) -> Any:
    """``value`` in ``dtype``. A constant keeps its meaning: a fill such as
    ``finfo(float32).min`` becomes the most negative finite number, not
    ``-inf``, and a nonzero one stays nonzero (on the host); a computed value
    that carries a constant out of range is clamped."""
    if magnitude is None or not is_float(jnp.result_type(value)):
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
    """Evaluates ``jaxpr`` (open, with ``consts``, or closed) on ``(value,
    fact)`` pairs; returns pairs."""
    if jaxprs.is_closed(jaxpr):
      jaxpr, consts = jaxpr.jaxpr, jaxpr.consts
    shifts = self._shifts(jaxpr)

    def rule(eqn, eqn_ins, eqn_stack):
      with jaxprs.equation_context(eqn):
        return self.eqn(eqn, eqn_ins, eqn_stack, shifts)

    return jaxprs.evaluate(jaxpr, [self.constant(c) for c in consts], ins, rule,
                           literal=self.constant, name_stack=stack)

  def _shifts(self, jaxpr) -> dict[int, tuple[str, bool]]:
    """``{id(eqn): (rule, only with a flexible input)}`` for the operations
    that take their consumer's rule (``_FEEDING``), and for the ``add`` and
    ``select_n`` that compute softmax's ``x`` where a flexible value (a mask,
    given or a constant) meets the scores: a fully masked row stays uniform."""
    producers = {e.outvars[0]: e for e in jaxpr.eqns if e.primitive.name in (
        *_MASKING, *_FEEDING.values(), "convert_element_type")}
    shifts = {}

    def producer(atom):
      eqn = None if jaxprs.is_literal(atom) else producers.get(atom)
      if eqn is not None and eqn.primitive.name == "convert_element_type":
        return producer(eqn.invars[0])
      return eqn

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
    if flexible_only and not any(f.flexible for v, f in ins if is_float(jnp.result_type(v))):
      rule = None
    rule = rule or self.table.get(name) or (
        "original" if jaxprs.inner_jaxprs(eqn.params) else "promote")
    new = eqn.params.get("new_dtype")
    if (name == "convert_element_type" and rule != "original" and ins[0][1].widened
        and is_float(new) and np.dtype(new).itemsize == 2):
      # A cast to 16 bits of what a float32 rule computed stays float32 (a
      # float16 sum is a float32 sum), as PyTorch's autocast returns it.
      return [(ins[0][0], ins[0][1]._replace(flexible=False))]
    return self.apply(rule, eqn, ins, *self.scopes(jaxprs.name_parts(stack)[0]))

  def apply(self, rule, eqn, ins, policy, pinned) -> list[tuple[Any, _Fact]]:
    """Casts the inputs of ``eqn`` by ``rule`` and binds its primitive."""
    floor = policy.compute_dtype if pinned else None
    out_shape = tuple(eqn.outvars[0].aval.shape) if eqn.outvars else ()
    spreads = rule == "promote" and KIND.get(eqn.primitive.name) == "elementwise"
    values = []
    for (v, f), t in zip(ins, self._targets(rule, eqn, ins, policy, floor)):
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
    if rule != "original" and is_float(preferred):
      traced = [a.aval.dtype for a in eqn.invars if is_float(a.aval.dtype)]
      dtypes = [jnp.result_type(v) for v in values if is_float(jnp.result_type(v))]
      # JAX sets it to the inputs' dtype by default; wider was asked for, and is kept.
      if dtypes and not (traced and np.dtype(preferred).itemsize > max(
          np.dtype(d).itemsize for d in traced)):
        params["preferred_element_type"] = _widest(dtypes)
    outs = jaxprs.bind(eqn, values, params)
    if rule == "float32":
      return [(o, _Fact(widened=is_float(jnp.result_type(o)))) for o in outs]
    if rule not in ("promote", "as_is"):
      return [(o, _Fact()) for o in outs]
    in_facts = [f for v, (_, f) in zip(values, ins) if is_float(jnp.result_type(v))]
    # An explicit cast between floating dtypes computes its output.
    flexible = all(f.flexible for f in in_facts) and not (
        in_facts and eqn.primitive.name == "convert_element_type")
    magnitude = max((f.magnitude for _, f in ins if f.magnitude is not None), default=None)
    widened = any(f.widened for _, f in ins)
    moved = None
    if (flexible and len(in_facts) == 1 and len(outs) == 1
        and KIND.get(eqn.primitive.name) == "move"):
      index = next(i for i, v in enumerate(values) if is_float(jnp.result_type(v)))
      moved = (eqn, params, tuple(values), index, ins[index][1])
    return [(o, _Fact(flexible, magnitude, widened and np.dtype(d).itemsize >= 4, moved)
             if is_float(d) else _Fact(flexible))
            for o, d in ((o, jnp.result_type(o)) for o in outs)]

  @staticmethod
  def _targets(rule, eqn, ins, policy, floor) -> list[Any]:
    dtypes = [jnp.result_type(v) for v, _ in ins]
    floating = [is_float(d) and rule != "as_is" for d in dtypes]
    if rule in ("as_is", "original"):  # as they come, or as traced
      return [a.aval.dtype if fl and a.aval.dtype != d else None
              for a, d, fl in zip(eqn.invars, dtypes, floating)]
    if rule == "compute":  # float8 inputs, quantized on purpose, stay but when pinned
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


# Programs inside programs, each rebuilt with the public API that made it.
def _cast_all(ev, pairs, dtypes):
  return [ev.cast(v, d, f) if is_float(d) else v
          for (v, f), d in itertools.zip_longest(pairs, dtypes)]


def _body(ev, program, consts, facts, stack, record, dtypes=(), split=None):
  """A function of new values (arrays or lists of them) for the inputs of
  ``program`` after ``consts``, with ``facts``, that evaluates it in its own
  trace, records its outputs' flexibility in ``record``, casts them to
  ``dtypes``, and returns them (cut in two at ``split``)."""
  def body(*args):
    inner = ev.child()
    outs = inner.run(program, [], [
        *consts, *zip(jax.tree_util.tree_leaves(args), facts)], stack)
    record[:] = [f.flexible for _, f in outs]
    outs = _cast_all(inner, outs, dtypes)
    return outs if split is None else (outs[:split], outs[split:])
  return body


def _constrain(pairs, shardings):
  return [(v, f) if s is None or type(s).__name__ == "UnspecifiedValue" else
          (lax.with_sharding_constraint(v, s), f._replace(moved=None))
          for (v, f), s in zip(pairs, shardings or [None] * len(pairs))]


def _inline(ev, eqn, ins, stack):
  """``jit`` and ``closed_call``: evaluated in place, shardings kept."""
  p = eqn.params
  outs = ev.run(p.get("jaxpr", p.get("call_jaxpr")), [],
                _constrain(ins, p.get("in_shardings")), stack)
  return _constrain(outs, p.get("out_shardings"))


def _checkpoint(ev, eqn, ins, stack):
  """``jax.checkpoint``: the body is evaluated under a new checkpoint."""
  flags = []
  outs = jax.checkpoint(
      _body(ev, eqn.params["jaxpr"], [], _facts(ins), stack, flags),
      prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])(*_values(ins))
  return list(zip(outs, map(_Fact, flags)))


def _loop(ev, eqn, ins, stack):
  """``scan`` and ``while_loop``: the body follows the table, and each carry
  keeps one dtype and flexibility. A carry starts as its initial value; a
  flexible one takes the dtype the body computes for it, a computed one the
  widest of what it starts as and what the body makes of it."""
  p, scan = eqn.params, eqn.primitive.name == "scan"
  n = p["num_consts"] if scan else p["cond_nconsts"] + p["body_nconsts"]
  k = p["num_carry"] if scan else len(ins) - n
  consts, init, xs = ins[0 if scan else p["cond_nconsts"]:n], ins[n:n + k], ins[n + k:]

  def body(flags, dtypes, record):  # (carry, slices) -> (carry, other outputs)
    return _body(ev, p["jaxpr"] if scan else p["body_jaxpr"], consts,
                 [*map(_Fact, flags), *_facts(xs)], stack, record, dtypes, k)

  dtypes, flags = [jnp.result_type(v) for v, _ in init], [f.flexible for _, f in init]
  slices = [jax.ShapeDtypeStruct(jnp.shape(x)[1:], jnp.result_type(x)) for x, _ in xs]
  for _ in range(_CARRY_ROUNDS):
    record = []
    shapes = jax.eval_shape(body(flags, (), record), [
        jax.ShapeDtypeStruct(jnp.shape(v), d) for (v, _), d in zip(init, dtypes)], slices)[0]
    new = [(d, f) if not is_float(d) else
           (np.dtype(s.dtype), False) if f and not out_flag else
           (_widest([d, s.dtype]), f and out_flag)
           for d, f, s, out_flag in zip(dtypes, flags, shapes, record)]
    if new == list(zip(dtypes, flags)):
      break
    dtypes, flags = map(list, zip(*new))
  init, facts = _cast_all(ev, init, dtypes), list(map(_Fact, flags))
  if scan:
    carry, ys = lax.scan(body(flags, dtypes, []), init, _values(xs), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*zip(carry, facts), *((y, _Fact()) for y in ys)]
  cond = _body(ev, p["cond_jaxpr"], ins[:p["cond_nconsts"]], facts, stack, [])
  carry = lax.while_loop(lambda c: cond(*c)[0], lambda c: body(flags, dtypes, [])(c)[0], init)
  return list(zip(carry, facts))


def _cond(ev, eqn, ins, stack):
  """``cond``: each branch follows the table; they agree on the widest outputs."""
  branches, records = eqn.params["branches"], [[] for _ in eqn.params["branches"]]
  operands, facts = _values(ins[1:]), _facts(ins[1:])
  shapes = [jax.eval_shape(_body(ev, b, [], facts, stack, r), *operands)
            for b, r in zip(branches, records)]
  dtypes = [_widest([s[i].dtype for s in shapes]) if is_float(shape.dtype)
            else shape.dtype for i, shape in enumerate(shapes[0])]
  outs = lax.switch(ins[0][0], [_body(ev, b, [], facts, stack, [], dtypes)
                                for b in branches], *operands)
  return [(o, _Fact(all(r[i] for r in records))) for i, o in enumerate(outs)]


def _custom_jvp(ev, eqn, ins, stack):
  """A ``custom_jvp`` function: its primal and its JVP rule both follow the table."""
  p = eqn.params
  primals, facts = _values(ins[p["num_consts"]:]), _facts(ins[p["num_consts"]:])
  primal = _body(ev, p["call_jaxpr"], ins[:p["num_consts"]], facts, stack, [])
  out_dtypes, fun = [s.dtype for s in jax.eval_shape(primal, *primals)], jax.custom_jvp(primal)

  @fun.defjvp
  def _(primals_in, tangents_in):
    jvp_jaxpr, consts, zeros = jaxprs.custom_jvp_rule(p, len(primals_in))
    inner = ev.child()
    outs = inner.run(jvp_jaxpr, consts, [
        *zip(primals_in, facts), *((t, _Fact()) for t in tangents_in)], stack)
    primals_out = _cast_all(inner, outs[:len(zeros)], out_dtypes)
    nonzero, tangents = iter(outs[len(zeros):]), []
    for primal, zero in zip(primals_out, zeros):
      tangent, fact = (None, None) if zero else next(nonzero)
      tangents.append(
          np.zeros(primal.shape, jax.dtypes.float0)
          if not jnp.issubdtype(primal.dtype, jnp.inexact) else
          jnp.zeros_like(primal) if zero else inner.cast(tangent, primal.dtype, fact))
    return primals_out, tangents

  return [(o, _Fact()) for o in fun(*primals)]


def _custom_vjp(ev, eqn, ins, stack):
  """A ``custom_vjp`` function runs as written: inputs in their traced dtypes."""
  return ev.apply("original", eqn, ins, *ev.scopes(jaxprs.name_parts(stack)[0]))


_PROGRAMS = {
    "jit": _inline, "pjit": _inline, "closed_call": _inline, "core_call": _inline,
    "checkpoint": _checkpoint, "remat2": _checkpoint, "scan": _loop, "while": _loop,
    "cond": _cond, "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp,
}


def autocast(fn: Callable[..., Any] | None = None, policy: Any = None, *,
             rules: Mapping[Any, str] | None = None,
             scope_policies: Mapping[str, Any] | None = None) -> Callable[..., Any]:
  """Returns ``fn`` running in mixed precision, operation by operation.

  The returned function traces ``fn`` once per abstract signature and casts
  each operation's floating inputs by the rule of its primitive
  (:func:`jaxmp.autocast_rules`): matmuls in the compute dtype, ``exp``,
  ``log``, softmax and sums in float32, the rest in the widest dtype of its
  inputs, where the function's inputs and constants follow what they meet.
  The autocast guide (``docs/autocast.md``) gives the details.

  Args:
    fn: the function, e.g. ``loss_fn(params, batch)``; non-array arguments
      are static. Left out, ``autocast`` returns a decorator.
    policy: a :class:`jaxmp.Policy` or a spec of :func:`jaxmp.get_policy`;
      floating outputs are cast to its ``output_dtype``.
    rules: overrides of the rule table, ``{primitive name: rule}``.
    scope_policies: ``{pattern: policy}``: operations under the innermost
      ``jax.named_scope`` (or Linen module) whose name or path the regular
      expression matches run in at least its compute dtype.

  Raises:
    TypeError: for a ``fn``, policy, ``rules`` or ``scope_policies`` of the
      wrong kind.
    ValueError: for an unknown policy, primitive or rule, or a bad pattern.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> w = jnp.ones((4, 4))  # float32, captured by the closure
    >>> fast = jaxmp.autocast(lambda x: jax.nn.log_softmax(x @ w).sum(), "mixed_bfloat16")
    >>> jaxmp.precision_report(fast, jnp.ones((2, 4))).flops_by_dtype()
    {('bfloat16', 'bfloat16'): 64}
    >>> fast(jnp.ones((2, 4))).dtype
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
  resolved, scopes = _policies(policy, scope_policies)
  table = autocast_rules(rules)

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
    outs = ev.run(closed, [], [(x, _Fact(flexible=True)) for x in jax.tree_util.tree_leaves(
        (args, kwargs)) if is_array(x)], jaxprs.current_name_stack())
    outs = [ev.cast(x, policy.output_dtype if i < n_outputs else aval.dtype, f)
            if is_float(jnp.result_type(x)) else x
            for i, ((x, f), aval) in enumerate(zip(outs, closed.out_avals))]
    return jax.tree_util.tree_unflatten(out_tree, outs)

  return autocast_fn
