"""Tests of policies: the Policy, its casts and the string grammar."""

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=bfloat16,output=float32", (F32, BF16, F32)),
        ("p = f32 , c = f16", (F32, F16, F16)),  # output follows compute
        ("c=bf16", (F32, BF16, BF16)),  # params default to float32
        ("p=f16", (F16, F16, F16)),  # compute follows params
        ("o=f16", (F32, F32, F16)),
        ("bf16", (BF16, BF16, BF16)),
        ("full", (F32, F32, F32)),
        ("half", (F16, F16, F16)),  # float16 on the CPU, as jmp
        ("float64", (np.dtype("float64"),) * 3),
        ("c=float8_e4m3fn", (F32, np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e4m3fn))),
        ("c=f8e5m2,o=f32", (F32, np.dtype(jnp.float8_e5m2), F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("mixed_float16", (F32, F16, F32)),
        ("float32", (F32, F32, F32)),
        ("auto", (F32, F32, F32)),  # the CPU gets float32
    ],
)
def test_grammar_and_presets(spec, expected):
  policy = jaxmp.get_policy(spec)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == expected


@pytest.mark.parametrize(
    "spec",
    ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32", "p=bf16,c=bf16,o=f16",
     "p=f32,c=f8e4m3,o=f32", "p=f64,c=f32,o=f32"],
)
def test_str_round_trips(spec):
  policy = jaxmp.get_policy(spec)
  assert str(policy) == spec
  assert jaxmp.get_policy(str(policy)) == policy


def test_str_short_form_of_preset():
  assert str(jaxmp.get_policy("mixed_bfloat16")) == "p=f32,c=bf16,o=f32"


@pytest.mark.parametrize(
    "spec, must_mention",
    [
        ("", ["Empty policy", "mixed_bfloat16"]),
        ("p=", ["Missing dtype after p=", "bf16"]),
        ("c=int32", ["'int32'", "f32", "bfloat16"]),
        ("p=f32;c=bf16", ["f32;c", "','"]),
        ("mixed_float17", ["'mixed_float17'", "mixed_bfloat16", "p, params"]),
        ("x=f32", ["Unknown key 'x'", "p, params, c, compute, o, output"]),
        ("p=f32,p=bf16", ["second time"]),
        ("p=f32,,c=bf16", ["not of the form key=dtype"]),
        ("c=float8", ["'float8'", "float8_e4m3fn"]),
    ],
)
def test_bad_spec_names_the_part_and_lists_valid_names(spec, must_mention):
  with pytest.raises(ValueError) as info:
    jaxmp.get_policy(spec)
  for text in must_mention:
    assert text in str(info.value)


def test_non_string_spec_is_a_type_error():
  with pytest.raises(TypeError, match="get_policy expects"):
    jaxmp.get_policy(3)


def test_policy_rejects_non_floating_dtype():
  with pytest.raises(ValueError, match="must be floating"):
    jaxmp.Policy(jnp.float32, jnp.int32, jnp.float32)


def test_jmp_policy_is_accepted():
  policy = jaxmp.get_policy(jmp.get_policy("p=f32,c=bf16,o=f16"))
  assert str(policy) == "p=f32,c=bf16,o=f16"


def test_casts_touch_only_floating_leaves():
  policy = jaxmp.get_policy("mixed_float16")
  tree = {
      "jax_f32": jnp.ones(2),
      "np_f64": np.ones(2),
      "np_scalar": np.float32(1.5),
      "int": jnp.arange(3),
      "bool": jnp.array([True]),
      "python_float": 1.5,
      "string": "name",
      "none": None,
  }
  out = policy.cast_to_compute(tree)
  assert out["jax_f32"].dtype == F16 and isinstance(out["jax_f32"], jax.Array)
  assert out["np_f64"].dtype == F16 and isinstance(out["np_f64"], np.ndarray)
  assert out["np_scalar"].dtype == F16
  assert out["int"].dtype == jnp.int32
  assert out["bool"].dtype == jnp.bool_
  assert out["python_float"] == 1.5 and isinstance(out["python_float"], float)
  assert out["string"] == "name" and out["none"] is None
  assert policy.cast_to_param(out)["jax_f32"].dtype == F32
  assert policy.with_output_dtype(jnp.bfloat16).cast_to_output(out)["jax_f32"].dtype == BF16


def test_with_methods_and_needs_loss_scaling():
  policy = jaxmp.get_policy("float32")
  assert str(policy.with_compute_dtype("bf16")) == "p=f32,c=bf16,o=f32"
  assert str(policy.with_param_dtype(jnp.bfloat16)) == "p=bf16,c=f32,o=f32"
  assert not jaxmp.get_policy("mixed_bfloat16").needs_loss_scaling
  assert jaxmp.get_policy("mixed_float16").needs_loss_scaling
  assert jaxmp.get_policy("c=f8e4m3").needs_loss_scaling


def test_policy_is_hashable_and_a_static_jit_argument():
  traces = []

  def step(x, policy):
    traces.append(None)
    return policy.cast_to_output(policy.cast_to_compute(x) * 2)

  f = jax.jit(step, static_argnums=1)
  a = jaxmp.get_policy("mixed_bfloat16")
  b = jaxmp.get_policy("p=f32,c=bf16,o=f32")
  assert hash(a) == hash(b) and a == b
  assert f(jnp.ones(2), a).dtype == F32
  f(jnp.ones(2), b)  # an equal policy: no retrace
  assert len(traces) == 1
  assert f(jnp.ones(2), jaxmp.get_policy("bf16")).dtype == BF16
  assert len(traces) == 2


def test_jmp_helpers_keep_jmp_semantics():
  tree = {"w": jnp.ones(2, jnp.bfloat16), "n": jnp.arange(2)}
  assert jaxmp.half_dtype() == np.dtype(jmp.half_dtype())
  assert jaxmp.cast_to_full(tree)["w"].dtype == jmp.cast_to_full(tree)["w"].dtype
  assert jaxmp.cast_to_half(tree)["w"].dtype == jmp.cast_to_half(tree)["w"].dtype
  assert jaxmp.cast_to_half(tree)["n"].dtype == jnp.int32


@pytest.mark.parametrize(
    "spec", ["p=f32,c=bf16,o=f32", "params=float32,compute=float16", "bf16", "half", "full"]
)
def test_same_result_as_jmp_grammar(spec):
  ours = jaxmp.get_policy(spec)
  theirs = jmp.get_policy(spec)
  assert (ours.param_dtype, ours.compute_dtype, ours.output_dtype) == (
      np.dtype(theirs.param_dtype),
      np.dtype(theirs.compute_dtype),
      np.dtype(theirs.output_dtype),
  )
