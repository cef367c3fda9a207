"""Tests of the precision audit: jaxmp.precision_report and the PrecisionWarning.

The report is checked on small hand-built functions with exact FLOP counts;
the warning on Linen models under jaxmp.flax.TrainState and on NNX models,
with the dtypes read from the jaxpr itself (not from the params).
"""

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
from matmul_dtypes import matmul_dtypes

F16 = np.dtype(jnp.float16)
HERE = "test_precision_audit.py"

# The user code these tests audit mixes dtypes on purpose: that is what the
# audit reports. Under standard promotion (JAX's default) it silently upcasts;
# strict promotion would refuse it before the audit could see it.
USER_CODE_MIXES = (
    "the audited user code mixes float16 and float32 on purpose (the silent "
    "upcast the warning reports); only standard promotion accepts it")


def at_line(source, fn, offset=1):
  """Whether ``source`` (a report's) names a line of ``fn``: "file:line:column (name)"."""
  file, line, _ = source.split(" ")[0].split(":")
  return ((file, int(line)) == (HERE, fn.__code__.co_firstlineno + offset)
          and source.endswith(f" ({fn.__qualname__})"))


def jaxpr_dot_dtypes(fn, *args):
  """The input dtypes of every matmul of ``fn``'s jaxpr, read directly."""
  return {dtypes for _, dtypes in matmul_dtypes(fn, *args)}


# ---------------------------------------------------------------------------
# The report on hand-built functions.


def test_a_dot_with_its_dtypes_shapes_flops_operands_and_source():
  def loss(params, x):
    return jnp.sum(x.astype(jnp.float16) @ params["w"].astype(jnp.float16))

  params, x = {"w": jnp.ones((3, 5))}, jnp.ones((4, 3))
  report = jaxmp.precision_report(loss, params, x)
  op, = report.ops
  assert op == type(op)(
      primitive="dot_general", direction="forward", lhs_dtype=F16,
      rhs_dtype=F16, out_dtype=F16, lhs_shape=(4, 3), rhs_shape=(3, 5),
      out_shape=(4, 5), flops=2 * 4 * 5 * 3, repeats=1, module="",
      operands=("x", "params/w"), source=op.source, cause="", captured="")
  assert at_line(op.source, loss)
  assert op.inputs == ("float16", "float16") and op.runs_in("f16")
  assert op.where == "params/w"
  assert report.flops_by_dtype() == {("float16", "float16"): 120}
  assert report.flops_share(jnp.float16) == 1.0
  assert report.ops_outside("float16") == ()
  assert report.ops_outside("float32") == (op,)

  def power(a):  # JAX's own jit: the lines of its matmuls are JAX's
    return jnp.linalg.matrix_power(a, 3)

  ops = jaxmp.precision_report(power, jnp.ones((4, 4))).ops
  assert len(ops) == 2 and all(at_line(op.source, power) for op in ops)
  # Called directly, no line of the user's (nor of jaxmp's) is the source.
  assert {op.source for op in jaxmp.precision_report(
      jnp.linalg.matrix_power, jnp.ones((4, 4)), 3).ops} == {""}

  # An einsum with batch dimensions.
  op, = jaxmp.precision_report(
      lambda a, b: jnp.einsum("bij,bjk->bik", a, b),
      jnp.ones((2, 3, 4), jnp.bfloat16), jax.ShapeDtypeStruct((2, 4, 5), jnp.bfloat16)).ops
  assert op.flops == 2 * 2 * 3 * 5 * 4  # 2 * batch * M * N * K
  assert (op.lhs_shape, op.rhs_shape, op.out_shape) == ((2, 3, 4), (2, 4, 5), (2, 3, 5))


def test_convolutions_plain_strided_and_grouped():
  def convs(x, k, grouped):
    y = jax.lax.conv_general_dilated(
        x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    z = jax.lax.conv_general_dilated(
        x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    g = jax.lax.conv_general_dilated(
        y, grouped, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
        feature_group_count=2)
    return y, z, g

  x, k = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))
  grouped = jnp.ones((3, 3, 2, 6))  # 4 input features in 2 groups of 2
  same, valid, group = jaxmp.precision_report(convs, x, k, grouped).ops
  assert {op.primitive for op in (same, valid, group)} == {"conv_general_dilated"}
  assert same.out_shape == (2, 8, 8, 4) and same.flops == 2 * (2 * 8 * 8 * 4) * 3 * 9
  assert valid.out_shape == (2, 3, 3, 4) and valid.flops == 2 * (2 * 3 * 3 * 4) * 3 * 9
  assert group.out_shape == (2, 8, 8, 6) and group.flops == 2 * (2 * 8 * 8 * 6) * 2 * 9
  assert group.operands == ("", "grouped")


