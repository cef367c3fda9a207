"""Tests of jaxmp.flax.TrainState: a Linen MLP under mixed_float16."""

import functools
from typing import Any

import chex
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from models import LinenBatchNormMLP as BatchNormMLP
from models import LinenMLP as MLP
from models import classification_batch as batch

F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)


@functools.cache
def mlp_params():
  return jax.jit(MLP().init)(jax.random.key(0), jnp.ones((1, 4)))["params"]


def make_state(policy="mixed_float16", loss_scale=None, tx=None, **kwargs):
  model, params = MLP(), mlp_params()
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


def assert_bit_identical(a, b):
  """Same structure, dtypes and bits (so -0.0 differs from 0.0)."""
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


class BatchNormState(jaxmp.flax.TrainState):
  batch_stats: Any  # no default needed


def make_batch_norm_state():
  model = BatchNormMLP()
  variables = model.init(jax.random.key(0), jnp.ones((1, 4)), train=False)
  return BatchNormState.create(
      apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2),
      policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**8),
      batch_stats=variables["batch_stats"])


def batch_norm_step(state, x, y):
  """The Flax BatchNorm recipe: the new stats go to apply_gradients."""

  def loss_fn(params, x, y):
    logits, updates = state.apply_fn(
        {"params": params, "batch_stats": state.batch_stats}, x, train=True,
        mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean()
    return loss, updates["batch_stats"]

  (_, new_stats), grads = state.value_and_grad(loss_fn, has_aux=True)(
      state.params, x, y)
  return state.apply_gradients(grads=grads, batch_stats=new_stats), new_stats


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

  value, grads = jax.jit(state.value_and_grad(loss))(state.params, x, y)
  # The batch comes as it is; apply_fn casts the model's inputs and outputs.
  assert seen == {"params": {F16}, "x": F32, "y": np.dtype(jnp.int32), "logits": F32}
  assert value.dtype == F32  # cast to the output dtype

  def manual(params):  # the same computation written out by hand
    out = MLP().apply(
        {"params": jaxmp.get_policy("mixed_float16").cast_to_compute(params)},
        x.astype(F16)).astype(F32)
    return jnp.mean(out ** 2)

  expected_value, expected_grads = jax.jit(jaxmp.scaled_value_and_grad(
      manual, jaxmp.StaticLossScale(64.0)))(state.params)
  chex.assert_trees_all_equal(value, expected_value)
  chex.assert_trees_all_equal(grads, expected_grads)
  assert {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
  # Float targets come as they are too: the loss compares the float32 output
  # with 1000.3, not float16's 1000.5, and nothing mixes float16 and float32.
  y = jnp.full((x.shape[0], 3), 1000.3)
  assert float(y.astype(F16)[0, 0]) == 1000.5

  def regression(params, x, y):
    seen["y"] = y.dtype
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  value, _ = jax.jit(state.value_and_grad(regression))(state.params, x, y)
  assert seen["y"] == F32 and value.dtype == F32
  assert float(value) == float(jax.jit(regression)(
      jaxmp.get_policy("mixed_float16").cast_to_compute(state.params), x, y))


@pytest.mark.parametrize("policy", [
    "mixed_float16",
    jaxmp.PathPolicy({"^Dense_1/": "float32"}, default="mixed_float16"),
    jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16")],
    ids=["policy", "path_policy", "module_policy"])
def test_a_state_created_twice_is_one_pytree_structure(policy):
  # As with Flax's TrainState, the static fields (apply_fn, tx, policy)
  # compare by value (the model and the optimizer built once, as in Flax):
  # a restore target from jax.eval_shape maps over the state, and a second
  # state runs the same compiled step.
  model, tx = MLP(), optax.adam(1e-2)
  make = lambda: jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.ones((1, 4)))[
          "params"], tx=tx, policy=policy)
  state, again = make(), make()
  assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(again)
  assert hash(jax.tree_util.tree_structure(state)) == hash(
      jax.tree_util.tree_structure(again))
  jax.tree.map(lambda a, b: a, state, jax.eval_shape(make))
  traces = []
  step = jax.jit(lambda s: traces.append(s) or s.step + 1)
  assert int(step(state)) == int(step(again)) == 1 and len(traces) == 1


def test_create_defaults():
  model, params = MLP(), mlp_params()
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


def test_a_subclass_steps_without_retrace_and_its_policy_stays_static():
  state = make_batch_norm_state()
  assert [f for f in BatchNormState.__dataclass_fields__][-1] == "batch_stats"
  assert state.policy == jaxmp.get_policy("mixed_float16")
  # batch_stats is a leaf, the policy is not.
  leaves = jax.tree_util.tree_leaves(state)
  assert not any(isinstance(leaf, jaxmp.Policy) for leaf in leaves)
  assert len(leaves) == len(jax.tree_util.tree_leaves(
      (state.step, state.params, state.opt_state, state.batch_stats)))
  x, y = batch()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    return batch_norm_step(state, x, y)[0]

  state = step(step(state, x, y), x, y)
  assert isinstance(state, BatchNormState) and int(state.step) == 2
  assert state.step.dtype == jnp.int32
  assert state.policy == jaxmp.get_policy("mixed_float16")
  with pytest.raises(TypeError, match="batch_stats"):
    BatchNormState.create(apply_fn=None, params={}, tx=optax.sgd(0.1))


def test_apply_gradients_keeps_the_fields_dtypes_and_replaces_static_ones():

  class State(jaxmp.flax.TrainState):
    ema: Any
    note: str = flax.struct.field(pytree_node=False, default="")

  params = {"w": jnp.ones(2)}
  state = State.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                       policy="mixed_float16", ema=params)
  # A float16 value is stored in the field's float32; static fields as given.
  finite = state.apply_gradients(grads={"w": jnp.ones(2)},
                                 ema={"w": jnp.full(2, 0.5, F16)}, note="a")
  assert finite.ema["w"].dtype == F32 and finite.note == "a"
  np.testing.assert_array_equal(finite.ema["w"], [0.5, 0.5])
  skipped = finite.apply_gradients(grads={"w": jnp.full(2, jnp.nan)},
                                   ema={"w": jnp.zeros(2)}, note="b")
  assert_bit_identical(skipped.ema, finite.ema)
  assert skipped.note == "b"
  np.testing.assert_array_equal(skipped.params["w"], finite.params["w"])


