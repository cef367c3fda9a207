"""Tests of the optax wrapper loss_scaling, its state lookup, metrics and checks."""

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from models import init_mlp, make_batch, mse, poison


def inner_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 100)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-3))


@jax.jit
def scaled_mse_grads(params, batch, loss_scale):
  return jaxmp.scaled_value_and_grad(mse, loss_scale)(params, batch)[1]


mse_grads = jax.jit(jax.grad(mse))


def bits(tree):
  """The leaves as raw bytes: equal only if bit-identical (signed zeros too)."""
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


# -- The wrapper's update, jitted and not -------------------------------------


class LossScalingTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_finite_step_equals_bare_optimizer_on_unscaled_grads(self):
    params = init_mlp(jax.random.key(0))
    tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale(2.0**12))
    bare = inner_optimizer()
    state, bare_state = tx.init(params), bare.init(params)
    update, bare_update = self.variant(tx.update), self.variant(bare.update)
    for step in range(3):
      batch = make_batch(step)
      scaled_grads = scaled_mse_grads(params, batch, jaxmp.get_loss_scale(state))
      updates, state = update(scaled_grads, state, params)
      bare_updates, bare_state = bare_update(mse_grads(params, batch), bare_state, params)
      # Differently compiled programs may fuse reductions differently.
      chex.assert_trees_all_close(updates, bare_updates, rtol=1e-5, atol=1e-9)
      chex.assert_trees_all_close(state.inner_state, bare_state, rtol=1e-5, atol=1e-9)
      params = optax.apply_updates(params, updates)
    assert int(state.skipped_steps) == 0 and bool(state.last_finite)
    assert int(state.loss_scale.counter) == 3

  @chex.variants(with_jit=True, without_jit=True)
  def test_non_finite_step_is_skipped_bit_identically(self):
    params = init_mlp(jax.random.key(1))
    params = poison(params, -0.0, leaf_index=1)  # a signed zero must survive
    grads = mse_grads(params, make_batch(0))
    n_leaves = len(jax.tree_util.tree_leaves(grads))
    for clip in (None, 1.0):  # the flag of all_finite, or of the clipping norm
      tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale(2.0**12),
                              clip_global_norm=clip)
      _, state = tx.update(grads, tx.init(params), params)  # one good step first
      update = self.variant(tx.update)
      for bad in [jnp.inf, -jnp.inf, jnp.nan]:
        for leaf_index in range(n_leaves):
          updates, new_state = update(poison(grads, bad, leaf_index=leaf_index),
                                      state, params)
          assert bits(optax.apply_updates(params, updates)) == bits(params)
          assert bits(updates) == bits(jax.tree_util.tree_map(
              lambda u: jnp.full_like(u, -0.0), updates))
          assert bits(new_state.inner_state) == bits(state.inner_state)
          assert float(new_state.loss_scale.loss_scale) == 2.0**11
          assert int(new_state.skipped_steps) == 1
          assert not bool(new_state.last_finite)


