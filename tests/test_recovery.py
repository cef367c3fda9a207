"""Recovering a non-finite batch inside the step (jaxmp.Recover)."""

from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
import jaxmp.flax
from models import benchmark

F16 = jnp.float16
# The fp16 backward pass computes scale * x * cos(w): with x = 6 it is over
# 65504 at 2**15 and 2**14, not at 2**13; with x = 0.6 it is finite at 2**15.
W = jnp.linspace(0.0, 0.5, 8, dtype=jnp.float32)
OVERFLOWS = jnp.full(8, 6.0)
FINITE = jnp.full(8, 0.6)


def overflowing_loss(w, x):
  return jnp.sum(jnp.sin(w.astype(F16)) * x.astype(F16)).astype(jnp.float32)


def float32_loss(w, x):
  return jnp.sum(jnp.sin(w) * x)


# The two forms of recovery: the retries inside the gradients
# (scaled_value_and_grad(recover=) and tx.update(recovery=)), or the whole
# step in the loop (recovering_step). Both promise the same results.
FORMS = ("value_and_grad", "recovering_step")


def make_step(tx, recover, fun=overflowing_loss, form="value_and_grad"):
  if recover is not None and form == "recovering_step":
    return jax.jit(jaxmp.recovering_step(fun, tx, recover))

  @jax.jit
  def step(w, opt_state, x):
    scale = jaxmp.get_loss_scale(opt_state)
    if recover is None:
      loss, grads = jaxmp.scaled_value_and_grad(fun, scale)(w, x)
      updates, opt_state = tx.update(grads, opt_state, w)
      recovery = None
    else:
      loss, grads, recovery = jaxmp.scaled_value_and_grad(
          fun, scale, recover=recover)(w, x)
      updates, opt_state = tx.update(grads, opt_state, w, recovery=recovery)
    return optax.apply_updates(w, updates), opt_state, loss, recovery
  return step


@pytest.mark.parametrize("form", FORMS)
def test_a_batch_that_overflows_only_at_the_current_scale_is_recovered(form):
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
  state = tx.init(W)
  step = make_step(tx, jaxmp.Recover(max_retries=4), form=form)
  w, state, loss, recovery = step(W, state, OVERFLOWS)
  assert int(recovery.retries) == 2 and bool(recovery.finite)
  assert not bool(recovery.fell_back)
  # The scale backed off once per retry: 2**15 -> 2**14 -> 2**13.
  assert float(recovery.loss_scale.loss_scale) == 2.0**13
  metrics = jaxmp.loss_scaling_metrics(state)
  assert int(metrics["recovered_steps"]) == 1
  assert int(metrics["skipped_steps"]) == int(metrics["lost_steps"]) == 0
  assert int(metrics["fallback_steps"]) == 0

  # The same step computed directly at the lower scale, without recovery:
  # the same elementwise fp16 program, so the same bits.
  direct_tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**13))
  direct_state = direct_tx.init(W)
  direct_w, direct_state, direct_loss, _ = make_step(direct_tx, None)(
      W, direct_state, OVERFLOWS)
  chex.assert_trees_all_equal(w, direct_w)
  chex.assert_trees_all_equal(loss, direct_loss)
  chex.assert_trees_all_equal(state.inner_state, direct_state.inner_state)
  # The loss scale continues as if the overflows had been steps of their own
  # and this step had then run at 2**13.
  assert jaxmp.get_loss_scale(state) == jaxmp.get_loss_scale(direct_state)


def test_without_recovery_that_batch_is_skipped():
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
  state = tx.init(W)
  w, state, _, _ = make_step(tx, None)(W, state, OVERFLOWS)
  chex.assert_trees_all_equal(w, W)
  metrics = jaxmp.loss_scaling_metrics(state)
  assert int(metrics["lost_steps"]) == int(metrics["skipped_steps"]) == 1
  assert int(metrics["recovered_steps"]) == 0


@pytest.mark.parametrize("form", FORMS)
def test_a_nan_batch_is_lost_with_params_and_state_bit_identical(form):
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
  w0, state0 = make_step(tx, None)(W, tx.init(W), FINITE)[:2]
  recover = jaxmp.Recover(max_retries=3, fallback=float32_loss)
  w, state, _, recovery = make_step(tx, recover, form=form)(
      w0, state0, FINITE.at[3].set(jnp.nan))
  assert int(recovery.retries) == 3 and bool(recovery.fell_back)
  assert not bool(recovery.finite)
  chex.assert_trees_all_equal(w, w0)
  chex.assert_trees_all_equal(state.inner_state, state0.inner_state)
  metrics = jaxmp.loss_scaling_metrics(state)
  assert int(metrics["lost_steps"]) == int(metrics["skipped_steps"]) == 1
  assert int(metrics["recovered_steps"]) == int(metrics["fallback_steps"]) == 0
  # One backoff per attempt in float16 (the first and three retries).
  assert float(metrics["loss_scale"]) == 2.0**15 / 2**4


