"""Tests of jaxmp.flax.ModulePolicy: per-module policies for Linen and NNX.

The dtypes each module computes in are read off the jaxpr (split at the matrix
products), not inferred from outputs; a promise of both frameworks is tested
once over both. The error messages live in tests/test_bad_input.py.
"""

import dataclasses
import functools
import types
import warnings
from typing import Any

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
from models import LinenMLP, f32, finite, like_flax_init

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)
CONV, DOT = "conv_general_dilated", "dot_general"


def float_out_dtypes(eqns):
  return {np.dtype(v.aval.dtype) for e in eqns for v in e.outvars
          if jnp.issubdtype(v.aval.dtype, jnp.floating)}


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


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.LayerNorm(name="norm")(nn.Dense(3, name="dense")(x))


class LinenNested(nn.Module):
  """Two blocks (Dense, LayerNorm) and a head, named as NnxNested's attributes."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head")(LinenBlock(name="block1")(LinenBlock(name="block0")(x)))


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
    x = nn.LayerNorm(dtype=self.dtype)(nn.Conv(4, (3, 3), dtype=self.dtype)(x))
    x = SetupBlock(dtype=self.dtype)(x.reshape((x.shape[0], -1)))
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
    return self.head(nnx.relu(self.block(x.reshape((x.shape[0], -1)))))


def trace(framework, model, policy, x):
  """The model (a key of MODELS) under the policy (Linen: wrap_apply; NNX:
  set_nnx_dtypes), traced: its forward jaxpr, gradients' dtypes, NNX report."""
  model, report = MODELS[framework][model], None
  if framework == "linen":
    apply = policy.wrap_apply(model().apply)
    params = jax.eval_shape(model().init, jax.random.key(0), x)["params"]
    forward = lambda p, x: apply({"params": p}, x)
  else:
    model = nnx.eval_shape(lambda: model(nnx.Rngs(0)))
    report = policy.set_nnx_dtypes(model)
    graphdef, params = nnx.split(model)
    forward = lambda p, x: nnx.merge(graphdef, p)(x)
  grads = jax.eval_shape(jax.grad(lambda p: forward(p, x).astype(F32).sum()), params)
  return types.SimpleNamespace(jaxpr=jax.make_jaxpr(forward)(params, x), report=report,
                               grads={g.dtype for g in jax.tree_util.tree_leaves(grads)})


MODELS = {"linen": {"LayerNorm": nn.LayerNorm, "Dense": nn.Dense, "Block": LinenBlock,
                    "Nested": LinenNested, "Declared": DeclaredFloat32},
          "nnx": {"LayerNorm": nnx.LayerNorm, "Dense": nnx.Linear, "Block": NnxBlock,
                  "Nested": NnxNested, "Declared": NnxDeclaredFloat32}}
frameworks = pytest.mark.parametrize("framework", sorted(MODELS))
X = jnp.ones((2, 3))
TOKENS = jax.device_put(np.array([[1, 2, 3], [4, 5, 6]], np.int32))


@frameworks
def test_a_class_rule_keeps_the_layernorms_in_float32_and_the_dense_layers_in_bfloat16(
    framework):
  policy = jaxmp.flax.ModulePolicy({MODELS[framework]["LayerNorm"]: "float32"},
                                   default="mixed_bfloat16")
  traced = trace(framework, "Nested", policy, X)
  assert products(traced.jaxpr) == [(DOT, (BF16, BF16))] * 3
  for norm in after_each_product(traced.jaxpr)[:2]:
    assert_computes_in_float32(norm, BF16)  # the bfloat16 Dense's output
  assert traced.grads == {F32}  # the master params' dtype
  # The check discriminates: without the rule, the LayerNorms compute in bfloat16.
  control = trace(framework, "Nested", jaxmp.flax.ModulePolicy({}, default="mixed_bfloat16"), X)
  assert all(BF16 in float_out_dtypes(norm) for norm in after_each_product(control.jaxpr)[:2])
  if framework == "linen":
    assert traced.jaxpr.out_avals[0].dtype == F32  # the default policy's output dtype
  else:  # what set_nnx_dtypes set
    half, full = "p=f32,c=bf16,o=f32", "p=f32,c=f32,o=f32"
    assert traced.report == {"block0/dense": half, "block0/norm": full,
                             "block1/dense": half, "block1/norm": full, "head": half}


