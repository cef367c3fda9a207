"""Tests of jaxmp.autocast: mixed precision decided per operation, read off
jaxprs walked into every inner program (jit, scan, cond, checkpoint, custom
derivatives, the backward pass): what a dot_general receives is what is multiplied."""

import functools
import inspect
import pathlib
import re

import chex
import equinox as eqx
import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
import models
from models import f32, like_flax_init
from matmul_dtypes import MATMULS, all_eqns

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32)


def in_dtypes(eqn):
  return tuple(np.dtype(v.aval.dtype) for v in eqn.invars)


def eqns(jaxpr, *primitives):
  return [e for e in all_eqns(jaxpr) if e.primitive.name in primitives]


def dot_dtypes(jaxpr):
  return [in_dtypes(e) for e in eqns(jaxpr, *MATMULS)]


def dtypes_of(jaxpr, primitive, feeding=None):
  """The floating input dtypes of each ``primitive`` equation (whose result feeds a
  ``feeding`` equation)."""
  fed = feeding and {e.invars[0] for e in eqns(jaxpr, feeding)}
  return [{d for d in in_dtypes(e) if jnp.issubdtype(d, jnp.floating)}
          for e in eqns(jaxpr, primitive) if not feeding or e.outvars[0] in fed]


def train(loss_fn, model, batch, steps, learning_rate):
  """The losses of ``steps`` Adam steps of ``loss_fn(model, *batch(step))``."""
  tx = optax.flatten(optax.adam(learning_rate))  # on one vector: a third less to compile

  @eqx.filter_jit
  def step(model, opt_state, *args):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, *args)
    updates, opt_state = tx.update(grads, opt_state)  # Adam reads no params
    return eqx.apply_updates(model, updates), opt_state, loss

  opt_state, losses = jax.jit(tx.init)(eqx.filter(model, eqx.is_array)), []
  for i in range(steps):
    model, opt_state, loss = step(model, opt_state, *batch(i))
    losses.append(float(loss))
  return np.array(losses)


train_lm = models.benchmark("overhead").train_lm  # examples/train_lm.py


def token_batch(seed=0):
  return jax.device_put(np.random.default_rng(seed).integers(0, 256, (4, 17)).astype(np.int32))


@functools.cache  # initialised once
def transformer_and_loss():
  """train_lm's byte transformer, every layer declaring float32; its params and loss."""
  model = train_lm.make_model(32, 2, 2, 16, dtype=jnp.float32)
  params = like_flax_init(jax.eval_shape(model.init, jax.random.key(0), token_batch()[:, :-1]))
  return model, params["params"], train_lm.make_loss_fn(model, jaxmp.get_policy("float32"))


def test_a_float32_linen_transformer_multiplies_in_bf16_and_normalises_in_float32():
  model, params, loss_fn = transformer_and_loss()
  batch = token_batch()
  # Without autocast the declared dtype wins, even with bf16 params.
  hand_cast = train_lm.make_loss_fn(model, jaxmp.get_policy("mixed_bfloat16"))
  assert set(dot_dtypes(jax.make_jaxpr(hand_cast)(params, batch))) == {(F32, F32)}
  fast = jaxmp.autocast(loss_fn, "mixed_bfloat16")
  jaxpr = jax.make_jaxpr(fast)(params, batch)
  # 2 layers x (q, k, v, out, scores, weighted values, 2 MLP) + the head; the
  # backward pass has each twice more.
  assert dot_dtypes(jaxpr) == [(BF16, BF16)] * 17
  assert dot_dtypes(jax.make_jaxpr(jax.grad(fast))(params, batch)) == [(BF16, BF16)] * 51
  # Softmax (2 layers) and the loss's logsumexp: the shift x - max(x), exp, log
  # and the sums in float32; layer norm (5): mean, mean of squares and rsqrt.
  assert dtypes_of(jaxpr, "sub", "exp") == dtypes_of(jaxpr, "exp") == [{F32}] * 3
  assert dtypes_of(jaxpr, "log") == [{F32}]
  assert dtypes_of(jaxpr, "rsqrt") == [{F32}] * 5
  assert dtypes_of(jaxpr, "square") == [{F32}] * 10
  assert dtypes_of(jaxpr, "reduce_sum") == [{F32}] * (5 * 2 + 2 * 1 + 2)
  assert jaxpr.out_avals[0].dtype == F32


# Measured (JAX 0.10.2, CPU): over 30 Adam steps (the loss falls from 6.0 to 2.7) the
# bf16 loss stays within 0.11% of float32's (1% stated in docs/autocast.md).
def test_a_short_training_run_stays_close_to_float32():
  _, params, loss_fn = transformer_and_loss()
  batches = lambda i: (token_batch(seed=i % 4),)
  full = train(loss_fn, params, batches, 30, 3e-3)
  mixed = train(jaxmp.autocast(loss_fn, "mixed_bfloat16"), params, batches, 30, 3e-3)
  assert full[-1] < 0.8 * full[0]  # it learns
  np.testing.assert_allclose(mixed, full, rtol=0.01)