@pytest.mark.parametrize("form", FORMS)
def test_a_finite_step_with_recovery_is_bit_identical_without_retrace_or_transfer(form):
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10))
  x = FINITE
  plain = make_step(tx, None)
  recover = jaxmp.Recover(max_retries=4, fallback=float32_loss)
  recovering = jaxmp.recovering_step(overflowing_loss, tx, recover)
  chex.clear_trace_counter()  # counted per test, not across its parameters

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(w, opt_state, x):
    if form == "recovering_step":
      return recovering(w, opt_state, x)
    loss, grads, recovery = jaxmp.scaled_value_and_grad(
        overflowing_loss, jaxmp.get_loss_scale(opt_state), recover=recover)(w, x)
    updates, opt_state = tx.update(grads, opt_state, w, recovery=recovery)
    return optax.apply_updates(w, updates), opt_state, loss, recovery

  w, state = W, tx.init(W)
  w_plain, state_plain = W, tx.init(W)
  w, state, x = jax.device_put((w, state, x))
  for _ in range(2):  # the second call neither retraces nor transfers
    with jax.transfer_guard("disallow"):
      w, state, loss, recovery = step(w, state, x)
    w_plain, state_plain, loss_plain, _ = plain(w_plain, state_plain, x)
    chex.assert_trees_all_equal(w, w_plain)
    chex.assert_trees_all_equal(loss, loss_plain)
    chex.assert_trees_all_equal(state.inner_state, state_plain.inner_state)
    assert jaxmp.get_loss_scale(state) == jaxmp.get_loss_scale(state_plain)
  assert int(recovery.retries) == 0 and not bool(recovery.fell_back)
  assert int(jaxmp.loss_scaling_metrics(state)["recovered_steps"]) == 0


@pytest.mark.parametrize("form", FORMS)
def test_the_fallback_recovers_a_batch_that_overflows_at_every_scale(form):
  # fp16 overflows in the forward pass (x * 2**16 > 65504): no scale helps;
  # the float32 fallback computes it.
  big = jnp.full(8, 2.0**16)
  loss16 = lambda w, x: jnp.sum(w.astype(F16) * x.astype(F16)).astype(jnp.float32)
  loss32 = lambda w, x: jnp.sum(w * x)
  scale = jaxmp.DynamicLossScale(2.0**3, min_loss_scale=1.0)
  tx = jaxmp.loss_scaling(optax.sgd(2.0**-20), scale)
  step = make_step(tx, jaxmp.Recover(max_retries=6, fallback=loss32), fun=loss16,
                   form=form)
  w, state, loss, recovery = step(W, tx.init(W), big)
  assert bool(recovery.fell_back) and bool(recovery.finite)
  assert int(recovery.retries) == 6
  metrics = jaxmp.loss_scaling_metrics(state)
  assert int(metrics["fallback_steps"]) == int(metrics["recovered_steps"]) == 1
  assert int(metrics["lost_steps"]) == 0
  # The float32 update, unscaled by 1: w - 2**-20 * 2**16.
  np.testing.assert_array_equal(w, W - 2.0**-4)
  assert float(loss) == float(jnp.sum(W * big))
  # The scale reached the floor (2**3 -> 1 in three backoffs) and stays there.
  assert float(metrics["loss_scale"]) == 1.0


@pytest.mark.parametrize("form", FORMS)
def test_static_scales_go_straight_to_the_fallback(form):
  tx = jaxmp.loss_scaling(optax.sgd(2.0**-20), jaxmp.StaticLossScale(2.0**15))
  step = make_step(tx, jaxmp.Recover(max_retries=4, fallback=float32_loss),
                   form=form)
  _, state, _, recovery = step(W, tx.init(W), OVERFLOWS)
  assert int(recovery.retries) == 0 and bool(recovery.fell_back)
  assert int(jaxmp.loss_scaling_metrics(state)["fallback_steps"]) == 1


