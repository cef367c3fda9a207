"""The canary: every JAX internal that jaxmp touches (jaxmp/_src/jaxpr.py),
against the installed JAX.

autocast, the precision audit and the in-place select are rules over its one
evaluator (jaxpr.evaluate), and read
jaxprs through these helpers only. If this fails after a JAX upgrade, the
helper it names needs updating (meanwhile, JAXMP_INPLACE_SELECT=0 turns the
in-place select off).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxmp._src import inplace_select
from jaxmp._src import jaxpr as jaxprs


def test_the_jax_internals_jaxmp_relies_on_still_work():
  @jax.custom_vjp
  def clipped(x):
    return jnp.clip(x, -1.0, 1.0)

  clipped.defvjp(lambda x: (clipped(x), None), lambda _, g: (g,))

  def fn(x, y):
    # A literal, a nested jit, custom_jvp (relu), custom_vjp and primitives
    # with several results (sort of two operands, top_k).
    with jax.named_scope("outer"):
      z = jax.jit(lambda a: a * 2.0 + 1.0)(x)
    keys, values = jax.lax.sort((y, z), num_keys=1)
    _, index = jax.lax.top_k(values, 1)
    return jax.nn.relu(values - 0.5) + clipped(keys), jnp.sum(z), index

  x, y = jnp.linspace(-2.0, 2.0, 5), jnp.array([3.0, 1.0, 2.0, 5.0, 4.0])
  closed = jax.make_jaxpr(fn)(x, y)
  jaxpr = closed.jaxpr
  assert jaxprs.is_closed(closed) and not jaxprs.is_closed(jaxpr)
  atoms = [a for eqn in jaxpr.eqns for a in eqn.invars]
  assert any(jaxprs.is_var(a) for a in atoms)
  literals = [a for a in atoms if jaxprs.is_literal(a)]
  assert literals and all(np.ndim(a.val) == 0 for a in literals)
  assert not any(jaxprs.is_dropped(v) for v in jaxpr.invars)
  jit_eqn = next(e for e in jaxpr.eqns if e.primitive.name == "jit")
  assert len(jaxprs.inner_jaxprs(jit_eqn.params)) == 1
  assert {"jit", "sort", "custom_jvp_call", "custom_vjp_call"} <= {
      eqn.primitive.name for eqn in jaxpr.eqns}
  assert {"dot_general", "exp", "reduce_sum"} <= jaxprs.primitive_names()
  assert jaxprs.is_primitive(jit_eqn.primitive)
  relu = next(e for e in jaxpr.eqns if e.primitive.name == "custom_jvp_call")
  rule_jaxpr, _, zeros = jaxprs.custom_jvp_rule(relu.params, 1)
  assert len(rule_jaxpr.invars) == 2 and list(zeros) == [False]  # primal, tangent

  # The evaluator, with its default rule (bind the primitive in the
  # equation's context), outside and inside jit.
  def evaluate(x, y):
    return jaxprs.evaluate(jaxpr, closed.consts, [x, y])

  expected = fn(x, y)
  for run in (evaluate, jax.jit(evaluate)):
    chex.assert_trees_all_equal(tuple(run(x, y)), expected)

  # A rule of one's own, recursing into inner programs with the name stack:
  # what it sees of each equation (its scopes, transforms, source line), and
  # literals read through `literal`.
  seen_eqns = []

  def rule(eqn, invals, stack):
    scopes, transforms = jaxprs.name_parts(stack)
    seen_eqns.append((eqn.primitive.name, scopes, transforms, jaxprs.source_line(eqn)))
    for sub in jaxprs.inner_jaxprs(eqn.params):
      jaxprs.evaluate(sub, [None] * len(sub.constvars), [None] * len(sub.invars),
                      rule, literal=lambda value: None, name_stack=stack)
    return [None] * len(eqn.outvars)

  outs = jaxprs.evaluate(jaxpr, [None] * len(jaxpr.constvars), [None, None], rule,
                         literal=lambda value: None)
  assert outs == [None] * len(jaxpr.outvars)
  inner = [(n, s) for n, s, _, _ in seen_eqns if n == "mul"]
  assert ("mul", ("outer",)) in inner  # a * 2.0 inside the nested jit
  line = fn.__code__.co_firstlineno + 5  # the sort's
  assert [l for n, _, _, l in seen_eqns if n == "sort"] == [
      f"test_jaxpr.py:{line}:19 ({fn.__qualname__})"]
  grad_eqns = []
  jaxprs.evaluate(
      jax.make_jaxpr(jax.grad(lambda a: jnp.sum(a * a)))(x).jaxpr, [], [x],
      lambda eqn, invals, stack: grad_eqns.append(jaxprs.name_parts(stack)[1])
      or jaxprs.bind_rule(eqn, invals, stack))
  assert ("transpose", "jvp") in grad_eqns

  # Varying manual axes: inside shard_map, per-device values vary, replicated
  # ones do not; outside, nothing does.
  assert not jaxprs.manual_axes(jax.typeof(x))
  mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  seen = {}

  def body(sharded, replicated):
    seen["sharded"] = jaxprs.manual_axes(jax.typeof(sharded))
    seen["replicated"] = jaxprs.manual_axes(jax.typeof(replicated))
    # A jaxpr traced inside shard_map keeps those types, so a re-evaluation
    # binds its equations (pvary included) with the types they were traced with.
    closed = jax.make_jaxpr(lambda a, b: a * b)(sharded, replicated)
    seen["kept"] = inplace_select._keeps_manual_axes(closed.jaxpr, [sharded, replicated])
    seen["pvary"] = "pvary" in {eqn.primitive.name for eqn in closed.jaxpr.eqns}
    return sharded

  jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()),
                        out_specs=P("d")))(jnp.ones(4), jnp.ones(()))
  assert seen["sharded"] == {"d"} and seen["replicated"] == frozenset()
  assert seen["kept"] and seen["pvary"]
