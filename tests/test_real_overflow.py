"""Real float16 overflow (large inputs, no normalisation: skipped and reported)
and underflow (a small loss: rescued by the scale), produced by the numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
from models import bits, f32, finite

MIXED = jaxmp.get_policy("mixed_float16")
FLOAT32 = jaxmp.get_policy("float32")


def mlp(params, x, policy):
  """Two dense layers without normalisation, run under ``policy``."""
  p, x = policy.cast_to_compute((params, x))
  h = jax.nn.relu(x @ p["hidden"]["w"] + p["hidden"]["b"])
  return policy.cast_to_output(h @ p["out"]["w"] + p["out"]["b"])


def setup(seed, n_in, n_hidden, n_out, n, gain=1.0, x_gain=1.0):
  rng = np.random.default_rng(seed)
  dense = lambda a, b: {"w": f32(gain * rng.normal(size=(a, b)) / np.sqrt(a)),
                        "b": f32(np.zeros(b))}
  params = {"hidden": dense(n_in, n_hidden), "out": dense(n_hidden, n_out)}
  return params, f32(x_gain * rng.normal(size=(n, n_in))), f32(rng.normal(size=(n, n_out)))


def mse(params, x, y, policy):
  return jnp.mean((mlp(params, x, policy) - y) ** 2)


def small_loss(params, x, y, policy):  # one small term of a weighted sum of losses
  return 3e-7 * mse(params, x, y, policy)


flat = lambda tree: np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(tree)])


def test_forward_overflow_is_skipped_and_reported():
  # Large raw inputs, as from unnormalised features (still finite in float16).
  params, x, y = setup(0, 16, 64, 4, 32, gain=8.0, x_gain=3000.0)
  assert np.max(np.abs(x)) < 65504  # the activations overflow, not x
  forward = jax.jit(mlp, static_argnums=2)
  assert not finite(forward(params, x, MIXED))
  out32 = forward(params, x, FLOAT32)
  assert finite(out32) and np.max(np.abs(out32)) > 65504
  tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**15))
  opt_state = tx.init(params)
  reports = []

  @jax.jit
  def train_step(params, opt_state, step):
    loss, grads = jaxmp.scaled_value_and_grad(mse, jaxmp.get_loss_scale(opt_state))(
        params, x, y, MIXED)
    report = lambda g, s: reports.append((int(s), jaxmp.nonfinite_paths(g)))
    jax.lax.cond(jaxmp.all_finite(grads), lambda g, s: None,
                 lambda g, s: jax.debug.callback(report, g, s), grads, step)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state, loss, grads,
            jaxmp.loss_scaling_metrics(opt_state))

  new_params, new_state, loss, grads, metrics = train_step(params, opt_state, 1)
  jax.effects_barrier()
  assert bits(new_params) == bits(params)
  assert bits(new_state.inner_state) == bits(opt_state.inner_state)
  assert not np.isfinite(float(loss))
  assert (int(metrics["skipped_steps"]), bool(metrics["last_finite"]),
          float(metrics["loss_scale"])) == (1, False, 2.0**14)
  bad = jaxmp.nonfinite_paths(grads)
  assert "['out']['w']" in bad and "['hidden']['w']" in bad
  assert reports == [(1, bad)]
  # No scale rescues a forward overflow: every step is skipped.
  params_now, state_now = new_params, new_state
  for step in range(2, 12):
    params_now, state_now, *_, metrics = train_step(params_now, state_now, step)
  assert (int(metrics["skipped_steps"]), float(metrics["loss_scale"])) == (11, 2.0**4)
  assert bits(params_now) == bits(params) and finite((params_now, state_now))
  # The same model and data in float32 train normally.
  tx32 = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.NoOpLossScale())
  _, grads32 = jax.jit(jaxmp.scaled_value_and_grad(mse, jaxmp.NoOpLossScale()),
                       static_argnums=3)(params, x, y, FLOAT32)
  assert int(tx32.update(grads32, tx32.init(params), params)[1].skipped_steps) == 0


UNDERFLOW = setup(1, 8, 32, 4, 64)


@jax.jit
def float16_grads(params, x, y, loss_scale):
  """Gradients of the float16 model, unscaled back to the true values."""
  _, grads = jaxmp.scaled_value_and_grad(small_loss, loss_scale)(params, x, y, MIXED)
  return loss_scale.unscale(grads)


def zero_fraction(grads):
  fraction = float(jax.jit(jaxmp.grad_stats)(grads)["zero_fraction"])
  assert np.isclose(fraction, np.mean(flat(grads) == 0))
  return fraction


def test_scaling_rescues_gradients_that_underflow_in_float16():
  reference = jax.jit(jax.grad(small_loss), static_argnums=3)(*UNDERFLOW, FLOAT32)
  assert zero_fraction(reference) < 0.2  # only the dead ReLUs' exact zeros
  unscaled = float16_grads(*UNDERFLOW, jaxmp.NoOpLossScale())
  scaled = float16_grads(*UNDERFLOW, jaxmp.StaticLossScale(2.0**15))
  # Without a loss scale every gradient is flushed to zero in float16; with
  # one, the zeros are only those of the float32 reference.
  assert zero_fraction(unscaled) > 0.99
  assert zero_fraction(scaled) <= zero_fraction(reference) + 0.01
  error = lambda g: np.linalg.norm(flat(g) - flat(reference)) / np.linalg.norm(flat(reference))
  assert error(scaled) < 1e-2 and error(unscaled) > 0.9
  # Nothing overflowed either way, so neither step would have been skipped.
  assert finite(unscaled) and finite(scaled)
  # The headroom diagnostics see the problem before training starts.
  headroom = jax.jit(jaxmp.dtype_headroom, static_argnums=1)(reference, jnp.float16)
  assert float(headroom["underflow"]) + float(headroom["subnormal"]) > 0.5


def test_dynamic_scaling_trains_like_float32_where_unscaled_float16_stalls():
  params0, x, y = UNDERFLOW

  def moved(policy, loss_scale):
    """How far 30 steps of plain SGD (updates as small as the gradients) move."""
    tx = jaxmp.loss_scaling(optax.sgd(3e3), loss_scale)

    @jax.jit
    def step(params, state):
      _, grads = jaxmp.scaled_value_and_grad(
          small_loss, jaxmp.get_loss_scale(state))(params, x, y, policy)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    params, state = params0, tx.init(params0)
    for _ in range(30):
      params, state = step(params, state)
    assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 0
    return flat(params) - flat(params0)

  moved32 = moved(FLOAT32, jaxmp.NoOpLossScale())
  assert np.linalg.norm(moved32) > 1e-3  # float32 learns something
  assert not np.any(moved(MIXED, jaxmp.NoOpLossScale()))  # all zero: stalled
  np.testing.assert_allclose(moved(MIXED, jaxmp.DynamicLossScale(2.0**15, period=10)),
                             moved32, rtol=0, atol=1e-2 * np.abs(moved32).max())