def test_a_scan_over_layers_counts_every_iteration():
  def stack(weights, x):
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, weights)[0]

  op, = jaxmp.precision_report(stack, jnp.ones((3, 4, 4)), jnp.ones((2, 4))).ops
  assert op.repeats == 3 and op.flops == 3 * (2 * 2 * 4 * 4)
  assert op.rhs_shape == (4, 4) and op.operands == ("x", "weights")
  assert "(x3)" in str(jaxmp.precision_report(stack, jnp.ones((3, 4, 4)), jnp.ones((2, 4))))


def test_gradients_remat_and_a_custom_vjp_label_their_passes():
  def block(w, x):
    return jnp.tanh(jnp.tanh(x @ w) @ w)

  w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
  report = jaxmp.precision_report(
      jax.grad(lambda w, x: jnp.sum(jax.checkpoint(block)(w, x))), w, x)
  assert [op.direction for op in report.ops] == (
      ["forward"] * 2 + ["recompute"] * 2 + ["backward"] * 3)
  assert {op.flops for op in report.ops} == {2 * 2 * 4 * 4}
  assert report.flops("recompute") == 128 and report.flops("backward") == 192
  assert report.flops() == 448
  assert report.flops_share("float32", direction="backward") == 1.0

  @jax.custom_vjp
  def product(a, b):
    return a @ b

  def forward(a, b):
    return a @ b, (a, b)

  def backward(residuals, g):
    a, b = residuals
    return g @ b.T, a.T @ g

  product.defvjp(forward, backward)
  report = jaxmp.precision_report(jax.grad(lambda w, x: jnp.sum(product(x, w))), w, x)
  assert [op.direction for op in report.ops] == ["forward", "backward", "backward"]
  assert at_line(report.ops[0].source, forward)
  assert [op.operands for op in report.ops[1:]] == [("", "w"), ("x", "")]
  # Not differentiated, the custom_vjp's own jaxpr is walked.
  op, = jaxmp.precision_report(lambda w, x: product(x, w), w, x).ops
  assert op.direction == "forward" and at_line(op.source, product.fun, 2)  # below its decorator


def test_jit_cond_and_while_are_walked():
  def fn(w, x):
    y = jax.lax.cond(jnp.sum(x) > 0, lambda y: y @ w, lambda y: y + 1, x)
    return jax.lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] @ w), (0, y))[1]

  report = jaxmp.precision_report(jax.jit(fn), jnp.ones((4, 4)), jnp.ones((2, 4)))
  # A while body counts once; it cannot know how often it runs.
  assert [(op.repeats, op.flops) for op in report.ops] == [(1, 64), (1, 64)]
  assert all(op.operands[1] == "w" for op in report.ops)


def test_shard_map_counts_every_device():
  mesh = Mesh(np.array(jax.devices()), ("d",))
  shards = len(jax.devices())
  fn = jax.shard_map(lambda a, b: a @ b, mesh=mesh,
                     in_specs=(PartitionSpec("d"), PartitionSpec()),
                     out_specs=PartitionSpec("d"))
  op, = jaxmp.precision_report(fn, jnp.ones((2 * shards, 3)), jnp.ones((3, 5))).ops
  assert op.repeats == shards and op.lhs_shape == (2, 3)
  assert op.flops == 2 * (2 * shards) * 5 * 3  # the FLOPs of the whole product


def test_static_arguments_and_abstract_values_run_nothing():
  def fn(x, w, *, train):
    if train:  # a Python flag stays a Python value
      x = x * 2
    return x @ w

  x = jax.ShapeDtypeStruct((8, 3), jnp.float16)
  w = jax.ShapeDtypeStruct((3, 2), jnp.float16)
  with jax.transfer_guard("disallow"):
    report = jaxmp.precision_report(fn, x, w, train=True)
  assert report.flops_by_dtype() == {("float16", "float16"): 96}


