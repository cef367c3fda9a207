"""Tests of the in-place select of loss_scaling: same values as the plain update.

Also the one compatibility test of the JAX internals it relies on, and the
choice of forms by backend (``cpu_form``): the plain select
(``JAXMP_INPLACE_SELECT=0``) and the finiteness check's
(``JAXMP_GROUPED_CHECK``).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src import inplace_select
from jaxmp._src.inplace_select import update_or_keep
from models import DEFAULT_CODEGEN, benchmark


def _with_odd_state():
  """A transformation whose state has a passthrough, a constant and a duplicate."""

  def init(params):
    del params
    return {"kept": jnp.arange(3.0), "const": jnp.zeros([], jnp.int32),
            "a": jnp.ones([]), "b": jnp.ones([])}

  def update(updates, state, params=None):
    del params
    total = sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))
    new = {"kept": state["kept"], "const": jnp.zeros([], jnp.int32),
           "a": state["a"] + total, "b": state["a"] + total}
    scaled = jax.tree_util.tree_map(lambda u: u * new["a"], updates)
    return scaled, new

  return optax.GradientTransformation(init, update)


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "chain_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-2),
    "trace": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    # Control flow inside the inner update: lax.cond and a schedule of k.
    "multisteps_inside": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "apply_if_finite_inside": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "odd_state": _with_odd_state,
}


# What this file asserts of the in-place select (no copies, the same bits as
# the plain select's program) is asserted of XLA's default code generator.
default_jit = functools.partial(jax.jit, compiler_options=DEFAULT_CODEGEN)


def _inputs():
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.0])}
  grads = {"w": jnp.full((2, 3), 0.25), "b": jnp.array([-1.0, 2.0])}
  return params, grads


def _bits(tree):
  """The leaves as raw bytes: equal only if bit-identical (signed zeros, nans)."""
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("jit", [True, False])
def test_finite_and_skipped_steps(name, jit):
  tx = OPTIMIZERS[name]()
  params, grads = _inputs()
  state = tx.init(params)
  # A first step so that moments and counters are non-trivial.
  _, state = tx.update(grads, state, params)

  def fold(finite, grads, state, params):
    return update_or_keep(tx.update, finite, grads, state, params)

  plain = tx.update
  if jit:
    fold, plain = default_jit(fold), default_jit(plain)
  expected_updates, expected_state = plain(grads, state, params)
  updates, new_state = fold(jnp.array(True), grads, state, params)
  chex.assert_trees_all_equal(updates, expected_updates)
  chex.assert_trees_all_equal(new_state, expected_state)

  bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf), grads)
  _, kept = fold(jnp.array(False), bad, state, params)
  chex.assert_trees_all_equal(kept, state)


@pytest.mark.parametrize("new_state, error", [
    (lambda a: {"a": a, "b": a}, "differ in tree structure"),
    # jnp.where would broadcast the old leaf to the new shape without a word.
    (lambda a: {"a": jnp.zeros(3) + a}, r"differ in shape at \['a'\]: \(3,\) against \(\)")],
    ids=["structure", "shape"])
def test_a_new_state_unlike_the_old_is_an_error(new_state, error):
  def update(updates, state, params=None):
    del params
    return updates, new_state(state["a"])

  for run in (lambda f: f, jax.jit):  # the plain select and the in-place one
    with pytest.raises(ValueError, match=error):
      run(functools.partial(update_or_keep, update))(
          jnp.array(True), {"w": jnp.ones(2)}, {"a": jnp.zeros([])}, None)


# The switch back to the plain select.

SWITCH_OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "chain_clipping": lambda: optax.chain(
        optax.clip_by_global_norm(0.5),
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10))),
}


def _guarded_run(name):
  """A fresh jitted step of the wrapped optimizer: a finite, then a skipped step."""
  tx = jaxmp.loss_scaling(SWITCH_OPTIMIZERS[name](), jaxmp.DynamicLossScale(2.0**4))

  @default_jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return updates, optax.apply_updates(params, updates), state

  params, grads = _inputs()
  state = tx.init(params)
  outs = []
  for g in (grads, jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.nan), grads)):
    updates, params, state = step(params, state, g)
    outs.append((updates, params, state))
  return outs


@pytest.mark.parametrize("name", sorted(SWITCH_OPTIMIZERS))
def test_both_selects_give_bit_identical_steps(name, monkeypatch):
  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "1")
  inplace = _guarded_run(name)
  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "0")
  plain = _guarded_run(name)
  (_, _, finite_state), (skipped_updates, _, skipped_state) = inplace
  assert bool(finite_state.last_finite) and not bool(skipped_state.last_finite)
  assert _bits(skipped_updates) == _bits(jax.tree_util.tree_map(
      lambda u: jnp.full_like(u, -0.0), skipped_updates))
  for (u1, p1, s1), (u2, p2, s2) in zip(inplace, plain):
    assert _bits(u1) == _bits(u2)
    assert _bits(p1) == _bits(p2)
    assert _bits(s1) == _bits(s2)


def test_the_switch_selects_the_select(monkeypatch):
  tx = optax.adam(1e-3)
  params, grads = {"w": jnp.ones((16, 16))}, {"w": jnp.full((16, 16), 0.5)}

  def temp_bytes():
    def step(params, state, grads):
      finite = jnp.all(jnp.isfinite(grads["w"]))
      updates, state = update_or_keep(tx.update, finite, grads, state, params)
      return optax.apply_updates(params, updates), state

    compiled = default_jit(step, donate_argnums=(0, 1)).lower(
        params, tx.init(params), grads).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "1")
  inplace = temp_bytes()
  # In place, each moment is written once: no temporary as large as one.
  assert inplace < 16 * 16 * 4
  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "0")
  plain = temp_bytes()
  # XLA:CPU copies mu and nu (16 x 16 float32 each) for the plain select.
  assert plain - inplace >= 2 * 16 * 16 * 4
  with monkeypatch.context() as m:  # the variable wins over the backend
    m.setattr(jax, "default_backend", lambda: "cpu")
    assert temp_bytes() == plain
  monkeypatch.delenv("JAXMP_INPLACE_SELECT")
  assert temp_bytes() == inplace  # the default on a CPU: in place
  with monkeypatch.context() as m:  # elsewhere the plain select, which XLA:GPU fuses
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert temp_bytes() == plain
  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "yes")
  with pytest.raises(ValueError, match=r"must be 1 .* or 0 .*, got 'yes'"):
    temp_bytes()


def test_the_switch_and_the_backend_choose_the_check(monkeypatch):
  leaves = [jnp.ones((40, 50)), jnp.ones((40, 50)), jnp.ones(500)]
  decisions = [  # (tree, finite): every form must decide alike
      (leaves, True), ({}, True),
      ({"w": leaves[0].at[3, 4].set(jnp.inf), "n": jnp.arange(3)}, False),
      ({"w": leaves[2].at[7].set(jnp.nan), "z": jnp.zeros((0, 2))}, False),
      ({"c": jnp.array([1.0 + 2.0j, 1j * jnp.inf], jnp.complex64)}, False)]
  traced = []  # each check traced afresh, its function kept alive

  def form():
    """Which form all_finite takes now, after checking its decisions. On
    XLA:CPU the grouped reduces read each leaf once; one reduce per leaf also
    writes each leaf's isfinite mask and reads it back."""
    for tree, finite in decisions:
      assert bool(jaxmp.all_finite(tree)) is finite
      traced.append(lambda t: jaxmp.all_finite(t))
      assert bool(default_jit(traced[-1])(tree)) is finite
    traced.append(lambda t: jaxmp.all_finite(t))
    cost = default_jit(traced[-1]).lower(leaves).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    read = sum(x.nbytes for x in leaves)
    return "grouped" if cost["bytes accessed"] <= read + 64 else "per leaf"

  assert form() == "grouped"  # the default on a CPU
  with monkeypatch.context() as m:  # jmp's form on a GPU
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert form() == "per leaf"
    m.setenv("JAXMP_GROUPED_CHECK", "1")  # the variable wins over the backend
    assert form() == "grouped"
  monkeypatch.setenv("JAXMP_GROUPED_CHECK", "0")
  assert form() == "per leaf"
  monkeypatch.setenv("JAXMP_GROUPED_CHECK", "yes")
  with pytest.raises(ValueError, match=r"JAXMP_GROUPED_CHECK must be 1 .* or 0 .*, got 'yes'"):
    form()


