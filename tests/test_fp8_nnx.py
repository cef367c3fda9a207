"""FP8 training of NNX models: the FP8 ops set_nnx_dtypes attaches, their
meta (jaxmp.flax.Fp8Meta) under the guard and in unscaled units.

The policy, the Linen path and the checkpoints are tested in tests/test_fp8.py;
the error messages of bad inputs live in tests/test_bad_input.py.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.linen import fp8_ops
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp
import jaxmp.flax
from matmul_dtypes import matmul_dtypes

POLICY = "p=f32,c=bf16,o=f32,dot=fp8,amax_history=4"
META = "_overwrite_with_gradient"
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)


class Mlp(nnx.Module):
  """One layer of each kind that gets an FP8 op."""

  def __init__(self, rngs, use_bias=True):
    self.l1 = nnx.Linear(3, 16, use_bias=use_bias, rngs=rngs)
    self.l2 = nnx.LinearGeneral(16, 8, use_bias=use_bias, rngs=rngs)
    self.head = nnx.Einsum("bi,io->bo", (8, 4), (4,) if use_bias else None,
                           rngs=rngs)

  def __call__(self, x):
    return self.head(self.l2(nnx.relu(self.l1(x))))


def _batch(seed=1, n=16):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (n, 4))


def _setup(loss_scale=None, tx=None, use_bias=True):
  model = Mlp(nnx.Rngs(0), use_bias=use_bias)
  jaxmp.flax.ModulePolicy({}, default=POLICY).set_nnx_dtypes(model)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
      tx or optax.adam(1e-2), loss_scale or jaxmp.DynamicLossScale(2.0**12)),
      wrt=nnx.Param)
  return model, optimizer


def _mse(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


def _train_step(model, optimizer, x, y, loss_fn=_mse):
  # The FP8 meta is state the optimizer does not own: kept on a skipped step.
  meta = lambda: nnx.state(model, jaxmp.flax.Fp8Meta)
  old = jax.tree_util.tree_map(lambda v: v, meta())
  loss, grads = jaxmp.scaled_value_and_grad(
      loss_fn, jaxmp.get_loss_scale(optimizer.opt_state),
      value_and_grad=nnx.value_and_grad)(model, x, y)
  optimizer.update(model, grads)
  nnx.update(model, jaxmp.keep_on_skip(optimizer.opt_state, meta(), old))
  return loss


_step = nnx.jit(_train_step, static_argnames="loss_fn")


def _meta(model):
  return nnx.to_pure_dict(nnx.state(model, jaxmp.flax.Fp8Meta))


def _ops(model):
  """Each FP8 layer's meta, by layer name."""
  meta = _meta(model)
  return {"l1": meta["l1"]["dot_general"], "l2": meta["l2"]["dot_general"],
          "head": meta["head"]["einsum_op"]}


def test_an_op_that_did_not_run_keeps_its_meta():
  """The head does not run in this step: Flax's pattern would give its meta
  zeros (scales of 0); it keeps its meta, and the layers that ran are written."""
  model, optimizer = _setup()
  x, y = _batch()
  before = _ops(model)

  def without_head(model, x, y):
    return jnp.mean((model.l2(nnx.relu(model.l1(x))).astype(jnp.float32)[:, :4] - y) ** 2)

  _step(model, optimizer, x, y, loss_fn=without_head)
  after = _ops(model)
  chex.assert_trees_all_equal(after["head"], before["head"])
  for name in ("l1", "l2"):
    assert float(after[name]["input_amax_history"][0]) > 0, name


