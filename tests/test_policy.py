"""Tests of policies: the Policy, its casts, the string grammar and wrap_apply
(refusals: tests/test_bad_input.py)."""

import functools
import re
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
from models import LinenBatchNormMLP, LinenMLP

F32, F16 = jnp.float32, jnp.float16


# A jmp spec's dtypes are compared with jmp's own in tests/test_jmp_suite.py.
@pytest.mark.parametrize("spec, expected", [
    ("p=f32,c=bf16,o=f32", "p=f32,c=bf16,o=f32"),
    ("params=float32,compute=bfloat16,output=float32", "p=f32,c=bf16,o=f32"),
    ("p = f32 , c = f16", "p=f32,c=f16,o=f16"),  # output follows compute (and see jmp's)
    ("p=f16", "p=f16,c=f16,o=f16"),  # compute follows params
    ("bf16", "p=bf16,c=bf16,o=bf16"),
    ("half", "p=f16,c=f16,o=f16"),  # float16 on the CPU, as jmp
    ("fp64", "p=f64,c=f64,o=f64"),
    ("p=fp32,c=fp16", "p=f32,c=f16,o=f16"),  # PyTorch's spelling, short names
    ("mixed_bfloat16", "p=f32,c=bf16,o=f32"),
    ("mixed_float16", "p=f32,c=f16,o=f32"),
    ("float32", "p=f32,c=f32,o=f32"),
    ("auto", str(jaxmp.auto_policy())),
    ("mixed_fp8", "p=f32,c=bf16,o=f32,dot=fp8"),
    (jmp.get_policy("p=f32,c=bf16,o=f16"), "p=f32,c=bf16,o=f16"),
])
def test_grammar_presets_and_the_round_trip_of_str(spec, expected):
  policy = jaxmp.get_policy(spec)
  assert str(policy) == expected
  assert jaxmp.get_policy(str(policy)) == policy
  assert policy.needs_loss_scaling == ("c=f16" in expected)  # float16 compute only


def test_dtypes_are_jax_scalar_types_and_the_with_methods():
  policy = jaxmp.Policy(np.dtype("float32"), np.float16, "bf16")
  assert policy.param_dtype is jnp.float32 and policy.output_dtype is jnp.bfloat16
  assert policy.compute_dtype is jnp.float16 and policy.compute_dtype.__name__ == "float16"
  assert policy.compute_dtype(1.5).dtype == np.dtype("float16")  # callable
  assert {jnp.float16: "half"}[policy.compute_dtype] == "half"  # a dict key
  # Equal to NumPy's dtypes and scalar types, either way round.
  assert policy.compute_dtype == np.dtype("float16") == policy.compute_dtype != np.dtype("float32")
  assert policy.compute_dtype == np.float16 and np.float16 == policy.compute_dtype
  f32 = jaxmp.get_policy("float32")
  assert [str(f32.with_compute_dtype("bf16")), str(f32.with_param_dtype(jnp.float64)),
          str(f32.with_output_dtype(np.float16))] == [
              "p=f32,c=bf16,o=f32", "p=f64,c=f32,o=f32", "p=f32,c=f32,o=f16"]
  assert f32.with_compute_dtype("f16").compute_dtype is jnp.float16


def test_casts_touch_only_floating_array_leaves_and_keep_their_kind():
  policy = jaxmp.get_policy("mixed_float16")
  tree = {"jax_f32": jnp.array([1.0, 1.0 + 2.0**-11]), "int": jnp.arange(3),
          "bool": jnp.array([True]), "complex": jnp.array([1 + 2j], jnp.complex64),
          "np": np.ones(2), "np_scalar": np.float32(1.5), "python": 1.5, "string": "name",
          "none": None, "function": jnp.tanh}  # as Equinox modules hold
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


def test_equal_policies_hash_alike_and_are_one_static_jit_argument():
  # However the dtypes were given, equal policies are equal and hash alike.
  assert jaxmp.Policy("f32", "f16", "f32") == jaxmp.get_policy("mixed_float16")
  a = jaxmp.get_policy("mixed_bfloat16")
  b = jaxmp.Policy(np.dtype("float32"), "bf16", np.float32)
  c = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  assert a == b == c and hash(a) == hash(b) == hash(c)
  step = jax.jit(chex.assert_max_traces(lambda x, p: p.cast_to_output(p.cast_to_compute(x) * 2),
                                        n=1), static_argnums=1)
  chex.assert_trees_all_equal(step(jnp.ones(2), a), step(jnp.ones(2), b), jnp.full(2, 2.0))


def test_sixteen_bit_params_warn_once_per_policy_at_the_callers_line():
  # Policies used by no other test, so that this process has not warned yet.
  bf16 = jaxmp.get_policy("p=bf16,c=bf16,o=f64")
  with pytest.warns(UserWarning) as record:
    bf16.cast_to_param({"w": jnp.ones(2)})
  assert len(record) == 1 and record[0].filename == __file__
  assert re.match(r"jaxmp: the policy p=bf16,c=bf16,o=f64 keeps the parameters.* in bfloat16: "
                  r"an update smaller than 0\.00390625 of a weight is rounded away.*you "
                  r"probably want 'mixed_bfloat16'", str(record[0].message), re.S)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # Not again: not for an equal policy, nor when traced, nor per leaf.
    jaxmp.get_policy("p=bf16,c=bf16,o=f64").cast_to_param({"w": jnp.ones(2)})
    jax.jit(bf16.params_for_storage)({"a": jnp.ones(2), "b": jnp.ones(3)})
    jaxmp.get_policy("p=f32,c=f16,o=bf16").cast_to_param(jnp.ones(2))  # 32-bit params: never
    jaxmp.get_policy("p=f16,c=f16,o=f64").cast_to_compute(jnp.ones(2))  # nor other casts
  with pytest.warns(UserWarning, match=r"in float16: .*'mixed_float16'"):
    jaxmp.get_policy("p=fp16,c=fp16,o=f64").params_for_storage(jnp.ones(2))


