"""FP8 training: the FP8 policy, Flax's FP8 ops injected without model edits,
the FP8 meta under the guard, and its units against the loss scale.

The error messages of bad FP8 inputs live in tests/test_bad_input.py.
"""

import pathlib
import sys

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp
import jaxmp.flax
from matmul_dtypes import matmul_dtypes

META = "_overwrite_with_gradient"
OP = "Fp8DirectDotGeneralOp_0"
E5M2_MAX = float(jnp.finfo(jnp.float8_e5m2).max)


class Mlp(nn.Module):
  """Two Dense layers without bias: every weight gradient goes through FP8."""

  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, use_bias=self.use_bias)(x))
    return nn.Dense(4, use_bias=self.use_bias)(x)


def _batch(seed=1, n=16):
  kx, ky = jax.random.split(jax.random.key(seed))
  return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (n, 4))


def _setup(policy="p=f32,c=bf16,o=f32,dot=fp8,amax_history=4", loss_scale=None,
           tx=None, model=None):
  model = model or Mlp()
  module_policy = (policy if isinstance(policy, jaxmp.flax.ModulePolicy)
                   else jaxmp.flax.ModulePolicy({}, default=policy))
  x, _ = _batch()
  variables = jax.jit(module_policy.wrap_apply(model.init))(jax.random.key(0), x)
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=variables,
      tx=tx or optax.adam(1e-2), policy=policy,
      loss_scale=loss_scale or jaxmp.DynamicLossScale(2.0**12))
  return model, module_policy, variables, state


def _mse_of(out, y):
  return jnp.mean((out - y.astype(out.dtype)) ** 2)


def _mse(state):
  def loss_fn(variables, x, y):
    return _mse_of(state.apply_fn(variables, x), y)
  return loss_fn


def _step(state, x, y):
  loss, grads = state.value_and_grad(_mse(state))(state.params, x, y)
  return state.apply_gradients(grads=grads), loss


# The policy.


def test_mixed_fp8_is_bf16_with_fp8_dots():
  policy = jaxmp.get_policy("mixed_fp8")
  assert isinstance(policy, jaxmp.Policy)
  assert str(policy) == "p=f32,c=bf16,o=f32,dot=fp8"
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, jnp.bfloat16, jnp.float32)
  assert policy.base == jaxmp.get_policy("mixed_bfloat16") != policy
  assert not policy.needs_loss_scaling  # delayed scaling covers FP8's range
  assert jaxmp.get_policy("p=f32,c=f16,o=f32,dot=fp8").needs_loss_scaling
  short = jaxmp.get_policy("p=f32,c=bf16,o=f32,dot=fp8,amax_history=16")
  assert short.amax_history_length == 16
  assert jaxmp.get_policy(str(short)) == short and hash(short) != hash(policy)


def test_dense_layers_run_in_fp8_and_the_rest_in_bf16():
  """E4M3 x E4M3 forward, E5M2 gradients; the bf16 head is left alone."""
  model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(4)])
  policy = jaxmp.flax.ModulePolicy({"layers_2": "mixed_bfloat16"}, default="mixed_fp8")
  x = jnp.ones((2, 3))
  variables = jax.eval_shape(policy.wrap_apply(model.init), jax.random.key(0), x)
  assert list(variables[META]) == ["layers_0"]  # the head has no FP8 meta
  assert set(variables[META]["layers_0"][OP]) == {
      f"{t}_{k}" for t in ("input", "kernel", "output_grad")
      for k in ("scale", "amax_history")}
  apply = policy.wrap_apply(model.apply)
  assert [d for _, d in matmul_dtypes(apply, variables, x)] == [
      ("float8_e4m3fn", "float8_e4m3fn"), ("bfloat16", "bfloat16")]
  loss = lambda v: jnp.sum(apply(v, x))
  backward = {d for _, d in matmul_dtypes(jax.grad(loss), variables)}
  assert ("float8_e5m2", "float8_e4m3fn") in backward  # the input gradient
  assert jax.eval_shape(apply, variables, x).dtype == jnp.float32  # the default's output