def mlp_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


# Measured: over 30 Adam steps (the loss falls from 0.51 to 0.11) the bf16 loss stays within
# 1.8% of float32's (3% stated; it grows near bf16's resolution of the errors).
def test_an_equinox_mlp_multiplies_in_bf16_and_trains_like_float32():
  model = eqx.filter_jit(lambda: eqx.nn.MLP(8, 2, 32, 2, key=jax.random.key(0)))()  # 1 program
  rng = np.random.default_rng(0)
  x, y = f32(x := rng.normal(size=(64, 8))), f32(np.sin(x @ rng.normal(size=(8, 2))))
  fast = jaxmp.autocast(mlp_loss, "mixed_bfloat16")
  forward = eqx.filter_make_jaxpr(fast)(model, x, y)[0]
  assert dot_dtypes(forward) == [(BF16, BF16)] * 3
  backward = eqx.filter_make_jaxpr(eqx.filter_grad(fast))(model, x, y)[0]
  assert dot_dtypes(backward) == [(BF16, BF16)] * (3 * 3 - 1)  # no input gradient of x
  # The squared error and its mean in float32, the gradients float32.
  assert dtypes_of(forward, "integer_pow") == dtypes_of(forward, "reduce_sum") == [{F32}]
  grads = eqx.filter_eval_shape(eqx.filter_grad(fast), model, x, y)
  assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(grads)} == {F32}
  full = train(mlp_loss, model, lambda i: (x, y), 30, 1e-2)
  mixed = train(fast, model, lambda i: (x, y), 30, 1e-2)
  assert full[-1] < 0.3 * full[0]
  np.testing.assert_allclose(mixed, full, rtol=0.03)


def test_a_float32_array_in_a_closure_is_cast_at_the_matmul():
  w = f32(np.random.default_rng(0).normal(size=(8, 8)))
  batch = f32(np.ones((4, 8)))  # the batch, captured too
  loss = lambda scale: jnp.mean(jax.nn.logsumexp((jnp.tanh(batch @ w) * scale) @ w.T, -1))
  fast, scale = jaxmp.autocast(loss, "mixed_bfloat16"), jnp.float32(0.5)
  for jaxpr in (jax.make_jaxpr(fast)(scale), jax.make_jaxpr(jax.grad(fast))(scale)):
    assert dot_dtypes(jaxpr) and set(dot_dtypes(jaxpr)) == {(BF16, BF16)}
    assert dtypes_of(jaxpr, "exp") and all(d == {F32} for d in dtypes_of(jaxpr, "exp"))
  assert jax.eval_shape(jax.grad(fast), scale).dtype == F32
  np.testing.assert_allclose(jax.jit(fast)(scale), jax.jit(loss)(scale), rtol=1e-2)


def nested(params, x):
  """Rematerialised layers under lax.scan (params stacked on a leading axis), a
  layer norm and a cond."""
  layer = jax.checkpoint(lambda h, p: (h + jnp.tanh(h @ p["w"] + p["b"]), jnp.sum(h)))
  h, sums = jax.lax.scan(layer, x, params)
  h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True))
  h = jax.lax.cond(jnp.sum(x) > 0, jnp.exp, lambda h: jnp.tanh(h @ params["w"][0]), h)
  return jnp.mean(h ** 2) + jnp.mean(sums)


def params_and_x():
  rng = np.random.default_rng(0)
  return {"w": f32(rng.normal(size=(3, 8, 8)) * 0.3), "b": f32(np.zeros((3, 8)))}, f32(
      rng.normal(size=(2, 8)))