@frameworks
def test_rules_by_name_by_path_and_by_an_enclosing_block(framework):
  def traced(rules, **kwargs):
    kwargs = {"default": "mixed_bfloat16", **kwargs}
    return trace(framework, "Nested", jaxmp.flax.ModulePolicy(rules, **kwargs), X)

  def dots(traced):  # of block0/dense, block1/dense, head
    return [dtypes for _, dtypes in products(traced.jaxpr)]

  half, full = (BF16, BF16), (F32, F32)
  by_name = traced({"head": "float32"})
  assert dots(by_name) == [half, half, full]
  assert dots(traced({"block1/dense": "float32"})) == [half, full, half]
  # A block forced to float32 forces what is inside it, by its name or class.
  by_block = traced({"block0": "float32"})
  assert dots(by_block) == [full, half, half]
  assert float_out_dtypes(after_each_product(by_block.jaxpr)[0]) == {F32}  # its LayerNorm
  assert dots(traced({MODELS[framework]["Block"]: "float32"})) == [full, full, half]
  # Overlapping rules resolve by first_match (without it they raise: the catalogue's "ModulePolicy:
  # overlapping rules"); default=None leaves the other layers alone.
  assert dots(traced([("block1/dense", "float32"), (MODELS[framework]["Dense"], "bf16")],
                     default="float32", first_match=True)) == [half, full, half]
  assert dots(traced({"head": "bf16"}, default=None)) == [full, full, half]
  if framework == "nnx":  # what set_nnx_dtypes set
    assert by_name.report["head"] == "p=f32,c=f32,o=f32"
    assert by_name.report["block1/dense"] == "p=f32,c=bf16,o=f32"


@frameworks
def test_layers_built_with_float32_compute_in_float16_but_a_float32_rule_holds(framework):
  """override_dtype (Linen; NNX always overrides): every conv and matmul of a
  model whose layers declare dtype=float32 runs in float16, the LayerNorm
  kept in float32 by its rule computes in float32, the master params stay."""
  x = jnp.ones((2, 5, 5, 3))
  plain = trace(framework, "Declared", jaxmp.flax.ModulePolicy({}, default=None), x)
  assert {dtypes for _, dtypes in products(plain.jaxpr)} == {(F32, F32)}
  policy = jaxmp.flax.ModulePolicy({MODELS[framework]["LayerNorm"]: "float32"},
                                   default="mixed_float16", override_dtype=True)
  traced = trace(framework, "Declared", policy, x)
  assert products(traced.jaxpr) == [(CONV, (F16, F16)), (DOT, (F16, F16)), (DOT, (F16, F16))]
  # The LayerNorm converts only its float16 input; the gradients are float32.
  assert_computes_in_float32(after_each_product(traced.jaxpr)[0], F16)
  assert traced.grads == {F32}


class ScanCell(nn.Module):
  @nn.compact
  def __call__(self, carry, x):
    del x
    carry = nn.LayerNorm()(nn.Dense(4)(carry))
    return carry, carry


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
  model, x = LinenMLP(), f32(np.ones((2, 4)))
  variables = like_flax_init(jax.eval_shape(model.init, jax.random.key(0), x))  # NumPy's draws

  @jax.jit(static_argnums=0)
  @chex.assert_max_traces(n=1)
  def apply(policy, variables, x):
    return policy.wrap_apply(model.apply)(variables, x)

  # The policy applied directly; without any rule and default, wrap_apply is the identity.
  direct, identity, plain = jax.jit(lambda v, x: [wrap(v, x) for wrap in (
      a.wrap_apply(model.apply), jaxmp.flax.ModulePolicy({}, default=None).wrap_apply(
          model.apply), model.apply)])(variables, x)
  chex.assert_trees_all_equal(apply(a, variables, x), direct)
  apply(b, variables, x)  # an equal policy: no retrace
  chex.assert_trees_all_equal(identity, plain)