@pytest.mark.parametrize("form", FORMS)
def test_recovery_with_has_aux_returns_the_aux_of_the_recovered_attempt(form):
  fun = lambda w, x: (overflowing_loss(w, x), {"scale_free": jnp.sum(w)})
  if form == "recovering_step":
    tx = jaxmp.loss_scaling(optax.sgd(1e-3), jaxmp.DynamicLossScale(2.0**15))
    _, _, (loss, aux), recovery = jaxmp.recovering_step(
        fun, tx, jaxmp.Recover(), has_aux=True)(W, tx.init(W), OVERFLOWS)
  else:
    (loss, aux), grads, recovery = jaxmp.scaled_value_and_grad(
        fun, jaxmp.DynamicLossScale(2.0**15), has_aux=True,
        recover=jaxmp.Recover())(W, OVERFLOWS)
    assert bool(jaxmp.all_finite(grads))
  assert int(recovery.retries) == 2 and bool(recovery.finite)
  assert float(aux["scale_free"]) == float(jnp.sum(W))
  assert float(loss) == float(overflowing_loss(W, OVERFLOWS))


# -- multi_steps ---------------------------------------------------------------


def test_multi_steps_adopts_the_recovered_scale_for_the_whole_accumulation():
  k = 2
  tx = jaxmp.multi_steps(optax.sgd(1e-2), jaxmp.DynamicLossScale(2.0**15), k)
  recover = jaxmp.Recover()
  state = tx.init(W)
  # Micro-batch 1 is finite at 2**15 (x small); micro-batch 2 overflows there.
  xs = (FINITE, OVERFLOWS)
  w = W
  for x in xs:
    _, grads, recovery = jaxmp.scaled_value_and_grad(
        overflowing_loss, jaxmp.get_loss_scale(state), recover=recover)(w, x)
    updates, state = tx.update(grads, state, w, recovery=recovery)
    w = optax.apply_updates(w, updates)
  assert int(recovery.retries) == 2
  metrics = jaxmp.loss_scaling_metrics(state)
  assert int(metrics["recovered_steps"]) == 1 and int(metrics["lost_steps"]) == 0

  # The same accumulation run at 2**13 from the start: the first micro-batch's
  # gradients were rescaled by 2**13 / 2**15, a power of two, so exactly.
  direct = jaxmp.multi_steps(optax.sgd(1e-2), jaxmp.DynamicLossScale(2.0**13), k)
  direct_state = direct.init(W)
  direct_w = W
  for x in xs:
    _, grads = jaxmp.scaled_value_and_grad(
        overflowing_loss, jaxmp.get_loss_scale(direct_state))(direct_w, x)
    updates, direct_state = direct.update(grads, direct_state, direct_w)
    direct_w = optax.apply_updates(direct_w, updates)
  chex.assert_trees_all_equal(w, direct_w)
  assert float(metrics["loss_scale"]) == 2.0**13


# -- TrainState and NNX ----------------------------------------------------------


@pytest.mark.parametrize("form", ("value_and_grad", "recovering_train_step"))
def test_train_state_policy_fallback_runs_the_loss_in_float32(form):
  import flax.linen as nn

  model = nn.Dense(1, use_bias=False)
  x = jnp.full((2, 4), 300.0)  # fp16 activations 300 * 300: over 65504
  params = {"kernel": jnp.full((4, 1), 300.0)}
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.0),
      policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**4))

  def loss_fn(params, x):
    return jnp.mean(state.apply_fn({"params": params}, x) ** 2)

  recover = jaxmp.Recover(max_retries=2, fallback="float32")

  @jax.jit
  def step(state, x):
    if form == "recovering_train_step":
      return jaxmp.flax.recovering_train_step(
          lambda params, state, x: loss_fn(params, x), recover)(state, x)
    loss, grads, recovery = state.value_and_grad(loss_fn, recover=recover)(
        state.params, x)
    return state.apply_gradients(grads=grads, recovery=recovery), loss, recovery

  state, loss, recovery = step(state, x)
  assert bool(recovery.fell_back) and bool(recovery.finite)
  assert float(loss) == float(jnp.mean(model.apply({"params": params}, x) ** 2))
  assert int(state.metrics["fallback_steps"]) == 1
  assert int(state.metrics["lost_steps"]) == 0


def test_nnx_recovery_passes_through_the_optimizer_and_keeps_batch_stats_of_the_recovered_attempt():
  from flax import nnx

  model = nnx.Sequential(
      nnx.Linear(8, 8, dtype=F16, rngs=nnx.Rngs(0)),
      nnx.BatchNorm(8, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.sgd(1e-3), jaxmp.DynamicLossScale(2.0**10)),
      wrt=nnx.Param)
  x = jnp.full((4, 8), 4.0).at[0].set(8.0)  # fp16 kernel grads ~490 * scale

  @nnx.jit
  def step(model, optimizer, x):
    loss, grads, recovery = jaxmp.flax.nnx_scaled_value_and_grad(
        lambda m: jnp.sum(m(x) ** 2).astype(jnp.float32),
        jaxmp.get_loss_scale(optimizer.opt_state), recover=jaxmp.Recover(8))(model)
    optimizer.update(model, grads, recovery=recovery)
    return recovery, jaxmp.loss_scaling_metrics(optimizer.opt_state)

  recovery, metrics = step(model, optimizer, x)
  assert int(recovery.retries) == 3 and bool(recovery.finite)  # 2**10 -> 2**7
  assert int(metrics["recovered_steps"]) == 1 and int(metrics["lost_steps"]) == 0
  assert bool(jnp.all(jnp.isfinite(model.layers[1].mean[...])))
  assert not bool(jnp.all(model.layers[1].mean[...] == 0))  # written back