def small_loss(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return jnp.mean(jax.nn.log_softmax(h @ params["w2"]) ** 2)


def small_params():
  rng = np.random.default_rng(0)
  return {"w1": f32(rng.normal(size=(8, 8)) * 0.3), "b1": f32(np.zeros(8)),
          "w2": f32(rng.normal(size=(8, 8)) * 0.3)}  # one shape: fewer op-by-op programs


class GradientsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_float32_gradients_scaled_or_not_traced_once_per_signature(self):
    params, x = small_params(), f32(np.ones((8, 8)))  # the reference, compiled once
    want_loss, want_grads = jax.jit(jax.value_and_grad(small_loss))(params, x)
    traces = []
    for policy, loss_scale in (("mixed_bfloat16", jaxmp.NoOpLossScale()),
                               ("mixed_float16", jaxmp.StaticLossScale(2.0**10))):
      chex.clear_trace_counter()  # the variants share chex's counter
      traces.clear()

      @chex.assert_max_traces(n=2)
      def loss(params, x):
        traces.append(x.shape)
        return small_loss(params, x)

      step = self.variant(jaxmp.scaled_value_and_grad(jaxmp.autocast(loss, policy), loss_scale))
      (value, grads), (second, _) = step(params, x), step(params, f32(np.full((8, 8), 2.0)))
      assert value.dtype == second.dtype == F32 and float(value) != float(second)
      chex.assert_trees_all_equal_dtypes(grads, params)
      chex.assert_trees_all_close(loss_scale.unscale(grads), want_grads, rtol=0.05, atol=1e-3)
      np.testing.assert_allclose(value, want_loss, rtol=1e-2)
      jax.eval_shape(step, params, f32(np.ones((2, 8))))  # another shape traces again
      assert traces == [(8, 8), (2, 8)]


def test_a_real_float16_overflow_is_skipped_and_the_scale_backs_off():
  params, x = {"w": f32(np.full((4, 4), 0.5))}, f32(np.ones((2, 4)))

  def loss(params, x, weight):
    return weight * jnp.sum(x @ params["w"])

  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**15))

  @jax.jit
  def step(params, opt_state, weight):
    value, grads = jaxmp.scaled_value_and_grad(jaxmp.autocast(loss, "mixed_float16"),
                                               jaxmp.get_loss_scale(opt_state))(params, x, weight)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  # The cotangent of the float16 matmul output is 4 * 2**15 > 65504: inf (in
  # float32 the same scaled gradient is finite).
  assert jax.jit(lambda: jaxmp.all_finite(jaxmp.scaled_value_and_grad(
      loss, jaxmp.DynamicLossScale(2.0**15))(params, x, 4.0)[1]))()
  new_params, opt_state, value = step(params, tx.init(params), 4.0)
  chex.assert_trees_all_equal(new_params, params)  # skipped
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  assert (float(value), float(metrics["loss_scale"]), int(metrics["skipped_steps"])) == (
      64.0, 2.0**14, 1)
  # A small enough loss passes at the new scale, and the params move.
  new_params, opt_state, _ = step(params, opt_state, 1.0)
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 1
  assert float(np.asarray(new_params["w"])[0, 0]) == pytest.approx(0.5 - 0.1 * 2.0)


def test_checkpoint_scan_cond_and_while_loop():
  params, x = params_and_x()
  fast = jaxmp.autocast(nested, "mixed_bfloat16")
  jaxpr = jax.make_jaxpr(jax.value_and_grad(fast))(params, x)
  assert eqns(jaxpr, "checkpoint", "remat2")  # still rematerialised
  # The scan carries (forward, transposed): the float32 input meets bf16 matmul outputs,
  # so bf16. The branches agree on the widest result, exp's float32.
  assert [s.invars[s.params["num_consts"]].aval.dtype for s in eqns(jaxpr, "scan")] == [BF16] * 2
  assert eqns(jaxpr, "cond")[0].outvars[0].aval.dtype == F32
  # scan 1 and cond 1 forward; 1 recomputed and 2 transposed each.
  assert dot_dtypes(jaxpr) == [(BF16, BF16)] * 7
  (loss, grads), (want_loss, want_grads) = jax.jit(  # both in one program
      lambda *args: [jax.value_and_grad(f)(*args) for f in (fast, nested)])(params, x)
  chex.assert_trees_all_equal_dtypes(grads, params)
  chex.assert_trees_all_close(grads, want_grads, rtol=0.05, atol=0.02)
  np.testing.assert_allclose(loss, want_loss, rtol=2e-2)
  # Checkpointing the autocast function instead.
  chex.assert_trees_all_close(jax.jit(jax.grad(jax.checkpoint(fast)))(params, x), grads)
  # A while loop's carry follows the matmul too.
  w = params["w"][0]
  loop = lambda x: jax.lax.while_loop(
      lambda c: c[1] < 3, lambda c: (jnp.tanh(c[0] @ w), c[1] + 1), (x, 0))[0]
  fast, x = jaxmp.autocast(loop, "mixed_bfloat16"), f32(np.ones((2, 8)))
  [eqn] = eqns(jax.make_jaxpr(fast)(x), "while")
  assert eqn.outvars[0].aval.dtype == BF16 and (y := jax.jit(fast)(x)).dtype == F32
  np.testing.assert_allclose(y, loop(x), rtol=3e-2)


