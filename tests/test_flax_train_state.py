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
from models import LinenMLP as MLP
from models import bits, f32, like_flax_init

F16, F32 = np.dtype(jnp.float16), np.dtype(jnp.float32)
MIXED = jaxmp.get_policy("mixed_float16")
BATCH = f32(np.random.default_rng(0).normal(size=(8, 4))), jax.device_put(np.arange(8) % 3)  # NumPy


@functools.cache
def mlp_params():  # drawn in NumPy: nothing compiled
  return like_flax_init(jax.eval_shape(MLP().init, jax.random.key(0), np.ones((1, 4))))["params"]


def make_state(policy="mixed_float16", loss_scale=None, tx=None, **kwargs):
  if loss_scale is None:
    loss_scale = jaxmp.DynamicLossScale(2.0**8, period=100)
  return jaxmp.flax.TrainState.create(apply_fn=MLP().apply, params=mlp_params(),
                                      tx=tx or optax.adam(1e-2), policy=policy,
                                      loss_scale=loss_scale, **kwargs)


def train_step(state, x, y, seen=lambda dtypes: None):
  """``seen`` is given the dtype of each layer's params in the loss."""

  def loss_fn(params, x, y):
    seen({name: dtypes(p).pop() for name, p in params.items()})
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), y).mean(), logits

  (loss, logits), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
  return state.apply_gradients(grads=grads), loss, logits


def dtypes(tree):
  return {np.dtype(leaf.dtype) for leaf in jax.tree_util.tree_leaves(tree)}


def test_value_and_grad_runs_under_policy_and_returns_scaled_grads():
  state, (x, y), seen = make_state(loss_scale=jaxmp.StaticLossScale(64.0)), BATCH, {}

  def loss(params, x, y):
    logits = state.apply_fn({"params": params}, x)
    seen.update(params=dtypes(params), x=x.dtype, y=y.dtype, logits=logits.dtype)
    return jnp.mean(logits ** 2)

  value, grads = jax.jit(state.value_and_grad(loss))(state.params, x, y)
  # The batch comes as it is; apply_fn casts the model's inputs and outputs.
  assert seen == {"params": {F16}, "x": F32, "y": np.dtype(jnp.int32), "logits": F32}
  assert value.dtype == F32 and dtypes(grads) == {F32}
  manual = lambda params: jnp.mean(MLP().apply(  # the same computation by hand
      {"params": MIXED.cast_to_compute(params)}, x.astype(F16)).astype(F32) ** 2)
  chex.assert_trees_all_equal((value, grads), jax.jit(jaxmp.scaled_value_and_grad(
      manual, jaxmp.StaticLossScale(64.0)))(state.params))
  # Float targets come as they are too: the loss compares the float32 output
  # with 1000.3, not float16's 1000.5, and nothing mixes float16 and float32.
  assert float(np.float16(1000.3)) == 1000.5 and (y := f32(np.full((8, 3), 1000.3))).dtype == F32

  def regression(params, x, y):
    seen["y"] = y.dtype
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  value, _ = jax.jit(state.value_and_grad(regression))(state.params, x, y)
  assert seen["y"] == F32 and value.dtype == F32
  assert float(value) == float(jax.jit(lambda p, x, y: regression(MIXED.cast_to_compute(p), x, y))(
      state.params, x, y))


@pytest.mark.parametrize("policy", [
    "mixed_float16",
    jaxmp.PathPolicy({"^Dense_1/": "float32"}, default="mixed_float16"),
    jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16")],
    ids=["policy", "path_policy", "module_policy"])
def test_a_state_created_twice_is_one_pytree_structure(policy):
  # Static fields compare by value, as in Flax: a restore target from
  # jax.eval_shape maps over the state, and a second one runs the same step.
  model, tx = MLP(), optax.adam(1e-2)
  make = lambda: jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=mlp_params(), tx=tx, policy=policy)
  state, again = make(), make()
  treedefs = [jax.tree_util.tree_structure(s) for s in (state, again)]
  assert treedefs[0] == treedefs[1] and hash(treedefs[0]) == hash(treedefs[1])
  jax.tree.map(lambda a, b: a, state, jax.eval_shape(make))
  traces = []
  step = jax.jit(lambda s: traces.append(s) or s.step + 1)
  assert int(step(state)) == int(step(again)) == 1 and len(traces) == 1