# -- The whole TrainState step in the loop (jaxmp.flax.recovering_train_step) ----


class FieldState(jaxmp.flax.TrainState):
  seen: Any  # a field written through apply_gradients, like batch_stats


def state_loss(params, state, x):  # aux: the new value of the field
  return overflowing_loss(params["w"], x), state.seen + x


def train_state(scale, loss_scale=jaxmp.DynamicLossScale):
  return FieldState.create(
      apply_fn=None, params={"w": W}, tx=optax.adam(1e-2), policy="mixed_float16",
      loss_scale=loss_scale(scale), seen=jnp.zeros(8))


@jax.jit
def plain_train_step(state, x):
  (loss, seen), grads = state.value_and_grad(state_loss, has_aux=True)(
      state.params, state, x)
  return state.apply_gradients(grads=grads, seen=seen), loss


def recovering_train_step(recover):
  return jax.jit(jaxmp.flax.recovering_train_step(
      state_loss, recover, has_aux=True, fields=lambda seen: {"seen": seen}))


def assert_states_equal(state, expected):
  chex.assert_trees_all_equal(
      (state.step, state.params, state.opt_state.inner_state, state.seen),
      (expected.step, expected.params, expected.opt_state.inner_state, expected.seen))


def test_train_state_recovering_step_applies_the_update_of_the_lower_scale():
  step = recovering_train_step(jaxmp.Recover(max_retries=4))
  state, (loss, _), recovery = step(train_state(2.0**15), OVERFLOWS)
  assert int(recovery.retries) == 2 and bool(recovery.finite)
  metrics = state.metrics
  assert int(metrics["recovered_steps"]) == 1
  assert int(metrics["skipped_steps"]) == int(metrics["lost_steps"]) == 0
  # The plain step run directly at 2**13: the same program, so the same bits,
  # the field written once and the step counted once.
  direct, direct_loss = plain_train_step(train_state(2.0**13), OVERFLOWS)
  assert_states_equal(state, direct)
  chex.assert_trees_all_equal(loss, direct_loss)
  assert state.loss_scale == direct.loss_scale
  assert int(state.step) == 1


def test_train_state_recovering_step_loses_a_nan_batch_with_every_field_bit_identical():
  state0, _ = plain_train_step(train_state(2.0**15), FINITE)
  step = recovering_train_step(jaxmp.Recover(max_retries=3, fallback="float32"))
  state, _, recovery = step(state0, FINITE.at[3].set(jnp.nan))
  assert int(recovery.retries) == 3 and bool(recovery.fell_back)
  assert not bool(recovery.finite)
  assert_states_equal(state, state0.replace(step=state0.step + 1))
  metrics = state.metrics
  assert int(metrics["lost_steps"]) == int(metrics["skipped_steps"]) == 1
  assert int(metrics["recovered_steps"]) == int(metrics["fallback_steps"]) == 0
  assert float(metrics["loss_scale"]) == 2.0**15 / 2**4


def test_train_state_recovering_step_when_finite_is_the_plain_step_without_retrace_or_transfer():
  recovering = jaxmp.flax.recovering_train_step(
      state_loss, jaxmp.Recover(max_retries=4, fallback="float32"), has_aux=True,
      fields=lambda seen: {"seen": seen})
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x):
    return recovering(state, x)

  state = plain = train_state(2.0**10)
  state, x = jax.device_put((state, FINITE))
  for _ in range(2):  # the second call neither retraces nor transfers
    with jax.transfer_guard("disallow"):
      state, (loss, _), recovery = step(state, x)
    plain, plain_loss = plain_train_step(plain, x)
    assert_states_equal(state, plain)
    chex.assert_trees_all_equal(loss, plain_loss)
    assert state.loss_scale == plain.loss_scale
  assert int(recovery.retries) == 0 and not bool(recovery.fell_back)
  assert int(state.metrics["recovered_steps"]) == 0


# -- Devices -------------------------------------------------------------------