def test_a_custom_vjp_op_runs_as_written():
  @jax.custom_vjp
  def clipped_matmul(x, w):  # a user's op whose gradient of x is clipped to [-1, 1]
    return x @ w

  clipped_matmul.defvjp(lambda x, w: (x @ w, (x, w)),
                        lambda r, g: (jnp.clip(g @ r[1].T, -1.0, 1.0), r[0].T @ g))

  def loss(params, x):
    return jnp.sum(clipped_matmul(x, params["w1"]) @ params["w2"])

  params, x = small_params(), f32(np.ones((2, 8)))
  fast = jaxmp.autocast(loss, "mixed_bfloat16")
  # Its inputs are in the float32 it was traced with; its forward and its own
  # backward rule run in float32, the rest of the model in bf16.
  [custom] = eqns(jax.make_jaxpr(fast)(params, x), "custom_vjp_call")
  assert in_dtypes(custom) == (F32, F32)
  dots = dot_dtypes(jax.make_jaxpr(jax.grad(fast))(params, x))
  assert (dots.count((F32, F32)), dots.count((BF16, BF16))) == (1 + 2, 3)
  grads, want_grads = (jax.jit(jax.grad(f))(params, x) for f in (fast, loss))
  chex.assert_trees_all_equal_dtypes(grads, params)
  chex.assert_trees_all_close(grads, want_grads, rtol=0.02, atol=0.01)


def test_a_custom_jvp_function_follows_the_table_on_both_sides():
  @jax.custom_jvp
  def soft_sign(x):
    return x / (1.0 + jnp.abs(x))

  soft_sign.defjvp(lambda primals, tangents: (
      soft_sign(primals[0]), tangents[0] / jnp.square(1.0 + jnp.abs(primals[0]))))
  w, x = f32(np.ones((4, 4))), f32(np.ones((2, 4)))
  fast = jaxmp.autocast(lambda x: jnp.sum(soft_sign(x @ w)), "mixed_bfloat16")
  primal = jax.make_jaxpr(fast)(x)
  [custom] = eqns(primal, "custom_jvp_call")
  assert in_dtypes(custom) == (BF16,)
  assert dtypes_of(primal, "div") == [{BF16}]  # the function, in bf16
  # The JVP rule, under the table: square in float32, the tangent back in bf16.
  assert {F32} in dtypes_of(jax.make_jaxpr(jax.jvp, static_argnums=0)(fast, (x,), (x,)), "square")
  got, want = (jax.jit(jax.grad(f))(x) for f in (fast, lambda x: jnp.sum(soft_sign(x @ w))))
  assert got.dtype == F32
  np.testing.assert_allclose(got, want, rtol=2e-2)


def test_each_param_is_cast_once_however_often_it_is_used():
  def loss(params, x):
    for _ in range(4):  # the same kernel in four layers, and its bias
      x = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.sum(x @ params["w"].T)  # and transposed

  params, x = {"w": f32(np.ones((8, 8))), "b": f32(np.zeros(8))}, f32(np.ones((2, 8)))
  fast = jaxmp.autocast(loss, "mixed_bfloat16")
  for jaxpr in (jax.make_jaxpr(fast)(params, x),
                jax.make_jaxpr(jax.value_and_grad(fast))(params, x)):
    inputs = set(jaxpr.jaxpr.invars)
    casts = [(e.invars[0], e.params["new_dtype"]) for e in eqns(jaxpr, "convert_element_type")
             if e.invars[0] in inputs]
    # w and x once each. The bias is cast after its broadcast (which fuses
    # into the add), so that its gradient is summed over the batch in float32.
    assert len(casts) == len(set(casts)) == 2
  bias_sums = [in_dtypes(e) for e in eqns(jaxpr, "reduce_sum") if e.outvars[0].aval.shape == (8,)]
  # Over the batch and over the broadcast's leading 1, for each of the 4 uses.
  assert bias_sums == [(F32,)] * 8


def test_the_rule_table_can_be_overridden_per_primitive():
  _, params, loss_fn = transformer_and_loss()

  def jaxpr(**rules):
    return jax.make_jaxpr(jaxmp.autocast(loss_fn, "mixed_bfloat16", rules=rules))(
        params, token_batch())

  assert set(dot_dtypes(jaxpr(dot_general="float32"))) == {(F32, F32)}
  half_exp = jaxpr(exp="promote")  # the softmax shifts follow exp's rule
  assert dtypes_of(half_exp, "exp") == dtypes_of(half_exp, "sub", "exp") == [{BF16}] * 3
  # A primitive object names a primitive too; the default is untouched.
  assert jaxmp.autocast_rules({jax.lax.exp_p: "promote"})["exp"] == "promote"
  assert jaxmp.autocast_rules()["exp"] == "float32"


