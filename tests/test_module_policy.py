"""Tests of jaxmp.flax.ModulePolicy: per-module policies for Linen and NNX.

The dtypes each module computes in are read off the jaxpr, not inferred from
outputs. A promise that holds in both frameworks is tested once, over both
(an adapter per framework traces its model under the policy), and the
equations are split at the matrix products; the Linen-only tests read each
module's name off its equations' name stack. The error messages live in
tests/test_bad_input.py.
"""

import dataclasses
import functools
import warnings
from typing import Any, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from matmul_dtypes import input_dtypes, matmul_dtypes

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(jnp.float16)
F32 = np.dtype(jnp.float32)
CONV, DOT = "conv_general_dilated", "dot_general"


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


def products(jaxpr):
  """``(primitive, input dtypes)`` of each matrix product and convolution."""
  return [(e.primitive.name, tuple(np.dtype(v.aval.dtype) for v in e.invars))
          for e in jaxpr.jaxpr.eqns if e.primitive.name in (CONV, DOT)]


def after_each_product(jaxpr):
  """For each matrix product or convolution, in order, the equations after it
  and its bias add, up to the input conversions of the next one: what the
  layers between two products (a LayerNorm, say) computed."""
  eqns = jaxpr.jaxpr.eqns
  products = [i for i, e in enumerate(eqns) if e.primitive.name in (CONV, DOT)]
  segments = []
  for start, end in zip(products, products[1:] + [len(eqns)]):
    start = next(i for i in range(start, end) if eqns[i].primitive.name == "add") + 1
    while end > start and eqns[end - 1].primitive.name == "convert_element_type":
      end -= 1
    segments.append(eqns[start:end])
  return segments


def assert_computes_in_float32(eqns, input_dtype):
  """A LayerNorm that converts only its input and computes in float32: its
  parameters are read straight from the float32 master copy."""
  assert any(e.primitive.name == "rsqrt" for e in eqns)
  converts = [e for e in eqns if e.primitive.name == "convert_element_type"]
  assert [(np.dtype(e.invars[0].aval.dtype), e.params["new_dtype"]) for e in converts] == [
      (input_dtype, F32)]
  assert float_out_dtypes(eqns) == {F32}


# Linen and NNX: each promise once, over both, with one model of each.


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm(name="norm")(nn.Dense(3, name="dense")(x))


class LinenNested(nn.Module):
  """Two blocks (Dense, LayerNorm) and a head, named as NnxNested's attributes."""

  @nn.compact
  def __call__(self, x):
    x = LinenBlock(name="block1")(LinenBlock(name="block0")(x))
    return nn.Dense(2, name="head")(x)


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.dense = nnx.Linear(3, 3, rngs=rngs)
    self.norm = nnx.LayerNorm(3, rngs=rngs)

  def __call__(self, x):
    return self.norm(self.dense(x))


class NnxNested(nnx.Module):

  def __init__(self, rngs):
    self.block0 = NnxBlock(rngs)
    self.block1 = NnxBlock(rngs)
    self.head = nnx.Linear(3, 2, rngs=rngs)

  def __call__(self, x):
    return self.head(self.block1(self.block0(x)))


class DeclaredFloat32(nn.Module):
  """Declares its dtype and passes it to every layer, as Flax's examples do."""

  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(4, (3, 3), dtype=self.dtype)(x)
    x = nn.LayerNorm(dtype=self.dtype)(x)
    x = x.reshape((x.shape[0], -1))
    x = SetupBlock(dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype, name="head")(x)


class SetupBlock(nn.Module):
  """Builds its layer in setup, with the declared dtype."""

  dtype: Any = jnp.float32

  def setup(self):
    self.dense = nn.Dense(5, dtype=self.dtype)

  def __call__(self, x):
    return nn.relu(self.dense(x))