# Inside shard_map, with an optimizer state sharded over the manual axis.


def _zero_style_step(name, mesh, guarded=True):
  """A step where every device holds a shard of the params, the gradients and
  the optimizer state (ZeRO-style); guarded, the devices agree on skipping."""
  tx = SWITCH_OPTIMIZERS[name]()
  if guarded:
    tx = jaxmp.loss_scaling(tx, jaxmp.DynamicLossScale(2.0**4), axis_name="d")
  params = {"w": jnp.linspace(-1.0, 1.0, 64 * 32).reshape(64, 32),
            "b": jnp.linspace(0.5, -0.5, 64)}
  state = tx.init(params)
  sharded = lambda tree: jax.tree_util.tree_map(
      lambda x: P("d") if jnp.ndim(x) else P(), tree)

  def body(params, state, poison):
    # An elementwise loss: each device's shard of the gradients is its own.
    scale = jaxmp.get_loss_scale(state).scale if guarded else lambda loss: loss
    grads = jax.grad(lambda p: scale(sum(
        jnp.sum(jnp.tanh(x) ** 2) for x in jax.tree_util.tree_leaves(p))))(params)
    grads = jax.tree_util.tree_map(lambda g: g + poison, grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  step = default_jit(jax.shard_map(
      body, mesh=mesh, in_specs=(sharded(params), sharded(state), P()),
      out_specs=(sharded(params), sharded(state))), donate_argnums=(0, 1))
  return step, params, state


def _temp_bytes(step, params, state):
  return step.lower(params, state, jnp.float32(0)).compile(
      ).memory_analysis().temp_size_in_bytes


# A device's shard of w, or of one of its moments: 32 x 32 float32.
SHARD_BYTES = 32 * 32 * 4


@pytest.mark.parametrize("name", sorted(SWITCH_OPTIMIZERS))
def test_inside_shard_map_a_sharded_state_is_selected_in_place(name, monkeypatch):
  mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  unguarded = _temp_bytes(*_zero_style_step(name, mesh, guarded=False))
  runs = {}
  for switch in ("1", "0"):
    monkeypatch.setenv("JAXMP_INPLACE_SELECT", switch)
    step, params, state = _zero_style_step(name, mesh)
    # The guard's temporaries beyond the unguarded step's: in place, only the
    # loss scale's scalars, never a copy of a sharded state leaf; the plain
    # select copies the moments.
    extra = _temp_bytes(step, params, state) - unguarded
    if switch == "1":
      assert extra < SHARD_BYTES, extra
    else:
      assert extra >= SHARD_BYTES, extra
    outs = []
    for poison in (0.0, jnp.nan, 0.0):  # finite, skipped, finite
      params, state = step(params, state, jnp.float32(poison))
      outs.append(jax.tree_util.tree_map(np.asarray, (params, state)))
    assert [bool(state.last_finite), int(state.skipped_steps)] == [True, 1]
    # The skipped step kept the params and the inner state bit-identical.
    assert _bits((outs[1][0], outs[1][1].inner_state)) == _bits(
        (outs[0][0], outs[0][1].inner_state))
    runs[switch] = outs
  if name == "chain_clipping":
    # XLA sums the clipping's local norm in another order in the two
    # programs: the params differ in their last bit.
    chex.assert_trees_all_close(runs["1"], runs["0"], rtol=1e-6, atol=1e-7)
  else:
    assert _bits(runs["1"]) == _bits(runs["0"])


ZERO_BYTES_OVER_UNGUARDED = 1.015


@pytest.mark.integration  # compiles three transformer steps on 8 devices
@pytest.mark.standard_promotion(
    reason="the benchmark transformer's attention mixes float32 and bfloat16")
def test_a_zero_style_transformer_keeps_its_sharded_moments_in_place():
  # The benchmark's ZeRO-style setting (benchmarks/scaling.py, zero) on a
  # small transformer: params, gradients and Adam's moments sharded over 8
  # devices inside shard_map, the params gathered for the forward pass.
  import argparse  # pylint: disable=import-outside-toplevel

  scaling = benchmark("scaling")

  args = argparse.Namespace(d_model=32, layers=1, heads=2, seq_len=8, batch_size=8)
  loss_fn, params = scaling.overhead.bf16_loss_fn(args)
  batch = jnp.zeros((8, 9), jnp.int32)
  figures = {}
  for variant in scaling.zero_variants(loss_fn):
    compiled = scaling.overhead.jit_step(variant.step).lower(
        variant.init(params), batch).compile()
    figures[variant.name] = scaling.overhead.compiler_figures(compiled)
  base, ours, plain = (figures[name] for name in
                       ("unguarded", "jaxmp", "jaxmp plain select"))
  assert ours["bytes_accessed"] <= ZERO_BYTES_OVER_UNGUARDED * base["bytes_accessed"]
  # A device's shard of the largest moment: the in-place select holds no copy
  # of it in temp memory beyond the unguarded step's; the plain select does.
  largest_shard = max(x.nbytes for x in jax.tree_util.tree_leaves(params)) // 8
  assert ours["temp_bytes"] - base["temp_bytes"] < largest_shard
  assert plain["temp_bytes"] - base["temp_bytes"] >= largest_shard