def test_set_nnx_dtypes_gives_each_matmul_layer_an_fp8_op_with_flax_meta():
  """Linear, LinearGeneral (those of MultiHeadAttention too) and Einsum get
  an op whose meta is laid out as Flax's Linen op's; the params are left
  alone, a bf16 rule gets no op, and a second call changes nothing."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.mlp = Mlp(rngs)
      self.attention = nnx.MultiHeadAttention(2, 4, rngs=rngs, decode=False)
      self.logits = nnx.Linear(4, 2, rngs=rngs)

  model = Model(nnx.Rngs(0))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  policy = jaxmp.flax.ModulePolicy({"logits": "mixed_bfloat16"}, default=POLICY)
  policy.set_nnx_dtypes(model)
  meta = _meta(model)
  assert sorted(meta) == ["attention", "mlp"]  # the bf16 head has none
  assert sorted(meta["attention"]) == ["key", "out", "query", "value"]
  chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model, nnx.Param)), params)
  assert not issubclass(jaxmp.flax.Fp8Meta, nnx.Param)  # the optimizer's wrt

  linen_policy = jaxmp.flax.ModulePolicy({}, default=POLICY)
  linen_meta = linen_policy.wrap_apply(nn.Dense(2).init)(
      jax.random.key(0), jnp.ones((1, 3)))[META]["Fp8DirectDotGeneralOp_0"]
  for op in _ops(model.mlp).values():
    chex.assert_trees_all_equal(op, dict(linen_meta))

  x = jnp.ones((2, 3))
  assert [d for _, d in matmul_dtypes(model.mlp, x)] == [
      ("float8_e4m3fn", "float8_e4m3fn")] * 3
  backward = {d for _, d in matmul_dtypes(nnx.grad(lambda m: jnp.sum(m(x))), model.mlp)}
  assert ("float8_e5m2", "float8_e4m3fn") in backward  # an input gradient

  op = model.mlp.l1.dot_general
  policy.set_nnx_dtypes(model)
  assert model.mlp.l1.dot_general is op


def test_finite_step_meta_is_flax_rule_on_unscaled_gradients():
  """At loss scale 2**12, the meta after one Adam step equals Flax's own FP8
  ops (put in a Linen twin by hand) differentiated at scale 1, bit for bit:
  it is never unscaled nor optimized."""
  model, optimizer = _setup()
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  x, y = _batch()
  _step(model, optimizer, x, y)
  assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 0

  op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4)
  dense = functools.partial(nn.Dense, dtype=jnp.bfloat16, dot_general_cls=op)

  class FlaxTwin(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = dense(8, name="l2")(nn.relu(dense(16, name="l1")(x)))
      kernel = self.param("kernel", nn.initializers.zeros, (8, 4))
      bias = self.param("bias", nn.initializers.zeros, (4,))
      y = fp8_ops.Fp8Einsum(amax_history_length=4, name="head")(
          "bi,io->bo", x, kernel.astype(jnp.bfloat16))
      return y + bias.astype(jnp.bfloat16)

  twin = FlaxTwin()
  variables = twin.init(jax.random.key(0), x)
  variables["params"] = {
      "l1": params["l1"], "l2": params["l2"], **params["head"]}
  loss = lambda v: jnp.mean((twin.apply(v, x).astype(jnp.float32) - y) ** 2)
  new_meta = jax.jit(jax.grad(loss))(variables)[META]
  flax_ops = {"l1": new_meta["l1"]["Fp8DirectDotGeneralOp_0"],
              "l2": new_meta["l2"]["Fp8DirectDotGeneralOp_0"],
              "head": new_meta["head"]}
  chex.assert_trees_all_equal(_ops(model), flax_ops)
  history = _ops(model)["head"]["output_grad_amax_history"]
  assert 0 < float(history[0]) < 1  # unscaled: not 2**12 times the gradient


def test_injected_inf_keeps_params_opt_state_and_meta():
  """Without bias every gradient goes through Flax's FP8 op, which saturates
  the inf output gradient to finite weight gradients: the inf amax still
  skips the step, and keep_on_skip puts the meta back."""
  model, optimizer = _setup(use_bias=False)
  x, y = _batch()
  for _ in range(2):  # finite steps: non-trivial meta
    _step(model, optimizer, x, y)
  state = lambda: (nnx.to_pure_dict(nnx.state(model)),  # params and meta
                   nnx.to_pure_dict(nnx.state(optimizer.opt_state))["inner_state"])
  before = state()
  assert before[0]["head"]["einsum_op"]["kernel_scale"][0] != 1.0  # moved
  overflowing = lambda model, x, y: jnp.sum(model(x).astype(jnp.float32)) * 1e38
  _step(model, optimizer, x, y, loss_fn=overflowing)
  assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 1
  chex.assert_trees_all_equal(state(), before)


def _saturation(model):
  """Per FP8 op, the largest output gradient of the last step over the E5M2
  range its scale gave: above 1, the op clipped (FP8 overflow)."""
  return [float(op["output_grad_amax_history"][0]
                / (E5M2_MAX * op["output_grad_scale"][0]))
          for op in _ops(model).values()]


def test_loss_scale_growth_and_backoff_leave_the_meta_as_at_scale_one():
  """The loss scale doubles on every finite step and backs off once (a
  skipped step): the stored meta, in unscaled units, ends bit for bit where
  the same finite steps at loss scale 1 leave it, and no FP8 op clips more
  than the amax itself grows between steps (Flax's scaled history clips by
  2x after each doubling: tests/test_fp8.py shows it on the same adapter)."""
  scale = jaxmp.DynamicLossScale(2.0**8, period=1)
  model, optimizer = _setup(loss_scale=scale, tx=optax.sgd(0.0))
  at_one, at_one_optimizer = _setup(loss_scale=jaxmp.NoOpLossScale(), tx=optax.sgd(0.0))
  x, y = _batch()
  saturation = []
  for targets in (y, y, y, y.at[0, 0].set(jnp.inf), y):  # grow x3, back off
    _step(model, optimizer, x, targets)
    saturation.append(max(_saturation(model)))
  for _ in range(4):
    _step(at_one, at_one_optimizer, x, y)
  assert float(jaxmp.get_loss_scale(optimizer.opt_state).loss_scale) == 2.0**11
  chex.assert_trees_all_equal(_meta(model), _meta(at_one))
  assert max(saturation[1:]) < 1.1, saturation  # measured: 1.038 at most


def test_second_step_no_retrace_no_host_transfer():
  model, optimizer = _setup()
  x, y = _batch()

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, x, y):
    return _train_step(model, optimizer, x, y)

  step(model, optimizer, x, y)
  with jax.transfer_guard("disallow"):
    loss = step(model, optimizer, x, y)
  assert int(optimizer.step[...]) == 2 and np.isfinite(float(loss))


def test_sharded_jit_keeps_meta_replicated_and_consistent():
  """Two steps with the batch split over 8 devices and the model and
  optimizer replicated: every Fp8Meta leaf comes out fully replicated, its
  8 shards equal, and equal to the single device's meta."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices; tests/conftest.py sets them up")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  x, y = _batch(n=32)
  single, single_optimizer = _setup()
  model, optimizer = _setup()
  for node in (model, optimizer):
    nnx.update(node, jax.device_put(nnx.state(node), NamedSharding(mesh, P())))
  rows = NamedSharding(mesh, P("data"))
  x_rows, y_rows = jax.device_put(x, rows), jax.device_put(y, rows)
  for _ in range(2):
    _step(single, single_optimizer, x, y)
    _step(model, optimizer, x_rows, y_rows)
  leaves = jax.tree_util.tree_leaves(nnx.state(model, jaxmp.flax.Fp8Meta))
  assert len(leaves) == 18  # 3 ops, 6 arrays each
  for leaf in leaves:
    assert leaf.sharding.is_fully_replicated
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == 8 and all((s == shards[0]).all() for s in shards)
  chex.assert_trees_all_equal(jax.device_get(_meta(model)), _meta(single))


