"""Real float16 overflow and underflow, produced by the numbers, not injected.

* Large inputs and no normalisation make float16 activations overflow in the
  forward pass: the step must be skipped (parameters and optimizer state
  bit-identical) and reported (metrics, and ``nonfinite_paths`` from a
  callback that runs only on the non-finite step).
* A loss of small magnitude makes float16 gradients underflow to zero without
  scaling: the fraction of zero gradients is measured with and without a loss
  scale, and scaling rescues them.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

MIXED = jaxmp.get_policy("mixed_float16")
FLOAT32 = jaxmp.get_policy("float32")


def mlp(params, x, policy):
  """Two dense layers without normalisation, run under ``policy``."""
  p, x = policy.cast_to_compute((params, x))
  h = jax.nn.relu(x @ p["hidden"]["w"] + p["hidden"]["b"])
  return policy.cast_to_output(h @ p["out"]["w"] + p["out"]["b"])


def init_params(seed, n_in, n_hidden, n_out, gain=1.0):
  rng = np.random.default_rng(seed)
  def dense(a, b):
    return {"w": jnp.asarray(gain * rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32)}
  return {"hidden": dense(n_in, n_hidden), "out": dense(n_hidden, n_out)}


def mse(params, x, y, policy):
  return jnp.mean((mlp(params, x, policy) - y) ** 2)


def assert_bit_identical(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


# ---------------------------------------------------------------------------
# Overflow in the forward pass.


def overflow_setup():
  rng = np.random.default_rng(0)
  params = init_params(0, 16, 64, 4, gain=8.0)
  # Large raw inputs, as from unnormalised features (still finite in float16).
  x = jnp.asarray(3000 * rng.normal(size=(32, 16)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
  return params, x, y


def test_forward_overflow_is_skipped_and_reported():
  params, x, y = overflow_setup()
  # The overflow is real: the inputs fit in float16, the activations do not.
  assert float(jnp.max(jnp.abs(x))) < 65504
  forward = jax.jit(mlp, static_argnums=2)
  assert not bool(jnp.all(jnp.isfinite(forward(params, x, MIXED))))
  assert bool(jnp.all(jnp.isfinite(forward(params, x, FLOAT32))))
  assert float(jnp.max(jnp.abs(forward(params, x, FLOAT32)))) > 65504
  tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**15))
  opt_state = tx.init(params)
  reports = []

  @jax.jit
  def train_step(params, opt_state, step):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(mse, loss_scale)(params, x, y, MIXED)
    report = lambda g, s: reports.append((int(s), jaxmp.nonfinite_paths(g)))
    jax.lax.cond(jaxmp.all_finite(grads), lambda g, s: None,
                 lambda g, s: jax.debug.callback(report, g, s), grads, step)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, loss, grads,
            jaxmp.loss_scaling_metrics(opt_state))

  new_params, new_state, loss, grads, metrics = train_step(params, opt_state, 1)
  jax.effects_barrier()
  # Skipped: parameters and the inner optimizer state are bit-identical.
  assert_bit_identical(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, opt_state.inner_state)
  # Reported: in the loss, the metrics, and the paths of the bad gradients.
  assert not np.isfinite(float(loss))
  assert int(metrics["skipped_steps"]) == 1 and not bool(metrics["last_finite"])
  assert float(metrics["loss_scale"]) == 2.0**14
  bad = jaxmp.nonfinite_paths(grads)
  assert "['out']['w']" in bad and "['hidden']['w']" in bad
  assert reports == [(1, bad)]

  # However many times it is tried, the scale cannot rescue a forward
  # overflow: every step is skipped and the model never changes.
  params_now, state_now = new_params, new_state
  for step in range(2, 12):
    params_now, state_now, *_, metrics = train_step(params_now, state_now, step)
  assert int(metrics["skipped_steps"]) == 11
  assert float(metrics["loss_scale"]) == 2.0**4
  assert_bit_identical(params_now, params)
  assert jaxmp.all_finite((params_now, state_now))

  # The same model and data in float32 train normally.
  tx32 = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.NoOpLossScale())

  @jax.jit
  def float32_step(params, state):
    _, grads = jaxmp.scaled_value_and_grad(mse, jaxmp.NoOpLossScale())(
        params, x, y, FLOAT32)
    return tx32.update(grads, state, params)[1]

  assert int(float32_step(params, tx32.init(params)).skipped_steps) == 0


# ---------------------------------------------------------------------------
# Underflow in the backward pass.

LOSS_WEIGHT = 3e-7  # e.g. one small term of a weighted sum of losses


def underflow_setup():
  rng = np.random.default_rng(1)
  params = init_params(1, 8, 32, 4)
  x = jnp.asarray(rng.normal(size=(64, 8)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(64, 4)), jnp.float32)
  return params, x, y


def small_loss(params, x, y, policy):
  return LOSS_WEIGHT * mse(params, x, y, policy)


@jax.jit
def float16_grads(params, x, y, loss_scale):
  """Gradients of the float16 model, unscaled back to the true values."""
  _, grads = jaxmp.scaled_value_and_grad(small_loss, loss_scale)(params, x, y, MIXED)
  return loss_scale.unscale(grads)


def zero_fraction(grads):
  stats = jax.jit(jaxmp.grad_stats)(grads)
  leaves = np.concatenate([np.ravel(g) for g in jax.tree_util.tree_leaves(grads)])
  assert np.isclose(float(stats["zero_fraction"]), np.mean(leaves == 0))
  return float(stats["zero_fraction"])


def relative_error(grads, reference):
  g = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(grads)])
  r = np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(reference)])
  return np.linalg.norm(g - r) / np.linalg.norm(r)


def test_scaling_rescues_gradients_that_underflow_in_float16():
  params, x, y = underflow_setup()
  reference = jax.jit(jax.grad(small_loss), static_argnums=3)(params, x, y, FLOAT32)
  assert zero_fraction(reference) < 0.2  # only the dead ReLUs' exact zeros

  unscaled = float16_grads(params, x, y, jaxmp.NoOpLossScale())
  scaled = float16_grads(params, x, y, jaxmp.StaticLossScale(2.0**15))
  without, with_scaling = zero_fraction(unscaled), zero_fraction(scaled)
  # Without a loss scale every gradient is flushed to zero in float16.
  assert without > 0.99, without
  # With one, the zeros are only those of the float32 reference.
  assert with_scaling <= zero_fraction(reference) + 0.01, with_scaling
  assert relative_error(scaled, reference) < 1e-2
  assert relative_error(unscaled, reference) > 0.9
  # Nothing overflowed either way, so neither step would have been skipped.
  assert bool(jaxmp.all_finite(unscaled)) and bool(jaxmp.all_finite(scaled))

  # The headroom diagnostics see the problem before training starts.
  headroom = jax.jit(jaxmp.dtype_headroom, static_argnums=1)(reference, jnp.float16)
  assert float(headroom["underflow"]) + float(headroom["subnormal"]) > 0.5


def test_dynamic_scaling_trains_like_float32_where_unscaled_float16_stalls():
  params0, x, y = underflow_setup()
  # Plain SGD on a small loss: the update is as small as the gradient.
  inner = optax.sgd(3e3)

  def train(policy, loss_scale, steps=30):
    tx = jaxmp.loss_scaling(inner, loss_scale)

    @jax.jit
    def step(params, state):
      _, grads = jaxmp.scaled_value_and_grad(
          small_loss, jaxmp.get_loss_scale(state))(params, x, y, policy)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params, state = params0, tx.init(params0)
    for _ in range(steps):
      params, state = step(params, state)
    return params, state

  params32, _ = train(FLOAT32, jaxmp.NoOpLossScale())
  params_unscaled, _ = train(MIXED, jaxmp.NoOpLossScale())
  params_scaled, state = train(MIXED, jaxmp.DynamicLossScale(2.0**15, period=10))

  def moved(params):
    return np.concatenate([
        np.ravel(a - b) for a, b in zip(jax.tree_util.tree_leaves(params),
                                        jax.tree_util.tree_leaves(params0))])

  moved32 = moved(params32)
  assert np.linalg.norm(moved32) > 1e-3  # float32 learns something
  assert not np.any(moved(params_unscaled))  # every gradient was zero: stalled
  np.testing.assert_allclose(moved(params_scaled), moved32, rtol=0,
                             atol=1e-2 * np.abs(moved32).max())
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 0