def test_create_defaults():
  create = functools.partial(jaxmp.flax.TrainState.create, apply_fn=MLP().apply,
                             params=mlp_params(), tx=optax.sgd(0.1))
  f16, bf16 = create(policy="mixed_float16"), create(policy="mixed_bfloat16")
  assert (type(f16.loss_scale), float(f16.loss_scale.loss_scale)) == (
      jaxmp.DynamicLossScale, 2.0**15)
  assert (type(bf16.loss_scale), str(bf16.policy)) == (jaxmp.NoOpLossScale, "p=f32,c=bf16,o=f32")
  # Params are cast to the param dtype at creation.
  half = jax.tree_util.tree_map(lambda p: jax.device_put(np.asarray(p, F16)), mlp_params())
  assert dtypes(create(params=half, policy="float32").params) == {F32}
  with pytest.raises(ValueError, match="needs a default"):
    create(policy=jaxmp.PathPolicy({"x": "f32"}, default=None))


def test_schedule_does_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  state = jax.jit(lambda: make_state(tx=optax.inject_hyperparams(optax.sgd)(schedule)))()
  (x, y), step = BATCH, jax.jit(train_step)  # the state made in one program too, not op by op
  after_one = (state := step(state, x, y)[0]).opt_state.inner_state
  state = step(state, f32(np.where(np.arange(32).reshape(8, 4) == 0, np.nan, x)), y)[0]
  chex.assert_trees_all_equal(state.opt_state.inner_state, after_one)
  assert int(state.step) == 2 and int(state.metrics["skipped_steps"]) == 1
  inner = step(state, x, y)[0].opt_state.inner_state
  # Two applied updates: the schedule is at its second value, not its third.
  assert (int(inner.count), float(inner.hyperparams["learning_rate"])) == (2, jax.jit(schedule)(1))


@pytest.mark.parametrize("policy, seen", [
    pytest.param(jaxmp.PathPolicy({"LayerNorm": "float32"}, default="mixed_float16"),
                 (F16, F32, F16), id="path_policy", marks=pytest.mark.standard_promotion(
                     reason="PathPolicy casts parameters only: the float32 LayerNorm's "
                     "output meets the float16 kernel of the next Dense, which Flax promotes")),
    pytest.param(jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16"),
                 (F32, F32, F32), id="module_policy")])
def test_a_path_or_module_policy_state_keeps_the_layernorm_in_float32(policy, seen):
  """``seen``: the dtypes of the params of each layer in the loss (a
  ModulePolicy casts inside the modules)."""
  state, (x, y), got = make_state(policy=policy), BATCH, []
  step = lambda s: train_step(s, x, y, got.append)
  eqns = jax.make_jaxpr(step)(state).jaxpr.eqns
  assert got.pop() == dict(zip(("Dense_0", "LayerNorm_0", "Dense_1"), seen))
  norm = [e for e in eqns if e.primitive.name == "rsqrt"
          and "LayerNorm_0" in str(e.source_info.name_stack).split("/")]
  assert norm and all(e.outvars[0].aval.dtype == F32 for e in norm)
  if isinstance(policy, jaxmp.flax.ModulePolicy):  # every product in float16
    assert {np.dtype(v.aval.dtype) for e in eqns if e.primitive.name == "dot_general"
            for v in e.invars} == {F16}
  state, loss, logits = jax.jit(step)(state)
  assert logits.dtype == loss.dtype == F32 and np.isfinite(loss) and int(state.step) == 1
  assert bool(state.metrics["last_finite"]) and dtypes(state.params) == {F32}


