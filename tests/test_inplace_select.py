"""The in-place select of loss_scaling (the same values as the plain update), and
the choice of forms by backend or switch: the select's (``JAXMP_INPLACE_SELECT``)
and the finiteness check's (``JAXMP_GROUPED_CHECK``)."""

import argparse
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxmp
from jaxmp._src.inplace_select import update_or_keep
from models import DEFAULT_CODEGEN, benchmark, bits


def _with_odd_state():
  """A transformation whose state has a passthrough, a constant and a duplicate."""

  def update(updates, state, params=None):
    del params
    a = state["a"] + sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))
    new = {"kept": state["kept"], "const": jnp.zeros([], jnp.int32), "a": a, "b": a}
    return jax.tree_util.tree_map(lambda u: u * a, updates), new

  return optax.GradientTransformation(lambda params: {
      "kept": jnp.arange(3.0), "const": jnp.zeros([], jnp.int32), "a": jnp.ones([]),
      "b": jnp.ones([])}, update)


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "chain_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
    "trace": lambda: optax.sgd(1e-2, momentum=0.9), "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2), "lamb": lambda: optax.lamb(1e-2),
    # Control flow inside the inner update: lax.cond and a schedule of k.
    "multisteps_inside": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "apply_if_finite_inside": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "odd_state": _with_odd_state,
}

# What this file asserts of the in-place select (no copies, the same bits as
# the plain select's program) is asserted of XLA's default code generator.
default_jit = functools.partial(jax.jit, compiler_options=DEFAULT_CODEGEN)
# Leaves of one shape: each eager primitive is compiled once, not once a shape.
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([[0.5, -0.0, 0.0]] * 2)}
GRADS = {"w": jnp.full((2, 3), 0.25), "b": jnp.array([[-1.0, 2.0, 0.5]] * 2)}
# Each optimizer built once, its update jitted once: the selects' rows share that program.
_optimizer = functools.cache(lambda name: (tx := OPTIMIZERS[name](), default_jit(tx.update)))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("select", ["in place", "plain", "eager"])
def test_finite_and_skipped_steps(name, select, monkeypatch):
  """Either select, jitted or not, steps bit for bit as the plain update."""
  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "0" if select == "plain" else "1")
  tx, update = _optimizer(name)  # the fold traced afresh: the switch is read when it traces
  fold = functools.partial(update_or_keep, tx.update)
  update, fold = (tx.update, fold) if select == "eager" else (update, default_jit(fold))
  _, state = update(GRADS, tx.init(PARAMS), PARAMS)  # non-trivial moments, counters
  assert bits(fold(jnp.array(True), GRADS, state, PARAMS)) == bits(update(GRADS, state, PARAMS))
  bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf), GRADS)
  assert bits(fold(jnp.array(False), bad, state, PARAMS)[1]) == bits(state)


@pytest.mark.parametrize("new_state, error", [
    (lambda a: {"a": a, "b": a}, "differ in tree structure"),
    # jnp.where would broadcast the old leaf to the new shape without a word.
    (lambda a: {"a": jnp.zeros(3) + a}, r"differ in shape at \['a'\]: \(3,\) against \(\)")],
    ids=["structure", "shape"])
def test_a_new_state_unlike_the_old_is_an_error(new_state, error):
  update = lambda updates, state, params=None: (updates, new_state(state["a"]))
  for run in (lambda f: f, jax.jit):  # the plain select and the in-place one
    with pytest.raises(ValueError, match=error):
      run(functools.partial(update_or_keep, update))(
          jnp.array(True), {"w": jnp.ones(2)}, {"a": jnp.zeros([])}, None)


SWITCH_OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9, nesterov=True),
    "chain_clipping": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10))),
}


def test_the_switch_selects_the_select(monkeypatch):
  tx = optax.adam(1e-3)
  params, grads = {"w": jnp.ones((16, 16))}, {"w": jnp.full((16, 16), 0.5)}

  def temp_bytes():
    def step(params, state, grads):
      finite = jnp.all(jnp.isfinite(grads["w"]))
      updates, state = update_or_keep(tx.update, finite, grads, state, params)
      return optax.apply_updates(params, updates), state

    return default_jit(step, donate_argnums=(0, 1)).lower(
        params, tx.init(params), grads).compile().memory_analysis().temp_size_in_bytes

  monkeypatch.setenv("JAXMP_INPLACE_SELECT", "1")
  inplace = temp_bytes()
  assert inplace < 16 * 16 * 4  # each moment written once: no temporary as large
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


def test_the_switch_and_the_backend_choose_the_check(monkeypatch):
  leaves = [np.ones((40, 50), np.float32), np.ones((40, 50), np.float32), np.ones(500, np.float32)]
  (w := leaves[0].copy())[3, 4], (v := leaves[2].copy())[7] = np.inf, np.nan  # set up in NumPy
  decisions = list(zip(jax.device_put([  # (tree, finite): every form must decide alike
      leaves, {}, {"w": w, "n": np.arange(3, dtype=np.int32)},
      {"w": v, "z": np.zeros((0, 2), np.float32)},
      {"c": np.array([1.0 + 2.0j, 1j * np.inf], np.complex64)}]), [True] * 2 + [False] * 3))
  traced = []  # each check traced afresh, its function kept alive

  def form():
    """Which form all_finite takes now, after checking its decisions (jitted,
    all in one program). On XLA:CPU the grouped reduces read each leaf once;
    one reduce per leaf also writes each leaf's isfinite mask and reads it back."""
    traced.append(lambda trees: [jaxmp.all_finite(t) for t in trees])
    for (tree, finite), flag in zip(decisions, default_jit(traced[-1])([t for t, _ in decisions])):
      assert bool(jaxmp.all_finite(tree)) is bool(flag) is finite
    traced.append(lambda t: jaxmp.all_finite(t))
    cost = default_jit(traced[-1]).lower(leaves).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return "grouped" if cost["bytes accessed"] <= sum(x.nbytes for x in leaves) + 64 else (
        "per leaf")

  assert form() == "grouped"  # the default on a CPU
  with monkeypatch.context() as m:  # jmp's form on a GPU
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert form() == "per leaf"
    m.setenv("JAXMP_GROUPED_CHECK", "1")  # the variable wins over the backend
    assert form() == "grouped"
  monkeypatch.setenv("JAXMP_GROUPED_CHECK", "0")
  assert form() == "per leaf"


