"""Tests of jaxmp.PathPolicy: per-leaf policies by regular expressions on paths."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

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


def test_cast_keeps_values_and_works_under_jit():
  policy = jaxmp.PathPolicy({"kernel$": "bf16"}, default="float32")
  tree = {"a": {"kernel": jnp.array([1.0, 1.0 + 2.0**-10]), "bias": jnp.array([0.5])}}
  out = jax.jit(policy.cast_to_compute)(tree)
  # 1 + 2**-10 rounds to 1 in bfloat16; the bias is untouched.
  chex.assert_trees_all_equal(
      out, {"a": {"kernel": jnp.array([1.0, 1.0], BF16), "bias": jnp.array([0.5])}}
  )


def test_overlapping_patterns_raise():
  policy = jaxmp.PathPolicy({"bias$": "float32", "head": "bf16"}, default="f32")
  with pytest.raises(ValueError, match=r"params/head/bias.*matches several patterns.*'bias\$', 'head'.*first_match=True"):
    policy.cast_to_compute(params())
  # A path that only one of them matches is fine.
  assert policy.policy_for("params/head/kernel").compute_dtype == BF16


def test_first_match_resolves_overlaps_in_order():
  rules = [("bias$", "float32"), ("head", "bf16")]
  policy = jaxmp.PathPolicy(rules, default="f16", first_match=True)
  compute = dtypes(policy.cast_to_compute(params()))["params"]
  assert compute["head"] == {"kernel": BF16, "bias": F32}
  assert compute["Dense_0"] == {"kernel": F16, "bias": F32}
  reversed_policy = jaxmp.PathPolicy(rules[::-1], default="f16", first_match=True)
  assert dtypes(reversed_policy.cast_to_compute(params()))["params"]["head"] == {
      "kernel": BF16, "bias": BF16}


def test_unmatched_paths_default_and_none():
  policy = jaxmp.PathPolicy({"head": "bf16"})
  assert policy.default == jaxmp.get_policy("float32")  # the documented default
  assert policy.policy_for("params/Dense_0/kernel") == jaxmp.get_policy("float32")
  strict = jaxmp.PathPolicy({"head": "bf16"}, default=None)
  with pytest.raises(ValueError, match=r"no pattern matches the path 'params/Dense_0/bias'.*default="):
    strict.cast_to_compute(params())
  # Non-floating leaves are never looked up.
  assert strict.cast_to_compute({"step": jnp.int32(3)})["step"].dtype == jnp.int32


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ({"(": "f32"}, ValueError, "not a valid regular expression"),
        ({3: "f32"}, TypeError, "regular-expression strings"),
        ({"x": "p=f32;c=bf16"}, ValueError, "pattern 'x'"),
        ([("x", "f32"), ("x", "bf16")], ValueError, "given twice"),
        (["x"], TypeError, "pairs"),
    ],
)
def test_bad_rules(rules, error, match):
  with pytest.raises(error, match=match):
    jaxmp.PathPolicy(rules)


def test_hashable_static_and_describe():
  a = jaxmp.PathPolicy({"head": "bf16"}, default="mixed_float16")
  b = jaxmp.PathPolicy({"head": "bf16"}, default="mixed_float16")
  assert a == b and hash(a) == hash(b)
  assert a.needs_loss_scaling
  assert not jaxmp.PathPolicy({"head": "bf16"}).needs_loss_scaling

  @jax.jit
  def f(x, policy=a):
    return policy.cast_to_compute(x)

  assert f({"head": jnp.ones(1)})["head"].dtype == BF16
  assert a.describe(params()["params"]) == {
      "Dense_0/bias": "p=f32,c=f16,o=f32",
      "Dense_0/kernel": "p=f32,c=f16,o=f32",
      "LayerNorm_0/bias": "p=f32,c=f16,o=f32",
      "LayerNorm_0/scale": "p=f32,c=f16,o=f32",
      "head/bias": "p=bf16,c=bf16,o=bf16",
      "head/kernel": "p=bf16,c=bf16,o=bf16",
  }
  assert "head" in str(a)


def test_nnx_state_paths_leave_out_value():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  paths = [path_to_string(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  assert paths == ["bias", "kernel"]
  policy = jaxmp.PathPolicy({"^kernel$": "bf16"})
  cast = policy.cast_to_compute(state)
  assert cast["kernel"][...].dtype == BF16 and cast["bias"][...].dtype == F32


def test_exported():
  assert "PathPolicy" in jaxmp.__all__