@functools.cache
def declared_model():
  model, x = DeclaredFloat32(), f32(np.linspace(-1.0, 1.0, 2 * 5 * 5 * 3).reshape(2, 5, 5, 3))
  return model, x, like_flax_init(jax.eval_shape(model.init, jax.random.key(0), x))


def test_declared_dtypes_win_unless_override_dtype_makes_every_conv_and_matmul_float16():
  """override_dtype=True overrides every layer; a tuple, the layers of those classes."""
  model, x, variables = declared_model()
  plain = jaxmp.flax.ModulePolicy({}, default="mixed_float16")
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=True)
  names = [CONV, DOT, DOT, DOT, DOT, DOT, DOT, CONV]  # forward, then backward
  for p, dtype in ((plain, "float32"), (policy, "float16")):
    apply = p.wrap_apply(model.apply)
    loss = lambda params: jnp.mean(apply({"params": params}, x).astype(jnp.float32) ** 2)
    assert matmul_dtypes(jax.value_and_grad(loss), variables["params"]) == [
        (name, (dtype, dtype)) for name in names]
    # The LayerNorm returns float16 with the override; without, float32.
    _, state = jax.eval_shape(lambda v: apply(v, x, capture_intermediates=True), variables)
    assert {name: np.dtype(out["__call__"][0].dtype) for name, out in state[
        "intermediates"].items() if name != "__call__"} == dict.fromkeys(
            ("Conv_0", "LayerNorm_0", "SetupBlock_0", "head"), np.dtype(dtype))
  # The model's own fields are untouched (the gradients' float32: test_layers_built_with_
  # float32_compute_in_float16_but_a_float32_rule_holds).
  assert model.dtype is jnp.float32
  assert input_dtypes(model.apply, variables, x) == {"float32"}  # without the policy
  # A TrainState under the policy trains its float32 params in float16.
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1), policy=policy)
  loss_fn = lambda params: optax.softmax_cross_entropy_with_integer_labels(
      state.apply_fn({"params": params}, x), jnp.array([0, 2])).mean()
  def train_step(state):
    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss
  assert input_dtypes(train_step, state) == {"float16"}
  new_state, loss = jax.jit(train_step)(state)
  assert np.isfinite(loss) and bool(new_state.metrics["last_finite"])
  assert {p.dtype for p in jax.tree_util.tree_leaves(new_state.params)} == {F32}
  # For chosen classes only: the model's own dtype (passed to the Conv) is not
  # overridden, the Dense layers' is (the one built in setup too); overriding
  # the model class passes the compute dtype on to its layers.
  chosen = jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=(nn.Dense,))
  assert matmul_dtypes(chosen.wrap_apply(model.apply), variables, x) == [
      (CONV, ("float32",) * 2), (DOT, ("float16",) * 2), (DOT, ("float16",) * 2)]
  by_model = jaxmp.flax.ModulePolicy({}, default="mixed_float16",
                                     override_dtype=(DeclaredFloat32,))
  assert input_dtypes(by_model.wrap_apply(model.apply), variables, x) == {"float16"}


