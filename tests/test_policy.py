"""Tests of policies: the Policy, its casts, the string grammar and wrap_apply.

The error messages of bad policy strings live in tests/test_bad_input.py.
"""

import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from matmul_dtypes import input_dtypes, matmul_dtypes

F32, F16 = jnp.float32, jnp.float16


# The grammar.

# A jmp spec's dtypes are compared with jmp's own in tests/test_jmp_suite.py.
@pytest.mark.parametrize(
    "spec, expected",
    [
        ("p=f32,c=bf16,o=f32", "p=f32,c=bf16,o=f32"),
        ("params=float32,compute=bfloat16,output=float32", "p=f32,c=bf16,o=f32"),
        ("p = f32 , c = f16", "p=f32,c=f16,o=f16"),  # output follows compute
        ("c=bf16", "p=f32,c=bf16,o=bf16"),  # params default to float32
        ("p=f16", "p=f16,c=f16,o=f16"),  # compute follows params
        ("c=f16,o=full", "p=f32,c=f16,o=f32"),
        ("bf16", "p=bf16,c=bf16,o=bf16"),
        ("half", "p=f16,c=f16,o=f16"),  # float16 on the CPU, as jmp
        ("fp64", "p=f64,c=f64,o=f64"),
        ("p=fp32,c=fp16", "p=f32,c=f16,o=f16"),  # PyTorch's spelling, short names
        ("mixed_bfloat16", "p=f32,c=bf16,o=f32"),
        ("mixed_float16", "p=f32,c=f16,o=f32"),
        ("float32", "p=f32,c=f32,o=f32"),
        ("auto", str(jaxmp.auto_policy())),
        ("p=f32,c=bf16,o=f32,dot=fp8", "p=f32,c=bf16,o=f32,dot=fp8"),
        (jmp.get_policy("p=f32,c=bf16,o=f16"), "p=f32,c=bf16,o=f16"),
    ],
)
def test_grammar_presets_and_the_round_trip_of_str(spec, expected):
  policy = jaxmp.get_policy(spec)
  assert str(policy) == expected
  assert jaxmp.get_policy(str(policy)) == policy


# The dtypes are JAX scalar types, as in jmp.


def test_dtypes_are_jax_scalar_types():
  policy = jaxmp.Policy(np.dtype("float32"), np.float16, "bf16")
  assert policy.param_dtype is jnp.float32
  assert policy.compute_dtype is jnp.float16
  assert policy.output_dtype is jnp.bfloat16
  assert policy.compute_dtype.__name__ == "float16"
  assert policy.compute_dtype(1.5).dtype == np.dtype("float16")  # callable
  assert {jnp.float16: "half"}[policy.compute_dtype] == "half"  # a dict key
  # Equal to NumPy's dtypes and scalar types, either way round.
  assert policy.compute_dtype == np.dtype("float16") == policy.compute_dtype
  assert policy.compute_dtype == np.float16 and np.float16 == policy.compute_dtype
  assert policy.compute_dtype != np.dtype("float32")
  # However the dtypes were given, equal policies are equal and hash alike.
  same = jaxmp.Policy(jnp.float32, jnp.float16, jnp.bfloat16)
  assert policy == same and hash(policy) == hash(same)
  assert jaxmp.Policy("f32", "f16", "f32") == jaxmp.get_policy("mixed_float16")


def test_with_methods_and_needs_loss_scaling():
  policy = jaxmp.get_policy("float32")
  assert str(policy.with_compute_dtype("bf16")) == "p=f32,c=bf16,o=f32"
  assert str(policy.with_param_dtype(jnp.float64)) == "p=f64,c=f32,o=f32"
  assert str(policy.with_output_dtype(np.float16)) == "p=f32,c=f32,o=f16"
  assert policy.with_compute_dtype("f16").compute_dtype is jnp.float16
  assert [jaxmp.get_policy(s).needs_loss_scaling for s in (
      "mixed_bfloat16", "mixed_float16", "float32", "mixed_fp8")] == [
          False, True, False, False]


# Casts.


