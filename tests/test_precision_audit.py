"""Tests of the precision audit: jaxmp.precision_report (exact FLOP counts of small
functions) and the PrecisionWarning (Linen models under jaxmp.flax.TrainState, NNX),
with the dtypes read off the jaxpr itself (not off the params)."""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import jaxmp
import jaxmp.flax
import models
from matmul_dtypes import input_dtypes

F16 = np.dtype(jnp.float16)
X, Y = models.f32(np.random.default_rng(0).normal(size=(8, 4))), jax.device_put(np.arange(8) % 3)
ones = lambda *shape: np.ones(shape, np.float32)  # arguments traced only: nothing compiled
KEY = jax.random.key(0)
USER_CODE_MIXES = "the audited code mixes float16 and float32 on purpose"


def at_line(source, fn, offset=1):
  """Whether ``source`` (a report's) names a line of ``fn``: "file:line:column (name)"."""
  file, line, _ = source.split(" ")[0].split(":")
  return ((file, int(line)) == ("test_precision_audit.py", fn.__code__.co_firstlineno + offset)
          and source.endswith(f" ({fn.__qualname__})"))


def test_a_dot_with_its_dtypes_shapes_flops_operands_and_source():
  def loss(params, x):  # v stays float32 (what `@` gives under standard promotion)
    h = x.astype(jnp.float16) @ params["w"].astype(jnp.float16)
    return jax.lax.dot(h, params["v"], preferred_element_type=jnp.float32)

  report = jaxmp.precision_report(loss, {"w": ones(3, 5), "v": ones(5, 2)}, ones(4, 3))
  op, mixed = report.ops
  assert op == type(op)(
      primitive="dot_general", direction="forward", lhs_dtype=F16,
      rhs_dtype=F16, out_dtype=F16, lhs_shape=(4, 3), rhs_shape=(3, 5),
      out_shape=(4, 5), flops=2 * 4 * 5 * 3, repeats=1, module="",
      operands=("x", "params/w"), source=op.source, cause="", captured="")
  assert at_line(op.source, loss) and at_line(mixed.source, loss, 2)
  assert (op.inputs, op.runs_in("f16"), op.where) == (("float16", "float16"), True, "params/w")
  assert (mixed.inputs, mixed.cause, mixed.operands) == (
      ("float16", "float32"), "mixed", ("", "params/v"))
  assert report.flops_by_dtype() == {("float16", "float16"): 120, ("float16", "float32"): 80}
  assert report.flops_share(jnp.float16) == 0.6 and report.flops_share("f16") == 0.6
  assert (report.ops_outside("f16"), report.ops_outside("float32")) == ((mixed,), (op, mixed))
  lines = str(report).splitlines()
  assert lines[:4] == [
      "jaxmp precision report: 2 matmul/conv ops, 200 FLOPs per call (forward 200)",
      "FLOPs by input dtypes:", "  float16 x float16      60.0%  120",
      "  float16 x float32      40.0%  80"]
  assert lines[5].split() == ["pass", "op", "inputs", "output", "shapes", "FLOPs",
                              "where", "cause", "source"]
  assert lines[7].split()[:9] == ["forward", "dot", "float16", "x", "float32", "float32",
                                  "[4,5]", "x", "[5,2]"]
  assert lines[7].rstrip().endswith(mixed.source) and " mixed " in lines[7]
  empty = jaxmp.precision_report(jnp.tanh, ones(3))
  assert empty.ops == () and "nothing to report" in str(empty)

  def power(a):  # JAX's own jit: the lines of its matmuls are JAX's, the source is the call
    return jnp.linalg.matrix_power(a, 3)

  ops = jaxmp.precision_report(power, ones(4, 4)).ops
  assert len(ops) == 2 and all(at_line(op.source, power) for op in ops)
  # Called directly, no line of the user's (nor of jaxmp's) is the source.
  assert {op.source for op in jaxmp.precision_report(
      jnp.linalg.matrix_power, ones(4, 4), 3).ops} == {""}
  # An einsum with batch dimensions (2 * batch * M * N * K), of abstract values and a
  # static flag, which stays a Python value: nothing runs.
  einsum = lambda a, b, *, t: jnp.einsum("bji,bjk->bik" if t else "bij,bjk->bik", a, b)
  with jax.transfer_guard("disallow"):
    op, = jaxmp.precision_report(einsum, jax.ShapeDtypeStruct((2, 3, 4), jnp.bfloat16),
                                 jax.ShapeDtypeStruct((2, 4, 5), jnp.bfloat16), t=False).ops
  assert (op.flops, op.lhs_shape, op.rhs_shape, op.out_shape) == (
      2 * 2 * 3 * 5 * 4, (2, 3, 4), (2, 4, 5), (2, 3, 5))


