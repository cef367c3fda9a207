"""Tests of jaxmp.multi_steps: gradient accumulation with loss scaling."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from models import init_mlp, make_batch, mse

K = 4


def make_micro_step(tx):
  @jax.jit
  def micro_step(params, state, batch, inject):
    loss_scale = jaxmp.get_loss_scale(state)
    _, grads = jaxmp.scaled_value_and_grad(mse, loss_scale)(params, batch)
    grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, jnp.nan * g, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return micro_step


def test_non_finite_micro_batch_skips_the_accumulated_step_once():
  params0 = init_mlp(jax.random.key(6))
  tx = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10), K)
  micro_step = make_micro_step(tx)
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


def test_unprotected_multisteps_is_poisoned_for_good():
  params0 = {"w": jnp.ones(3)}
  tx = optax.MultiSteps(optax.adam(1e-2), 2)
  params, state = params0, tx.init(params0)
  for grads in [{"w": jnp.full(3, jnp.nan)}] + [{"w": jnp.ones(3)}] * 5:
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  assert bool(jnp.all(jnp.isnan(params["w"])))  # what multi_steps avoids
