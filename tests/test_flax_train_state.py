"""Tests of jaxmp.flax.TrainState: a Linen MLP under mixed_float16."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl.testing import parameterized

import jaxmp
import jaxmp.flax
from models import LinenMLP as MLP
from models import classification_batch as batch

F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)


def make_state(policy="mixed_float16", loss_scale=None, tx=None, **kwargs):
  model = MLP()
  x = jnp.ones((1, 4))
  params = model.init(jax.random.key(0), x)["params"]
  if loss_scale is None:
    loss_scale = jaxmp.DynamicLossScale(2.0**8, period=100)
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx or optax.adam(1e-2),
      policy=policy, loss_scale=loss_scale, **kwargs)


def loss_fn(params, x, y, apply_fn):
  logits = apply_fn({"params": params}, x)
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), y).mean(), logits


def train_step(state, x, y):
  (loss, logits), grads = state.value_and_grad(
      lambda p, x, y: loss_fn(p, x, y, state.apply_fn), has_aux=True)(
          state.params, x, y)
  return state.apply_gradients(grads=grads), loss, logits


def changed_leaves(a, b):
  return jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda u, v: bool(jnp.any(u != v)), a, b))


class TrainStateTest(parameterized.TestCase):

  # A whole training step, so jitted only: the wrapper's eager path is tested
  # in test_loss_scaling.py.
  @chex.variants(with_jit=True)
  def test_overflow_skips_then_next_step_updates_every_param(self):
    step = self.variant(train_step)
    state = make_state()
    x, y = batch()
    state, loss, logits = step(state, x, y)
    self.assertEqual(logits.dtype, F32)  # the policy's output dtype
    self.assertTrue(np.isfinite(loss))
    params_before = state.params
    opt_before = state.opt_state.inner_state
    # An inf in the batch: the gradients are not finite, the step is skipped.
    state, _, _ = step(state, x.at[0, 0].set(jnp.inf), y)
    chex.assert_trees_all_equal(state.params, params_before)
    chex.assert_trees_all_equal(state.opt_state.inner_state, opt_before)
    self.assertEqual(float(state.loss_scale.loss_scale), 2.0**7)
    self.assertEqual(int(state.step), 2)  # step counts calls ...
    self.assertEqual(int(state.metrics["skipped_steps"]), 1)  # ... skips here
    self.assertFalse(bool(state.metrics["last_finite"]))
    # The next finite step updates every parameter.
    new_state, _, _ = step(state, x, y)
    self.assertTrue(all(changed_leaves(new_state.params, state.params)))
    self.assertTrue(bool(new_state.metrics["last_finite"]))
    self.assertEqual(int(new_state.step), 3)
    # Params stay float32 throughout.
    dtypes = {p.dtype for p in jax.tree_util.tree_leaves(new_state.params)}
    self.assertEqual(dtypes, {F32})


def test_value_and_grad_runs_under_policy_and_returns_scaled_grads():
  state = make_state(loss_scale=jaxmp.StaticLossScale(64.0))
  x, y = batch()
  seen = {}

  def loss(params, x, y):
    seen["params"] = {p.dtype for p in jax.tree_util.tree_leaves(params)}
    seen["x"], seen["y"] = x.dtype, y.dtype
    logits = state.apply_fn({"params": params}, x)
    seen["logits"] = logits.dtype
    return jnp.mean(logits ** 2)

  value, grads = state.value_and_grad(loss)(state.params, x, y)
  assert seen == {"params": {F16}, "x": F16, "y": np.dtype(jnp.int32), "logits": F16}
  assert value.dtype == F32  # cast to the output dtype

  def manual(params):  # the same computation written out by hand
    out = loss(jaxmp.get_policy("mixed_float16").cast_to_compute(params),
               x.astype(F16), y)
    return out.astype(F32)

  expected_value, expected_grads = jaxmp.scaled_value_and_grad(
      manual, jaxmp.StaticLossScale(64.0))(state.params)
  chex.assert_trees_all_equal(value, expected_value)
  chex.assert_trees_all_equal(grads, expected_grads)
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}


def test_no_retrace_and_policy_is_static():
  state = make_state()
  x, y = batch()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    return train_step(state, x, y)[0]

  state = step(state, x, y)
  state = step(state, x, y)
  assert int(state.step) == 2
  assert state.policy == jaxmp.get_policy("mixed_float16")
  leaves = jax.tree_util.tree_leaves(state)
  assert not any(isinstance(leaf, jaxmp.Policy) for leaf in leaves)
  assert state.step.dtype == jnp.int32


def test_create_defaults_and_errors():
  assert isinstance(make_state("mixed_float16", loss_scale=None).loss_scale,
                    jaxmp.DynamicLossScale)
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  f16_default = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy="mixed_float16")
  assert isinstance(f16_default.loss_scale, jaxmp.DynamicLossScale)
  assert float(f16_default.loss_scale.loss_scale) == 2.0**15
  bf16 = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy="mixed_bfloat16")
  assert isinstance(bf16.loss_scale, jaxmp.NoOpLossScale)
  assert str(bf16.policy) == "p=f32,c=bf16,o=f32"
  # Params are cast to the param dtype at creation.
  half = jax.tree_util.tree_map(lambda p: p.astype(F16), params)
  created = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=half, tx=optax.sgd(0.1), policy="float32")
  assert {p.dtype for p in jax.tree_util.tree_leaves(created.params)} == {F32}
  wrapped = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
  with pytest.raises(ValueError, match="already wrapped"):
    jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params, tx=wrapped)
  with pytest.raises(TypeError, match="loss_scale must be"):
    jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=optax.sgd(0.1), loss_scale=2.0**15)
  with pytest.raises(ValueError, match="Unknown policy"):
    jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=optax.sgd(0.1), policy="mixed_fp16")
  with pytest.raises(ValueError, match="needs a default"):
    jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params,
                                 tx=optax.sgd(0.1),
                                 policy=jaxmp.PathPolicy({"x": "f32"}, default=None))


def test_schedule_does_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  state = make_state(tx=optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
  x, y = batch()
  step = jax.jit(train_step)
  state = step(state, x, y)[0]
  after_one = state.opt_state.inner_state
  state = step(state, x.at[0, 0].set(jnp.nan), y)[0]
  chex.assert_trees_all_equal(state.opt_state.inner_state, after_one)
  assert int(state.step) == 2 and int(state.metrics["skipped_steps"]) == 1
  state = step(state, x, y)[0]
  inner = state.opt_state.inner_state
  # Two applied updates: the schedule is at its second value, not its third.
  assert int(inner.count) == 2
  assert float(inner.hyperparams["learning_rate"]) == float(schedule(1))


@pytest.mark.standard_promotion(
    reason="PathPolicy casts parameters only: the float32 LayerNorm's output "
           "meets the float16 kernel of the next Dense, which Flax promotes")
def test_path_policy_state():
  policy = jaxmp.PathPolicy({"LayerNorm": "float32"}, default="mixed_float16")
  state = make_state(policy=policy)
  seen = {}

  def loss(params, x):
    seen.update(jax.tree_util.tree_map(lambda p: p.dtype, params))
    return jnp.mean(state.apply_fn({"params": params}, x) ** 2)

  x, _ = batch()
  value, grads = jax.jit(state.value_and_grad(loss))(state.params, x)
  assert seen["Dense_0"]["kernel"] == F16 and seen["LayerNorm_0"]["scale"] == F32
  assert value.dtype == F32
  state = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))(state, grads)
  assert int(state.step) == 1 and bool(state.metrics["last_finite"])


def test_module_policy_state_layernorm_in_float32():
  policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16")
  state = make_state(policy=policy)
  x, y = batch()
  jaxpr = jax.make_jaxpr(lambda s: train_step(s, x, y)[1])(state)
  norm = [e for e in jaxpr.jaxpr.eqns
          if "LayerNorm_0" in str(e.source_info.name_stack).split("/")
          and e.primitive.name == "rsqrt"]
  assert norm and all(e.outvars[0].aval.dtype == F32 for e in norm)
  dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
  # The forward products (and the backward ones they give) run in float16.
  assert {np.dtype(v.aval.dtype) for e in dots for v in e.invars} == {F16}
  state, loss, logits = jax.jit(train_step)(state, x, y)
  assert logits.dtype == F32 and np.isfinite(loss) and bool(state.metrics["last_finite"])
  assert {p.dtype for p in jax.tree_util.tree_leaves(state.params)} == {F32}