def test_eight_devices_under_sharded_jit_agree_on_each_retry():
  assert jax.device_count() == 8
  mesh = jax.make_mesh((8,), ("batch",))
  sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  # Only the rows of device 5 overflow, and only above 2**13.
  x = jnp.broadcast_to(FINITE, (8, 8)).at[5].set(OVERFLOWS)
  w = jnp.broadcast_to(W, (8, 8))
  loss = overflowing_loss

  @jax.jit
  def grads_of(w, x):
    _, grads, recovery = jaxmp.scaled_value_and_grad(
        loss, jaxmp.DynamicLossScale(2.0**15), recover=jaxmp.Recover())(w, x)
    return grads, recovery

  grads, recovery = grads_of(jax.device_put(w, sharded), jax.device_put(x, sharded))
  assert int(recovery.retries) == 2 and bool(recovery.finite)
  # Every device recomputed at 2**13: its gradients are 6 cos(w x) 2**13.
  expected = jax.grad(lambda w, x: loss(w, x) * 2.0**13)(w, x)
  chex.assert_trees_all_equal(np.asarray(grads), np.asarray(expected))


def test_eight_devices_under_sharded_jit_agree_on_each_retry_of_the_whole_step():
  mesh = jax.make_mesh((8,), ("batch",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  # Only the rows of device 5 overflow, and only above 2**13.
  x = jax.device_put(jnp.broadcast_to(FINITE, (8, 8)).at[5].set(OVERFLOWS), rows)
  w = jax.device_put(jnp.broadcast_to(W, (8, 8)), rows)
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
  step = jax.jit(jaxmp.recovering_step(overflowing_loss, tx))
  new_w, state, _, recovery = step(w, tx.init(w), x)
  assert int(recovery.retries) == 2 and bool(recovery.finite)
  # Every device's rows were updated from gradients taken at 2**13.
  direct_tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**13))
  direct_w, direct_state, _, _ = make_step(direct_tx, None)(w, direct_tx.init(w), x)
  chex.assert_trees_all_equal(np.asarray(new_w), np.asarray(direct_w))
  assert jaxmp.get_loss_scale(state) == jaxmp.get_loss_scale(direct_state)


def test_axis_name_reduces_the_flag_over_shard_map():
  mesh = jax.make_mesh((8,), ("batch",))
  spec = jax.sharding.PartitionSpec("batch")
  sharded = jax.sharding.NamedSharding(mesh, spec)
  x = jax.device_put(jnp.broadcast_to(FINITE, (8, 8)).at[5].set(OVERFLOWS), sharded)
  w = jax.device_put(jnp.broadcast_to(W, (8, 8)), sharded)
  recover = jaxmp.Recover(axis_name="batch")

  def per_device(w, x):
    _, _, recovery = jaxmp.scaled_value_and_grad(
        overflowing_loss, jaxmp.DynamicLossScale(2.0**15), recover=recover)(w, x)
    return recovery.retries[None]

  retries = jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=(spec, spec), out_specs=spec))(w, x)
  # Device 5 needed two retries; the others, reduced with it, ran them too.
  np.testing.assert_array_equal(retries, np.full(8, 2, np.int32))


# -- The benchmark's compiler figures, reduced ------------------------------------


def _benchmark():
  return benchmark("recovery")


@pytest.mark.integration  # the benchmark's reduced transformer, compiled
@pytest.mark.standard_promotion(
    reason="the benchmark transformer is examples/train_lm.py's model, whose "
           "float16 attention meets Flax's float32 softmax (as in the demo)")
def test_a_finite_step_with_recovery_costs_within_half_a_percent_of_plain():
  # jaxmp.recovering_step against plain scaled_value_and_grad, on the
  # benchmark transformer, reduced; the compiler's figures are exact. (The
  # retries inside the gradients cost far more: docs/benchmarks.md.)
  recovery = _benchmark()
  args = recovery.build_parser().parse_args(
      ["--d-model", "32", "--layers", "1", "--seq-len", "16", "--batch-size", "2"])
  loss16, loss32, params = recovery.loss_fns(args)
  steps, tx = recovery.make_steps(loss16, loss32)
  batch = jnp.zeros((2, 17), jnp.int32)
  state = (params, tx.init(params))
  figures = recovery.compile_figures(
      {k: steps[k] for k in ("plain", "recovering_step")}, state, batch, timed=False)
  for key in ("bytes_accessed", "temp_bytes", "peak_live_bytes"):
    assert figures["recovering_step"][key] <= 1.005 * figures["plain"][key], key


@pytest.mark.integration  # the benchmark's reduced transformer, compiled
@pytest.mark.standard_promotion(
    reason="the benchmark transformer is examples/train_lm.py's model, whose "
           "float16 attention meets Flax's float32 softmax (as in the demo)")