# wrap_apply: params, inputs and outputs under the policy, of every kind (in float16).
X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
KINDS = {
    "policy": lambda: jaxmp.get_policy("mixed_float16"),
    "path_policy": lambda: jaxmp.PathPolicy({"bias$": "mixed_float16"}, default="mixed_float16"),
    "module_policy": lambda: jaxmp.flax.ModulePolicy({}, default="mixed_float16"),
}


@functools.cache
def mlp_variables():
  return LinenMLP().init(jax.random.key(0), X)


def test_wrap_apply_casts_params_floating_inputs_and_output_not_token_ids():
  policy = jaxmp.get_policy("mixed_float16")
  apply = policy.wrap_apply(LinenMLP().apply)
  assert matmul_dtypes(apply, mlp_variables(), X) == [("dot_general", ("float16", "float16"))] * 2
  assert input_dtypes(lambda v, x: apply(v, x=x), mlp_variables(), X) == {"float16"}  # keywords
  expected = LinenMLP().apply(policy.cast_to_compute(mlp_variables()), X.astype(F16)).astype(F32)
  chex.assert_trees_all_equal(apply(mlp_variables(), X), expected)
  # Integer inputs (token ids) are left alone.
  embed, ids = nn.Embed(10, 4), jnp.array([[1, 7, 3]])
  variables = embed.init(jax.random.key(0), ids)
  chex.assert_trees_all_equal(policy.wrap_apply(embed.apply)(variables, ids),
                              embed.apply(policy.cast_to_compute(variables), ids).astype(F32))


@pytest.mark.parametrize("kind", KINDS)
def test_wrap_apply_with_mutable_casts_only_the_output(kind):
  model, x = LinenBatchNormMLP(), jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
  variables = model.init(jax.random.key(0), x, train=False)
  apply = KINDS[kind]().wrap_apply(model.apply)
  out, updates = apply(variables, x, train=True, mutable=["batch_stats"])
  evaluated = apply({**variables, **updates}, x, train=False)
  captured, state = apply(variables, x, train=False, capture_intermediates=True)
  assert (out.dtype, evaluated.dtype, captured.dtype) == (F32, F32, F32)  # the output dtype
  assert "intermediates" in state and jax.tree_util.tree_map(
      lambda s: s.dtype, updates["batch_stats"]) == {
          "BatchNorm_0": {"mean": np.float32, "var": np.float32}}  # their own dtype
  assert not np.array_equal(updates["batch_stats"]["BatchNorm_0"]["mean"],
                            variables["batch_stats"]["BatchNorm_0"]["mean"])
  assert input_dtypes(lambda v: apply(v, x, train=True, mutable=["batch_stats"]),
                      variables) == {"float16"}


@pytest.mark.parametrize("kind", KINDS)
def test_closures_and_eval_through_apply_fn_run_under_every_policy_kind(kind):
  """A TrainState whose loss_fn closes over a float32 batch (Flax's canonical
  pattern), and its eval step, compute in float16 through ``apply_fn``, which
  equal policies wrap into equal functions: one trace as a static argument."""
  model, y = LinenMLP(), jnp.array([0, 2])
  state, again = (jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=mlp_variables()["params"], tx=optax.sgd(0.1),
      policy=KINDS[kind](), loss_scale=jaxmp.StaticLossScale(8.0)) for _ in range(2))
  a, b = state.apply_fn, again.apply_fn
  assert a == b and hash(a) == hash(b) and a != KINDS[kind]().wrap_apply(LinenMLP().apply)
  assert a.__name__ == "apply" and a.__wrapped__ == model.apply
  chex.clear_trace_counter()  # the counter is shared by the parametrized runs

  @jax.jit(static_argnums=0)
  @chex.assert_max_traces(n=1)
  def eval_apply(apply, params):
    return apply({"params": params}, X)

  logits = eval_apply(a, state.params)
  chex.assert_trees_all_equal(logits, eval_apply(b, again.params))
  assert logits.dtype == np.float32  # the model outputs in the output dtype

  def train_step(state):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, X)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  # Forward and backward products of the training step, and eval, in float16.
  assert len(matmul_dtypes(train_step, state)) == 5
  assert input_dtypes(train_step, state) == input_dtypes(
      lambda s: s.apply_fn({"params": s.params}, X), state) == {"float16"}
  new_state, loss = jax.jit(train_step)(state)
  assert loss.dtype == np.float32 and bool(new_state.metrics["last_finite"])
  assert {p.dtype for p in jax.tree_util.tree_leaves(new_state.params)} == {np.dtype("float32")}