def test_convolutions_scans_loops_and_shard_map_count_their_flops():
  conv = functools.partial(jax.lax.conv_general_dilated,
                           dimension_numbers=("NHWC", "HWIO", "NHWC"))

  def convs(x, k, grouped):
    y = conv(x, k, (1, 1), "SAME")
    return y, conv(x, k, (2, 2), "VALID"), conv(y, grouped, (1, 1), "SAME", feature_group_count=2)

  grouped = ones(3, 3, 2, 6)  # 4 input features in 2 groups of 2
  ops = jaxmp.precision_report(convs, ones(2, 8, 8, 3), ones(3, 3, 3, 4), grouped).ops
  assert [(op.primitive, op.out_shape, op.flops) for op in ops] == [
      ("conv_general_dilated", (2, 8, 8, 4), 2 * (2 * 8 * 8 * 4) * 3 * 9),
      ("conv_general_dilated", (2, 3, 3, 4), 2 * (2 * 3 * 3 * 4) * 3 * 9),
      ("conv_general_dilated", (2, 8, 8, 6), 2 * (2 * 8 * 8 * 6) * 2 * 9)]
  assert ops[2].operands == ("", "grouped")
  # A scan over layers counts every iteration.
  stack = lambda weights, x: jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, weights)[0]
  report = jaxmp.precision_report(stack, ones(3, 4, 4), ones(2, 4))
  op, = report.ops
  assert (op.repeats, op.flops, op.rhs_shape, op.operands) == (
      3, 3 * (2 * 2 * 4 * 4), (4, 4), ("x", "weights"))
  assert "(x3)" in str(report)

  def fn(w, x):  # jit, cond and while are walked; a while body counts once
    y = jax.lax.cond(jnp.sum(x) > 0, lambda y: y @ w, lambda y: y + 1, x)
    return jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, y))[1]

  report = jaxmp.precision_report(jax.jit(fn), ones(4, 4), ones(2, 4))
  assert [(op.repeats, op.flops, op.operands[1]) for op in report.ops] == [(1, 64, "w")] * 2
  # shard_map counts every device: the FLOPs of the whole product.
  shards = len(jax.devices())
  fn = jax.shard_map(lambda a, b: a @ b, mesh=Mesh(np.array(jax.devices()), ("d",)),
                     in_specs=(PartitionSpec("d"), PartitionSpec()), out_specs=PartitionSpec("d"))
  op, = jaxmp.precision_report(fn, ones(2 * shards, 3), ones(3, 5)).ops
  assert (op.repeats, op.lhs_shape, op.flops) == (shards, (2, 3), 2 * (2 * shards) * 5 * 3)


def test_gradients_remat_and_a_custom_vjp_label_their_passes():
  block = jax.checkpoint(lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w))
  w, x = ones(4, 4), ones(2, 4)
  report = jaxmp.precision_report(jax.grad(lambda w, x: jnp.sum(block(w, x))), w, x)
  assert [op.direction for op in report.ops] == (
      ["forward"] * 2 + ["recompute"] * 2 + ["backward"] * 3)
  assert {op.flops for op in report.ops} == {2 * 2 * 4 * 4}
  assert (report.flops("recompute"), report.flops("backward"), report.flops()) == (128, 192, 448)
  assert report.flops_share("float32", direction="backward") == 1.0

  @jax.custom_vjp
  def product(a, b):
    return a @ b

  def forward(a, b):
    return a @ b, (a, b)

  product.defvjp(forward, lambda residuals, g: (g @ residuals[1].T, residuals[0].T @ g))
  report = jaxmp.precision_report(jax.grad(lambda w, x: jnp.sum(product(x, w))), w, x)
  assert [op.direction for op in report.ops] == ["forward", "backward", "backward"]
  assert at_line(report.ops[0].source, forward)
  assert [op.operands for op in report.ops[1:]] == [("", "w"), ("x", "")]
  # Not differentiated, the custom_vjp's own jaxpr is walked.
  op, = jaxmp.precision_report(lambda w, x: product(x, w), w, x).ops
  assert op.direction == "forward" and at_line(op.source, product.fun, 2)  # below its decorator