def test_an_einsum_kept_out_of_fp8_by_a_rule_and_the_params_of_the_plain_model():
  """Linen's nn.Einsum takes no dot_general_cls, so FP8 refuses it
  (tests/test_bad_input.py); a rule keeps it in bfloat16 while the Dense
  layers run in FP8, with the params (paths, shapes, values) of the model
  without FP8 and the meta under the Dense layers only."""

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Einsum((3, 4, 2), "bi,ihk->bhk")(x)).reshape(x.shape[0], 8)
      return nn.Dense(4)(nn.Dense(8)(x))

  model = Model()
  x, y = _batch()
  policy = "p=f32,c=bf16,o=f32,dot=fp8,amax_history=4"
  _, module_policy, variables, state = _setup(
      model=model, policy=jaxmp.flax.ModulePolicy({nn.Einsum: "mixed_bfloat16"},
                                                  default=policy))
  chex.assert_trees_all_equal(variables["params"],
                              jax.jit(model.init)(jax.random.key(0), x)["params"])
  assert sorted(variables[META]) == ["Dense_0", "Dense_1"]
  apply = module_policy.wrap_apply(model.apply)
  assert [d for _, d in matmul_dtypes(apply, variables, x)] == [
      ("bfloat16", "bfloat16")] + [("float8_e4m3fn", "float8_e4m3fn")] * 2
  state, _ = jax.jit(_step)(state, x, y)
  assert int(state.metrics["skipped_steps"]) == 0


# The meta under the guard.


def test_finite_step_meta_is_flax_rule_on_unscaled_gradients():
  """At loss scale 2**12, the meta after one Adam step equals Flax's own FP8
  step at scale 1, bit for bit: it is never unscaled nor optimized."""
  model, policy, variables, state = _setup()
  x, y = _batch()
  new_state, _ = jax.jit(_step)(state, x, y)
  assert int(new_state.metrics["skipped_steps"]) == 0

  apply = policy.wrap_apply(model.apply)

  @jax.jit
  def flax_step(variables):  # Flax's own pattern: grad of all, Adam at scale 1
    grads = jax.grad(lambda v: _mse_of(apply(v, x), y))(variables)
    tx = optax.adam(1e-2)
    updates, _ = tx.update(grads["params"], tx.init(variables["params"]),
                           variables["params"])
    return grads[META], optax.apply_updates(variables["params"], updates)

  meta, params = flax_step(variables)
  chex.assert_trees_all_equal(new_state.params[META], meta)
  # The params agree to the last bit or so (XLA fuses Adam differently).
  chex.assert_trees_all_close(new_state.params["params"], params, rtol=1e-6, atol=1e-8)
  history = new_state.params[META]["Dense_1"][OP]["output_grad_amax_history"]
  assert 0 < float(history[0]) < 1  # unscaled: not 2**12 times the gradient


class TwoHeads(nn.Module):
  """Two Dense heads, of which a step may run one."""

  @nn.compact
  def __call__(self, x, only_a=False):
    a = nn.Dense(4, name="a")(x)
    return a if only_a else a + nn.Dense(4, name="b")(x)


def test_an_op_that_did_not_run_keeps_its_meta():
  """Flax's pattern gives the meta of a layer that did not run a zero
  "gradient": written back, its scales would be 0. Its meta is kept."""
  _, _, _, state = _setup(model=TwoHeads())
  x, y = _batch()

  def loss_fn(variables, x, y):
    return _mse_of(state.apply_fn(variables, x, only_a=True), y)

  @jax.jit
  def step(state, x, y):
    _, grads = state.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads)

  new_state = step(state, x, y)
  assert int(new_state.metrics["skipped_steps"]) == 0
  chex.assert_trees_all_equal(new_state.params[META]["b"], state.params[META]["b"])
  # The op that ran is written (its scales move from the next step on).
  assert float(new_state.params[META]["a"][OP]["input_amax_history"][0]) > 0


