"""Tests of jaxmp.multi_steps: gradient accumulation with loss scaling."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from models import bits, init_mlp, make_batch, mse

K = 4


def micro_step_body(tx, params, state, batch, inject):
  """One micro-batch: the scaled gradients (nan where ``inject``), then ``tx``."""
  _, grads = jaxmp.scaled_value_and_grad(mse, jaxmp.get_loss_scale(state))(params, batch)
  grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, jnp.nan * g, g), grads)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


make_micro_step = lambda tx: jax.jit(lambda *args: micro_step_body(tx, *args))  # as micro_step
TX = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), K)
INPUTS = [(make_batch(i), jnp.asarray(i == 1)) for i in range(3 * K)]  # the second is nan
run = lambda step, params, state, inputs: functools.reduce(  # (params, state) after inputs
    lambda carry, batch_and_inject: step(*carry, *batch_and_inject), inputs, (params, state))


@pytest.fixture(scope="module")
def micro_step():  # TX's jitted micro-step, traced once for the whole module
  return jax.jit(chex.assert_max_traces(lambda *args: micro_step_body(TX, *args), n=1))


def test_a_non_finite_micro_batch_skips_its_step_once_without_branch_retrace_or_transfer(
    micro_step):
  params0 = init_mlp(jax.random.key(6), sizes=(4, 3))  # one layer: few leaves
  # The jaxpr of the fixture's one trace, which its first call below compiles.
  jaxpr = micro_step.trace(params0, TX.init(params0), *INPUTS[0]).jaxpr.jaxpr
  names = {e.primitive.name for j in [jaxpr] + [
      sub for eqn in jaxpr.eqns for sub in jax.extend.core.jaxprs_in_params(eqn.params)]
           for e in j.eqns}
  assert not names & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}
  params, state = micro_step(params0, TX.init(params0), *INPUTS[0])  # compiled once
  with jax.transfer_guard("disallow"):
    params, state = run(micro_step, params, state, INPUTS[1:K])
  # The first accumulation's step is skipped, and its accumulator starts clean.
  chex.assert_trees_all_equal(
      (params, state.inner_opt_state.inner_state, state.acc_grads),
      (params0, TX.init(params0).inner_opt_state.inner_state,
       jax.tree_util.tree_map(jnp.zeros_like, params0)))
  metrics = jaxmp.loss_scaling_metrics(state)  # backed off once
  assert (float(metrics["loss_scale"]), int(metrics["skipped_steps"])) == (2.0**9, 1)
  with jax.transfer_guard("disallow"):
    params, state = run(micro_step, params, state, INPUTS[K:2 * K])
  # The second, clean: the same update as a fresh run on it.
  fresh = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**9), K)
  fresh_params, _ = run(make_micro_step(fresh), params0, fresh.init(params0), INPUTS[K:2 * K])
  chex.assert_trees_all_equal(params, fresh_params)
  leaves = jax.tree_util.tree_leaves
  assert all(bool(jnp.any(a != b)) for a, b in zip(leaves(params), leaves(params0)))
  assert (int(state.inner_opt_state.skipped_steps), int(state.gradient_step)) == (1, 2)
  assert bool(optax.MultiSteps(optax.sgd(1.0), K).has_updated(state))
  # Why multi_steps exists: optax.MultiSteps around the wrapper keeps the nan
  # in its accumulator, and so skips every later step: training stalls.
  tx = optax.MultiSteps(
      jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10)), K)
  params, state = run(make_micro_step(tx), params0, tx.init(params0), INPUTS)
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 3
  chex.assert_trees_all_equal(params, params0)


GRAD = jax.jit(jax.grad(mse))
SCALED_GRAD = jax.jit(lambda p, batch, scale: jaxmp.scaled_value_and_grad(mse, scale)(p, batch)[1])
negative_zeros = lambda tree: jax.tree_util.tree_map(lambda u: jnp.full_like(u, -0.0), tree)


class AccumulationTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_finite_micro_batches_step_as_optax_multisteps_does(self):
    params0 = init_mlp(jax.random.key(3), sizes=(4, 3))  # one layer, as above
    for k, mean in ((3, True), (lambda step: 2 + step, False)):  # two steps: 6, 5 batches
      tx = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), k,
                             use_grad_mean=mean)
      reference = optax.MultiSteps(optax.adam(1e-2), k, use_grad_mean=mean)
      update, ref_update = self.variant(tx.update), jax.jit(reference.update)
      (params, state), (ref_params, ref_state) = [(params0, t.init(params0))
                                                  for t in (tx, reference)]
      for i in range(6 if k == 3 else 5):
        batch = make_batch(i)
        updates, state = update(SCALED_GRAD(params, batch, jaxmp.get_loss_scale(state)),
                                state, params)
        # optax.MultiSteps' running mean divides by its int32 counter.
        with jax.numpy_dtype_promotion("standard"):
          ref_updates, ref_state = ref_update(GRAD(ref_params, batch), ref_state, ref_params)
        emitted = int(ref_state.mini_step) == 0
        if not emitted:  # the updates in between leave every bit alone
          assert bits(updates) == bits(negative_zeros(updates))
        params = optax.apply_updates(params, updates)
        ref_params = optax.apply_updates(ref_params, ref_updates)
        counters = lambda s: (int(s.mini_step), int(s.gradient_step))
        assert counters(state) == counters(ref_state)
        assert bool(reference.has_updated(state)) == emitted
      # The sum and then the mean, against optax's running mean: rounding.
      chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-7)
      chex.assert_trees_all_close(state.inner_opt_state.inner_state,
                                  ref_state.inner_opt_state, rtol=1e-5, atol=1e-8)
      assert (int(state.gradient_step), int(state.inner_opt_state.skipped_steps)) == (2, 0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_the_accumulator_holds_the_unscaled_float32_sum(self):
    params = {"w": jnp.zeros(3, jnp.bfloat16)}
    tx = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.StaticLossScale(16.0), 3)
    update, state = self.variant(tx.update), tx.init(params)
    assert state.acc_grads["w"].dtype == jnp.float32
    for micro, acc in (([16.0, 48.0, -8.0], [1.0, 3.0, -0.5]),
                       ([0.5, 1.0, 3.0], [1.03125, 3.0625, -0.3125]),
                       ([32.0, 0.0, 8.0], [0.0, 0.0, 0.0])):
      updates, state = update({"w": jnp.array(micro, jnp.bfloat16)}, state, params)
      np.testing.assert_array_equal(state.acc_grads["w"], acc)
    # The mean of the unscaled gradients, in the params' dtype, to sgd(1.0).
    expected = (np.array([3.03125, 3.0625, 0.1875]) / 3).astype(jnp.bfloat16)
    chex.assert_trees_all_equal(updates["w"], jnp.asarray(-expected), strict=True)

  @chex.variants(with_jit=True, without_jit=True)
  def test_guard_false_applies_a_nan_accumulation_on_its_last_micro_batch(self):
    params = {"w": jnp.ones(2)}
    tx = jaxmp.multi_steps(optax.adam(0.1), jaxmp.NoOpLossScale(), 2, guard=False)
    update, state = self.variant(tx.update), tx.init(params)
    updates, new_state = update({"w": jnp.array([jnp.nan, 1.0])}, state, params)
    assert bits((updates, new_state.inner_opt_state)) == bits((negative_zeros(updates),
                                                               state.inner_opt_state))
    updates, new_state = update({"w": jnp.ones(2)}, new_state, params)
    assert bool(jnp.isnan(updates["w"][0])) and bool(jnp.isfinite(updates["w"][1]))
    assert (int(new_state.inner_opt_state.inner_state[0].count),
            int(new_state.inner_opt_state.skipped_steps)) == (1, 0)


def test_every_device_records_the_same_micro_batch_flag_under_shard_map():
  """Gradients split over 8 devices, one nan: every device keeps its statistics."""
  mesh = jax.make_mesh((8,), ("batch",))
  tx = jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2, axis_name="batch")
  P = jax.sharding.PartitionSpec

  def device_step(grads):  # this device's shard of the gradients
    w = stats = jnp.zeros(1)
    _, opt_state = tx.update(grads, tx.init(w), w)
    return jaxmp.keep_on_skip(opt_state, stats + 1.0, stats), opt_state.skip_state

  step = jax.jit(jax.shard_map(device_step, mesh=mesh, in_specs=P("batch"), out_specs=P()))
  for poisoned in (False, True):
    stats, skip_state = step(jax.device_put(jnp.ones(8).at[5].set(
        jnp.nan if poisoned else 1.0), jax.sharding.NamedSharding(mesh, P("batch"))))
    assert bool(skip_state["should_skip"]) == poisoned
    np.testing.assert_array_equal(stats, [0.0 if poisoned else 1.0])