def train_state(model, policy="mixed_float16", *inputs):
  """A TrainState of ``model``, initialised on ``inputs`` (by default ``X``)."""
  params = models.like_flax_init(jax.eval_shape(model.init, KEY, *(inputs or (X,))))["params"]
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy=policy)


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def make_step(apply=None, audit=True, captured=None):
  """A new training step (no test finds another's in jit's cache) whose loss applies
  ``apply`` (by default the state's) to the batch, or to the ``captured`` one."""

  def step(state, x, y):
    def loss_fn(params, *batch):
      x, y = batch or captured
      return cross_entropy((apply or state.apply_fn)({"params": params}, x), y)

    loss, grads = state.value_and_grad(loss_fn, audit=audit)(
        state.params, *(() if captured else (x, y)))
    return state.apply_gradients(grads=grads), loss

  return step


class Translator(nn.Module):
  """Flax's WMT example in small: tokens, a padding mask, a float32 position table, dropout."""

  dtype: object = jnp.float32
  deterministic: bool = False

  @nn.compact
  def __call__(self, tokens):
    mask = nn.make_attention_mask(tokens > 0, tokens > 0, dtype=self.dtype)
    x = nn.Embed(8, 8)(tokens) + jnp.asarray(np.ones((1, 4, 8), np.float32))
    x = nn.Dropout(0.1)(x, deterministic=self.deterministic).astype(self.dtype)
    x = x + nn.MultiHeadDotProductAttention(num_heads=2, dtype=self.dtype)(x, mask=mask)
    x = nn.Dropout(0.1)(nn.relu(nn.Dense(16, dtype=self.dtype)(x)),
                        deterministic=self.deterministic)
    return nn.Dense(8, dtype=self.dtype, name="logits")(x)


def linen_mlp(dtype, policy, how):
  """``LinenMLP``'s state; a step applying it as the state does, uncast, or to X captured."""
  state = train_state(model := models.LinenMLP(dtype=dtype), policy)
  return state, make_step(None if how == "state" else model.apply,
                          captured=(X, Y) if how == "closure" else None)


def wmt_style():
  """As in Flax's WMT example: the state holds the evaluation model, and the loss
  calls the training one, capturing the tokens and the dropout key."""
  tokens, key = jax.device_put(np.array([[1, 2, 3, 0], [4, 5, 0, 0]], np.int32)), jax.random.key(1)
  state = train_state(Translator(deterministic=True), "mixed_bfloat16", tokens)
  return state, make_step(lambda variables, tokens: Translator().apply(
      variables, tokens, rngs={"dropout": key}), captured=(tokens, tokens))


MLP = "LinenMLP/Dense_0, LinenMLP/Dense_1"
MIXES = pytest.mark.standard_promotion(
    reason=USER_CODE_MIXES + ": a float32 batch meets 16-bit params in a Flax Dense")


