"""Tests of orbax checkpoints: the loss scale's configuration, with jaxmp and orbax alone.

That a resumed run is bit-identical to running on is tested, for Linen and NNX,
in tests/test_checkpoint_resilience.py.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

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


def arrays(state):
  """The pytree part of a state (its ``tx`` is a new closure in each state)."""
  return state.step, state.params, state.opt_state


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
