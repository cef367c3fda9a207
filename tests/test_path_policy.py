"""Tests of jaxmp.PathPolicy: per-leaf policies by regular expressions on paths.

The refusals (overlaps, unmatched paths without a default, bad rules) live in
tests/test_bad_input.py; the rule table's mechanics are tested here through
PathPolicy and in tests/test_module_policy.py through ModulePolicy.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxmp
from jaxmp._src.path_policy import path_to_string

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
PARAMS = {"params": {"Dense_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)},
                     "LayerNorm_0": {"scale": jnp.ones(3), "bias": jnp.zeros(3)},
                     "head": {"kernel": jnp.ones((3, 1)), "bias": jnp.zeros(1)}},
          "step": jnp.zeros([], jnp.int32)}


def dtypes(tree):
  return jax.tree_util.tree_map(lambda x: np.dtype(x.dtype), tree)


def test_right_leaves_get_right_dtypes():
  policy = jaxmp.PathPolicy(
      {"/LayerNorm_0/": "float32", "^params/head/": "p=f32,c=f16,o=f32"}, default="mixed_bfloat16")
  assert dtypes(policy.cast_to_compute(PARAMS)) == {
      "params": {"Dense_0": {"kernel": BF16, "bias": BF16},
                 "LayerNorm_0": {"scale": F32, "bias": F32},
                 "head": {"kernel": F16, "bias": F16}},
      "step": np.dtype(jnp.int32)}  # non-floating: unchanged
  v, p = 1 + 2**-10, {"params": PARAMS["params"]}  # bfloat16 rounds v to 1, float16 keeps it
  cast = jax.jit(policy.cast_to_compute)(jax.tree_util.tree_map(lambda x: x * 0 + v, p))["params"]
  assert [float(x.ravel()[0]) for x in jax.tree_util.tree_leaves(cast)] == [1, 1] + [v] * 4
  assert set(jax.tree_util.tree_leaves(dtypes(policy.cast_to_output(PARAMS)["params"]))) == {F32}
  half = jax.tree_util.tree_map(lambda x: x.astype(BF16), PARAMS["params"])
  assert set(jax.tree_util.tree_leaves(dtypes(policy.cast_to_param(half)))) == {F32}


def test_overlapping_patterns_resolve_in_order_with_first_match():
  overlapping = [("bias$", "float32"), ("head", "mixed_bfloat16")]
  # A path that only one of them matches is fine without first_match.
  policy = jaxmp.PathPolicy(overlapping, default="f32")
  assert policy.policy_for("params/head/kernel").compute_dtype == BF16
  for rules, head_bias in ((overlapping, F32), (overlapping[::-1], BF16)):
    first = jaxmp.PathPolicy(rules, default="mixed_float16", first_match=True)
    compute = dtypes(first.cast_to_compute(PARAMS))["params"]
    assert compute["head"] == {"kernel": BF16, "bias": head_bias}
    assert compute["Dense_0"] == {"kernel": F16, "bias": F32}


def test_unmatched_paths_get_the_default_and_non_floating_leaves_are_never_looked_up():
  policy = jaxmp.PathPolicy({"head": "mixed_bfloat16"})
  assert policy.default == jaxmp.get_policy("float32")  # the documented default
  assert policy.policy_for("params/Dense_0/kernel") == jaxmp.get_policy("float32")
  strict = jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default=None)
  assert strict.cast_to_compute({"step": jnp.int32(3)})["step"].dtype == jnp.int32


def test_hashable_static_and_describe():
  a = jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default="mixed_float16")
  b = jaxmp.PathPolicy([("head", jaxmp.get_policy("p=f32,c=bf16,o=f32"))],
                       default="p=f32,c=f16,o=f32")
  assert a == b and hash(a) == hash(b)
  assert a != jaxmp.PathPolicy({"head": "mixed_bfloat16"}, default="mixed_float16",
                               first_match=True)
  # Loss scaling is needed when any policy, a rule's or the default, computes in float16.
  assert [p.needs_loss_scaling for p in (
      a, jaxmp.PathPolicy({"head": "mixed_float16"}, default=None),
      jaxmp.PathPolicy({"head": "mixed_bfloat16"}))] == [True, True, False]
  assert a.rules == (("head", jaxmp.get_policy("mixed_bfloat16")),)
  assert str(a) == ("PathPolicy({'head': p=f32,c=bf16,o=f32}, default=p=f32,c=f16,o=f32, "
                    "first_match=False)")

  @jax.jit(static_argnums=1)
  @chex.assert_max_traces(n=1)
  def f(x, policy):
    return policy.cast_to_compute(x)

  assert f({"head": jnp.ones(1)}, a)["head"].dtype == BF16
  f({"head": jnp.ones(1)}, b)  # an equal policy: no retrace
  f16, bf16 = "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"
  assert a.describe(PARAMS["params"]) == {
      "Dense_0/bias": f16, "Dense_0/kernel": f16, "LayerNorm_0/bias": f16,
      "LayerNorm_0/scale": f16, "head/bias": bf16, "head/kernel": bf16}
  assert a.policies({"head": jnp.ones(1), "n": 3}) == {
      "head": jaxmp.get_policy("mixed_bfloat16"), "n": None}


def test_paths_are_keystr_paths_without_the_value_of_nnx_variables():
  tree = {"a": [jnp.ones(1), (jnp.ones(1),)], "b": {"c": jnp.ones(1)}}
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  assert [path_to_string(p) for p, _ in flat] == ["a/0", "a/1/0", "b/c"] == [
      jax.tree_util.keystr(p, simple=True, separator="/") for p, _ in flat]

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])

  state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  # keystr alone would end each path with "/value".
  assert jax.tree_util.keystr(flat[0][0], simple=True, separator="/") == "layers/0/bias/value"
  assert [path_to_string(p) for p, _ in flat] == [
      "layers/0/bias", "layers/0/kernel", "layers/1/bias", "layers/1/kernel"]
  cast = jaxmp.PathPolicy({"^layers/1/kernel$": "mixed_bfloat16"}).cast_to_compute(state)
  assert (cast["layers"][1]["kernel"][...].dtype, cast["layers"][0]["kernel"][...].dtype) == (
      BF16, F32)