def test_casts_touch_only_floating_array_leaves_and_keep_their_kind():
  policy = jaxmp.get_policy("mixed_float16")
  tree = {
      "jax_f32": jnp.array([1.0, 1.0 + 2.0**-11]),
      "int": jnp.arange(3), "bool": jnp.array([True]),
      "complex": jnp.array([1 + 2j], jnp.complex64),
      "np": np.ones(2), "np_scalar": np.float32(1.5), "python": 1.5,
      "string": "name", "none": None, "function": jnp.tanh,  # as Equinox modules hold
  }
  out = policy.cast_to_compute(tree)
  # 1 + 2**-11 is halfway between two float16 numbers and rounds to 1.
  chex.assert_trees_all_equal(out, {
      **tree, "jax_f32": jnp.array([1.0, 1.0], jnp.float16),
      "np": np.ones(2, np.float16), "np_scalar": np.float16(1.5)}, strict=True)
  assert isinstance(out["np"], np.ndarray) and isinstance(out["np_scalar"], np.generic)
  assert out["function"] is jnp.tanh and isinstance(out["python"], float)
  assert policy.cast_to_param(out)["jax_f32"].dtype == np.float32
  bf16 = policy.with_output_dtype(jnp.bfloat16).cast_to_output(out)
  assert bf16["jax_f32"].dtype == jnp.bfloat16 and bf16["int"].dtype == np.int32


def test_policy_is_hashable_and_a_static_jit_argument():

  @jax.jit(static_argnums=1)
  @chex.assert_max_traces(n=2)
  def step(x, policy):
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  a = jaxmp.get_policy("mixed_bfloat16")
  b = jaxmp.Policy(np.dtype("float32"), "bf16", np.float32)
  assert a == b and hash(a) == hash(b)
  chex.assert_trees_all_equal(step(jnp.ones(2), a), jnp.full(2, 2.0))
  step(jnp.ones(2), b)  # an equal policy: no retrace
  assert step(jnp.ones(2), jaxmp.get_policy("bf16")).dtype == jnp.bfloat16  # retraces once


# 16-bit params warn once.


def test_sixteen_bit_params_warn_once_per_policy_at_the_callers_line():
  # Policies used by no other test, so that this process has not warned yet.
  bf16 = jaxmp.get_policy("p=bf16,c=bf16,o=f64")
  with pytest.warns(UserWarning) as record:
    bf16.cast_to_param({"w": jnp.ones(2)})
  assert len(record) == 1
  message = str(record[0].message)
  assert message.startswith("jaxmp: the policy p=bf16,c=bf16,o=f64 keeps the parameters")
  assert "in bfloat16: an update smaller than 0.00390625 of a weight is rounded away" in message
  assert "you probably want 'mixed_bfloat16'" in message
  assert record[0].filename == __file__
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # Not again: not for an equal policy, nor when traced, nor per leaf.
    jaxmp.get_policy("p=bf16,c=bf16,o=f64").cast_to_param({"w": jnp.ones(2)})
    jax.jit(bf16.params_for_storage)({"a": jnp.ones(2), "b": jnp.ones(3)})
    # 32-bit params never warn.
    jaxmp.get_policy("p=f32,c=f16,o=bf16").cast_to_param(jnp.ones(2))
    # Nor do casts to the compute or output dtype.
    jaxmp.get_policy("p=f16,c=f16,o=f64").cast_to_compute(jnp.ones(2))
  with pytest.warns(UserWarning, match=r"in float16: .*'mixed_float16'"):
    jaxmp.get_policy("p=fp16,c=fp16,o=f64").params_for_storage(jnp.ones(2))


# wrap_apply: params, inputs and outputs under the policy.


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(nn.relu(nn.Dense(8)(x)))


class TokenModel(nn.Module):

  @nn.compact
  def __call__(self, ids, scale):
    return nn.Dense(2)(nn.Embed(10, 4)(ids) * scale)


class BatchNormNet(nn.Module):

  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(4)(x)
    return nn.BatchNorm(use_running_average=not train)(x)


def mlp_variables(x):
  return MLP().init(jax.random.key(0), x)


def test_wrap_apply_casts_params_floating_inputs_and_output_not_token_ids():
  policy = jaxmp.get_policy("mixed_float16")
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  variables = mlp_variables(x)
  apply = policy.wrap_apply(MLP().apply)
  assert matmul_dtypes(apply, variables, x) == [
      ("dot_general", ("float16", "float16"))] * 2
  # Keyword inputs too.
  assert input_dtypes(lambda v, x: apply(v, x=x), variables, x) == {"float16"}
  out = apply(variables, x)
  expected = MLP().apply(policy.cast_to_compute(variables), x.astype(F16)).astype(F32)
  chex.assert_trees_all_equal(out, expected)
  # Without the wrapper the float32 batch meets the float16 params: standard
  # promotion computes in float32 (strict promotion refuses it).
  with jax.numpy_dtype_promotion("standard"):
    assert input_dtypes(MLP().apply, policy.cast_to_compute(variables), x) == {"float32"}
  # Integer inputs (token ids) are left alone.
  model, ids, scale = TokenModel(), jnp.array([[1, 7, 3]]), jnp.float32(0.5)
  variables = model.init(jax.random.key(0), ids, scale)
  out = policy.wrap_apply(model.apply)(variables, ids, scale)
  expected = model.apply(policy.cast_to_compute(variables), ids, scale.astype(F16))
  chex.assert_trees_all_equal(out, expected.astype(F32))