def test_create_passes_axis_name_so_replicas_skip_together():
  state = make_state(tx=optax.sgd(0.1), axis_name="replicas")
  x, y = batch()
  replicated = jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), state)
  xs = jnp.stack([x, x.at[0, 0].set(jnp.inf)])  # an overflow on one replica
  ys = jnp.stack([y, y])

  def step(state, x, y):
    new_state, _, _ = train_step(state, x, y)
    return new_state

  # Jitted: the same program as the eager vmap, compiled once instead of op by op.
  stepped = jax.jit(jax.vmap(step, axis_name="replicas"))(replicated, xs, ys)
  np.testing.assert_array_equal(stepped.metrics["skipped_steps"], [1, 1])
  chex.assert_trees_all_equal(stepped.params, replicated.params)


class _NormedMlp(nn.Module):
  """Layers that declare float32, with a LayerNorm whose params matter."""

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, dtype=jnp.float32)(x)
    x = nn.LayerNorm(dtype=jnp.float32, scale_init=nn.initializers.normal(1.0),
                     bias_init=nn.initializers.normal(1.0))(x)
    return nn.Dense(4, dtype=jnp.float32)(nn.relu(x))


def test_autocast_alone_decides_the_dtypes():
  """Under autocast=True the state's apply_fn casts nothing itself (no
  blanket cast of the params or inputs to the compute dtype): the loss and
  gradients are those of jaxmp.autocast over the bare model, bit for bit."""
  model = _NormedMlp()
  x = jax.random.normal(jax.random.key(1), (8, 3))
  params = model.init(jax.random.key(0), x)["params"]
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
      policy="mixed_bfloat16", autocast=True)

  def loss_fn(apply_fn):
    return lambda params, x: jnp.mean(apply_fn({"params": params}, x) ** 2)

  got = jax.jit(state.value_and_grad(loss_fn(state.apply_fn)))(params, x)
  bare = jaxmp.autocast(loss_fn(model.apply), "mixed_bfloat16")
  want = jax.jit(jax.value_and_grad(bare))(params, x)
  chex.assert_trees_all_equal(got, want)