def test_checkpoint_resume_is_bit_identical(tmp_path):
  """save_checkpoint((model, optimizer)) holds the params, the Fp8Meta and
  the optimizer state; a fresh model and optimizer restored from it take the
  next two steps bit for bit as the saved run does."""
  model, optimizer = _setup()
  x, y = _batch()
  _step(model, optimizer, x, y)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", (model, optimizer))
  resumed, resumed_optimizer = _setup()
  history = lambda model: _ops(model)["head"]["output_grad_amax_history"][0]
  assert history(resumed) == 0 < history(model)  # the step wrote the meta
  jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", (resumed, resumed_optimizer))
  chex.assert_trees_all_equal(_meta(resumed), _meta(model))
  for _ in range(2):
    _step(model, optimizer, x, y)
    _step(resumed, resumed_optimizer, x, y)
  state = lambda *nodes: nnx.to_pure_dict(nnx.state(nodes))
  chex.assert_trees_all_equal(state(resumed, resumed_optimizer),
                              state(model, optimizer))


def test_fallback_reports_the_layer_and_the_switch_removes_just_its_fp8_op():
  """On a float16-base FP8 model whose head overflows, find_overflowing_modules
  reports the head, not the FP8 op inside it; switching to the proposed policy
  (the head in float32) takes the head's FP8 op and meta off, says so, and
  keeps the other layers' ops and meta as they were; the model then trains."""
  policy = "p=f32,c=f16,o=f32,dot=fp8,amax_history=4"
  model = Mlp(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({}, default=policy).set_nnx_dtypes(model)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
      optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**12)), wrt=nnx.Param)
  x, y = _batch()
  # At the initial scales (1), FP8 clips to 448: 8 * 448 * 448 > 65504.
  model.head.kernel[...] = jnp.full((8, 4), 1e4)
  report = jaxmp.flax.find_overflowing_modules(model, x * 100)
  assert report.modules == ("head",)
  assert [c.path for c in report.calls] == ["", "l1", "l2", "head"]  # no op
  kept = {name: getattr(model, name).dot_general for name in ("l1", "l2")}
  kept_meta = {name: _ops(model)[name] for name in ("l1", "l2")}
  with pytest.warns(UserWarning, match=r"runs 1 layer\(s\) that had FP8 matmuls "
                    r"without them \('head'\): their FP8 ops, and the "
                    r"jaxmp\.flax\.Fp8Meta in them, are removed"):
    jaxmp.switch_precision(optimizer, report.propose_policy(policy), model=model)
  assert model.head.einsum_op is jnp.einsum and model.head.dtype == jnp.float32
  assert all(getattr(model, name).dot_general is op for name, op in kept.items())
  meta = _meta(model)
  assert sorted(meta) == ["l1", "l2"]
  chex.assert_trees_all_equal({n: meta[n]["dot_general"] for n in kept}, kept_meta)
  assert jaxmp.flax.find_overflowing_modules(model, x * 100).modules == ()
  model.head.kernel[...] = jnp.full((8, 4), 0.1)  # a step that trains
  _step(model, optimizer, x, y)
  assert int(jaxmp.loss_scaling_metrics(optimizer.opt_state)["skipped_steps"]) == 0


