"""Tests of jaxmp.multi_steps: gradient accumulation with loss scaling."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from models import init_mlp, make_batch, mse

K = 4


def micro_step_body(tx, params, state, batch, inject):
  """One micro-batch: the scaled gradients (nan where ``inject``), then ``tx``."""
  loss_scale = jaxmp.get_loss_scale(state)
  _, grads = jaxmp.scaled_value_and_grad(mse, loss_scale)(params, batch)
  grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, jnp.nan * g, g), grads)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


def make_micro_step(tx):
  return jax.jit(functools.partial(micro_step_body, tx))


TX = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), K)


@pytest.fixture(scope="module")
def micro_step():
  """TX's jitted micro-step, traced once for every test of the module."""
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch, inject):
    return micro_step_body(TX, params, state, batch, inject)
  return step


def test_non_finite_micro_batch_skips_the_accumulated_step_once(micro_step):
  params0 = init_mlp(jax.random.key(6))
  tx = TX
  params, state = params0, tx.init(params0)
  # First accumulation: the second micro-batch is poisoned.
  for i in range(K):
    params, state = micro_step(params, state, make_batch(i), jnp.asarray(i == 1))
  chex.assert_trees_all_equal(params, params0)  # the whole step is skipped
  inner = state.inner_opt_state
  chex.assert_trees_all_equal(inner.inner_state, tx.init(params0).inner_opt_state.inner_state)
  assert float(jaxmp.get_loss_scale(state).loss_scale) == 2.0**9  # backed off once
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1
  chex.assert_trees_all_equal(  # the accumulator starts clean
      state.acc_grads, jax.tree_util.tree_map(jnp.zeros_like, params0))
  # Second accumulation, clean: the same update as a fresh run on it.
  for i in range(K, 2 * K):
    params, state = micro_step(params, state, make_batch(i), jnp.asarray(False))
  fresh = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**9), K)
  fresh_step = make_micro_step(fresh)
  fresh_params, fresh_state = params0, fresh.init(params0)
  for i in range(K, 2 * K):
    fresh_params, fresh_state = fresh_step(
        fresh_params, fresh_state, make_batch(i), jnp.asarray(False))
  chex.assert_trees_all_equal(params, fresh_params)
  changed = [not np.array_equal(a, b) for a, b in zip(
      jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params0))]
  assert all(changed)
  assert int(state.inner_opt_state.skipped_steps) == 1
  assert bool(optax.MultiSteps(optax.sgd(1.0), K).has_updated(state))


def test_plain_optax_multisteps_around_loss_scaling_stays_poisoned():
  """Why multi_steps exists: optax.MultiSteps keeps a nan in its accumulator."""
  params0 = init_mlp(jax.random.key(8))
  tx = optax.MultiSteps(
      jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10)), K)
  micro_step = make_micro_step(tx)
  params, state = params0, tx.init(params0)
  for i in range(3 * K):
    params, state = micro_step(params, state, make_batch(i), jnp.asarray(i == 1))
  # Every later accumulated step is skipped too: training has stalled.
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 3
  chex.assert_trees_all_equal(params, params0)


# -- What an accumulation computes ----------------------------------------------


GRAD = jax.jit(jax.grad(mse))
SCALED_GRAD = jax.jit(
    lambda params, batch, scale: jaxmp.scaled_value_and_grad(mse, scale)(params, batch)[1])


def _bits(tree):
  return [np.asarray(x).tobytes() for x in jax.tree_util.tree_leaves(tree)]


class AccumulationTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_finite_micro_batches_step_as_optax_multisteps_does(self):
    scale = jaxmp.DynamicLossScale(2.0**10)
    for schedule, use_grad_mean in ((3, True), (lambda step: 2 + step, False)):
      params0 = init_mlp(jax.random.key(3))
      tx = jaxmp.multi_steps(optax.adam(1e-2), scale, schedule,
                             use_grad_mean=use_grad_mean)
      reference = optax.MultiSteps(optax.adam(1e-2), schedule,
                                   use_grad_mean=use_grad_mean)
      update = self.variant(tx.update)  # the rest is jitted: only update varies
      ref_update = jax.jit(reference.update)
      params, state = params0, tx.init(params0)
      ref_params, ref_state = params0, reference.init(params0)
      k_of_step = schedule if callable(schedule) else lambda _: schedule
      micro_batches = k_of_step(0) + k_of_step(1)  # two accumulated steps
      for i in range(micro_batches):
        batch = make_batch(i)
        grads = SCALED_GRAD(params, batch, jaxmp.get_loss_scale(state))
        updates, state = update(grads, state, params)
        # optax.MultiSteps' running mean divides by its int32 counter.
        with jax.numpy_dtype_promotion("standard"):
          ref_updates, ref_state = ref_update(GRAD(ref_params, batch), ref_state, ref_params)
        emitted = int(ref_state.mini_step) == 0
        if not emitted:  # the updates in between leave every bit alone
          assert _bits(updates) == _bits(jax.tree_util.tree_map(
              lambda u: jnp.full_like(u, -0.0), updates))
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        assert int(state.mini_step) == int(ref_state.mini_step)
        assert int(state.gradient_step) == int(ref_state.gradient_step)
        assert bool(reference.has_updated(state)) == emitted
      # The sum and then the mean, against optax's running mean: rounding.
      chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-7)
      chex.assert_trees_all_close(state.inner_opt_state.inner_state,
                                  ref_state.inner_opt_state, rtol=1e-5, atol=1e-8)
      assert int(state.gradient_step) == 2
      assert int(state.inner_opt_state.skipped_steps) == 0

  @chex.variants(with_jit=True, without_jit=True)
  def test_the_accumulator_holds_the_unscaled_float32_sum(self):
    params = {"w": jnp.zeros(3, jnp.bfloat16)}
    tx = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.StaticLossScale(16.0), 3)
    update = self.variant(tx.update)
    state = tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float32
    micro = [jnp.array([16.0, 48.0, -8.0], jnp.bfloat16),
             jnp.array([0.5, 1.0, 3.0], jnp.bfloat16)]
    _, state = update({"w": micro[0]}, state, params)
    np.testing.assert_array_equal(state.acc_grads["w"], [1.0, 3.0, -0.5])
    _, state = update({"w": micro[1]}, state, params)
    np.testing.assert_array_equal(state.acc_grads["w"], [1.03125, 3.0625, -0.3125])
    updates, state = update({"w": jnp.array([32.0, 0.0, 8.0], jnp.bfloat16)},
                            state, params)
    # The mean of the unscaled gradients, in the params' dtype, to sgd(1.0).
    expected = (np.array([3.03125, 3.0625, 0.1875]) / 3).astype(jnp.bfloat16)
    assert updates["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(updates["w"], -expected)
    np.testing.assert_array_equal(state.acc_grads["w"], [0.0, 0.0, 0.0])

  @chex.variants(with_jit=True, without_jit=True)
  def test_guard_false_applies_a_nan_accumulation_on_its_last_micro_batch(self):
    params = {"w": jnp.ones(2)}
    tx = jaxmp.multi_steps(optax.adam(0.1), jaxmp.NoOpLossScale(), 2, guard=False)
    update = self.variant(tx.update)
    state = tx.init(params)
    updates, new_state = update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert _bits(updates) == _bits({"w": jnp.full(2, -0.0)})
    assert _bits(new_state.inner_opt_state) == _bits(state.inner_opt_state)
    updates, new_state = update({"w": jnp.ones(2)}, new_state, params)
    assert bool(jnp.isnan(updates["w"][0])) and bool(jnp.isfinite(updates["w"][1]))
    assert int(new_state.inner_opt_state.inner_state[0].count) == 1
    assert int(new_state.inner_opt_state.skipped_steps) == 0


def test_a_micro_step_compiles_once_and_needs_no_branch_or_host_transfer(micro_step):
  params0 = init_mlp(jax.random.key(9))
  tx = TX
  jaxpr = jax.make_jaxpr(functools.partial(micro_step_body, tx))(
      params0, tx.init(params0), make_batch(0), jnp.asarray(False))
  names = {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}
  for eqn in jaxpr.jaxpr.eqns:
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= {e.primitive.name for e in sub.eqns}
  assert not names & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}
  batches = [jax.device_put(make_batch(i)) for i in range(2 * K)]
  injects = [jax.device_put(jnp.asarray(i == 1)) for i in range(2 * K)]
  params, state = params0, tx.init(params0)
  params, state = micro_step(params, state, batches[0], injects[0])  # compiled once
  with jax.transfer_guard("disallow"):
    for i in range(1, 2 * K):
      params, state = micro_step(params, state, batches[i], injects[i])
  assert int(state.inner_opt_state.skipped_steps) == 1
  assert int(state.gradient_step) == 2


def test_every_device_records_the_same_micro_batch_flag_under_shard_map():
  """Gradients split over 8 devices, one of them nan: keep_on_skip keeps the
  replicated statistics on every device."""
  mesh = jax.make_mesh((8,), ("batch",))
  tx = jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2, axis_name="batch")
  P = jax.sharding.PartitionSpec

  def device_step(grads):  # this device's shard of the gradients
    w = jnp.zeros(1)
    _, opt_state = tx.update(grads, tx.init(w), w)
    stats = jnp.zeros(1)
    return jaxmp.keep_on_skip(opt_state, stats + 1.0, stats), opt_state.skip_state

  step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=P("batch"), out_specs=P()))
  for poisoned in (False, True):
    grads = jnp.ones(8).at[5].set(jnp.nan if poisoned else 1.0)
    stats, skip_state = step(
        jax.device_put(grads, jax.sharding.NamedSharding(mesh, P("batch"))))
    assert bool(skip_state["should_skip"]) == poisoned
    np.testing.assert_array_equal(stats, [0.0 if poisoned else 1.0])