class NnxDeclaredFloat32(nnx.Module):
  """DeclaredFloat32 in NNX: every layer built with dtype=float32."""

  def __init__(self, rngs):
    f32 = jnp.float32
    self.conv = nnx.Conv(3, 4, (3, 3), dtype=f32, rngs=rngs)
    self.norm = nnx.LayerNorm(4, dtype=f32, rngs=rngs)
    self.block = nnx.Linear(100, 5, dtype=f32, rngs=rngs)
    self.head = nnx.Linear(5, 3, dtype=f32, rngs=rngs)

  def __call__(self, x):
    x = self.norm(self.conv(x))
    x = nnx.relu(self.block(x.reshape((x.shape[0], -1))))
    return self.head(x)


class Traced(NamedTuple):
  jaxpr: Any  # of the forward pass
  grads: set  # the dtypes of the gradients
  report: dict | None  # what set_nnx_dtypes set (NNX)


def traced(forward, params, x):
  """``forward(params, x)`` traced, and the dtypes of its gradients: nothing
  runs or compiles."""
  grads = jax.eval_shape(jax.grad(lambda p: forward(p, x).astype(F32).sum()), params)
  return jax.make_jaxpr(forward)(params, x), {g.dtype for g in jax.tree_util.tree_leaves(grads)}


class Linen:
  """``policy.wrap_apply(model.apply)``; the model's own fields stay."""

  LayerNorm, Block = nn.LayerNorm, LinenBlock
  Nested, Declared = LinenNested, DeclaredFloat32

  @staticmethod
  def trace(model_class, policy, x):
    model = model_class()
    params = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    apply = policy.wrap_apply(model.apply)
    return Traced(*traced(lambda p, x: apply({"params": p}, x), params, x), None)


class Nnx:
  """``policy.set_nnx_dtypes(model)``, which sets each layer's dtype."""

  LayerNorm, Block = nnx.LayerNorm, NnxBlock
  Nested, Declared = NnxNested, NnxDeclaredFloat32

  @staticmethod
  def trace(model_class, policy, x):
    model = nnx.eval_shape(lambda: model_class(nnx.Rngs(0)))
    report = policy.set_nnx_dtypes(model)
    graphdef, params = nnx.split(model)
    return Traced(*traced(lambda p, x: nnx.merge(graphdef, p)(x), params, x), report)


FRAMEWORKS = {"linen": Linen, "nnx": Nnx}
frameworks = pytest.mark.parametrize("framework", sorted(FRAMEWORKS))
X = jnp.ones((2, 3))


@frameworks
def test_a_class_rule_keeps_the_layernorms_in_float32_and_the_dense_layers_in_bfloat16(
    framework):
  fw = FRAMEWORKS[framework]
  policy = jaxmp.flax.ModulePolicy({fw.LayerNorm: "float32"}, default="mixed_bfloat16")
  traced = fw.trace(fw.Nested, policy, X)
  assert dot_dtypes(traced.jaxpr.jaxpr.eqns) == [(BF16, BF16)] * 3
  norm0, norm1, _ = after_each_product(traced.jaxpr)
  assert_computes_in_float32(norm0, BF16)  # the bfloat16 Dense's output
  assert_computes_in_float32(norm1, BF16)
  assert traced.grads == {F32}  # the master params' dtype
  # The check discriminates: without the rule, the LayerNorms compute in bfloat16.
  control = fw.trace(fw.Nested, jaxmp.flax.ModulePolicy({}, default="mixed_bfloat16"), X)
  assert all(BF16 in float_out_dtypes(norm) for norm in after_each_product(control.jaxpr)[:2])
  if framework == "linen":
    assert traced.jaxpr.out_avals[0].dtype == F32  # the default policy's output dtype
  else:  # what set_nnx_dtypes set
    half, full = "p=f32,c=bf16,o=f32", "p=f32,c=f32,o=f32"
    assert traced.report == {"block0/dense": half, "block0/norm": full,
                             "block1/dense": half, "block1/norm": full, "head": half}