# The ways a float32 matmul comes into a 16-bit step: the model declares float32 ('recast',
# which a ModulePolicy does not hide; tokens and a key the loss captures are not blamed),
# the loss captures the float32 batch ('closure', Flax's canonical form) or is fed it uncast.
@pytest.mark.parametrize("cause, layers, case", [
    ("recast", MLP, lambda: linen_mlp(jnp.float32, "mixed_float16", "state")),
    ("recast", MLP, lambda: linen_mlp(jnp.float32, jaxmp.flax.ModulePolicy(
        {nn.LayerNorm: "float32"}, default="mixed_float16"), "state")),
    pytest.param("recast", ", ".join(f"Translator/MultiHeadDotProductAttention_0/{name}"
                                     for name in ("query", "key")), wmt_style,
                 marks=pytest.mark.standard_promotion(reason="as in Flax's WMT example, "
                 "the float32 position table meets the bfloat16 embeddings")),
    pytest.param("closure", MLP, lambda: linen_mlp(None, "mixed_float16", "closure"), marks=MIXES),
    pytest.param("mixed", MLP, lambda: linen_mlp(None, "mixed_float16", "uncast"), marks=MIXES),
    pytest.param("mixed", MLP, lambda: linen_mlp(None, "mixed_bfloat16", "uncast"), marks=MIXES),
], ids=["recast", "recast-module_policy", "recast-wmt", "closure", "mixed-f16", "mixed-bf16"])
def test_the_warning_names_the_cause_the_layers_and_the_fix(cause, layers, case):
  state, step = case()
  with pytest.warns(jaxmp.PrecisionWarning) as record:  # at the first call
    new_state, loss = jax.jit(step)(state, X, Y)
  assert int(new_state.step) == 1 and np.isfinite(loss)  # and the step runs as before
  text, = [str(w.message) for w in record if "audit=True" in str(w.message)]  # the audit's
  # It says what it found (the share, the cause, the layers) and where the fixes are.
  captured = "float32[8,4]" if cause == "closure" else ""
  named = f"'{cause}' ({captured})" if captured else f"'{cause}'"
  assert all(part in text for part in (
      f"{named}, in {layers}", "0%", "100% in float32", "diagnostics.md"))
  assert not any(w in text for w in {"recast", "closure", "'mixed'"} - {cause, f"'{cause}'"})
  assert {w.filename for w in record} == {__file__}  # points at the call in the step
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxmp.PrecisionWarning)
    # Every matmul of the jaxpr runs in float32, though the policy casts to 16 bits.
    assert input_dtypes(step, state, X, Y) == {"float32"}
    report = jaxmp.precision_report(step, state, X, Y)
  assert report.flops_share("float32") == 1.0
  # Every matmul has the cause, the backward ones too; the layers and kernels are named.
  assert {op.direction for op in report.ops} == {"forward", "backward"}
  assert {(op.cause, op.captured) for op in report.ops} == {(cause, captured)}
  forward = [op for op in report.ops if op.direction == "forward"]
  assert [op.module for op in forward[:2]] == layers.split(", ")
  assert forward[0].operands[1] == f"state/params/{forward[0].module.split('/', 1)[1]}/kernel"


def reparameterize(key, mean, logvar):  # as in Flax's VAE example
  eps = jax.random.normal(key, logvar.shape)  # float32: the default dtype
  return mean + eps * jnp.exp(0.5 * logvar)


class VAE(nn.Module):

  @nn.compact
  def __call__(self, x, key):
    h = nn.relu(nn.Dense(8)(x))
    mean, logvar = nn.Dense(2, name="mean")(h), nn.Dense(2, name="logvar")(h)
    return nn.Dense(4, name="decoder")(reparameterize(key, mean, logvar))


@pytest.mark.standard_promotion(
    reason=USER_CODE_MIXES + ": as in Flax's VAE example, float32 noise meets the float16 mean")
def test_a_float32_value_the_model_creates_is_the_cause_forward_and_backward():
  state = train_state(VAE(), "mixed_float16", X, jax.random.key(1))
  loss_fn = lambda params, x, key: jnp.mean(
      (state.apply_fn({"params": params}, x, key).astype(jnp.float32) - x) ** 2)
  report = jaxmp.precision_report(
      lambda state, x, key: state.value_and_grad(loss_fn, audit=True)(state.params, x, key),
      state, X, jax.random.key(2))
  wide = report.ops_outside("float16")
  assert {(op.module, op.direction) for op in wide} == {
      ("VAE/decoder", "forward"), ("VAE/decoder", "backward")}
  assert len(wide) == 3 and report.flops_share("float32") == 3 * 128 / report.flops()
  (cause, origin), = {(op.cause, op.captured) for op in wide}
  assert cause == "created" and origin.startswith("random_bits at ")
  assert at_line(origin.removeprefix("random_bits at "), reparameterize)