def test_training_with_injected_overflows_equals_training_without_them():
  params0 = init_mlp(jax.random.key(2))
  tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale(2.0**10, period=3))

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch, inject):
    loss_scale = jaxmp.get_loss_scale(state)
    loss, grads = jaxmp.scaled_value_and_grad(mse, loss_scale)(params, batch)
    grads = jax.tree_util.tree_map(
        lambda g: jnp.where(inject, g.at[(0,) * g.ndim].set(jnp.inf), g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  bare = inner_optimizer()

  @jax.jit
  def bare_step(params, state, batch):
    updates, state = bare.update(jax.grad(mse)(params, batch), state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.default_rng(0)
  injected = rng.random(60) < 0.15
  injected[10:14] = True  # a burst
  params, state = params0, tx.init(params0)
  bare_params, bare_state = params0, bare.init(params0)
  scales = []
  for i, inject in enumerate(injected):
    batch = make_batch(i)
    params, state, _ = step(params, state, batch, jnp.asarray(inject))
    scales.append(float(state.loss_scale.loss_scale))
    if not inject:
      bare_params, bare_state = bare_step(bare_params, bare_state, batch)
  chex.assert_trees_all_close(params, bare_params, rtol=2e-5, atol=1e-7)
  chex.assert_trees_all_close(state.inner_state, bare_state, rtol=2e-5, atol=1e-7)
  assert int(state.skipped_steps) == int(injected.sum())
  assert min(scales) < 2.0**10  # backed off during the burst
  assert any(b > a for a, b in zip(scales, scales[1:]))  # and grew


def test_wrapper_skips_for_every_kind_of_loss_scale():
  params = {"w": jnp.ones(3)}
  for loss_scale in [jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(4.0)]:
    tx = jaxmp.loss_scaling(optax.sgd(0.1), loss_scale)
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, state, params)
    chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
    assert int(state.skipped_steps) == 1
    updates, state = tx.update({"w": jnp.full(3, 4.0)}, state, params)
    expected = 4.0 / float(loss_scale.loss_scale)
    np.testing.assert_allclose(updates["w"], -0.1 * expected)
    assert int(state.skipped_steps) == 1 and bool(state.last_finite)


def test_jitted_step_needs_no_host_transfer():
  params = init_mlp(jax.random.key(3))
  tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale())
  state = tx.init(params)
  batch = make_batch(0)

  @jax.jit
  def step(params, state, batch):
    loss, grads = jaxmp.scaled_value_and_grad(mse, jaxmp.get_loss_scale(state))(params, batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, jaxmp.loss_scaling_metrics(state)

  step(params, state, batch)  # compile outside the guard
  with jax.transfer_guard("disallow"):
    for _ in range(3):
      params, state, metrics = step(params, state, batch)
  assert int(metrics["skipped_steps"]) == 0


@pytest.mark.parametrize("wrap", [
    jaxmp.loss_scaling, lambda tx, ls: jaxmp.multi_steps(tx, ls, 4)],
    ids=["loss_scaling", "multi_steps"])
def test_equal_arguments_give_equal_transformations(wrap):
  # As Flax compares a TrainState's tx: a pytree holding the wrapper as
  # static data has one structure, however often it is built.
  tx = optax.adam(1e-3)
  a, b = wrap(tx, jaxmp.DynamicLossScale()), wrap(tx, jaxmp.DynamicLossScale())
  assert a == b and hash(a) == hash(b)
  assert a != wrap(tx, jaxmp.DynamicLossScale(2.0**10))
  assert a != wrap(tx, jaxmp.DynamicLossScale(period=7))
  assert a != wrap(optax.adam(1e-3), jaxmp.DynamicLossScale())  # another inner tx

  @jax.jit
  def traced(scale):  # a loss scale of traced values compares by identity
    ls = jaxmp.StaticLossScale(scale)
    assert wrap(tx, ls) == wrap(tx, ls) != wrap(tx, jaxmp.StaticLossScale(scale))
    return scale

  traced(jnp.float32(2.0))


def test_extra_args_are_passed_through():
  seen = {}

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, loss):
    seen["loss"] = loss
    return jax.tree_util.tree_map(lambda u: -loss * u, updates), state

  inner = optax.GradientTransformationExtraArgs(init_fn, update_fn)
  tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0))
  params = {"w": jnp.ones(2)}
  updates, _ = tx.update({"w": jnp.full(2, 8.0)}, tx.init(params), params, loss=0.5)
  assert seen["loss"] == 0.5
  chex.assert_trees_all_equal(updates, {"w": jnp.full(2, -2.0)})


def test_real_float16_overflow_backs_off_until_steps_succeed():
  """A float16 backward pass that overflows at 2**24, with no injection."""
  policy = jaxmp.get_policy("mixed_float16")
  params = init_mlp(jax.random.key(4), sizes=(4, 32, 3))
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**24, period=1000))
  state = tx.init(params)
  batch = make_batch(0, n=16)

  @jax.jit
  def step(params, state):
    loss_fn = lambda p: mse(p, batch, policy)
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(state))(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  first_loss, finite_flags, losses = None, [], []
  for _ in range(40):
    params, state, loss = step(params, state)
    first_loss = float(loss) if first_loss is None else first_loss
    finite_flags.append(bool(state.last_finite))
    losses.append(float(loss))
  assert not finite_flags[0]  # the fp16 gradients really overflowed
  assert all(finite_flags[-20:])  # ...and after backing off, steps succeed
  assert float(state.loss_scale.loss_scale) < 2.0**24
  assert int(state.skipped_steps) == finite_flags.index(True)
  assert losses[-1] < first_loss
  for leaf in jax.tree_util.tree_leaves(params):
    assert leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf)))