@pytest.mark.parametrize("use_bias", [True, False])
def test_injected_inf_keeps_params_opt_state_and_meta(use_bias):
  """Without bias every gradient goes through Flax's FP8 op, which saturates
  the inf output gradient to finite weight gradients: the inf amax still
  skips the step."""
  _, _, _, state = _setup(model=Mlp(use_bias=use_bias))
  x, y = _batch()
  state, _ = jax.jit(_step)(state, x, y)  # one finite step: non-trivial meta

  def overflowing(state, x, y):
    loss_fn = lambda variables: jnp.sum(state.apply_fn(variables, x)) * 1e38
    loss, grads = state.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), grads

  new_state, grads = jax.jit(overflowing)(state, x, y)
  if not use_bias:  # the weight gradients alone would not show the overflow
    assert bool(jaxmp.all_finite(grads["params"]))
  assert not bool(jaxmp.all_finite(grads[META]))
  assert int(new_state.metrics["skipped_steps"]) == 1
  chex.assert_trees_all_equal(new_state.params, state.params)
  chex.assert_trees_all_equal(new_state.opt_state.inner_state,
                              state.opt_state.inner_state)
  chex.assert_trees_all_equal(new_state.params[META], state.params[META])


def _saturation(meta):
  """Per FP8 op, the largest output gradient of the last step over the E5M2
  range its scale gave: above 1, the op clipped (FP8 overflow)."""
  return [float(m[OP]["output_grad_amax_history"][0]
                / (E5M2_MAX * m[OP]["output_grad_scale"][0]))
          for m in meta.values()]


def test_loss_scale_growth_and_backoff_cause_no_fp8_overflow():
  """The same model, batch and loss-scale trajectory: Flax's history, in the
  scaled units, saturates after each growth; jaxmp's, in unscaled units,
  moves with the loss scale."""
  scale = jaxmp.DynamicLossScale(2.0**8, period=1)  # doubles every finite step
  model, policy, variables, state = _setup(loss_scale=scale, tx=optax.sgd(0.0))
  x, y = _batch()
  bad_y = y.at[0, 0].set(jnp.inf)  # an inf loss: both guards skip the step

  # Flax's pattern with jaxmp's loss scaling, the meta kept on skipped steps.
  apply = policy.wrap_apply(model.apply)
  tx = jaxmp.loss_scaling(optax.sgd(0.0), scale)

  @jax.jit
  def naive_step(params, meta, opt_state, y):
    loss_fn = lambda v: _mse_of(apply(v, x), y)
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(opt_state))(
        {"params": params, META: meta})
    _, opt_state = tx.update(grads["params"], opt_state, params)
    finite = jaxmp.loss_scaling_metrics(opt_state)["last_finite"]
    return jaxmp.select_tree(finite, grads[META], meta), opt_state

  step = jax.jit(_step)
  naive_meta, opt_state = variables[META], tx.init(variables["params"])
  naive, ours = [], []
  for targets in (y, y, y, bad_y, y):  # grow, grow, grow, back off, step
    naive_meta, opt_state = naive_step(variables["params"], naive_meta, opt_state, targets)
    state, _ = step(state, x, targets)
    naive.append(max(_saturation(naive_meta)))
    ours.append(max(_saturation(state.params[META])))
  assert float(state.loss_scale.loss_scale) == float(
      jaxmp.get_loss_scale(opt_state).loss_scale) == 2.0**11
  # Steps 2 and 3 follow a doubling: Flax's op clips the largest output
  # gradients to half their size. jaxmp's uses the range to within the 1.4%
  # by which the amax itself grows between steps here (delayed scaling has
  # no margin in Flax), after the growths and after the backoff (step 4 was
  # skipped, its meta kept). Measured: naive 2.02, 2.02; jaxmp 1.014, 1.007,
  # 1.007, 1.0.
  assert min(naive[1:3]) > 1.9
  np.testing.assert_allclose(ours[1:], 1.0, atol=0.02)


# Several devices, retracing, host transfers, checkpoints.


def test_sharded_jit_keeps_meta_replicated_and_consistent():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices; tests/conftest.py sets them up")
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  _, _, _, state = _setup()
  x, y = _batch(n=32)
  step = jax.jit(_step)
  single, _ = step(state, x, y)
  replicated = NamedSharding(mesh, P())
  rows = NamedSharding(mesh, P("data"))
  sharded, _ = step(jax.device_put(state, replicated),
                    jax.device_put(x, rows), jax.device_put(y, rows))
  for leaf in jax.tree_util.tree_leaves(sharded.params[META]):
    assert leaf.sharding.is_fully_replicated
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert len(shards) == 8 and all((s == shards[0]).all() for s in shards)
  # The amaxes are maxima, exact in any order: the meta is the single device's.
  chex.assert_trees_all_equal(jax.device_get(sharded.params[META]), single.params[META])