def test_mixed_inputs_and_the_table():
  def fn(x, w):  # w stays float32 (what `@` gives under standard promotion)
    return jax.lax.dot(x.astype(jnp.float16), w, preferred_element_type=jnp.float32)

  report = jaxmp.precision_report(fn, jnp.ones((4, 3)), jnp.ones((3, 2)))
  op, = report.ops
  assert op.inputs == ("float16", "float32") and op.cause == "mixed"
  assert report.ops_outside("f16") == (op,) and report.flops_share("f16") == 0.0
  text = str(report)
  assert text.splitlines()[:3] == [
      "jaxmp precision report: 1 matmul/conv ops, 48 FLOPs per call (forward 48)",
      "FLOPs by input dtypes:",
      "  float16 x float32     100.0%  48",
  ]
  header, row = text.splitlines()[4:6]
  assert header.split() == ["pass", "op", "inputs", "output", "shapes", "FLOPs",
                            "where", "cause", "source"]
  assert row.split()[:9] == ["forward", "dot", "float16", "x", "float32", "float32",
                             "[4,3]", "x", "[3,2]"]
  assert row.rstrip().endswith(report.ops[0].source) and " mixed " in row
  assert at_line(report.ops[0].source, fn)
  empty = jaxmp.precision_report(jnp.tanh, jnp.ones(3))
  assert empty.ops == () and "nothing to report" in str(empty)


# ---------------------------------------------------------------------------
# Linen under jaxmp.flax.TrainState.


class MLP(nn.Module):
  dtype: object = None  # Flax's default: compute in the dtype of the inputs

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=self.dtype, name="hidden")(x))
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(x)


X = jax.random.normal(jax.random.key(0), (8, 4))
Y = jax.random.randint(jax.random.key(1), (8,), 0, 3)


def linen_state(dtype=None, policy="mixed_float16"):
  model = MLP(dtype=dtype)
  params = jax.jit(model.init)(jax.random.key(0), X)["params"]
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy=policy), model


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), y).mean()


def make_step(audit=True):
  """A new training step, so that no test finds another's in jit's cache."""

  def step_with_arguments(state, x, y):
    def loss_fn(params, x, y):
      return cross_entropy(state.apply_fn({"params": params}, x), y)

    loss, grads = state.value_and_grad(loss_fn, audit=audit)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  return step_with_arguments


def precision_warnings(record):
  """The audit's warnings (the wrapped apply reports a declared dtype too)."""
  return [str(w.message) for w in record if issubclass(w.category, jaxmp.PrecisionWarning)
          and "audit=True" in str(w.message)]


@pytest.mark.parametrize("jit", [True, False])
def test_a_model_with_its_own_float32_dtype_warns_naming_the_layers_and_the_fix(jit):
  state, _ = linen_state(dtype=jnp.float32)
  step = jax.jit(make_step()) if jit else make_step()
  with pytest.warns(jaxmp.PrecisionWarning) as record:  # at the first call, jitted or not
    new_state, loss = step(state, X, Y)
  assert int(new_state.step) == 1 and np.isfinite(loss)  # and the step runs as before
  text, = precision_warnings(record)
  # It says what it found (the share, the cause, the layers) and where the
  # fixes are.
  assert "0%" in text and "100% in float32" in text
  assert "'recast', in MLP/hidden, MLP/Dense_0" in text
  assert "diagnostics.md" in text
  assert record[0].filename == __file__  # points at the call in the step
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxmp.PrecisionWarning)
    # The jaxpr: every matmul (forward and backward) runs in float32,
    # although the policy casts the params and the inputs to float16.
    assert jaxpr_dot_dtypes(step, state, X, Y) == {("float32", "float32")}
    report = jaxmp.precision_report(make_step(), state, X, Y)
  assert report.flops_share("float32") == 1.0
  forward = [op for op in report.ops if op.direction == "forward"]
  assert [(op.module, op.cause) for op in forward] == [
      ("MLP/hidden", "recast"), ("MLP/Dense_0", "recast")]
  assert forward[0].operands == ("x", "state/params/hidden/kernel")


def test_a_module_policy_does_not_hide_the_models_dtype():
  policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16")
  state, _ = linen_state(dtype=jnp.float32, policy=policy)
  with pytest.warns(jaxmp.PrecisionWarning, match="'recast', in MLP/hidden, MLP/Dense_0"):
    jax.jit(make_step())(state, X, Y)


@pytest.mark.standard_promotion(
    reason=USER_CODE_MIXES + ": a captured float32 batch meets float16 params in a Flax Dense")
def test_a_loss_fn_closing_over_a_float32_batch_warns_naming_the_closure():
  state, model = linen_state()

  def step(state):
    def loss_fn(params):  # Flax's canonical form: the batch is captured
      return cross_entropy(model.apply({"params": params}, X), Y)

    return state.value_and_grad(loss_fn, audit=True)(state.params)

  with pytest.warns(jaxmp.PrecisionWarning) as record:
    jax.jit(step)(state)
  assert jaxpr_dot_dtypes(step, state) == {("float32", "float32")}
  text, = precision_warnings(record)
  assert "'closure' (float32[8,4]), in MLP/hidden, MLP/Dense_0" in text
  assert "recast" not in text  # the closure, not the layers, is the cause