def test_inner_optimizer_sees_gradients_in_the_params_dtype():
  # unscale returns float16/bfloat16 leaves in float32; the wrapper casts
  # them back before the check and the inner optimizer.
  seen = {}

  def update(grads, state, params=None):
    del params
    seen.update(jax.tree_util.tree_map(lambda g: g.dtype, grads))
    return grads, state

  inner = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
  params = {"f16": jnp.ones(2, jnp.float16), "bf16": jnp.ones(2, jnp.bfloat16),
            "f32": jnp.ones(2)}
  tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**10))
  grads = jax.tree_util.tree_map(lambda p: jnp.full(2, 3 * 2.0**10, p.dtype), params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert seen == {k: p.dtype for k, p in params.items()}
  chex.assert_trees_all_equal(
      updates, jax.tree_util.tree_map(lambda p: jnp.full(2, 3.0, p.dtype), params),
      strict=True)


# -- Finding the state; where the wrapper sits --------------------------------

SCALE = jaxmp.StaticLossScale(8.0)
PARAMS = {"w": jnp.ones(3)}


def _nnx_optimizer(tx):
  from flax import nnx  # pylint: disable=import-outside-toplevel

  return nnx.Optimizer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)


def test_get_loss_scale_finds_the_scale_in_nested_states():
  wrapped = jaxmp.loss_scaling(optax.adam(1e-3), SCALE)
  states = [
      wrapped.init(PARAMS),
      optax.MultiSteps(wrapped, every_k_schedule=2).init(PARAMS),
      jaxmp.multi_steps(optax.adam(1e-3), SCALE, 2).init(PARAMS),
      optax.inject_hyperparams(
          lambda learning_rate: jaxmp.loss_scaling(optax.sgd(learning_rate), SCALE)
      )(0.1).init(PARAMS),
      _nnx_optimizer(wrapped).opt_state,  # leaves wrapped in NNX variables
      _nnx_optimizer(wrapped),
      # Containers of a user's: a tuple with the params, a dict.
      (PARAMS, wrapped.init(PARAMS)),
      {"params": PARAMS, "opt_state": wrapped.init(PARAMS)},
  ]
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # none of these is misplaced
    for state in states:
      loss_scale = jaxmp.get_loss_scale(state)
      assert type(loss_scale) is jaxmp.StaticLossScale
      assert type(loss_scale.loss_scale) is type(jnp.ones(1))  # not a Variable
      assert float(loss_scale.loss_scale) == 8.0
      assert float(jax.jit(jaxmp.get_loss_scale)(state).loss_scale) == 8.0
      metrics = jaxmp.loss_scaling_metrics(state)
      assert all(type(v) is type(jnp.ones(1)) for v in metrics.values())
      assert float(metrics["loss_scale"]) == 8.0
      jaxmp.check_loss_scale(state)
  # A dynamic scale's counter and configuration come out of NNX's variables too.
  dynamic = jaxmp.DynamicLossScale(2.0**8, period=7, hysteresis=2)
  loss_scale = jaxmp.get_loss_scale(
      _nnx_optimizer(jaxmp.loss_scaling(optax.adam(1e-3), dynamic)).opt_state)
  assert type(loss_scale) is jaxmp.DynamicLossScale
  assert type(loss_scale.counter) is type(jnp.ones(1))
  assert loss_scale.config() == dynamic.config() and float(loss_scale.loss_scale) == 2.0**8


