"""Tests of jaxmp.PathPolicy: per-leaf policies by regular expressions on paths.

The error messages (overlaps, unmatched paths, bad rules) live in
tests/test_bad_input.py; the rule table's mechanics are tested here through
PathPolicy and in tests/test_module_policy.py through ModulePolicy.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
from jaxmp._src.path_policy import path_to_string

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)


def params():
  return {
      "params": {
          "Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)},
          "LayerNorm_0": {"scale": jnp.ones(3), "bias": jnp.zeros(3)},
          "head": {"kernel": jnp.ones((3, 1)), "bias": jnp.zeros(1)},
      },
      "step": jnp.zeros([], jnp.int32),
  }


def dtypes(tree):
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype), tree)


def test_right_leaves_get_right_dtypes():
  policy = jaxmp.PathPolicy(
      {"/LayerNorm_0/": "float32", "^params/head/": "p=f32,c=f16,o=f32"},
      default="mixed_bfloat16",
  )
  compute = dtypes(policy.cast_to_compute(params()))
  assert compute["params"]["Dense_0"] == {"kernel": BF16, "bias": BF16}
  assert compute["params"]["LayerNorm_0"] == {"scale": F32, "bias": F32}
  assert compute["params"]["head"] == {"kernel": F16, "bias": F16}
  assert compute["step"] == np.dtype(jnp.int32)  # non-floating: unchanged
  output = dtypes(policy.cast_to_output(params()))
  assert set(jax.tree_util.tree_leaves(output["params"])) == {F32}
  half = jax.tree_util.tree_map(lambda x: x.astype(BF16), params()["params"])
  assert set(jax.tree_util.tree_leaves(dtypes(policy.cast_to_param(half)))) == {F32}


def test_overlapping_patterns_raise_unless_first_match():
  overlapping = [("bias$", "float32"), ("head", "mixed_bfloat16")]
  with pytest.raises(ValueError):
    jaxmp.PathPolicy(overlapping, default="f32").cast_to_compute(params())
  # A path that only one of them matches is fine.
  policy = jaxmp.PathPolicy(overlapping, default="f32")
  assert policy.policy_for("params/head/kernel").compute_dtype == BF16
  # With first_match the rules are tried in order.
  first = jaxmp.PathPolicy(overlapping, default="mixed_float16", first_match=True)
  compute = dtypes(first.cast_to_compute(params()))["params"]
  assert compute["head"] == {"kernel": BF16, "bias": F32}
  assert compute["Dense_0"] == {"kernel": F16, "bias": F32}
  reversed_policy = jaxmp.PathPolicy(
      overlapping[::-1], default="mixed_float16", first_match=True)
  assert dtypes(reversed_policy.cast_to_compute(params()))["params"]["head"] == {
      "kernel": BF16, "bias": BF16}


def test_unmatched_paths_get_the_default_or_raise_without_one():
  policy = jaxmp.PathPolicy({"head": "mixed_bfloat16"})
  assert policy.default == jaxmp.get_policy("float32")  # the documented default
  assert policy.policy_for("params/Dense_0/kernel") == jaxmp.get_policy("float32")
  strict = jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default=None)
  with pytest.raises(ValueError):
    strict.cast_to_compute(params())
  # Non-floating leaves are never looked up.
  assert strict.cast_to_compute({"step": jnp.int32(3)})["step"].dtype == jnp.int32


def test_hashable_static_and_describe():
  a = jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default="mixed_float16")
  b = jaxmp.PathPolicy([("head", jaxmp.get_policy("p=f32,c=bf16,o=f32"))],
                       default="p=f32,c=f16,o=f32")
  assert a == b and hash(a) == hash(b)
  assert a != jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default="mixed_float16",
                               first_match=True)
  # Loss scaling is needed when any policy, a rule's or the default, computes in float16.
  assert a.needs_loss_scaling
  assert jaxmp.PathPolicy({"head": "mixed_float16"}, default=None).needs_loss_scaling
  assert not jaxmp.PathPolicy({"head": "mixed_bfloat16"}).needs_loss_scaling
  assert a.rules == (("head", jaxmp.get_policy("mixed_bfloat16")),)
  assert str(a) == (
      "PathPolicy({'head': p=f32,c=bf16,o=f32}, default=p=f32,c=f16,o=f32, "
      "first_match=False)")

  @jax.jit(static_argnums=1)
  @chex.assert_max_traces(n=1)
  def f(x, policy):
    return policy.cast_to_compute(x)

  assert f({"head": jnp.ones(1)}, a)["head"].dtype == BF16
  f({"head": jnp.ones(1)}, b)  # an equal policy: no retrace
  assert a.describe(params()["params"]) == {
      "Dense_0/bias": "p=f32,c=f16,o=f32",
      "Dense_0/kernel": "p=f32,c=f16,o=f32",
      "LayerNorm_0/bias": "p=f32,c=f16,o=f32",
      "LayerNorm_0/scale": "p=f32,c=f16,o=f32",
      "head/bias": "p=f32,c=bf16,o=f32",
      "head/kernel": "p=f32,c=bf16,o=f32",
  }
  assert a.policies({"head": jnp.ones(1), "n": 3}) == {
      "head": jaxmp.get_policy("mixed_bfloat16"), "n": None}


def test_paths_are_keystr_paths_without_the_value_of_nnx_variables():
  tree = {"a": [jnp.ones(1), (jnp.ones(1),)], "b": {"c": jnp.ones(1)}}
  paths = [path_to_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  assert paths == ["a/0", "a/1/0", "b/c"]
  assert paths == [
      jax.tree_util.keystr(p, simple=True, separator="/")
      for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])

  state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  # keystr alone would end each path with "/value".
  assert jax.tree_util.keystr(flat[0][0], simple=True, separator="/") == "layers/0/bias/value"
  assert [path_to_string(p) for p, _ in flat] == [
      "layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel"]
  policy = jaxmp.PathPolicy({"^layers/1/kernel$": "mixed_bfloat16"})
  cast = policy.cast_to_compute(state)
  assert cast["layers"][1]["kernel"][...].dtype == BF16
  assert cast["layers"][0]["kernel"][...].dtype == F32