@frameworks
def test_rules_by_name_by_path_and_by_an_enclosing_block(framework):
  fw = FRAMEWORKS[framework]

  def traced(rules):
    return fw.trace(fw.Nested, jaxmp.flax.ModulePolicy(rules, default="mixed_bfloat16"), X)

  def dots(traced):  # of block0/dense, block1/dense, head
    return dot_dtypes(traced.jaxpr.jaxpr.eqns)

  half, full = (BF16, BF16), (F32, F32)
  by_name = traced({"head": "float32"})
  assert dots(by_name) == [half, half, full]
  assert dots(traced({"block1/dense": "float32"})) == [half, full, half]
  # A block forced to float32 forces what is inside it, by its name or class.
  by_block = traced({"block0": "float32"})
  assert dots(by_block) == [full, half, half]
  assert float_out_dtypes(after_each_product(by_block.jaxpr)[0]) == {F32}  # its LayerNorm
  assert dots(traced({fw.Block: "float32"})) == [full, full, half]
  if framework == "nnx":  # what set_nnx_dtypes set
    assert by_name.report["head"] == "p=f32,c=f32,o=f32"
    assert by_name.report["block1/dense"] == "p=f32,c=bf16,o=f32"


@frameworks
def test_layers_built_with_float32_compute_in_float16_but_a_float32_rule_holds(framework):
  """override_dtype (Linen; NNX always overrides): every conv and matmul of a
  model whose layers declare dtype=float32 runs in float16, the LayerNorm
  kept in float32 by its rule computes in float32, the master params stay."""
  fw = FRAMEWORKS[framework]
  x = jnp.ones((2, 5, 5, 3))
  plain = fw.trace(fw.Declared, jaxmp.flax.ModulePolicy({}, default=None), x)
  assert {dtypes for _, dtypes in products(plain.jaxpr)} == {(F32, F32)}
  policy = jaxmp.flax.ModulePolicy({fw.LayerNorm: "float32"}, default="mixed_float16",
                                   override_dtype=True)
  traced = fw.trace(fw.Declared, policy, x)
  assert products(traced.jaxpr) == [(CONV, (F16, F16)), (DOT, (F16, F16)), (DOT, (F16, F16))]
  norm, _, _ = after_each_product(traced.jaxpr)
  assert_computes_in_float32(norm, F16)  # only its float16 input is converted
  assert traced.grads == {F32}


# Linen only.


class LinenNet(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8)(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(4)(x)


def linen_jaxpr(model, policy, x=None):
  x = jnp.ones((2, 3)) if x is None else x
  variables = jax.jit(model.init)(jax.random.key(0), x)
  apply = policy.wrap_apply(model.apply)
  return jax.make_jaxpr(apply)(variables, x), apply, variables


def test_linen_overlap_resolves_by_first_match():
  # Without first_match it raises: the catalogue's "ModulePolicy: overlapping rules".
  rules = [(nn.Dense, "bf16"), ("Dense_1", "float32")]
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
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
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
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  apply = policy.wrap_apply(model.apply)
  assert apply({"params": params}, x).dtype == F32
  grads = jax.jit(jax.grad(lambda p: apply({"params": p}, x).sum()))(params)
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))