def test_a_scope_can_be_pinned_to_float32():
  _, params, loss_fn = transformer_and_loss()
  pinned = jaxmp.autocast(loss_fn, "mixed_bfloat16", scope_policies={
      "Transformer/Dense_0": "float32", r"Block_1/LayerNorm_\d+": "float32"})  # the head too
  jaxpr = jax.make_jaxpr(pinned)(params, token_batch())
  scope = lambda e: str(e.source_info.name_stack)
  assert [in_dtypes(e) for e in eqns(jaxpr, "dot_general")
          if scope(e) == "Transformer/Dense_0"] == [(F32, F32)]
  # Everything in the pinned layer norms computes in float32 (the bf16
  # activations coming in are cast); the rest in bf16.
  norms = [e for e in all_eqns(jaxpr) if re.match(r"Transformer/Block_1/LayerNorm_\d", scope(e))]
  assert len(norms) > 20
  assert {np.dtype(v.aval.dtype) for e in norms for v in e.outvars} == {F32}
  assert dot_dtypes(jaxpr).count((BF16, BF16)) == 16
  grads = jax.eval_shape(jax.grad(pinned), params, token_batch())  # dtypes, not values
  assert grads["Dense_0"]["kernel"].dtype == F32


HALF_POLICIES = ["mixed_float16", "mixed_bfloat16"]
FLOAT32_MIN = jnp.finfo(jnp.float32).min
ADDITIVE_MASKS = {  # float32 masks from a keep-mask: 0 where kept, a large negative where not
    "-1e9": lambda keep: jnp.where(keep, 0.0, -1e9).astype(jnp.float32),
    "-1e5": lambda keep: jnp.where(keep, 0.0, -1e5).astype(jnp.float32),
    "finfo_min": lambda keep: jnp.where(keep, 0.0, FLOAT32_MIN),
    "hugging_face": lambda keep: (1.0 - keep.astype(jnp.float32)) * FLOAT32_MIN,
}


def masked_rows(policy, q, k, keep):
  """Each case's softmax under autocast where ``policy``: the mask given or built inside."""
  given = lambda q, k, mask: jax.nn.softmax(q @ k.T + mask)  # a float32 mask from the caller
  selected = lambda q, k, keep: jax.nn.softmax(jnp.where(keep, q @ k.T, FLOAT32_MIN))  # Flax's
  cases = [(selected, keep)] + [case for mask in ADDITIVE_MASKS.values() for case in (
      (given, mask(keep)), (lambda q, k, keep, mask=mask: given(q, k, mask(keep)), keep))]
  return [(jaxmp.autocast(fn, policy) if policy else fn)(q, k, arg) for fn, arg in cases]


@pytest.mark.parametrize("policy", HALF_POLICIES)
def test_a_fully_masked_row_stays_uniform_with_the_mask_given_or_built_inside(policy):
  # Left padding and causal attention: the first query (a padding token)
  # sees only padding, so its row is fully masked.
  rng, padding = np.random.default_rng(0), (np.arange(4) == 0)[:, None]
  q, k = f32(rng.normal(size=(4, 8)) * ~padding), f32(rng.normal(size=(5, 8)))
  keep = jax.device_put(np.tril(np.ones((4, 5), bool), 1) & ~padding)
  compiled = jax.jit(masked_rows, static_argnums=0)  # all cases in one program
  expected = compiled(None, q, k, keep)
  for got in (masked_rows(policy, q, k, keep), compiled(policy, q, k, keep)):  # op by op, compiled
    for want, row in zip(map(np.asarray, expected), map(np.asarray, got), strict=True):
      np.testing.assert_array_equal(want[0], np.full(5, 1 / 5, np.float32))
      np.testing.assert_array_equal(row[0], want[0])
      np.testing.assert_allclose(row[1:], want[1:], atol=0.03)


@pytest.mark.parametrize("policy", HALF_POLICIES)
def test_a_padded_multi_head_attention_is_finite(policy):
  tokens = np.array([[5, 3, 0, 0], [7, 0, 0, 0]])  # padding queries too
  x = f32(np.random.default_rng(0).normal(size=(2, 4, 16)))
  attention = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=16)
  mask = jax.jit(nn.make_attention_mask)(tokens > 0, tokens > 0)  # one program, not op by op
  params = like_flax_init(jax.eval_shape(attention.init, jax.random.key(1), x, x, mask=mask))

  loss = lambda params, x: jnp.sum(attention.apply(params, x, x, mask=mask) ** 2)
  value, grads = jax.jit(jax.value_and_grad(jaxmp.autocast(loss, policy)))(params, x)
  assert jax.jit(jaxmp.all_finite)((value, grads))
  np.testing.assert_allclose(value, jax.jit(loss)(params, x), rtol=0.05)