def test_second_step_no_retrace_no_host_transfer():
  _, _, _, state = _setup()
  x, y = _batch()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    return _step(state, x, y)

  state, _ = step(state, x, y)
  with jax.transfer_guard("disallow"):
    state, loss = step(state, x, y)
  assert int(state.step) == 2 and np.isfinite(float(loss))


def test_checkpoint_resume_is_bit_identical(tmp_path):
  _, _, _, state = _setup()
  x, y = _batch()
  step = jax.jit(_step)
  state, _ = step(state, x, y)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state)
  _, _, _, fresh = _setup()
  resumed = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", fresh)
  chex.assert_trees_all_equal(resumed.params[META], state.params[META])
  for _ in range(2):
    state, _ = step(state, x, y)
    resumed, _ = step(resumed, x, y)
  chex.assert_trees_all_equal(resumed.params, state.params)
  chex.assert_trees_all_equal(resumed.params[META], state.params[META])
  chex.assert_trees_all_equal(resumed.opt_state, state.opt_state)


# The fallback helpers.


def test_fallback_reports_layers_and_a_switch_out_of_fp8_keeps_the_meta_unused():
  """find_overflowing_modules reports the Dense layers, never the FP8 op
  inside them; switch_precision to a policy without FP8 says so, and the
  state then trains in float32 with the same loss function, its meta kept."""
  _, _, variables, state = _setup()
  x, y = _batch()
  report = jaxmp.flax.find_overflowing_modules(
      state.apply_fn, state.params, x)
  assert [c.path for c in report.calls] == ["", "Dense_0", "Dense_1"]
  with pytest.warns(UserWarning, match=r"runs no FP8 matmuls: .* the state's FP8 "
                    r"meta stays in params unused"):
    switched = jaxmp.switch_precision(state, "float32")
  assert switched.params is state.params
  assert [d for _, d in matmul_dtypes(switched.apply_fn, variables, x)] == [
      ("float32", "float32")] * 2
  stepped, _ = jax.jit(_step)(switched, x, y)  # the same loss function
  assert int(stepped.metrics["skipped_steps"]) == 0
  chex.assert_trees_all_equal(stepped.params[META], state.params[META])


# The byte-level LM.

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))


def _lm_losses(policy_name, steps, seed=0):
  import train_lm  # pylint: disable=import-outside-toplevel

  model = train_lm.make_model(d_model=32, num_layers=1, num_heads=2, max_len=32)
  text = np.frombuffer(pathlib.Path(train_lm.__file__).read_bytes(), np.uint8)
  rng = np.random.default_rng(seed)
  starts = rng.integers(0, len(text) - 33, size=(steps, 8))
  batches = jnp.asarray(text[starts[..., None] + np.arange(33)], jnp.int32)
  policy = jaxmp.flax.ModulePolicy({}, default=policy_name)
  variables = jax.jit(policy.wrap_apply(model.init))(jax.random.key(seed), batches[0, :, :-1])
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=variables, tx=optax.adam(3e-3), policy=policy)

  def loss_fn(variables, batch):
    logits = state.apply_fn(variables, batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch[:, 1:]).mean()

  @jax.jit
  def step(state, batch):
    loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  losses = []
  for batch in batches:
    state, loss = step(state, batch)
    losses.append(float(loss))
  return np.array(losses)


@pytest.mark.standard_promotion(
    reason="the demo's attention computes its softmax in float32 "
    "(force_fp32_for_softmax) and multiplies it with bfloat16 values")
@pytest.mark.integration  # trains the demo's model
def test_lm_fp8_loss_stays_within_tolerance_of_bf16():
  """40 Adam steps on bytes of the demo's own source: the mean loss of the
  last 10 steps. Measured (seed 0, CPU): bfloat16 3.3660, FP8 3.3682,
  float32 3.3665 nats; the tolerance, 0.05 nats, is 20 times the measured
  gap between FP8 and bfloat16."""
  bf16 = _lm_losses("mixed_bfloat16", 40)
  fp8 = _lm_losses("mixed_fp8", 40)
  assert bf16[-10:].mean() < bf16[0] - 1.0  # it learns
  assert abs(fp8[-10:].mean() - bf16[-10:].mean()) < 0.05, (fp8[-10:], bf16[-10:])