@pytest.mark.parametrize("build, path, where", [
    (lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx), "[1]",
     "inside optax.chain, next to other transformations"),
    (lambda tx: optax.chain(tx, optax.add_decayed_weights(1e-4)), "[0]",
     "inside optax.chain, next to other transformations"),
    (lambda tx: optax.named_chain(("clip", optax.clip_by_global_norm(1.0)),
                                  ("scaled", tx)), "['scaled']",
     "inside optax.named_chain, next to other transformations"),
    (lambda tx: optax.masked(tx, {"w": True}), "MaskedState.inner_state",
     r"inside the state of an optax wrapper \(MaskedState\)"),
    (lambda tx: optax.apply_if_finite(tx, 3), "ApplyIfFiniteState.inner_state",
     r"inside the state of an optax wrapper \(ApplyIfFiniteState\)"),
    (lambda tx: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), tx), 2),
     "MultiStepsState.inner_opt_state[1]",
     "inside optax.chain, next to other transformations"),
])
def test_a_wrapper_that_is_not_outermost_is_warned_about(build, path, where):
  state = build(jaxmp.loss_scaling(optax.sgd(0.1), SCALE)).init(PARAMS)
  message = (rf"the jaxmp.loss_scaling state sits at {re.escape(path)} of the "
             rf"optimizer state, {where}\. .*Put every transformation inside "
             r"and wrap the whole optimizer once: jaxmp\.loss_scaling\(optax\.chain\(")
  for read in (jaxmp.get_loss_scale, jaxmp.loss_scaling_metrics,
               jaxmp.check_loss_scale):
    with pytest.warns(UserWarning, match=read.__name__ + ": " + message) as record:
      read(state)
    assert record[0].filename == __file__  # it points at the caller


def test_warned_misuse_is_real():
  """What the warning prevents: weight decay after the wrapper moves params."""
  tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.1), SCALE),
                   optax.add_decayed_weights(0.5))
  updates, state = tx.update({"w": jnp.full(3, jnp.nan)}, tx.init(PARAMS), PARAMS)
  with pytest.warns(UserWarning, match="inside optax.chain"):
    assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1
  np.testing.assert_array_equal(optax.apply_updates(PARAMS, updates)["w"], 1.5)
  inside = jaxmp.loss_scaling(
      optax.chain(optax.sgd(0.1), optax.add_decayed_weights(0.5)), SCALE)
  updates, _ = inside.update({"w": jnp.full(3, jnp.nan)}, inside.init(PARAMS), PARAMS)
  np.testing.assert_array_equal(optax.apply_updates(PARAMS, updates)["w"], 1.0)


def test_the_warning_comes_once_per_trace():
  tx = optax.chain(optax.clip_by_global_norm(1.0),
                   jaxmp.loss_scaling(optax.sgd(0.1), SCALE))
  state = tx.init(PARAMS)
  read = jax.jit(lambda s: jaxmp.get_loss_scale(s).loss_scale)
  with pytest.warns(UserWarning, match="inside optax.chain") as record:
    read(state)
    read(state)  # compiled: no second trace, no second warning
  assert len(record) == 1


# -- Metrics ------------------------------------------------------------------


def test_metrics_are_scalar_arrays_usable_in_jit():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4, period=3))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(lambda g, s: tx.update(g, s, params)[1])
  metrics_of = jax.jit(jaxmp.loss_scaling_metrics)
  history = [jax.device_get(metrics_of(state))]
  for g in (1.0, jnp.nan, 1.0):
    state = step({"w": jnp.full(2, g)}, state)
    history.append(jax.device_get(metrics_of(state)))
  metrics = metrics_of(state)
  assert {k: (v.shape, v.dtype) for k, v in metrics.items()} == {
      "loss_scale": ((), jnp.float32), "skipped": ((), jnp.int32),
      "skipped_steps": ((), jnp.int32), "last_finite": ((), jnp.bool_),
      "overflows_at_min": ((), jnp.int32),
      "steps_since_adjustment": ((), jnp.int32),
      "recovered_steps": ((), jnp.int32), "fallback_steps": ((), jnp.int32),
      "lost_steps": ((), jnp.int32)}
  # `skipped` is this step's 0/1, `skipped_steps` the running total.
  assert [m["skipped"] for m in history] == [0, 0, 1, 0]
  assert [m["skipped_steps"] for m in history] == [0, 0, 1, 1]
  assert history[-1] == {
      "loss_scale": 8.0, "skipped": 0, "skipped_steps": 1, "last_finite": True,
      "overflows_at_min": 0, "steps_since_adjustment": 1,
      # Without recovery, a skipped step is a lost batch.
      "recovered_steps": 0, "fallback_steps": 0, "lost_steps": 1}


# -- check_loss_scale ---------------------------------------------------------