# PyTorch's "ops that can autocast to float32" run and return float32 whatever their
# inputs' dtype; jaxmp's float32 rules do the same for half-precision values.
FLOAT32_OPS = {
    "sum": jnp.sum, "mean": jnp.mean, "logsumexp": jax.nn.logsumexp,
    "norm": jnp.linalg.norm, "var": jnp.var, "cumsum": lambda x: jnp.cumsum(x)[-1],
    "softmax": lambda x: jnp.sum(jax.nn.softmax(x)),
    "log_softmax": lambda x: jax.nn.log_softmax(x)[0],
    "cross_entropy": lambda x: optax.softmax_cross_entropy(
        x, jax.nn.one_hot(0, x.shape[-1], dtype=x.dtype)),
}
every_op = lambda x: {op: fn(x) for op, fn in FLOAT32_OPS.items()}  # all in one program


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_the_float32_rules_hold_for_half_precision_values(dtype):
  # 100,000 values of +-300: their sums, squares and counts leave float16's
  # range, and bfloat16 cannot count to 100,000 in steps of 1.
  x = np.tile(np.array([300.0, -300.0, 1.0, 2.0], dtype), 25_000)
  got = jax.jit(jaxmp.autocast(every_op, jaxmp.Policy(jnp.float32, dtype, jnp.float32)))(x)
  assert {value.dtype for value in got.values()} == {F32}
  chex.assert_trees_all_close(got, jax.jit(every_op)(f32(x)), rtol=1e-6)  # 1 program, 2 dtypes


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.bfloat16])
def test_float8_inputs_and_a_wider_preferred_element_type_are_kept(dtype):
  def matmul(x, w):  # in float8, or in bfloat16 accumulating in float32
    return jax.lax.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)

  x, w = f32(np.ones((2, 4))), f32(np.ones((4, 3)))
  policy = jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
  [dot] = eqns(jax.make_jaxpr(jaxmp.autocast(matmul, policy))(x, w), "dot_general")
  assert in_dtypes(dot) == (np.dtype(dtype),) * 2 and dot.outvars[0].aval.dtype == F32
  np.testing.assert_array_equal(jaxmp.autocast(matmul, "mixed_bfloat16")(x, w), matmul(x, w))


def test_arguments_outputs_and_constants():
  def f(x, factor, *, activation):
    y = x @ x.T
    return {"half": activation(y) * factor, "int": jnp.argmax(x), "loss": jnp.sum(x),
            "tiny": y * 1e-30, "huge": y - 1e38}  # constants below and past float16's range

  fast = jaxmp.autocast(policy="mixed_float16")(f)  # as a decorator
  assert (fast.__name__, list(inspect.signature(fast).parameters)) == (
      "f", ["x", "factor", "activation"])
  half_output = jaxmp.Policy(jnp.float32, jnp.float16, jnp.float16)
  out, bf16, half = jax.jit(lambda x: [  # one program; non-array arguments are static
      fn(x, 3, activation=jnp.tanh) for fn in (fast, *(jaxmp.autocast(f, p) for p in (
          "bf16", half_output)))])(f32(np.ones((2, 2))))
  assert float(np.asarray(out["half"])[0, 0]) == pytest.approx(3 * np.tanh(2.0), rel=1e-2)
  assert (out["half"].dtype, out["int"].dtype, out["loss"].dtype) == (F32, np.dtype(jnp.int32), F32)
  assert (np.asarray(out["tiny"]) > 0).all() and np.isfinite(out["huge"]).all()
  assert (bf16["half"].dtype, half["loss"].dtype) == (BF16, F16)


def test_the_casts_are_explicit_whatever_the_users_promotion():
  # Autocast inserts each cast itself: its program is the same under strict and standard
  # promotion, where bf16 meets a float32 layer norm, a float32 carry and float32 branches.
  fast, programs = jaxmp.autocast(nested, "mixed_bfloat16"), {}
  for promotion in ("strict", "standard"):
    with jax.numpy_dtype_promotion(promotion):
      programs[promotion] = str(jax.make_jaxpr(jax.value_and_grad(fast))(*params_and_x()))
  assert programs["strict"] == programs["standard"]
  assert "bf16" in programs["strict"]


def test_vmap_and_sharded_jit():
  params = small_params()
  rows = np.random.default_rng(0).normal(size=(8, 1, 8))
  fast, x, one = jaxmp.autocast(small_loss, "mixed_bfloat16"), f32(rows[:, 0]), f32(rows)
  per_example = jax.jit(jax.vmap(fast, in_axes=(None, 0)))(params, one)  # row by row: op by op
  np.testing.assert_allclose(per_example, [fast(params, f32(row)) for row in rows], rtol=1e-6)
  inside = jaxmp.autocast(jax.vmap(small_loss, in_axes=(None, 0)), "mixed_bfloat16")
  np.testing.assert_allclose(jax.jit(inside)(params, one), per_example, rtol=1e-6)

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
  sharded_x = jax.device_put(
      x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
  step = jax.jit(jax.value_and_grad(fast))
  (loss, grads), (want_loss, want_grads) = step(params, sharded_x), step(params, x)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-4)  # sums over 8 shards, reordered
  chex.assert_trees_all_close(grads, want_grads, rtol=1e-3, atol=1e-5)
  chex.assert_trees_all_equal_dtypes(grads, params)
  # The sharded program multiplies in bfloat16 and keeps x sharded over the
  # batch (it is not gathered onto one device first).
  assert set(dot_dtypes(jax.make_jaxpr(step)(params, sharded_x))) == {(BF16, BF16)}
  _, x_sharding = step.lower(params, sharded_x).compile().input_shardings[0]
  assert x_sharding.is_equivalent_to(sharded_x.sharding, x.ndim)