def test_jit_hashable_and_str():
  a = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_bfloat16")
  b = jaxmp.flax.ModulePolicy([(nn.LayerNorm, "f32")], default="p=f32,c=bf16,o=f32")
  assert a == b and hash(a) == hash(b)
  overriding = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_bfloat16",
                                       override_dtype=True)
  assert overriding != a
  assert jaxmp.flax.ModulePolicy({}, override_dtype=nn.Dense) == jaxmp.flax.ModulePolicy(
      {}, override_dtype=[nn.Dense])
  # str() is stable across processes: checkpoints record it.
  assert str(overriding) == (
      "ModulePolicy({flax.linen.normalization.LayerNorm: p=f32,c=f32,o=f32}, "
      "default=p=f32,c=bf16,o=f32, first_match=False, override_dtype=True)")
  assert str(jaxmp.flax.ModulePolicy({}, override_dtype=(nn.Dense,))).endswith(
      "override_dtype=(flax.linen.linear.Dense,))")
  model = LinenNet()
  x = jnp.ones((2, 3))
  variables = model.init(jax.random.key(0), x)

  @jax.jit(static_argnums=0)
  @chex.assert_max_traces(n=1)
  def apply(policy, variables, x):
    return policy.wrap_apply(model.apply)(variables, x)

  chex.assert_trees_all_equal(apply(a, variables, x), a.wrap_apply(model.apply)(variables, x))
  apply(b, variables, x)  # an equal policy: no retrace


# The model's own dtype: override_dtype.


@functools.cache
def declared_model():
  model = DeclaredFloat32()
  x = jnp.linspace(-1.0, 1.0, 2 * 5 * 5 * 3).reshape(2, 5, 5, 3)
  return model, x, jax.jit(model.init)(jax.random.key(0), x)


def forward_and_backward(policy, model, variables, x):
  apply = policy.wrap_apply(model.apply)

  def loss(params):
    return jnp.mean(apply({"params": params}, x).astype(jnp.float32) ** 2)

  return jax.value_and_grad(loss), variables["params"]



def output_dtypes(policy, model, variables, x):
  """The dtype each submodule of the root returns, under the policy."""
  seen = {}

  def capture(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and len(context.module.scope.path) == 1:
      seen[context.module.name] = np.dtype(out.dtype)
    return out

  with nn.intercept_methods(capture):  # traced: the dtypes, not the values
    jax.eval_shape(policy.wrap_apply(model.apply), variables, x)
  return seen


def test_declared_dtypes_win_unless_override_dtype_makes_every_conv_and_matmul_float16():
  model, x, variables = declared_model()
  plain = jaxmp.flax.ModulePolicy({}, default="mixed_float16")
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=True)
  found = {p: matmul_dtypes(*forward_and_backward(p, model, variables, x)) for p in (plain, policy)}
  names = [CONV, DOT, DOT, DOT, DOT, DOT, DOT, CONV]  # forward, then backward
  assert found[plain] == [(name, ("float32", "float32")) for name in names]
  assert found[policy] == [(name, ("float16", "float16")) for name in names]
  # The LayerNorm returns float16; without the override, float32.
  assert output_dtypes(policy, model, variables, x) == {
      "Conv_0": F16, "LayerNorm_0": F16, "SetupBlock_0": F16, "head": F16}
  assert output_dtypes(plain, model, variables, x) == {
      "Conv_0": F32, "LayerNorm_0": F32, "SetupBlock_0": F32, "head": F32}
  # The master params, the gradients and the model's own fields are untouched.
  grads = jax.eval_shape(
      jax.grad(lambda p: policy.wrap_apply(model.apply)({"params": p}, x).sum()),
      variables["params"])
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, variables["params"])
  assert model.dtype is jnp.float32
  assert input_dtypes(model.apply, variables, x) == {"float32"}  # without the policy
  # A TrainState under the policy trains its float32 params in float16.
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1), policy=policy)

  def train_step(state):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, jnp.array([0, 2])).mean()

    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  assert input_dtypes(train_step, state) == {"float16"}
  new_state, loss = jax.jit(train_step)(state)
  assert np.isfinite(loss) and bool(new_state.metrics["last_finite"])
  assert {p.dtype for p in jax.tree_util.tree_leaves(new_state.params)} == {F32}


