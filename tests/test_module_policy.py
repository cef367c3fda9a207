"""Tests of jaxmp.flax.ModulePolicy: per-module policies for Linen and NNX.

The dtypes each module computes in are read off the jaxpr, not inferred from
outputs: Linen puts each module's name on its equations' name stack; for NNX
the model's equations are split at its matrix products.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(jnp.float32)


def float_out_dtypes(eqns):
  return {
      np.dtype(v.aval.dtype)
      for e in eqns
      for v in e.outvars
      if jnp.issubdtype(v.aval.dtype, jnp.floating)
  }


def eqns_of(jaxpr, module_name):
  """The equations run inside the Linen module called ``module_name``."""
  return [
      e for e in jaxpr.jaxpr.eqns
      if module_name in str(e.source_info.name_stack).split("/")
  ]


def dot_dtypes(eqns):
  return [
      tuple(np.dtype(v.aval.dtype) for v in e.invars)
      for e in eqns if e.primitive.name == "dot_general"
  ]


# Linen.


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(4)(x)


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm()(nn.Dense(8)(x))


class LinenNested(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = LinenBlock()(x)
    x = LinenBlock()(x)
    return nn.Dense(2, name="head")(x)


def linen_jaxpr(model, policy, x=None):
  x = jnp.ones((2, 3)) if x is None else x
  variables = model.init(jax.random.key(0), x)
  apply = policy.wrap_apply(model.apply)
  return jax.make_jaxpr(apply)(variables, x), apply, variables


def test_linen_layernorm_in_float32_dense_in_bfloat16():
  policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"},
                                   default="mixed_bfloat16")
  jaxpr, apply, variables = linen_jaxpr(LinenNet(), policy)
  norm = eqns_of(jaxpr, "LayerNorm_0")
  assert norm and float_out_dtypes(norm) == {F32}
  assert any(e.primitive.name == "rsqrt" for e in norm)
  # The only conversion in the LayerNorm is of its bfloat16 input: its
  # parameters are read straight from the float32 master copy.
  converts = [e for e in norm if e.primitive.name == "convert_element_type"]
  assert [(np.dtype(e.invars[0].aval.dtype), e.params["new_dtype"]) for e in converts] == [(BF16, F32)]
  for name in ("Dense_0", "Dense_1"):
    assert dot_dtypes(eqns_of(jaxpr, name)) == [(BF16, BF16)]
  out = apply(variables, jnp.ones((2, 3)))
  assert out.dtype == F32  # the default policy's output dtype
  grads = jax.grad(lambda p: apply({"params": p}, jnp.ones((2, 3))).sum())(
      variables["params"])
  assert set(jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda g: g.dtype, grads))) == {F32}


def test_linen_control_without_rule_layernorm_is_bfloat16():
  # The check above discriminates: without the rule, LayerNorm yields bfloat16.
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_bfloat16")
  jaxpr, _, _ = linen_jaxpr(LinenNet(), policy)
  assert BF16 in float_out_dtypes(eqns_of(jaxpr, "LayerNorm_0"))


def test_linen_rule_by_name_and_by_path_and_inheritance():
  x = jnp.ones((2, 3))
  by_name = jaxmp.flax.ModulePolicy({"head": "float32"}, default="mixed_bfloat16")
  jaxpr, _, _ = linen_jaxpr(LinenNested(), by_name, x)
  assert dot_dtypes(eqns_of(jaxpr, "head")) == [(F32, F32)]
  assert dot_dtypes(eqns_of(jaxpr, "LinenBlock_0")) == [(BF16, BF16)]

  by_path = jaxmp.flax.ModulePolicy({"LinenBlock_1/Dense_0": "float32"},
                                    default="mixed_bfloat16")
  jaxpr, _, _ = linen_jaxpr(LinenNested(), by_path, x)
  assert dot_dtypes(eqns_of(jaxpr, "LinenBlock_0")) == [(BF16, BF16)]
  assert dot_dtypes(eqns_of(jaxpr, "LinenBlock_1")) == [(F32, F32)]

  # A block forced to float32 forces what is inside it.
  by_block = jaxmp.flax.ModulePolicy({"LinenBlock_0": "float32"},
                                     default="mixed_bfloat16")
  jaxpr, _, _ = linen_jaxpr(LinenNested(), by_block, x)
  assert float_out_dtypes(eqns_of(jaxpr, "LinenBlock_0")) == {F32}
  assert dot_dtypes(eqns_of(jaxpr, "LinenBlock_1")) == [(BF16, BF16)]


def test_linen_overlap_raises_unless_first_match():
  rules = [(nn.Dense, "bf16"), ("Dense_1", "float32")]
  with pytest.raises(ValueError, match=r"Dense at path 'Dense_1' matches several rules.*first_match=True"):
    linen_jaxpr(LinenNet(), jaxmp.flax.ModulePolicy(rules, default="float32"))
  first = jaxmp.flax.ModulePolicy(rules[::-1], default="float32", first_match=True)
  jaxpr, _, _ = linen_jaxpr(LinenNet(), first)
  assert dot_dtypes(eqns_of(jaxpr, "Dense_0")) == [(BF16, BF16)]
  assert dot_dtypes(eqns_of(jaxpr, "Dense_1")) == [(F32, F32)]


def test_linen_default_none_leaves_other_modules_alone():
  policy = jaxmp.flax.ModulePolicy({"Dense_1": "bf16"}, default=None)
  jaxpr, apply, variables = linen_jaxpr(LinenNet(), policy)
  assert dot_dtypes(eqns_of(jaxpr, "Dense_0")) == [(F32, F32)]
  assert dot_dtypes(eqns_of(jaxpr, "Dense_1")) == [(BF16, BF16)]
  # Without any rule and default, wrap_apply is the identity.
  plain = jaxmp.flax.ModulePolicy({}, default=None).wrap_apply(LinenNet().apply)
  chex.assert_trees_all_equal(
      plain(variables, jnp.ones((2, 3))), LinenNet().apply(variables, jnp.ones((2, 3))))


def test_linen_float32_module_sees_exact_float32_params():
  # A LayerNorm scale of 1 + 2**-10 is not a bfloat16 number: the float32
  # LayerNorm must use it unrounded, as a float32 LayerNorm alone would.
  model = LinenNet()
  x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
  params = model.init(jax.random.key(0), x)["params"]
  params["LayerNorm_0"]["scale"] = jnp.full((8,), 1.0 + 2.0**-10)
  captured = {}

  def capture(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if isinstance(context.module, nn.LayerNorm):
      captured["input"], captured["out"] = args[0], out
    return out

  policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_bfloat16")
  with nn.intercept_methods(capture):
    policy.wrap_apply(model.apply)({"params": params}, x)
  assert captured["input"].dtype == BF16  # what the bfloat16 Dense produced
  expected = nn.LayerNorm().apply(
      {"params": params["LayerNorm_0"]}, captured["input"].astype(F32))
  chex.assert_trees_all_equal(captured["out"], expected)
  rounded = nn.LayerNorm().apply(
      {"params": {"scale": jnp.ones(8), "bias": params["LayerNorm_0"]["bias"]}},
      captured["input"].astype(F32))
  assert not np.array_equal(captured["out"], rounded)


class ScanCell(nn.Module):

  @nn.compact
  def __call__(self, carry, x):
    del x
    carry = nn.LayerNorm()(nn.Dense(4)(carry))
    return carry, carry


class LiftedNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.remat(nn.Dense)(4)(x)
    stack = nn.scan(ScanCell, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2)
    x, _ = stack()(x, jnp.zeros((2,)))
    return x


def test_linen_lifted_transforms():
  # In a scan the carry keeps its dtype, so the float32 LayerNorm hands its
  # output back in the surrounding compute dtype (output dtype bfloat16).
  policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "p=f32,c=f32,o=bf16"},
                                   default="mixed_bfloat16")
  model = LiftedNet()
  x = jnp.ones((2, 4))
  params = model.init(jax.random.key(0), x)["params"]
  apply = policy.wrap_apply(model.apply)
  assert apply({"params": params}, x).dtype == F32
  grads = jax.grad(lambda p: apply({"params": p}, x).sum())(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


def test_jit_and_hashable():
  a = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_bfloat16")
  b = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_bfloat16")
  assert a == b and hash(a) == hash(b)
  model = LinenNet()
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)
  apply = a.wrap_apply(model.apply)
  chex.assert_trees_all_equal(jax.jit(apply)(variables, x), apply(variables, x))


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ({"(": "f32"}, ValueError, "not a valid regular expression"),
        ({3: "f32"}, TypeError, "module classes"),
        ({nn.Dense: "nonsense"}, ValueError, "flax.linen.linear.Dense"),
        (["x"], TypeError, "pairs"),
    ],
)
def test_bad_rules(rules, error, match):
  with pytest.raises(error, match=match):
    jaxmp.flax.ModulePolicy(rules)


# NNX.


class NnxNet(nnx.Module):

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(3, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.dense2 = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.norm(self.dense1(x)))


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense(x)


class NnxNested(nnx.Module):

  def __init__(self, rngs):
    self.block = NnxBlock(rngs)
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block(x))


def nnx_jaxpr(model, x):
  return jax.make_jaxpr(lambda x: model(x))(x)


def between_dots(jaxpr):
  """The equations after the first product's bias add, before the second's."""
  eqns = jaxpr.jaxpr.eqns
  dots = [i for i, e in enumerate(eqns) if e.primitive.name == "dot_general"]
  assert len(dots) == 2
  start = next(i for i in range(dots[0], dots[1]) if eqns[i].primitive.name == "add") + 1
  end = dots[1]
  while eqns[end - 1].primitive.name == "convert_element_type":
    end -= 1
  return eqns[start:end]


def test_nnx_layernorm_in_float32_dense_in_bfloat16():
  model = NnxNet(nnx.Rngs(0))
  policy = jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"}, default="mixed_bfloat16")
  assert policy.set_nnx_dtypes(model) == {
      "dense1": "p=f32,c=bf16,o=f32",
      "dense2": "p=f32,c=bf16,o=f32",
      "norm": "p=f32,c=f32,o=f32",
  }
  assert model.norm.dtype == F32 and model.dense1.dtype == BF16
  x = jnp.ones((2, 3))
  jaxpr = nnx_jaxpr(model, x)
  assert dot_dtypes(jaxpr.jaxpr.eqns) == [(BF16, BF16), (BF16, BF16)]
  norm = between_dots(jaxpr)
  assert any(e.primitive.name == "rsqrt" for e in norm)
  # After converting its bfloat16 input, the LayerNorm computes in float32.
  assert norm[0].primitive.name == "convert_element_type"
  assert float_out_dtypes(norm[1:]) == {F32}
  # The LayerNorm on its own, fed bfloat16, computes in float32 throughout.
  alone = jax.make_jaxpr(lambda h: model.norm(h))(jnp.ones((2, 8), BF16))
  assert float_out_dtypes(alone.jaxpr.eqns) == {F32}
  # Parameters keep their float32 master dtype.
  dtypes = {p.dtype for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))}
  assert dtypes == {F32}


def test_nnx_control_without_rule_layernorm_is_bfloat16():
  model = NnxNet(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({}, default="mixed_bfloat16").set_nnx_dtypes(model)
  assert BF16 in float_out_dtypes(between_dots(nnx_jaxpr(model, jnp.ones((2, 3)))))


def test_nnx_rules_by_name_path_and_inheritance():
  model = NnxNested(nnx.Rngs(0))
  policy = jaxmp.flax.ModulePolicy({"head": "float32"}, default="mixed_bfloat16")
  assert policy.set_nnx_dtypes(model) == {
      "block/dense": "p=f32,c=bf16,o=f32", "head": "p=f32,c=f32,o=f32"}
  assert dot_dtypes(nnx_jaxpr(model, jnp.ones((1, 3))).jaxpr.eqns) == [
      (BF16, BF16), (F32, F32)]
  model = NnxNested(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({"block/dense": "float32"}, default="bf16").set_nnx_dtypes(model)
  assert (model.block.dense.dtype, model.head.dtype) == (F32, BF16)
  model = NnxNested(nnx.Rngs(0))  # inherited from the enclosing block
  jaxmp.flax.ModulePolicy({NnxBlock: "float32"}, default="bf16").set_nnx_dtypes(model)
  assert (model.block.dense.dtype, model.head.dtype) == (F32, BF16)


def test_nnx_errors():
  model = NnxNested(nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"'Head' matches no module.*'block/dense'"):
    jaxmp.flax.ModulePolicy({"Head": "float32"}).set_nnx_dtypes(model)
  with pytest.raises(ValueError, match="matches several rules"):
    jaxmp.flax.ModulePolicy({nnx.Linear: "bf16", "head": "f32"}).set_nnx_dtypes(model)

  class Raw(nnx.Module):

    def __init__(self):
      self.w = nnx.Param(jnp.ones(2))

  class Holder(nnx.Module):

    def __init__(self):
      self.raw = Raw()
      self.dense = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  with pytest.raises(ValueError, match="without a dtype attribute"):
    jaxmp.flax.ModulePolicy({Raw: "bf16"}).set_nnx_dtypes(Holder())
  with pytest.raises(TypeError, match="wrap_apply"):
    jaxmp.flax.ModulePolicy({}).set_nnx_dtypes(LinenNet())