class Wide(nn.Module):
  """A float16 model whose output layer, 99% of the FLOPs, a rule keeps in float32."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(512, name="head")(nn.LayerNorm()(nn.Dense(4)(x)))


HALF, WIDE = ("float16", "float16"), ("float32", "float32")


@pytest.mark.parametrize("model, policy, first, head", [
    (models.LinenMLP(), "mixed_float16", HALF, HALF),
    (Wide(), jaxmp.flax.ModulePolicy({"head": "float32"}, default="mixed_float16"), HALF, WIDE),
    (Wide(), "float32", WIDE, WIDE),
    pytest.param(Wide(), jaxmp.PathPolicy({"head": "float32"}, default="mixed_float16"), HALF,
                 WIDE, marks=pytest.mark.standard_promotion(
        reason="PathPolicy casts params only: the float16 LayerNorm output meets the float32 "
               "head's params in a Flax Dense (a ModulePolicy casts the head's inputs)")),
], ids=["correct_float16", "module_policy", "float32_policy", "path_policy"])
def test_a_correct_model_or_float32_by_a_rule_does_not_warn_nor_retrace_nor_transfer(
    model, policy, first, head):
  # Nothing promoted a float32 FLOP, so there is nothing to fix (nor under a float32 policy).
  state = train_state(model, policy)
  chex.clear_trace_counter()  # the cases share chex's counter
  step = make_step()
  jitted, x, y = jax.jit(chex.assert_max_traces(step, n=1)), jax.device_put(X), jax.device_put(Y)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    with jax.transfer_guard("disallow"):
      new_state, _ = jitted(state, x, y)
      new_state, _ = jitted(new_state, x, y)
  assert int(new_state.step) == 2
  report = jaxmp.precision_report(step, state, X, Y)
  assert [(op.direction, op.inputs) for op in report.ops] == [
      ("forward", first), ("forward", head), ("backward", head), ("backward", head),
      ("backward", first)]
  assert input_dtypes(step, state, X, Y) == set(first + head)  # read off the jaxpr too
  assert not any(op.cause for op in report.ops)


@pytest.mark.parametrize("audit", [False, True])
def test_the_audit_is_opt_in_and_its_trace_the_only_extra_one(audit):
  state = train_state(nn.Dense(3, dtype=jnp.float32), "mixed_bfloat16")  # few ops, op by op
  traces, (x4, y4) = [], jax.device_put((np.asarray(X)[:4], np.asarray(Y)[:4]))

  def loss_fn(params, x, y):
    traces.append(x.shape)
    return jnp.mean(state.apply_fn({"params": params}, x) ** 2)

  grad_fn = state.value_and_grad(loss_fn, audit=audit)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    grad_fn(state.params, X, Y)  # outside jit, traced at each call
    grad_fn(state.params, X, Y)  # the same signature: no new audit
    jitted = jax.jit(grad_fn)
    jitted(state.params, x4, y4)  # a new signature: audited once more
    jitted(state.params, x4, y4)  # no new trace: no new check
    jitted(state.params, X, Y)  # traced again, but audited already
  assert traces == [(8, 4)] * (2 + audit) + [(4, 4)] * (1 + audit) + [(8, 4)]
  texts = [str(w.message) for w in record if "audit=True" in str(w.message)]
  assert len(texts) == 2 * audit
  assert all("computes in bfloat16" in t and "'recast'" in t for t in texts)
  assert {w.filename for w in record if "audit=True" in str(w.message)} == set([__file__] * audit)
  with warnings.catch_warnings():  # and a warning can be escalated to an error
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    with pytest.raises(jaxmp.PrecisionWarning):
      jax.jit(state.value_and_grad(loss_fn, audit=True))(state.params, X, Y)
  with pytest.raises(TypeError, match="audit"):
    state.value_and_grad(loss_fn, audit="yes")


class CustomDense(nnx.Module):  # a layer of one's own, with no dtype attribute

  def __init__(self, features_in, features_out, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (features_in, features_out)))

  def __call__(self, x):
    return x @ self.kernel[...]


def test_precision_report_reads_an_nnx_model():
  # NNX has no policy object to warn from: the report is the audit there.
  model = nnx.eval_shape(lambda rngs: nnx.Sequential(  # abstract: the report only traces
      nnx.Linear(4, 8, rngs=rngs), nnx.relu, nnx.BatchNorm(8, rngs=rngs), CustomDense(8, 64, rngs)),
      nnx.Rngs(0))
  jaxmp.flax.ModulePolicy(default="mixed_float16").set_nnx_dtypes(model)
  with jax.numpy_dtype_promotion("standard"):  # the custom layer mixes dtypes
    report = jaxmp.precision_report(
        lambda model, x: jnp.mean(model(x).astype(jnp.float32) ** 2), model, X)
  assert {op.inputs for op in report.ops} == {("float16", "float16"), ("float16", "float32")}
  assert report.flops_share("float16") < 0.1  # the custom layer's matmul dominates
