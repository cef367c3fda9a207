"""Tests of NNX training with jaxmp: nnx.Optimizer over jaxmp.loss_scaling."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from models import NnxMLP as MLP
from models import classification_batch as batch

F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)
POLICY = jaxmp.get_policy("mixed_float16")
# NNX takes the one gradient function with NNX's own value-and-grad.
nnx_value_and_grad = functools.partial(
    jaxmp.scaled_value_and_grad, value_and_grad=nnx.value_and_grad)


def make(loss_scale=None):
  model = MLP(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"}, default=POLICY).set_nnx_dtypes(model)
  loss_scale = loss_scale or jaxmp.DynamicLossScale(2.0**8, period=100)
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-2), loss_scale), wrt=nnx.Param)
  return model, optimizer


def params_of(model):
  return jax.tree_util.tree_map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_get_loss_scale_returns_plain_arrays():
  _, optimizer = make(jaxmp.DynamicLossScale(2.0**8, period=7, hysteresis=2))
  loss_scale = jaxmp.get_loss_scale(optimizer.opt_state)
  assert isinstance(loss_scale, jaxmp.DynamicLossScale)
  assert isinstance(loss_scale.loss_scale, jax.Array)
  assert isinstance(loss_scale.counter, jax.Array)
  assert (loss_scale.period, loss_scale.hysteresis) == (7, 2)
  assert float(loss_scale.loss_scale) == 256.0
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert all(isinstance(v, jax.Array) for v in metrics.values())
  jaxmp.check_loss_scale(optimizer.opt_state)  # nothing to report


def test_compute_dtypes_and_no_retrace():
  model, optimizer = make()
  x, y = batch()
  dtypes = {}

  def probe(model):
    dtypes["hidden"] = model.dense1(x.astype(F16)).dtype
    dtypes["norm"] = model.norm(jnp.ones((1, 16), F16)).dtype
    return jnp.zeros(())

  jax.eval_shape(lambda: probe(model))
  assert dtypes == {"hidden": F16, "norm": F32}

  traces = []

  @nnx.jit
  def step(model, optimizer, x, y):
    traces.append(1)
    loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(
        POLICY.cast_to_output(m(x)), y).mean()
    loss, grads = nnx_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model)
    optimizer.update(model, grads)
    return loss

  step(model, optimizer, x, y)
  step(model, optimizer, x, y)
  assert len(traces) == 1


class BatchNormMLP(nnx.Module):

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 16, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.dense2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense2(nnx.relu(self.norm(self.dense1(x))))


def batch_stats_of(model):
  return jax.tree_util.tree_map(
      jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.BatchStat)))


def make_batch_norm():
  model = BatchNormMLP(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({}, default=POLICY).set_nnx_dtypes(model)
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**8)),
      wrt=nnx.Param)
  return model, optimizer


def batch_norm_step(model, optimizer, x, y):
  """Returns the statistics the forward pass computed, before any restore."""

  def loss_fn(model):
    logits = POLICY.cast_to_output(model(POLICY.cast_to_compute(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  old = jax.tree_util.tree_map(lambda v: v, nnx.state(model, nnx.BatchStat))
  _, grads = nnx_value_and_grad(
      loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model)
  optimizer.update(model, grads)
  computed = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
  nnx.update(model, jaxmp.keep_on_skip(
      optimizer.opt_state, nnx.state(model, nnx.BatchStat), old))
  return computed


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_keep_on_skip_keeps_batch_stats_bit_identical_and_a_finite_step_writes_them(jit):
  step = nnx.jit(batch_norm_step) if jit else batch_norm_step
  model, optimizer = make_batch_norm()
  x, y = batch()
  step(model, optimizer, x, y)
  stats_before, params_before = batch_stats_of(model), params_of(model)
  poisoned = step(model, optimizer, x.at[0, 0].set(jnp.inf), y)
  assert not jaxmp.all_finite(poisoned)  # the forward pass did poison them
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["skipped_steps"]) == 1
  stats_after = batch_stats_of(model)
  chex.assert_trees_all_equal(stats_after, stats_before)
  for a, b in zip(jax.tree_util.tree_leaves(stats_after),
                  jax.tree_util.tree_leaves(stats_before)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
  chex.assert_trees_all_equal(params_of(model), params_before)
  model.eval()  # eval on the running averages still works
  assert jaxmp.all_finite(model(x))
  model.train()
  computed = step(model, optimizer, x, y)
  assert bool(jaxmp.loss_scaling_metrics(optimizer.opt_state)["last_finite"])
  chex.assert_trees_all_equal(batch_stats_of(model), computed)
  changed = jax.tree_util.tree_map(
      lambda a, b: bool(jnp.any(a != b)), batch_stats_of(model), stats_before)
  assert all(jax.tree_util.tree_leaves(changed))


def test_keep_on_skip_refuses_the_models_own_variables_as_the_old_value():
  # nnx.state returns the model's Variables, which the forward pass updates
  # in place: as `old` they would keep nothing.
  model, optimizer = make_batch_norm()
  x, y = batch()
  live = nnx.state(model, nnx.BatchStat)
  _, grads = nnx_value_and_grad(
      lambda m: jnp.mean(m(x.at[0, 0].set(jnp.nan)) ** 2),
      jaxmp.get_loss_scale(optimizer.opt_state))(model)
  optimizer.update(model, grads)
  with pytest.raises(ValueError, match="Take a copy before the step"):
    jaxmp.keep_on_skip(optimizer.opt_state, nnx.state(model, nnx.BatchStat), live)