class TinyLm(nnx.Module):
  """Bytes -> embedding -> causal attention -> MLP -> logits, in NNX."""

  def __init__(self, rngs, d=32):
    self.embed = nnx.Embed(256, d, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(2, d, rngs=rngs, decode=False)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)
    self.head = nnx.Linear(d, 256, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.attention(x, mask=nnx.make_causal_mask(tokens))
    x = x + self.down(nnx.relu(self.up(x)))
    return self.head(x)


def _lm_losses(policy, steps, seed=0):
  text = np.frombuffer(open(__file__, "rb").read(), np.uint8)
  starts = np.random.default_rng(seed).integers(0, len(text) - 33, size=(steps, 8))
  batches = jnp.asarray(text[starts[..., None] + np.arange(33)], jnp.int32)
  model = TinyLm(nnx.Rngs(seed))
  jaxmp.flax.ModulePolicy({}, default=policy).set_nnx_dtypes(model)
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
      optax.adam(3e-3), jaxmp.NoOpLossScale()), wrt=nnx.Param)

  def loss_fn(model, batch, _):
    logits = model(batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch[:, 1:]).mean()

  step = nnx.jit(functools.partial(_train_step, loss_fn=loss_fn))
  return np.array([float(step(model, optimizer, batch, None)) for batch in batches])


@pytest.mark.standard_promotion(
    reason="jax.nn.dot_product_attention, which nnx.MultiHeadAttention calls, "
    "promotes its bfloat16 logits to float32")
@pytest.mark.integration  # trains a byte-level model
def test_nnx_fp8_loss_stays_within_tolerance_of_bf16():
  """30 Adam steps of a tiny NNX byte model (its 7 matmul layers in FP8) on
  this file's bytes: the mean loss of the last 10 steps. Measured (seed 0,
  CPU): bfloat16 3.6170, FP8 3.6232, float32 3.6172 nats; the tolerance,
  0.05 nats, is 8 times the measured gap between FP8 and bfloat16."""
  bf16 = _lm_losses("mixed_bfloat16", 30)
  fp8 = _lm_losses("mixed_fp8", 30)
  assert bf16[-10:].mean() < bf16[0] - 1.0  # it learns
  gap = abs(fp8[-10:].mean() - bf16[-10:].mean())
  assert gap < 0.05, (fp8[-10:].mean(), bf16[-10:].mean())