def test_check_loss_scale_raises_only_after_an_overflow_at_the_minimum():
  tx = jaxmp.loss_scaling(
      optax.sgd(0.1), jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0, hysteresis=2))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  step = jax.jit(lambda s: tx.update({"w": jnp.full(2, jnp.inf)}, s, params)[1])
  for expected_scale in [4.0, 2.0, 1.0]:  # hysteresis, then two back-offs
    state = step(state)
    assert float(jaxmp.get_loss_scale(state).loss_scale) == expected_scale
    jaxmp.check_loss_scale(state)
    jaxmp.check_loss_scale(jaxmp.loss_scaling_metrics(state))
  state = step(state)  # at the minimum with no budget left
  for source in [state, jaxmp.get_loss_scale(state), jaxmp.loss_scaling_metrics(state)]:
    with pytest.raises(jaxmp.LossScaleAtMinimumError) as info:
      jaxmp.check_loss_scale(source)
    # (The remedies that follow are asserted in test_faults.py.)
    assert str(info.value).startswith(
        "Current loss scale already at minimum (1.0): 1 overflow(s) at the "
        "minimum scale.\n")
  jaxmp.check_loss_scale(state, max_overflows_at_min=1)  # tolerated


def test_check_loss_scale_names_the_worst_member_of_stacked_states():
  """vmapped runs (or pmap replicas): each member is checked, the worst named."""
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
  params = {"w": jnp.ones(2)}
  states = jax.vmap(lambda _: tx.init(params))(jnp.arange(4))
  step = jax.jit(jax.vmap(lambda g, s: tx.update({"w": g}, s, params)[1]))
  # Member 2 overflows three times (two of them at the minimum), member 1 twice.
  for bad in ([2], [1, 2], [1, 2]):
    grads = jnp.ones((4, 2)).at[jnp.array(bad)].set(jnp.inf)
    states = step(grads, states)
  metrics = jax.device_get(jaxmp.loss_scaling_metrics(states))
  np.testing.assert_array_equal(metrics["overflows_at_min"], [0, 1, 2, 0])
  np.testing.assert_array_equal(metrics["skipped"], [0, 1, 1, 0])
  for source in (states, metrics, jaxmp.get_loss_scale(states)):
    with pytest.raises(jaxmp.LossScaleAtMinimumError) as info:
      jaxmp.check_loss_scale(source, max_overflows_at_min=1)
    assert str(info.value).startswith(
        "Current loss scale already at minimum (1.0): 2 overflow(s) at the "
        "minimum scale (member 2 of the 4 stacked states).\n")
  jaxmp.check_loss_scale(states, max_overflows_at_min=2)
  # Two stacking axes (e.g. pmap over vmap): the member is an index pair.
  grid = jax.tree_util.tree_map(lambda x: x.reshape((2, 2) + x.shape[1:]), states)
  with pytest.raises(jaxmp.LossScaleAtMinimumError, match=r"member \(1, 0\) of the 2x2"):
    jaxmp.check_loss_scale(grid)


# -- scaled_value_and_grad ----------------------------------------------------


class ScaledValueAndGradTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_returns_unscaled_value_and_scaled_grads(self):
    loss_fn = lambda w, x: jnp.sum((w * x) ** 2)
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5])
    fn = self.variant(jaxmp.scaled_value_and_grad(loss_fn, jaxmp.StaticLossScale(16.0)))
    loss, grads = fn(w, x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, x)
    assert float(loss) == float(ref_loss)
    chex.assert_trees_all_equal(grads, ref_grads * 16.0)
    # With aux and several argnums; the loss keeps its dtype.
    def aux_loss_fn(w, b):
      return jnp.sum(w * b).astype(jnp.float16), {"norm": jnp.linalg.norm(w)}

    fn = jaxmp.scaled_value_and_grad(
        aux_loss_fn, jaxmp.StaticLossScale(4.0), argnums=(0, 1), has_aux=True)
    (loss, aux), (gw, gb) = self.variant(fn)(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))
    assert loss.dtype == jnp.float16 and float(loss) == 11.0
    assert float(aux["norm"]) == pytest.approx(np.sqrt(5.0))
    chex.assert_trees_all_equal(gw, jnp.array([12.0, 16.0]))
    chex.assert_trees_all_equal(gb, jnp.array([4.0, 8.0]))