@pytest.mark.integration  # the benchmark's reduced transformer, compiled
def test_the_benchmark_meets_the_bytes_goal_in_a_reduced_configuration():
  benchmark = models.benchmark("autocast")
  args = benchmark.build_parser().parse_args([
      "--d-model", "128", "--layers", "1", "--heads", "4", "--seq-len", "128",
      "--batch-size", "8"])
  ours = benchmark.compiler_figures(args, (benchmark.AUTOCAST,), dumps=False)[benchmark.AUTOCAST]
  # The hand cast needs standard promotion (Flax's force_fp32_for_softmax=True multiplies
  # the float32 softmax by bf16 values); autocast traces the strict-clean float32 model.
  with jax.numpy_dtype_promotion("standard"):
    target = benchmark.compiler_figures(args, (benchmark.TARGET,), dumps=False)[benchmark.TARGET]
  # Compiler figures only (deterministic); times are never asserted.
  assert ours["bytes_accessed"] <= benchmark.BYTES_TARGET * target["bytes_accessed"]
  assert ours["temp_bytes"] <= target["temp_bytes"]
  assert ours["bf16_matmuls"] == ours["matmuls"] == 27  # 9 forward, 18 backward
  assert target["bf16_matmuls"] == 24  # not the einsums of f32 attention weights
  assert ours["repeated_param_casts"] == 0


def test_the_docs_publish_the_rule_table():
  page = (pathlib.Path(__file__).parent.parent / "docs" / "autocast.md").read_text("utf-8")
  rows = re.findall(
      r"^\| `(compute|float32|promote|as_is|original)` \| ([^|]*) \|", page, re.MULTILINE)
  published = {}
  for kind, names in rows:
    for name in re.findall(r"`([\w\-]+)`", names):
      assert name not in published, name  # each primitive once
      published[name] = kind
  assert published == jaxmp.autocast_rules()


def autocast_state(policy):
  """A TrainState with autocast=True over an MLP declaring float32; a batch; a loss."""
  model, x = models.LinenMLP(dtype=jnp.float32), f32(np.ones((8, 4)))
  params = like_flax_init(jax.eval_shape(model.init, jax.random.key(0), x))["params"]
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-2), policy=policy,
      loss_scale=jaxmp.DynamicLossScale(2.0**8), autocast=True)
  return state, x, lambda params, x: jnp.mean(state.apply_fn({"params": params}, x) ** 2)


