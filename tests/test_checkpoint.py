"""Tests of orbax checkpoints: a resumed run is bit-identical to running on."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax

LOSS_SCALE = jaxmp.DynamicLossScale(
    2.0**8, period=3, min_loss_scale=2.0, max_loss_scale=2.0**12, hysteresis=2)


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


def make_state(loss_scale=LOSS_SCALE):
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-2),
      policy="mixed_float16", loss_scale=loss_scale)


def batches(n):
  """Batches with an overflow at the 5th: the resumed run must skip it too."""
  out = []
  for i in range(n):
    x = jax.random.normal(jax.random.key(i), (8, 4))
    if i in (4, 5):
      x = x.at[0, 0].set(jnp.inf)
    out.append((x, jax.random.randint(jax.random.key(100 + i), (8,), 0, 3)))
  return out


def arrays(state):
  """The pytree part of a state (its ``tx`` is a new closure in each state)."""
  return state.step, state.params, state.opt_state


@jax.jit
def train_step(state, x, y):

  def loss_fn(params, x, y):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  _, grads = state.value_and_grad(loss_fn)(state.params, x, y)
  return state.apply_gradients(grads=grads)


def test_train_state_resume_is_bit_identical(tmp_path):
  k = 3
  data = batches(k + 6)
  state = make_state()
  for x, y in data[:k]:
    state = train_step(state, x, y)
  jaxmp.flax.save_checkpoint(tmp_path / "step_3", state)
  # Run on without the restore.
  reference = state
  for x, y in data[k:]:
    reference = train_step(reference, x, y)
  # Restore into an abstract target built by the code, and run the same 6 steps.
  target = jax.eval_shape(make_state)
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "step_3", target)
  assert isinstance(restored, jaxmp.flax.TrainState)
  chex.assert_trees_all_equal(arrays(restored), arrays(state))
  for x, y in data[k:]:
    restored = train_step(restored, x, y)
  chex.assert_trees_all_equal(arrays(restored), arrays(reference))
  assert int(restored.metrics["skipped_steps"]) == 2
  # The static configuration comes back with the target.
  loss_scale = restored.loss_scale
  assert (loss_scale.period, loss_scale.hysteresis, loss_scale.min_loss_scale,
          loss_scale.max_loss_scale) == (3, 2, 2.0, 2.0**12)
  assert jaxmp.get_loss_scale(restored.opt_state).config() == {
      "type": "DynamicLossScale", "period": 3, "factor": 2.0,
      "min_loss_scale": 2.0, "backoff_factor": 0.5, "max_loss_scale": 4096.0,
      "hysteresis": 2, "consecutive_hysteresis": False}
  assert restored.policy == jaxmp.get_policy("mixed_float16")


def test_changed_configuration_is_refused(tmp_path):
  state = make_state()
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state)
  other = make_state(jaxmp.DynamicLossScale(2.0**8, period=2000))
  with pytest.raises(ValueError, match="'period': 3.*'period': 2000.*check_config=False"):
    jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", other)
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", other, check_config=False)
  assert restored.loss_scale.period == 2000  # the target's, as asked
  chex.assert_trees_all_equal(restored.params, state.params)


def test_plain_orbax_round_trip_keeps_config(tmp_path):
  # With orbax alone, the static configuration lives in the target's treedef.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  state = make_state()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "plain", state)
  checkpointer.wait_until_finished()
  restored = checkpointer.restore(tmp_path / "plain", jax.eval_shape(make_state))
  chex.assert_trees_all_equal(arrays(restored), arrays(state))
  assert restored.loss_scale.hysteresis == 2 and restored.loss_scale.period == 3


def test_plain_orbax_checkpoint_restores_unchecked_when_asked(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  state = make_state()
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "plain", state)
  checkpointer.wait_until_finished()
  with pytest.raises(ValueError, match="plain orbax checkpoint.*check_config=False"):
    jaxmp.flax.restore_checkpoint(tmp_path / "plain", jax.eval_shape(make_state))
  restored = jaxmp.flax.restore_checkpoint(
      tmp_path / "plain", jax.eval_shape(make_state), check_config=False)
  chex.assert_trees_all_equal(arrays(restored), arrays(state))
  assert restored.loss_scale.hysteresis == 2  # from the target


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
    self.dense2 = nnx.Linear(8, 3, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.dense2(nnx.relu(self.dense1(x))).astype(jnp.float32)


def make_nnx():
  model = NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-2), LOSS_SCALE), wrt=nnx.Param)
  return model, optimizer


@nnx.jit
def nnx_step(model, optimizer, x, y):
  loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(x), y).mean()
  _, grads = jaxmp.scaled_value_and_grad(
      loss_fn, jaxmp.get_loss_scale(optimizer.opt_state),
      value_and_grad=nnx.value_and_grad)(model)
  optimizer.update(model, grads)


def test_nnx_resume_is_bit_identical(tmp_path):
  k = 3
  data = batches(k + 6)
  model, optimizer = make_nnx()
  for x, y in data[:k]:
    nnx_step(model, optimizer, x, y)
  jaxmp.flax.save_checkpoint(tmp_path / "nnx", (model, optimizer))
  for x, y in data[k:]:
    nnx_step(model, optimizer, x, y)
  reference = nnx.to_pure_dict(nnx.state((model, optimizer)))
  new_model, new_optimizer = make_nnx()
  jaxmp.flax.restore_checkpoint(tmp_path / "nnx", (new_model, new_optimizer))
  assert int(new_optimizer.step[...]) == k
  for x, y in data[k:]:
    nnx_step(new_model, new_optimizer, x, y)
  chex.assert_trees_all_equal(
      nnx.to_pure_dict(nnx.state((new_model, new_optimizer))), reference)
  assert jaxmp.get_loss_scale(new_optimizer.opt_state).hysteresis == 2
  assert jaxmp.get_loss_scale(new_optimizer.opt_state).period == 3