@pytest.mark.parametrize("kind", ["policy", "path_policy", "module_policy"])
def test_wrap_apply_with_mutable_casts_only_the_output(kind):
  policy = {
      "policy": jaxmp.get_policy("mixed_float16"),
      "path_policy": jaxmp.PathPolicy({"^BatchNorm_0/": "float32"}, default="mixed_float16"),
      "module_policy": jaxmp.flax.ModulePolicy({}, default="mixed_float16"),
  }[kind]
  model = BatchNormNet()
  x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
  variables = model.init(jax.random.key(0), x, train=False)
  apply = policy.wrap_apply(model.apply)
  out, updates = apply(variables, x, train=True, mutable=["batch_stats"])
  assert out.dtype == np.float32  # the output dtype
  assert jax.tree_util.tree_map(lambda s: s.dtype, updates["batch_stats"]) == {
      "BatchNorm_0": {"mean": np.float32, "var": np.float32}}  # their own dtype
  assert not np.array_equal(updates["batch_stats"]["BatchNorm_0"]["mean"],
                            variables["batch_stats"]["BatchNorm_0"]["mean"])
  eval_out = apply({**variables, **updates}, x, train=False)
  assert eval_out.dtype == np.float32
  out, state = apply(variables, x, train=False, capture_intermediates=True)
  assert out.dtype == np.float32 and "intermediates" in state
  assert input_dtypes(lambda v: apply(v, x, train=True, mutable=["batch_stats"]),
                      variables) == {"float16"}


def closure_pattern_and_eval(policy):
  """A TrainState whose loss_fn closes over a float32 batch, and its eval."""
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  y = jnp.array([0, 2])
  state = jaxmp.flax.TrainState.create(
      apply_fn=MLP().apply, params=mlp_variables(x)["params"], tx=optax.sgd(0.1),
      policy=policy, loss_scale=jaxmp.StaticLossScale(8.0))

  def train_step(state):
    def loss_fn(params):  # Flax's canonical closure over the batch
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  def eval_step(state):
    return state.apply_fn({"params": state.params}, x)

  return state, train_step, eval_step


@pytest.mark.parametrize("kind", ["policy", "path_policy", "module_policy"])
def test_closures_and_eval_through_apply_fn_run_under_every_policy_kind(kind):
  policy = {
      "policy": "mixed_float16",
      "path_policy": jaxmp.PathPolicy({"bias$": "mixed_float16"}, default="mixed_float16"),
      "module_policy": jaxmp.flax.ModulePolicy({}, default="mixed_float16"),
  }[kind]
  state, train_step, eval_step = closure_pattern_and_eval(policy)
  # Forward and backward products of the training step, and eval, in float16.
  assert len(matmul_dtypes(train_step, state)) == 5
  assert input_dtypes(train_step, state) == {"float16"}
  assert input_dtypes(eval_step, state) == {"float16"}
  logits = jax.jit(eval_step)(state)
  assert logits.dtype == np.float32  # the model outputs in the output dtype
  new_state, loss = jax.jit(train_step)(state)
  assert loss.dtype == np.float32 and bool(new_state.metrics["last_finite"])
  assert {p.dtype for p in jax.tree_util.tree_leaves(new_state.params)} == {np.dtype("float32")}


@pytest.mark.parametrize("kind", ["policy", "path_policy", "module_policy"])
def test_wrapped_apply_functions_of_equal_policies_are_equal(kind):
  make = {
      "policy": lambda: jaxmp.get_policy("mixed_float16"),
      "path_policy": lambda: jaxmp.PathPolicy({"bias$": "mixed_float16"}, default="mixed_float16"),
      "module_policy": lambda: jaxmp.flax.ModulePolicy({}, default="mixed_float16"),
  }[kind]
  model = MLP()
  a, b = make().wrap_apply(model.apply), make().wrap_apply(model.apply)
  assert a == b and hash(a) == hash(b)
  assert a != make().wrap_apply(MLP().apply)  # another model
  assert a.__name__ == "apply" and a.__wrapped__ == model.apply
  chex.clear_trace_counter()  # the counter is shared by the parametrized runs

  @jax.jit(static_argnums=0)
  @chex.assert_max_traces(n=1)
  def eval_step(apply, variables, x):
    return apply(variables, x)

  x = jnp.ones((2, 4))
  variables = mlp_variables(x)
  chex.assert_trees_all_equal(eval_step(a, variables, x), eval_step(b, variables, x))
