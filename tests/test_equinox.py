"""Tests of jaxmp with Equinox: an eqx.filter_jit step holding a loss scale.

scaled_value_and_grad with eqx.filter_value_and_grad is tested with the other
frameworks in tests/test_loss_scaling.py.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

POLICY = jaxmp.get_policy("mixed_float16")


def make():
  model = eqx.nn.MLP(4, 3, 16, depth=2, key=jax.random.key(0))
  loss_scale = jaxmp.DynamicLossScale(2.0**8, hysteresis=2, consecutive_hysteresis=True)
  tx = jaxmp.loss_scaling(optax.adam(1e-2), loss_scale)
  return model, tx, tx.init(eqx.filter(model, eqx.is_inexact_array))


def loss_of(model, x, y):
  logits = POLICY.cast_to_output(
      jax.vmap(POLICY.cast_to_compute(model))(POLICY.cast_to_compute(x)))
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def batch(n=8):
  x = jax.random.normal(jax.random.key(1), (n, 4))
  return x, jax.random.randint(jax.random.key(2), (n,), 0, 3)


def arrays(tree):
  return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def assert_bit_identical(a, b):
  a, b = arrays(a), arrays(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def test_filter_jit_step_holding_a_hysteresis_scale_trains_and_skips_an_inf_step():
  model, tx, opt_state = make()
  traces = []

  @eqx.filter_jit
  def step(model, opt_state, x, y):
    traces.append(1)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    loss, grads = jaxmp.scaled_value_and_grad(
        lambda p: loss_of(eqx.combine(p, static), x, y),
        jaxmp.get_loss_scale(opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss

  x, y = batch()
  poisoned = x.at[0, 0].set(jnp.inf)
  hysteresis_left = []
  for i, inputs in enumerate([x, poisoned, x, poisoned, x]):
    before_model, before_state = model, opt_state
    model, opt_state, loss = step(model, opt_state, inputs, y)
    hysteresis_left.append(int(jaxmp.get_loss_scale(opt_state).hysteresis_left))
    if i % 2:  # skipped: the model and the inner state are bit-identical
      assert not np.isfinite(loss)
      assert_bit_identical(model, before_model)
      assert_bit_identical(opt_state.inner_state, before_state.inner_state)
    else:  # applied: every array of the model moved
      changed = [bool(np.any(a != b)) for a, b in zip(arrays(model), arrays(before_model))]
      assert all(changed)
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == 2
  # Each overflow spent one unit of hysteresis, each clean step refilled it,
  # so the scale never backed off.
  assert hysteresis_left == [2, 1, 2, 1, 2]
  assert float(metrics["loss_scale"]) == 2.0**8
  assert len(traces) == 1
  assert {str(a.dtype) for a in arrays(model)} == {"float32"}