def _equinox_case():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0))  # holds functions
  x = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
  loss_fn = lambda m, x: jnp.mean((jax.vmap(m)(x) - 0.5) ** 2)
  # Equinox modules go through eqx.filter_jit, not jax.jit.
  return model, x, loss_fn, eqx.filter_value_and_grad, eqx.filter_jit, (
      lambda grads: eqx.filter(grads, eqx.is_array))


def _nnx_case():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import jaxmp.flax  # pylint: disable=import-outside-toplevel,redefined-outer-name
  from models import NnxMLP, classification_batch  # pylint: disable=import-outside-toplevel
  policy = jaxmp.get_policy("mixed_float16")
  model = NnxMLP(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"}, default=policy).set_nnx_dtypes(model)
  x, _ = classification_batch()
  loss_fn = lambda m, x: jnp.mean(policy.cast_to_output(m(policy.cast_to_compute(x))) ** 2)
  return model, x, loss_fn, nnx.value_and_grad, nnx.jit, nnx.to_pure_dict


@pytest.mark.parametrize("framework", [_nnx_case, _equinox_case], ids=["nnx", "equinox"])
def test_scaled_value_and_grad_takes_each_frameworks_value_and_grad(framework):
  model, x, loss_fn, value_and_grad, jit, arrays_of = framework()
  scale = jaxmp.StaticLossScale(2.0**10)

  def with_aux(m, x):  # the batch passes through as an argument
    return loss_fn(m, x), {"n": 5}

  scaled = jaxmp.scaled_value_and_grad(with_aux, scale, has_aux=True,
                                       value_and_grad=value_and_grad)
  reference = value_and_grad(lambda m, x: (loss_fn(m, x) * jnp.float32(2.0**10), {"n": 5}),
                             has_aux=True)
  (loss, aux), grads = jit(scaled)(model, x)
  (expected_loss, expected_aux), expected_grads = jit(reference)(model, x)
  assert aux == expected_aux == {"n": 5}
  # The loss comes back unscaled, the gradients scaled: exactly, the scale
  # being a power of two.
  chex.assert_trees_all_equal(loss * 2.0**10, expected_loss)
  grads, expected_grads = arrays_of(grads), arrays_of(expected_grads)
  assert jax.tree_util.tree_structure(grads) == jax.tree_util.tree_structure(expected_grads)
  chex.assert_trees_all_equal(grads, expected_grads)


# Guard cost: clip_global_norm= and guard=False.


def _decision_table():
  """Gradient trees whose finiteness every form of the check must agree on."""
  cases = []
  for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    info = jnp.finfo(dtype)
    for name, value in (("finite", 1.5), ("inf", np.inf), ("-inf", -np.inf),
                        ("nan", np.nan), ("huge", float(info.max)),
                        ("subnormal", float(info.smallest_subnormal))):
      one = jnp.ones(7, dtype).at[3].set(value)
      many = jnp.full((1000,), value, dtype)  # 1000 huge values: still finite
      for shape_name, leaf in (("one", one), ("many", many)):
        cases.append((f"{dtype.__name__}-{name}-{shape_name}",
                      {"g": leaf, "other": jnp.full(3, 2.0, jnp.float32)},
                      name in ("finite", "huge", "subnormal")))
  return cases


DECISIONS = _decision_table()


@functools.cache
def _updates():
  """The updates whose flag is a form of the check, each built and jitted once
  for the whole table (its trees share six signatures, so a jitted update
  compiles six times, not once per case): name -> (optimizer, micro-batches
  per step, update, jitted update)."""
  updates = {}
  for clip in (None, 1.0):
    tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale(),
                            clip_global_norm=clip)
    updates[f"loss_scaling clip={clip}"] = (tx, 1, tx.update, jax.jit(tx.update))
    for k in (1, 2):
      accumulate = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.NoOpLossScale(), k,
                                     clip_global_norm=clip)
      updates[f"multi_steps k={k} clip={clip}"] = (
          accumulate, k, accumulate.update, jax.jit(accumulate.update))
  return updates


ALL_FINITE_JITTED = jax.jit(jaxmp.all_finite)