# The benchmark's model declares its layers' dtypes, which the audit of
# TrainState.value_and_grad reports; both steps run the same model.
@pytest.mark.filterwarnings("ignore::jaxmp.PrecisionWarning")
def test_a_finite_train_state_recovering_step_costs_within_half_a_percent_of_plain():
  # jaxmp.flax.recovering_train_step against the plain TrainState step
  # (value_and_grad, apply_gradients) on the same reduced transformer.
  recovery = _benchmark()
  args = recovery.build_parser().parse_args(
      ["--d-model", "32", "--layers", "1", "--seq-len", "16", "--batch-size", "2"])
  loss16, _, params = recovery.loss_fns(args)
  loss_fn = lambda params, state, batch: loss16(params, batch)
  state = jaxmp.flax.TrainState.create(
      apply_fn=None, params=params, tx=optax.adamw(1e-3), policy="mixed_float16",
      loss_scale=jaxmp.DynamicLossScale(recovery.INITIAL_SCALE))
  recovering = jaxmp.flax.recovering_train_step(
      loss_fn, jaxmp.Recover(max_retries=recovery.MAX_RETRIES))

  def plain(state, batch):
    loss, grads = state.value_and_grad(loss_fn)(state.params, state, batch)
    return state.apply_gradients(grads=grads), loss

  steps = {"plain": plain, "recovering": lambda state, batch: recovering(state, batch)[:2]}
  figures = recovery.compile_figures(steps, state, jnp.zeros((2, 17), jnp.int32),
                                     timed=False)
  for key in ("bytes_accessed", "temp_bytes", "peak_live_bytes"):
    assert figures["recovering"][key] <= 1.005 * figures["plain"][key], key


def test_the_peak_counts_a_buffer_shared_by_two_values_once():
  buffers = """allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:
 value: <1 p @0> (size=8,offset=0): f32[2]{0}
 value: <2 while.1{0} (phi) @0> (size=8,offset=0): f32[2]{0}
allocation 1: size 12, preallocated-temp:
 value: <3 t @0> (size=4,offset=0): f32[]
 value: <4 u @0> (size=4,offset=8): f32[]
"""
  # p hands over to the loop's value at 3, where both are listed; t and u
  # overlap at 5; t's buffer is live again from 7.
  ranges = """BufferLiveRange:
    p{}:0-3
    while.1{0}:3-9
    t{}:2-5
    u{}:5-6
    t{}:7-8
  Live ranges at 3 (peak):
"""
  assert _benchmark().distinct_peak(ranges, buffers) == 8 + 4 + 4


# -- The whole NNX step in the loop (jaxmp.flax.nnx_recovering_step) -------------


def nnx_model_and_optimizer(scale):
  from flax import nnx

  model = nnx.Sequential(
      nnx.Linear(8, 8, dtype=F16, rngs=nnx.Rngs(0)),
      nnx.BatchNorm(8, dtype=jnp.float32, rngs=nnx.Rngs(0)))
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(scale)),
      wrt=nnx.Param)
  return model, optimizer


def nnx_loss(model, x):  # fp16 kernel grads ~490 * scale with NNX_OVERFLOWS
  return jnp.sum(model(x) ** 2).astype(jnp.float32)


NNX_OVERFLOWS = jnp.full((4, 8), 4.0).at[0].set(8.0)  # finite from 2**7 down


def plain_nnx_step():
  from flax import nnx

  @nnx.jit
  def step(model, optimizer, x):
    with jaxmp.flax.nnx_keep_on_skip(model, optimizer):
      loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
          nnx_loss, jaxmp.get_loss_scale(optimizer.opt_state))(model, x)
      optimizer.update(model, grads)
    return loss
  return step


def nnx_snapshot(model, optimizer):
  """Copies of every variable of the model and of the optimizer, as arrays."""
  from flax import nnx

  return jax.tree_util.tree_map(
      np.asarray, nnx.as_pure((nnx.state(model), nnx.state(optimizer))))