def _zero_style_step(name, mesh, guarded=True):
  """A step where every device holds a shard of the params, the gradients and
  the optimizer state (ZeRO-style); guarded, the devices agree on skipping."""
  tx = SWITCH_OPTIMIZERS[name]()
  tx = jaxmp.loss_scaling(tx, jaxmp.DynamicLossScale(2.0**4), axis_name="d") if guarded else tx
  params = {"w": np.linspace(-1.0, 1.0, 64 * 32, dtype=np.float32).reshape(64, 32),
            "b": np.linspace(0.5, -0.5, 64, dtype=np.float32)}
  # On the mesh already: the calls run the program measured here, not another.
  params, state = jax.tree_util.tree_map(lambda x: jax.device_put(np.asarray(x), (
      jax.sharding.NamedSharding(mesh, P("d") if jnp.ndim(x) else P()))), (params, tx.init(params)))
  sharded = lambda tree: jax.tree_util.tree_map(lambda x: x.sharding.spec, tree)

  def body(params, state, poison):
    # An elementwise loss: each device's shard of the gradients is its own.
    scale = jaxmp.get_loss_scale(state).scale if guarded else lambda loss: loss
    grads = jax.grad(lambda p: scale(sum(
        jnp.sum(jnp.tanh(x) ** 2) for x in jax.tree_util.tree_leaves(p))))(params)
    updates, state = tx.update(jax.tree_util.tree_map(lambda g: g + poison, grads), state, params)
    return optax.apply_updates(params, updates), state

  step = default_jit(jax.shard_map(body, mesh=mesh, in_specs=(sharded(params), sharded(state), P()),
      out_specs=(sharded(params), sharded(state))), donate_argnums=(0, 1))
  return step, params, state, step.lower(params, state, jnp.float32(0)).compile(
      ).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", sorted(SWITCH_OPTIMIZERS))
def test_inside_shard_map_a_sharded_state_is_selected_in_place(name, monkeypatch):
  mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2],
                       axis_types=(jax.sharding.AxisType.Auto,))
  unguarded = _zero_style_step(name, mesh, guarded=False)[3]
  shard_bytes = 32 * 32 * 4  # a device's shard of w, or of one of its moments
  runs = {}
  for switch in ("1", "0"):
    monkeypatch.setenv("JAXMP_INPLACE_SELECT", switch)
    step, params, state, temp_bytes = _zero_style_step(name, mesh)
    # The guard's temporaries beyond the unguarded step's: in place, only the loss scale's scalars,
    # never a copy of a sharded state leaf; the plain select copies the moments.
    assert (temp_bytes - unguarded < shard_bytes) == (switch == "1"), temp_bytes - unguarded
    outs = []
    for poison in (0.0, jnp.nan, 0.0):  # finite, skipped, finite
      params, state = step(params, state, jnp.float32(poison))
      outs.append(jax.tree_util.tree_map(np.asarray, (params, state)))
    assert [bool(state.last_finite), int(state.skipped_steps)] == [True, 1]
    # The skipped step kept the params and the inner state bit-identical.
    assert bits((outs[1][0], outs[1][1].inner_state)) == bits(
        (outs[0][0], outs[0][1].inner_state))
    runs[switch] = outs
  if name == "chain_clipping":
    # XLA sums the clipping's local norm in another order in the two
    # programs: the params differ in their last bit.
    chex.assert_trees_all_close(runs["1"], runs["0"], rtol=1e-6, atol=1e-7)
  else:
    assert bits(runs["1"]) == bits(runs["0"])


@pytest.mark.integration  # compiles three transformer steps on 8 devices
@pytest.mark.standard_promotion(
    reason="the benchmark transformer's attention mixes float32 and bfloat16")
def test_a_zero_style_transformer_keeps_its_sharded_moments_in_place():
  # benchmarks/scaling.py's ZeRO-style setting on a small transformer: params,
  # gradients and moments sharded over 8 devices inside shard_map.
  scaling = benchmark("scaling")
  args = argparse.Namespace(d_model=32, layers=1, heads=2, seq_len=8, batch_size=8)
  loss_fn, params = scaling.overhead.bf16_loss_fn(args)
  figures = {variant.name: scaling.overhead.compiler_figures(
      scaling.overhead.jit_step(variant.step).lower(
          variant.init(params), jnp.zeros((8, 9), jnp.int32)).compile())
             for variant in scaling.zero_variants(loss_fn)}
  base, ours, plain = (figures[n] for n in ("unguarded", "jaxmp", "jaxmp plain select"))
  assert ours["bytes_accessed"] <= 1.015 * base["bytes_accessed"]
  # A device's shard of the largest moment: the in-place select holds no copy
  # of it in temp memory beyond the unguarded step's; the plain select does.
  largest_shard = max(x.nbytes for x in jax.tree_util.tree_leaves(params)) // 8
  assert ours["temp_bytes"] - base["temp_bytes"] < largest_shard
  assert plain["temp_bytes"] - base["temp_bytes"] >= largest_shard