def _forms_of_the_check(grads):
  """The flag of every form of the check: all_finite, the update's flag
  without clipping and with clipping (the norm's flag), and multi_steps' flag
  on the accumulated sum (the gradients in one micro-batch of one, or then
  zeros in a second), jitted or not."""
  flags = {
      "all_finite": jaxmp.all_finite(grads),
      "all_finite jitted": ALL_FINITE_JITTED(grads),
  }
  params = jax.tree_util.tree_map(jnp.zeros_like, grads)
  for name, (tx, k, update, jitted_update) in _updates().items():
    for jitted, run in ((False, update), (True, jitted_update)):
      state = tx.init(params)
      for micro_batch in [grads] + [params] * (k - 1):
        _, state = run(micro_batch, state, params)
      if name.startswith("multi_steps"):
        state = state.inner_opt_state
      flags[f"{name} jit={jitted}"] = state.last_finite
  return {name: bool(flag) for name, flag in flags.items()}


@pytest.mark.parametrize("name,grads,expected", DECISIONS,
                         ids=[c[0] for c in DECISIONS])
def test_every_form_of_the_check_decides_alike(name, grads, expected):
  del name
  flags = _forms_of_the_check(grads)
  assert flags == dict.fromkeys(flags, expected)


def _norm(tree) -> float:
  """The global norm of ``tree``, exactly: in float64, by NumPy.

  A float32 sum of squares of many leaves is off by up to a few parts in a
  million, by an amount that depends on the order XLA sums in, which changes
  between JAX versions (0.10.0 against 0.10.2: 3e-6 here).
  """
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree_util.tree_leaves(tree))))


def test_clip_global_norm_clips_as_optax_does():
  params = init_mlp(jax.random.PRNGKey(0), sizes=(64, 300, 10))
  grads = jax.tree_util.tree_map(lambda p: 3.0 * jnp.ones_like(p), params)
  scale = jaxmp.StaticLossScale(2.0**10)
  chained = jaxmp.loss_scaling(
      optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), scale)
  sharing = jaxmp.loss_scaling(optax.sgd(1.0), scale, clip_global_norm=1.0)
  scaled = scale.scale(grads)
  expected, _ = jax.jit(chained.update)(scaled, chained.init(params), params)
  got, state = jax.jit(sharing.update)(scaled, sharing.init(params), params)
  chex.assert_trees_all_close(got, expected, rtol=1e-6)
  assert _norm(got) == pytest.approx(1.0, rel=1e-6)
  assert bool(state.last_finite) and int(state.skipped_steps) == 0
  # Below the norm the gradients pass unchanged, bit for bit.
  small = jax.tree_util.tree_map(lambda g: g * 1e-4, grads)
  got, _ = jax.jit(sharing.update)(scale.scale(small), sharing.init(params), params)
  chex.assert_trees_all_equal(got, jax.tree_util.tree_map(jnp.negative, small))


def test_clip_global_norm_of_huge_finite_gradients_steps_and_stays_finite():
  # The plain float32 sum of squares of these overflows; the step must run.
  huge = float(jnp.finfo(jnp.float32).max)
  grads = {"a": jnp.array([huge, -huge, 3.0]), "b": jnp.full(4, 1e20)}
  params = jax.tree_util.tree_map(jnp.zeros_like, grads)
  tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale(),
                          clip_global_norm=2.0)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_finite) and int(state.skipped_steps) == 0
  np.testing.assert_allclose(updates["a"], [-np.sqrt(2.0), np.sqrt(2.0), 0.0],
                             rtol=1e-6, atol=1e-30)
  assert _norm(updates) == pytest.approx(2.0, rel=1e-6)


def test_guard_false_runs_the_bare_update():
  params = {"w": jnp.ones(3)}
  bare = optax.adamw(0.1)
  tx = jaxmp.loss_scaling(optax.adamw(0.1), jaxmp.NoOpLossScale(), guard=False)
  grads = {"w": jnp.array([1.0, jnp.nan, 2.0])}
  expected, expected_state = bare.update(grads, bare.init(params), params)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(updates, expected)  # the nan step is applied
  chex.assert_trees_all_equal(state.inner_state, expected_state)
  assert int(state.skipped_steps) == 0 and bool(state.last_finite)