class Translator(nn.Module):
  """A Linen model shaped like Flax's WMT example: integer tokens, a padding
  mask, an embedding plus a fixed float32 position table, dropout, and layers
  that declare the model's dtype."""

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


@pytest.mark.standard_promotion(
    reason="as in Flax's WMT example, the float32 position table meets the bfloat16 embeddings")
def test_a_wmt_style_step_blames_the_declared_dtype_not_the_key_nor_the_tokens():
  tokens = jnp.array([[1, 2, 3, 0], [4, 5, 0, 0]])
  params = jax.jit(Translator().init)(jax.random.key(0), tokens)["params"]
  # As in the WMT example: the state holds the evaluation model, and the loss
  # calls the training one, capturing the tokens and the dropout key.
  state = jaxmp.flax.TrainState.create(
      apply_fn=Translator(deterministic=True).apply, params=params,
      tx=optax.sgd(0.1), policy="mixed_bfloat16")
  key = jax.random.key(1)

  def step(state):
    def loss_fn(params):
      logits = Translator().apply({"params": params}, tokens, rngs={"dropout": key})
      return cross_entropy(logits, tokens)

    return state.value_and_grad(loss_fn, audit=True)(state.params)

  with pytest.warns(jaxmp.PrecisionWarning) as record:
    jax.jit(step)(state)
  text, = precision_warnings(record)
  assert "'recast'" in text and "closure" not in text
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxmp.PrecisionWarning)
    report = jaxmp.precision_report(step, state)
  assert report.flops_share("float32") == 1.0
  assert {(op.cause, op.captured) for op in report.ops} == {("recast", "")}


@pytest.mark.standard_promotion(
    reason=USER_CODE_MIXES + ": a float32 batch meets 16-bit params in a Flax Dense")
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_a_model_without_its_own_dtype_fed_an_uncast_batch_is_not_blamed_on_a_dtype(policy):
  state, model = linen_state(policy=policy)

  def step(state, x, y):
    return state.value_and_grad(
        lambda p, x, y: cross_entropy(model.apply({"params": p}, x), y),
        audit=True)(state.params, x, y)

  with pytest.warns(jaxmp.PrecisionWarning) as record:
    jax.jit(step)(state, X, Y)
  text, = precision_warnings(record)
  assert "'mixed', in MLP/hidden, MLP/Dense_0" in text
  assert "recast" not in text
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", jaxmp.PrecisionWarning)
    report = jaxmp.precision_report(step, state, X, Y)
  # Every float32 matmul has the cause, the backward ones (the kernel
  # gradients read the float32 batch) too.
  assert {op.direction for op in report.ops} == {"forward", "backward"}
  assert {op.cause for op in report.ops} == {"mixed"}


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
  model = VAE()
  params = jax.jit(model.init)(jax.random.key(0), X, jax.random.key(1))["params"]
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy="mixed_float16")

  def step(state, x, key):
    def loss_fn(params, x, key):
      recon = state.apply_fn({"params": params}, x, key)
      return jnp.mean((recon.astype(jnp.float32) - x) ** 2)

    return state.value_and_grad(loss_fn, audit=True)(state.params, x, key)

  report = jaxmp.precision_report(step, state, X, jax.random.key(2))
  wide = report.ops_outside("float16")
  assert {(op.module, op.direction) for op in wide} == {
      ("VAE/decoder", "forward"), ("VAE/decoder", "backward")}
  assert len(wide) == 3 and report.flops_share("float32") == 3 * 128 / report.flops()
  (cause, origin), = {(op.cause, op.captured) for op in wide}
  assert cause == "created" and origin.startswith("random_bits at ")
  assert at_line(origin.removeprefix("random_bits at "), reparameterize)


def test_a_correct_float16_model_does_not_warn_nor_retrace_nor_transfer():
  state, _ = linen_state()

  step_with_arguments = make_step()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    return step_with_arguments(state, x, y)

  x, y = jax.device_put(X), jax.device_put(Y)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    with jax.transfer_guard("disallow"):
      state, _ = step(state, x, y)
      state, _ = step(state, x, y)
  assert int(state.step) == 2
  assert jaxpr_dot_dtypes(step_with_arguments, state, X, Y) == {("float16", "float16")}
  report = jaxmp.precision_report(step_with_arguments, state, X, Y)
  assert report.flops_share("float16") == 1.0
  assert {op.direction for op in report.ops} == {"forward", "backward"}


