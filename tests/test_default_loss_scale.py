"""Tests of jaxmp.default_loss_scale: the loss scale each kind of policy gets."""

import flax.linen as nn
import jax.numpy as jnp
import jmp
import pytest

import jaxmp
import jaxmp.flax

NEEDS_SCALING = [
    "mixed_float16",
    "p=f32,c=f16,o=f16",
    jaxmp.Policy(jnp.float32, jnp.float16, jnp.float32),
    jmp.get_policy("p=f32,c=f16,o=f32"),
    # A rule-based policy needs scaling when any of its policies does.
    jaxmp.PathPolicy({"head": "mixed_float16"}, default="mixed_bfloat16"),
    jaxmp.flax.ModulePolicy({nn.Dense: "mixed_float16"}, default=None),
]
NO_SCALING = [
    "float32",
    "mixed_bfloat16",
    jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32),
    jmp.get_policy("p=f32,c=bf16,o=f32"),
    jaxmp.PathPolicy({"norm": "float32"}, default="mixed_bfloat16"),
    jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default=None),
]


@pytest.mark.parametrize("policy", NEEDS_SCALING, ids=str)
def test_float16_compute_gets_the_default_dynamic_scale(policy):
  loss_scale = jaxmp.default_loss_scale(policy)
  assert type(loss_scale) is jaxmp.DynamicLossScale
  assert loss_scale.config() == jaxmp.DynamicLossScale().config()
  assert float(loss_scale.loss_scale) == 2.0**15 and int(loss_scale.counter) == 0


@pytest.mark.parametrize("policy", NO_SCALING, ids=str)
def test_float32_and_bfloat16_compute_get_no_scaling(policy):
  assert type(jaxmp.default_loss_scale(policy)) is jaxmp.NoOpLossScale


def test_bad_policies_are_refused_as_get_policy_refuses_them():
  with pytest.raises(ValueError, match="Unknown policy 'mixed_fp17'"):
    jaxmp.default_loss_scale("mixed_fp17")
  with pytest.raises(TypeError, match="got 16 of type int"):
    jaxmp.default_loss_scale(16)