def test_nnx_recovering_step_applies_the_update_of_the_lower_scale():
  from flax import nnx

  model, optimizer = nnx_model_and_optimizer(2.0**10)
  step = nnx.jit(jaxmp.flax.nnx_recovering_step(nnx_loss, jaxmp.Recover(8)))
  loss, recovery = step(model, optimizer, NNX_OVERFLOWS)
  assert int(recovery.retries) == 3 and bool(recovery.finite)  # 2**10 -> 2**7
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["recovered_steps"]) == 1
  assert int(metrics["skipped_steps"]) == int(metrics["lost_steps"]) == 0
  assert int(metrics["fallback_steps"]) == 0
  # The plain NNX step run directly at 2**7: the same program, so the same
  # bits, the BatchNorm statistics written once and the step counted once.
  direct_model, direct_optimizer = nnx_model_and_optimizer(2.0**7)
  direct_loss = plain_nnx_step()(direct_model, direct_optimizer, NNX_OVERFLOWS)
  (variables, opt), (direct_variables, direct_opt) = (
      nnx_snapshot(model, optimizer), nnx_snapshot(direct_model, direct_optimizer))
  chex.assert_trees_all_equal(variables, direct_variables)
  chex.assert_trees_all_equal(
      (opt["step"], opt["opt_state"].inner_state),
      (direct_opt["step"], direct_opt["opt_state"].inner_state))
  chex.assert_trees_all_equal(loss, direct_loss)
  # The loss scale continues as if the overflows had been steps of their own.
  assert jaxmp.get_loss_scale(optimizer.opt_state) == jaxmp.get_loss_scale(
      direct_optimizer.opt_state)
  assert int(optimizer.step[...]) == 1
  assert not bool(jnp.all(model.layers[1].mean[...] == 0))


def test_nnx_recovering_step_loses_a_nan_batch_with_the_model_and_optimizer_bit_identical():
  from flax import nnx

  model, optimizer = nnx_model_and_optimizer(2.0**7)
  plain_nnx_step()(model, optimizer, NNX_OVERFLOWS)  # finite at 2**7: all set
  before = nnx_snapshot(model, optimizer)
  step = nnx.jit(jaxmp.flax.nnx_recovering_step(
      nnx_loss, jaxmp.Recover(max_retries=3, fallback=nnx_loss)))
  _, recovery = step(model, optimizer, NNX_OVERFLOWS.at[1, 3].set(jnp.nan))
  assert int(recovery.retries) == 3 and bool(recovery.fell_back)
  assert not bool(recovery.finite)
  # Params, moments and BatchNorm statistics as they were; the step counted.
  after = nnx_snapshot(model, optimizer)
  chex.assert_trees_all_equal(after[0], before[0])
  chex.assert_trees_all_equal(after[1]["opt_state"].inner_state,
                              before[1]["opt_state"].inner_state)
  assert int(optimizer.step[...]) == 2
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["lost_steps"]) == int(metrics["skipped_steps"]) == 1
  assert int(metrics["recovered_steps"]) == int(metrics["fallback_steps"]) == 0
  # One backoff per attempt in float16 (the first and three retries).
  assert float(metrics["loss_scale"]) == 2.0**7 / 2**4


def test_nnx_recovering_step_falls_back_and_returns_the_aux_of_the_applied_attempt():
  # fp16 overflows in the forward pass (x = 2**16 > 65504): no scale helps;
  # the fallback computes the same model in float32.
  from flax import nnx

  model = nnx.Linear(8, 1, use_bias=False, dtype=F16, rngs=nnx.Rngs(0))
  kernel = model.kernel[...]
  optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
      optax.sgd(2.0**-20), jaxmp.DynamicLossScale(2.0**3, min_loss_scale=1.0)),
      wrt=nnx.Param)
  # aux: 0 from the float16 loss, 1 from the float32 fallback.
  loss16 = lambda model, x: (jnp.sum(model(x)).astype(jnp.float32), jnp.zeros([]))
  loss32 = lambda model, x: (jnp.sum(x @ model.kernel[...]), jnp.ones([]))
  step = nnx.jit(jaxmp.flax.nnx_recovering_step(
      loss16, jaxmp.Recover(max_retries=6, fallback=loss32), has_aux=True))
  x = jnp.full((2, 8), 2.0**16)
  (loss, aux), recovery = step(model, optimizer, x)
  assert bool(recovery.fell_back) and bool(recovery.finite)
  assert int(recovery.retries) == 6
  assert float(aux) == 1.0  # the aux of the attempt applied: the fallback's
  assert float(loss) == float(jnp.sum(x @ kernel))
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["fallback_steps"]) == int(metrics["recovered_steps"]) == 1
  assert int(metrics["lost_steps"]) == 0
  # The float32 update, unscaled by 1: kernel - 2**-20 * (2 * 2**16).
  np.testing.assert_array_equal(model.kernel[...], kernel - 2.0**-3)
  assert int(optimizer.step[...]) == 1