@pytest.mark.parametrize("pinned", [False, True])
def test_train_state_autocast_wins_over_the_declared_dtype_trains_and_skips(pinned):
  policy = jaxmp.flax.ModulePolicy({"Dense_1": "float32"}, default="mixed_float16")
  state, x, loss_fn = autocast_state(policy if pinned else "mixed_float16")
  report = jaxmp.precision_report(state.value_and_grad(loss_fn), state.params, x)
  half = ("float16", "float16")
  head = ("float32", "float32") if pinned else half  # a ModulePolicy rule still pins
  assert [(op.direction, op.module.split("/")[1], op.inputs) for op in report.ops] == [
      ("forward", "Dense_0", half), ("forward", "Dense_1", head), ("backward", "Dense_1", head),
      ("backward", "Dense_1", head), ("backward", "Dense_0", half)], str(report)

  @jax.jit
  def step(state, x):
    loss, grads = state.value_and_grad(loss_fn)(state.params, x)
    return state.apply_gradients(grads=grads), loss, grads

  state, loss, grads = step(state, x)
  assert loss.dtype == F32 and {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
  assert np.isfinite(loss) and int(state.metrics["skipped_steps"]) == 0
  before = state.params
  state, _, _ = step(state, f32(np.where(np.arange(32).reshape(8, 4) == 0, np.inf, 1.0)))
  assert int(state.metrics["skipped_steps"]) == 1
  chex.assert_trees_all_equal(state.params, before)


@nnx.jit  # initialised in one program, not op by op
def declared_float32_nnx():
  """An NNX model whose layers declare float32, with BatchNorm (layer 1) and dropout (3)."""
  rngs, f32 = nnx.Rngs(0), jnp.float32
  return nnx.Sequential(
      nnx.Linear(3, 16, dtype=f32, rngs=rngs), nnx.BatchNorm(16, dtype=f32, rngs=rngs),
      nnx.relu, nnx.Dropout(0.1, rngs=rngs), nnx.Linear(16, 16, dtype=f32, rngs=rngs),
      nnx.relu, nnx.Linear(16, 4, dtype=f32, rngs=rngs))


def nnx_loss(model, x):
  return jnp.mean(model(x) ** 2)


NNX_X = f32(np.random.default_rng(0).normal(size=(8, 3)))


def nnx_value_and_grad(policy, scale):
  """``nnx_loss``'s scaled value and gradient, under autocast where ``policy``."""
  return jaxmp.scaled_value_and_grad(jaxmp.autocast(nnx_loss, policy) if policy else nnx_loss,
                                     scale, value_and_grad=nnx.value_and_grad)


def test_nnx_autocast_multiplies_in_bf16_and_writes_back_what_the_model_updates():
  scale = jaxmp.DynamicLossScale(2.0**8)
  graphdef, state = nnx.split(declared_float32_nnx())

  def value_and_grad(state, policy):  # on a fresh copy of the same model; and its new state
    model = nnx.merge(graphdef, state, copy=True)
    return nnx_value_and_grad(policy, scale)(model, NNX_X), nnx.state(model)

  # 3 matmuls forward, 2 backward each but the input gradient of x. As
  # written, the declared float32 wins.
  assert dot_dtypes(jax.make_jaxpr(lambda s: value_and_grad(s, None))(state)) == [(F32, F32)] * 8
  jaxpr = jax.make_jaxpr(lambda s: value_and_grad(s, "mixed_bfloat16"))(state)
  assert dot_dtypes(jaxpr) == [(BF16, BF16)] * 8
  assert dtypes_of(jaxpr, "rsqrt") == [{F32}]  # the batch norm
  run = jax.jit(value_and_grad, static_argnums=1)  # compiled, not op by op
  ((loss, grads), mixed), ((want_loss, want_grads), full) = (
      run(state, "mixed_bfloat16"), run(state, None))
  assert loss.dtype == F32 and {g.dtype for g in jax.tree_util.tree_leaves(grads)} == {F32}
  np.testing.assert_allclose(loss, want_loss, rtol=1e-2)  # measured: 3e-4
  chex.assert_trees_all_close(  # measured: at most 1.3e-3 off, of grads up to 0.37
      *jax.jit(scale.unscale)((nnx.to_pure_dict(grads), nnx.to_pure_dict(want_grads))),
      rtol=0.1, atol=2e-3)
  # What the model updated is written back: BatchNorm statistics, in float32,
  # close to the float32 run's; the dropout RNG advanced as without autocast.
  (_, mixed, _, drop, *_), (_, full, _, full_drop, *_) = (
      nnx.merge(graphdef, mixed).layers, nnx.merge(graphdef, full).layers)
  assert np.abs(mixed.mean[...]).max() > 0
  assert mixed.mean[...].dtype == mixed.var[...].dtype == F32
  # Measured: the means (up to 2.8e-3) 1.3e-5 apart, the variances (about 1) 1.6e-4.
  np.testing.assert_allclose(mixed.mean[...], full.mean[...], rtol=2e-2, atol=5e-5)
  np.testing.assert_allclose(mixed.var[...], full.var[...], rtol=2e-3)
  assert int(drop.rngs.count[...]) == int(full_drop.rngs.count[...]) == 1
  # Plain autocast takes a model that updates nothing (in eval mode).
  model = nnx.merge(graphdef, state)
  model.eval()
  fast = jaxmp.autocast(nnx_loss, "mixed_bfloat16")
  assert dot_dtypes(jax.make_jaxpr(fast)(model, NNX_X)) == [(BF16, BF16)] * 3
  np.testing.assert_allclose(*nnx.jit(lambda m: (fast(m, NNX_X), nnx_loss(m, NNX_X)))(model),
                             rtol=1e-2)


def test_nnx_autocast_trains_under_nnx_jit_without_retracing():
  model = declared_float32_nnx()
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**8)),
      wrt=nnx.Param)

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, x):
    loss, grads = nnx_value_and_grad(
        "mixed_float16", jaxmp.get_loss_scale(optimizer.opt_state))(model, x)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, NNX_X)) for _ in range(20)]
  assert losses[-1] < 0.5 * losses[0]
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  assert {p.dtype for p in jax.tree_util.tree_leaves(params)} == {F32}
  # A step with an inf in the batch: skipped, the params untouched.
  step(model, optimizer, f32(np.where(np.arange(24).reshape(8, 3) == 0, np.inf, NNX_X)))
  assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 1
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)