def test_apply_gradients_keeps_the_fields_dtypes_and_replaces_static_ones():
  """A subclass's field is a leaf (the policy is not), stored in its dtype,
  written on a finite step and kept on a skipped one; a static field is set."""

  class State(jaxmp.flax.TrainState):
    ema: Any  # no default needed
    note: str = flax.struct.field(pytree_node=False, default="")

  params, half = {"w": f32(np.ones(2))}, lambda v: {"w": jax.device_put(np.full(2, v, F16))}
  state = State.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                       policy="mixed_float16", ema=params)
  assert list(State.__dataclass_fields__)[-2:] == ["ema", "note"] and state.policy == MIXED
  leaves = jax.tree_util.tree_leaves(state)
  assert not any(isinstance(leaf, jaxmp.Policy) for leaf in leaves)
  assert len(leaves) == len(jax.tree_util.tree_leaves(
      (state.step, state.params, state.opt_state, state.ema)))
  step = jax.jit(chex.assert_max_traces(
      lambda state, grads, ema: state.apply_gradients(grads=grads, ema=ema), n=1))
  finite = step(state, params, half(0.5))
  assert finite.ema["w"].dtype == F32  # a float16 value in the field's float32
  np.testing.assert_array_equal(finite.ema["w"], [0.5, 0.5])
  skipped = step(finite, nan := {"w": f32(np.full(2, np.nan))}, half(0.0))
  assert bits(skipped.ema) == bits(finite.ema)
  np.testing.assert_array_equal(skipped.params["w"], finite.params["w"])
  assert isinstance(skipped, State) and (skipped.policy, skipped.step.dtype, int(skipped.step)) == (
      MIXED, jnp.int32, 2)
  noted = jax.jit(lambda finite, skipped: (finite.apply_gradients(grads=params, note="a"),
                                            skipped.apply_gradients(grads=nan, note="b")))
  assert [s.note for s in noted(finite, skipped)] == ["a", "b"]
  with pytest.raises(TypeError, match="ema"):
    State.create(apply_fn=None, params={}, tx=optax.sgd(0.1))


def test_create_passes_axis_name_so_replicas_skip_together():
  state, (x, y) = make_state(tx=optax.sgd(0.1), axis_name="replicas"), BATCH
  replicated = jax.tree_util.tree_map(lambda a: np.stack([a, a]), state)  # NumPy: not compiled
  xs = np.stack([x, np.where(np.arange(32).reshape(8, 4) == 0, np.inf, x)])  # an overflow on one
  # Jitted: the same program as the eager vmap, compiled once instead of op by op.
  stepped = jax.jit(jax.vmap(lambda *args: train_step(*args)[0], axis_name="replicas"))(
      replicated, xs, np.stack([y, y]))
  np.testing.assert_array_equal(stepped.metrics["skipped_steps"], [1, 1])
  chex.assert_trees_all_equal(stepped.params, replicated.params)


class _NormedMlp(nn.Module):
  """Layers that declare float32, with a LayerNorm (the test draws its params too)."""

  @nn.compact
  def __call__(self, x):
    x = nn.LayerNorm(dtype=jnp.float32)(nn.Dense(16, dtype=jnp.float32)(x))
    return nn.Dense(4, dtype=jnp.float32)(nn.relu(x))


def test_autocast_alone_decides_the_dtypes():
  """apply_fn casts nothing itself: jaxmp.autocast over the bare model, bit for bit."""
  model, x = _NormedMlp(), f32((rng := np.random.default_rng(1)).normal(size=(8, 3)))
  params = jax.tree.map(lambda p: f32(rng.normal(size=p.shape)), jax.eval_shape(  # all normal
      model.init, jax.random.key(0), x))["params"]
  state = jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1),
                                       policy="mixed_bfloat16", autocast=True)
  loss_fn = lambda apply_fn: lambda params, x: jnp.mean(apply_fn({"params": params}, x) ** 2)
  got = jax.jit(state.value_and_grad(loss_fn(state.apply_fn)))(params, x)
  want = jax.jit(jax.value_and_grad(jaxmp.autocast(loss_fn(model.apply), "mixed_bfloat16")))(
      params, x)
  chex.assert_trees_all_equal(got, want)