@pytest.mark.parametrize("fallback", (None, nnx_loss), ids=("retries", "fallback"))
def test_nnx_recovering_step_when_finite_is_the_plain_step_without_retrace_or_transfer(
    fallback):
  from flax import nnx

  recovering = jaxmp.flax.nnx_recovering_step(
      nnx_loss, jaxmp.Recover(max_retries=4, fallback=fallback))
  chex.clear_trace_counter()  # counted per test, not across its parameters

  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(model, optimizer, x):
    return recovering(model, optimizer, x)

  model, optimizer = nnx_model_and_optimizer(2.0**7)
  plain_model, plain_optimizer = nnx_model_and_optimizer(2.0**7)
  plain = plain_nnx_step()
  x = jax.device_put(NNX_OVERFLOWS)  # finite at 2**7
  for _ in range(2):  # the second call neither retraces nor transfers
    with jax.transfer_guard("disallow"):
      loss, recovery = step(model, optimizer, x)
    plain_loss = plain(plain_model, plain_optimizer, x)
    chex.assert_trees_all_equal(loss, plain_loss)
    got = nnx_snapshot(model, optimizer)
    expected = nnx_snapshot(plain_model, plain_optimizer)
    if fallback is None:
      chex.assert_trees_all_equal(got, expected)
    else:
      # With a fallback the forward pass runs in a lax.cond branch, which XLA
      # fuses on its own: the running statistics' float32 update may differ
      # in the last bit. The params and the optimizer state do not.
      chex.assert_trees_all_equal(
          nnx.state(model, nnx.Param), nnx.state(plain_model, nnx.Param))
      chex.assert_trees_all_equal(got[1], expected[1])
      chex.assert_trees_all_close(got[0], expected[0], rtol=1e-6, atol=0)
  assert int(recovery.retries) == 0 and not bool(recovery.fell_back)
  metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
  assert int(metrics["recovered_steps"]) == int(metrics["skipped_steps"]) == 0


def test_a_finite_nnx_recovering_step_costs_within_half_a_percent_of_plain():
  # jaxmp.flax.nnx_recovering_step against the plain NNX step
  # (nnx_scaled_value_and_grad, optimizer.update, nnx_keep_on_skip) on a
  # small float16 MLP with BatchNorm; the compiler's figures are exact.
  from flax import nnx

  model = nnx.Sequential(
      nnx.Linear(64, 256, dtype=F16, rngs=nnx.Rngs(0)),
      nnx.BatchNorm(256, dtype=jnp.float32, rngs=nnx.Rngs(0)), nnx.relu,
      nnx.Linear(256, 64, dtype=F16, rngs=nnx.Rngs(1)))
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adamw(1e-3), jaxmp.DynamicLossScale(2.0**7)),
      wrt=nnx.Param)
  loss_fn = lambda model, x: jnp.mean(model(x).astype(jnp.float32) ** 2)
  recovering = jaxmp.flax.nnx_recovering_step(loss_fn)

  def plain(model, optimizer, x):
    with jaxmp.flax.nnx_keep_on_skip(model, optimizer):
      loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
          loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model, x)
      optimizer.update(model, grads)
    return loss

  graphdef, state = nnx.split((model, optimizer))

  def on_the_state(step):  # (state, batch) -> (state, loss), as the benchmark takes
    def functional(state, x):
      model, optimizer = nnx.merge(graphdef, state)
      out = step(model, optimizer, x)
      return nnx.state((model, optimizer)), out
    return functional

  steps = {"plain": on_the_state(plain),
           "recovering": on_the_state(lambda *a: recovering(*a)[0])}
  figures = _benchmark().compile_figures(steps, state, jnp.ones((32, 64), F16),
                                         timed=False)
  for key in ("bytes_accessed", "temp_bytes", "peak_live_bytes"):
    assert figures["recovering"][key] <= 1.005 * figures["plain"][key], key


def test_eight_devices_under_sharded_jit_agree_on_each_retry_of_the_nnx_step():
  from flax import nnx

  mesh = jax.make_mesh((8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  # One row per device; device 5's row stands out (with all rows equal the
  # BatchNorm output, and the gradients, would vanish).
  x = jax.device_put(jnp.full((8, 8), 4.0).at[5].set(8.0), rows)
  model, optimizer = nnx_model_and_optimizer(2.0**10)
  step = nnx.jit(jaxmp.flax.nnx_recovering_step(nnx_loss, jaxmp.Recover(8)))
  _, recovery = step(model, optimizer, x)
  retries = int(recovery.retries)
  assert retries == 6 and bool(recovery.finite)  # 2**10 -> 2**4
  # Every device's rows were used at the one scale they agreed on.
  direct_model, direct_optimizer = nnx_model_and_optimizer(2.0**(10 - retries))
  plain_nnx_step()(direct_model, direct_optimizer, x)
  chex.assert_trees_all_equal(
      jax.tree_util.tree_map(np.asarray, nnx.state(model, nnx.Param)),
      jax.tree_util.tree_map(np.asarray, nnx.state(direct_model, nnx.Param)))
  assert jaxmp.get_loss_scale(optimizer.opt_state) == jaxmp.get_loss_scale(
      direct_optimizer.opt_state)