class DeclaredHead(nn.Module):
  head_dtype: Any = jnp.float32  # the head's own dtype

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, dtype=self.head_dtype, name="head")(nn.relu(nn.Dense(8, name="body")(x)))


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
  model, x, traces = DeclaredHead(declared), f32(np.ones((2, 3))), []
  params = like_flax_init(jax.eval_shape(model.init, jax.random.key(0), x))["params"]

  def step_of(**kwargs):  # value_and_grad of a TrainState, jitted; its apply_fn
    state = jaxmp.flax.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1), **kwargs)

    def loss_fn(p, x):
      traces.append(None)
      return jnp.mean(state.apply_fn({"params": p}, x) ** 2)

    return functools.partial(jax.jit(state.value_and_grad(loss_fn)), state.params), state.apply_fn

  step, apply_fn = step_of(policy=policy)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    step(x)
    step(x)  # no new trace: no new report
    # The head's own dtype wins over its policy.
    assert matmul_dtypes(apply_fn, {"params": params}, x)[1] == (DOT, (declared.name,) * 2)
  warned = [w for w in record if issubclass(w.category, jaxmp.PrecisionWarning)]
  message = str(warned[0].message)
  assert len(traces) == 1 and len(warned) == 2  # the step's, once; matmul_dtypes'
  assert all(part in message for part in (
      f"'head' declares dtype={declared.name}, its policy computes in {computes.name}",
      "Drop dtype=", "override_dtype=True", f"ModulePolicy({{'head': '{declared.name}'}}"))
  assert warned[0].filename == __file__  # points at the call of the model
  # Kept on purpose by a rule, overridden, or autocast: nothing to report (when traced).
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    for kwargs in (
        {"policy": jaxmp.flax.ModulePolicy({"head": declared.name}, default="mixed_float16")},
        {"policy": jaxmp.PathPolicy({"^head/": declared.name}, default="mixed_float16")},
        {"policy": jaxmp.flax.ModulePolicy({}, default="mixed_float16", override_dtype=True)},
        {} if isinstance(policy, jaxmp.PathPolicy) else {"policy": policy, "autocast": True}):
      jax.eval_shape(step_of(**kwargs)[0], x)


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


@functools.partial(jax.jit, static_argnums=0)
def run_every_binding(policy):
  """``(variables, output, batch_stats)`` of EveryBinding, init and apply (one program)."""
  init, apply = EveryBinding().init, EveryBinding().apply
  if policy is not None:
    init, apply = policy.wrap_apply(init), policy.wrap_apply(apply)
  variables = init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, TOKENS)
  return variables, *apply(variables, TOKENS, rngs={"dropout": jax.random.key(2)},
                           mutable=["batch_stats"])


def test_a_module_given_the_policys_dtype_keeps_its_variables_and_rngs():
  """Given dtype=float32, every layer runs as a copy bound to its variables: init, output (dropout
  included) and new batch statistics bit for bit as the plain model's. In bfloat16 it trains; in
  the scan the carry keeps its dtype (the float32 LayerNorm returns bfloat16)."""
  policy = jaxmp.flax.ModulePolicy({}, default="float32", override_dtype=True)
  ran = run_every_binding(policy)
  chex.assert_trees_all_equal(ran, run_every_binding(None))
  half = jaxmp.flax.ModulePolicy({nn.LayerNorm: "p=f32,c=f32,o=bf16"}, default="mixed_bfloat16",
                                 override_dtype=True)
  variables, tokens = ran[0], TOKENS
  apply = functools.partial(half.wrap_apply(EveryBinding().apply), mutable=["batch_stats"],
                            rngs={"dropout": jax.random.key(2)})
  assert {d for _, d in matmul_dtypes(apply, variables, tokens)} == {("bfloat16", "bfloat16")}
  assert jax.eval_shape(apply, variables, tokens)[0].dtype == F32
  grads = jax.jit(jax.grad(lambda p: apply({**variables, "params": p}, tokens)[0].sum()))(
      variables["params"])
  chex.assert_trees_all_equal_shapes_and_dtypes(grads, variables["params"])
  assert finite(grads)


def fields(module):
  return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)
          if f.name not in ("parent", "name")}


@pytest.mark.parametrize("policy, make_model", [
    (jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16",
                             override_dtype=True), declared_model),
    (jaxmp.flax.ModulePolicy({}, default="mixed_fp8"), lambda: (LinenMLP(), jnp.ones((2, 4)), 0))],
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
  assert not [module.name for module, now in seen
              if id(module) in built and now != built[id(module)][1]]
  # The policy took effect on what ran.
  if "fp8" in str(policy):
    assert any(f.get("dot_general_cls") is not None for _, f in seen)
  else:
    assert {np.dtype(f["dtype"]) for m, f in seen if isinstance(m, nn.Dense)} == {F16}