def test_override_dtype_for_chosen_classes_only():
  model, x, variables = declared_model()
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=(nn.Dense,))
  # The model's own dtype (passed to the Conv) is not overridden; the Dense
  # layers' is, the one built in setup too.
  assert matmul_dtypes(policy.wrap_apply(model.apply), variables, x) == [
      (CONV, ("float32", "float32")), (DOT, ("float16", "float16")),
      (DOT, ("float16", "float16"))]
  # Overriding the model class passes the compute dtype on to its layers.
  by_model = jaxmp.flax.ModulePolicy({}, default="mixed_float16",
                                     override_dtype=(DeclaredFloat32,))
  assert input_dtypes(by_model.wrap_apply(model.apply), variables, x) == {"float16"}


class DeclaredHead(nn.Module):

  head_dtype: Any = jnp.float32  # the head's own dtype

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(8, name="body")(x))
    return nn.Dense(4, dtype=self.head_dtype, name="head")(x)


@pytest.mark.parametrize("policy, declared, computes", [
    ("mixed_float16", F32, F16),
    (jaxmp.PathPolicy({"^body/": "mixed_float16"}, default="mixed_float16"), F32, F16),
    (jaxmp.flax.ModulePolicy({}, default="mixed_float16"), F32, F16),
    (jaxmp.flax.ModulePolicy({"head": "float32"}, default="mixed_float16"), F16, F32)],
    ids=["policy", "path_policy", "module_policy", "module_rule"])
def test_a_declared_dtype_the_policy_does_not_override_is_reported_once_per_trace(
    policy, declared, computes):
  # Overridden or reported, never silently kept: the wrapped apply sees every
  # module as it is traced, so the report costs no trace of its own.
  model, x = DeclaredHead(declared), jnp.ones((2, 3))
  params = model.init(jax.random.key(0), x)["params"]
  traces = []

  def step_of(**kwargs):
    state = jaxmp.flax.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1), **kwargs)

    def step(state, x):
      def loss_fn(p, x):
        traces.append(None)
        return jnp.mean(state.apply_fn({"params": p}, x) ** 2)
      return state.value_and_grad(loss_fn)(state.params, x)

    return functools.partial(jax.jit(step), state)

  step = step_of(policy=policy)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    step(x)
    step(x)  # no new trace: no new report
    # The head's own dtype wins over its policy.
    assert matmul_dtypes(step.args[0].apply_fn, {"params": params}, x)[1] == (
        DOT, (declared.name, declared.name))
  warned = [w for w in record if issubclass(w.category, jaxmp.PrecisionWarning)]
  message = str(warned[0].message)
  assert len(traces) == 1 and len(warned) == 2  # the step's, once; matmul_dtypes'
  assert f"'head' declares dtype={declared.name}, its policy computes in {computes.name}" in message
  assert "Drop dtype=" in message and "override_dtype=True" in message
  assert f"ModulePolicy({{'head': '{declared.name}'}}" in message
  assert warned[0].filename == __file__  # points at the call of the model
  # Kept on purpose by a rule, overridden, or autocast: nothing to report.
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    for kwargs in (
        {"policy": jaxmp.flax.ModulePolicy({"head": declared.name}, default="mixed_float16")},
        {"policy": jaxmp.PathPolicy({"^head/": declared.name}, default="mixed_float16")},
        {"policy": jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=True)},
        {} if isinstance(policy, jaxmp.PathPolicy) else {"policy": policy, "autocast": True}):
      step_of(**kwargs)(x)


# The policy's fields: each module that gets them runs as a copy.


class EveryBinding(nn.Module):
  """Submodules bound in setup and in a compact method, each called twice, a
  lifted one, batch statistics, dropout, and a method other than __call__."""

  dtype: Any = None

  def setup(self):
    self.embed = nn.Embed(10, 4, dtype=self.dtype)
    self.dense = nn.Dense(4, dtype=self.dtype)
    self.norm = nn.BatchNorm(use_running_average=False, dtype=self.dtype)
    self.drop = nn.Dropout(0.5, deterministic=False)
    self.compact = EveryCompact(dtype=self.dtype)

  def __call__(self, tokens):
    h = self.embed(tokens)
    for _ in range(2):
      h = self.drop(self.norm(nn.relu(self.dense(h))))
    return self.embed.attend(self.compact(h))