@pytest.mark.parametrize("kind", [
    "module_policy", "float32_policy",
    pytest.param("path_policy", marks=pytest.mark.standard_promotion(
        reason="PathPolicy casts params only: the float16 LayerNorm output meets "
               "the float32 head's params in a Flax Dense, which promotes them "
               "(strict promotion refuses; a ModulePolicy casts the head's inputs)")),
])
def test_float32_on_purpose_under_a_rule_does_not_warn(kind):
  # The output layer in float32 by a rule: 1% of the FLOPs would be float16,
  # but nothing promoted them, so there is nothing to fix. (A float32 policy
  # never warns.)
  class Wide(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.LayerNorm()(nn.Dense(4)(x))
      return nn.Dense(512, name="head")(x)

  model = Wide()
  params = jax.jit(model.init)(jax.random.key(0), X)["params"]
  policy = {
      "module_policy": jaxmp.flax.ModulePolicy({"head": "float32"}, default="mixed_float16"),
      "path_policy": jaxmp.PathPolicy({"head": "float32"}, default="mixed_float16"),
      "float32_policy": "float32",
  }[kind]
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1), policy=policy)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    jax.jit(make_step())(state, X, Y)
  report = jaxmp.precision_report(make_step(), state, X, Y)
  assert report.flops_share("float16", direction="forward") < 0.5
  assert not any(op.cause for op in report.ops_outside("float16", "forward"))


def test_once_per_trace_bfloat16_and_escalation():
  state, _ = linen_state(dtype=jnp.float32, policy="mixed_bfloat16")
  step = jax.jit(make_step())
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    step(state, X, Y)
    step(state, X, Y)  # no new trace: no new check
    step(state, X[:4], Y[:4])  # a new shape: a new trace, checked again
  texts = precision_warnings(record)
  assert len(texts) == 2
  assert all("computes in bfloat16" in t and "'recast'" in t for t in texts)
  with warnings.catch_warnings():
    warnings.simplefilter("error", jaxmp.PrecisionWarning)
    with pytest.raises(jaxmp.PrecisionWarning):
      jax.jit(make_step())(state, X, Y)


@pytest.mark.parametrize("audit", [False, True])
def test_the_audit_is_opt_in_and_its_trace_the_only_extra_one(audit):
  state, _ = linen_state(dtype=jnp.float32)
  traces = []

  def loss_fn(params, x, y):
    traces.append(1)  # once per trace of the loss
    return cross_entropy(state.apply_fn({"params": params}, x), y)

  grad_fn = state.value_and_grad(loss_fn, audit=audit)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    grad_fn(state.params, X, Y)
    grad_fn(state.params, X, Y)  # the same signature: no new audit
  # The gradient traces the loss once per call outside jit; the audit adds
  # one trace of the forward pass on the first call only.
  assert len(traces) == 2 + audit
  assert len(precision_warnings(record)) == audit
  with pytest.raises(TypeError, match="audit"):
    state.value_and_grad(loss_fn, audit="yes")


# ---------------------------------------------------------------------------
# NNX.


class CustomDense(nnx.Module):  # a layer of one's own, with no dtype attribute

  def __init__(self, features_in, features_out, rngs):
    self.kernel = nnx.Param(jax.random.normal(rngs.params(), (features_in, features_out)))

  def __call__(self, x):
    return x @ self.kernel[...]


class NNXModel(nnx.Module):

  def __init__(self, rngs, dtype=None, param_dtype=jnp.float32, custom=False):
    self.dense1 = nnx.Linear(4, 8, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dense2 = (CustomDense(8, 64, rngs) if custom else
                   nnx.Linear(8, 64, dtype=dtype, param_dtype=param_dtype, rngs=rngs))

  def __call__(self, x):
    return self.dense2(self.norm(nnx.relu(self.dense1(x))))


def test_precision_report_reads_an_nnx_model():
  # NNX has no policy object to warn from: the report is the audit there.
  model = NNXModel(nnx.Rngs(0), custom=True)
  jaxmp.flax.ModulePolicy(default="mixed_float16").set_nnx_dtypes(model)
  with jax.numpy_dtype_promotion("standard"):  # the custom layer mixes dtypes
    report = jaxmp.precision_report(
        lambda model, x: jnp.mean(model(x).astype(jnp.float32) ** 2), model, X)
  assert {op.inputs for op in report.ops} == {
      ("float16", "float16"), ("float16", "float32")}
  assert report.flops_share("float16") < 0.1  # the custom layer's matmul dominates