class EveryCompact(nn.Module):

  dtype: Any = None

  @nn.compact
  def __call__(self, h):
    dense = nn.Dense(4, dtype=self.dtype)
    h = dense(dense(h))
    h = nn.remat(nn.Dense)(4, dtype=self.dtype)(h)
    stack = nn.scan(ScanCell, variable_axes={"params": 0},
                    split_rngs={"params": True}, length=2)
    return stack()(h, jnp.zeros((2,)))[0]


def run_every_binding(policy):
  """``(variables, output, batch_stats)`` of EveryBinding, init and apply."""
  model, tokens = EveryBinding(), jnp.array([[1, 2, 3], [4, 5, 6]])
  rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
  init, apply = model.init, model.apply
  if policy is not None:
    init, apply = policy.wrap_apply(init), policy.wrap_apply(apply)
  variables = jax.jit(init)(rngs, tokens)
  out, state = jax.jit(functools.partial(apply, mutable=["batch_stats"]))(
      variables, tokens, rngs={"dropout": jax.random.key(2)})
  return variables, out, state


def test_a_module_given_the_policys_dtype_keeps_its_variables_and_rngs():
  """Under float32 every layer (dtype=None) is given dtype=float32: each runs
  as a copy bound to its variables, and init, the output (dropout included)
  and the new batch statistics are bit for bit those of the plain model."""
  policy = jaxmp.flax.ModulePolicy({}, default="float32", override_dtype=True)
  chex.assert_trees_all_equal(run_every_binding(policy), run_every_binding(None))
  half = jaxmp.flax.ModulePolicy({}, default="mixed_bfloat16", override_dtype=True)
  model, tokens = EveryBinding(), jnp.ones((2, 3), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)  # traced only
  assert {d for _, d in matmul_dtypes(functools.partial(
      half.wrap_apply(model.apply), mutable=["batch_stats"],
      rngs={"dropout": jax.random.key(2)}), variables, tokens)} == {
          ("bfloat16", "bfloat16")}


def fields(module):
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
          if f.name not in ("parent", "name")}


def linen_net():
  x = jnp.ones((2, 3))
  return LinenNet(), x, None


@pytest.mark.parametrize("policy, make_model", [
    (jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16",
                             override_dtype=True), declared_model),
    (jaxmp.flax.ModulePolicy({}, default="mixed_fp8"), linen_net)],
    ids=["override_dtype", "fp8"])
@pytest.mark.parametrize("method", ["init", "apply"])
def test_no_field_of_a_bound_module_changes(policy, make_model, method):
  """The model's code never sees one of its modules with other fields than
  it was built with: the policy's dtype and FP8 op reach a copy."""
  model, x, _ = make_model()
  variables = jax.eval_shape(policy.wrap_apply(model.init), jax.random.key(0), x)
  built, seen = {}, []

  def outside(next_fun, args, kwargs, context):  # as the model's code made it
    built.setdefault(id(context.module), (context.module, fields(context.module)))
    return next_fun(*args, **kwargs)

  def inside(next_fun, args, kwargs, context):  # as the module runs
    seen.append((context.module, fields(context.module)))
    return next_fun(*args, **kwargs)

  def run(*args, **kwargs):
    with nn.intercept_methods(inside):
      return getattr(model, method)(*args, **kwargs)

  args = (jax.random.key(0), x) if method == "init" else (variables, x)
  with nn.intercept_methods(outside):
    jax.eval_shape(policy.wrap_apply(run), *args)
  changed = [module.name for module, now in seen
             if id(module) in built and now != built[id(module)][1]]
  assert not changed
  # The policy took effect on what ran.
  if "fp8" in str(policy):
    assert any(f.get("dot_general_cls") is not None for _, f in seen)
  else:
    assert {np.dtype(f["dtype"]) for m, f in seen if isinstance(m, nn.Dense)} == {F16}
