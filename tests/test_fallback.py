"""Falling back to a wider policy: the controller, the switch, promotion.

Level 2 (``jaxmp.PrecisionFallback``, ``jaxmp.switch_precision``): the switch
keeps params and optimizer state bit-identical, compiles the step once more
and never again, is logged and recorded, survives a checkpoint, and works
for a plain optax loop, a ``jaxmp.flax.TrainState`` and NNX. Level 3
(``jaxmp.flax.find_overflowing_modules``): on a model in which exactly one
module overflows in float16, that module alone is promoted, and training then
skips no step.
"""

import dataclasses
import functools
import logging
import pathlib
import subprocess
import sys

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

LADDER = ("mixed_float16", "float32")
X = jnp.ones((4, 2))
Y = jnp.zeros((4, 3))


def _same_arrays(a, b):
  """Bit-identical: same structure, dtypes and bits (nan included)."""
  chex.assert_trees_all_equal_structs(a, b)
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape
    assert x.tobytes() == y.tobytes()


def _overflowing_opt_state(steps=2):
  """An adam state whose dynamic scale reached its floor; the last step overflowed there."""
  tx = jaxmp.loss_scaling(optax.adam(0.1),
                          jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
  params = {"w": jnp.arange(3.0), "b": jnp.ones(1)}
  state = tx.init(params)
  finite = {"w": jnp.ones(3), "b": jnp.ones(1)}
  _, state = tx.update(finite, state, params)  # moments and count move
  for _ in range(steps):
    _, state = tx.update(jax.tree_util.tree_map(lambda g: g * jnp.inf, finite),
                         state, params)
  return tx, params, state


# -- Three frameworks -----------------------------------------------------------
# A plain optax loop holds (params, opt_state); a jaxmp.flax.TrainState holds
# its policy; an nnx.Optimizer is switched in place with its model.

FRAMEWORKS = ("optax", "train_state", "nnx")


def _overflowed(framework):
  """A training state whose dynamic scale reached its floor, and its NNX model.

  One finite step moved the moments, then two steps overflowed (the last one
  at the minimum scale). The model is ``None`` but for NNX.
  """
  if framework == "optax":
    _, params, opt_state = _overflowing_opt_state()
    return (params, opt_state), None
  loss_scale = jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0)
  inf = lambda tree: jax.tree_util.tree_map(lambda g: g * jnp.inf, tree)
  if framework == "train_state":
    state = _train_state(loss_scale=loss_scale)
    ones = jax.tree_util.tree_map(jnp.ones_like, state.params)
    for grads in (ones, inf(ones), inf(ones)):
      state = state.apply_gradients(grads=grads)
    return state, None
  model, optimizer, _, _ = _nnx_run(loss_scale=loss_scale)
  ones = jax.tree_util.tree_map(jnp.ones_like, nnx.state(model, nnx.Param))
  for grads in (ones, inf(ones), inf(ones)):
    optimizer.update(model, grads)
  return optimizer, model


def _opt_state(target):
  return target[1] if isinstance(target, tuple) else target.opt_state


def _kept(target, model):
  """What a switch keeps bit-identical: the params, inner optimizer state, step."""
  params = (nnx.state(model, nnx.Param) if model is not None
            else target[0] if isinstance(target, tuple) else target.params)
  return jax.tree_util.tree_map(jnp.copy, (
      params, _opt_state(target).inner_state, getattr(target, "step", None)))


# -- The switch itself ----------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_switch_keeps_the_optimizer_state_and_counters_bit_identical(framework):
  target, model = _overflowed(framework)
  opt_state, kept = _opt_state(target), _kept(target, model)
  switched = jaxmp.switch_precision(target, "float32", model=model)
  new = _opt_state(switched)
  assert jaxmp.get_loss_scale(new) == jaxmp.NoOpLossScale()
  assert new.inner_state is opt_state.inner_state  # not even a copy
  _same_arrays(_kept(switched, model), kept)
  before, after = jaxmp.loss_scaling_metrics(opt_state), jaxmp.loss_scaling_metrics(new)
  assert int(after["skipped_steps"]) == int(before["skipped_steps"]) == 2
  assert int(after["overflows_at_min"]) == 0  # a no-op scale has no floor


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_switch_to_a_float16_policy_keeps_the_dynamic_scale(framework):
  target, model = _overflowed(framework)
  opt_state = _opt_state(target)
  switched = jaxmp.switch_precision(
      target, jaxmp.get_policy("mixed_float16").with_output_dtype(jnp.float16),
      model=model)
  assert _opt_state(switched) is opt_state  # nothing to change: the scale stays


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_second_switch_to_the_same_policy_changes_nothing(framework):
  once, model = _overflowed(framework)
  once = jaxmp.switch_precision(once, "float32", model=model)
  kept = [_opt_state(once), getattr(once, "tx", None), getattr(once, "apply_fn", None)]
  again = jaxmp.switch_precision(once, "float32", model=model)
  assert _opt_state(again) is kept[0] and getattr(again, "tx", None) is kept[1]
  assert getattr(again, "apply_fn", None) == kept[2]


@pytest.mark.parametrize("framework", ["train_state", "nnx"])  # they hold the tx
def test_an_optimizer_built_afresh_after_a_switch_has_the_switched_structure(framework):
  target, model = _overflowed(framework)
  switched = jaxmp.switch_precision(target, "float32", model=model)
  fresh = (switched.tx.init(switched.params) if model is None
           else nnx.Optimizer(model, switched.tx, wrt=nnx.Param).opt_state)
  assert (jax.tree_util.tree_structure(fresh)
          == jax.tree_util.tree_structure(switched.opt_state))
  assert jaxmp.get_loss_scale(fresh) == jaxmp.NoOpLossScale()


def test_switching_an_nnx_optimizer_needs_no_import_of_jaxmp_flax():
  # No registry that an import fills: `import jaxmp` alone switches NNX.
  code = """if True:
    import sys
    import jax.numpy as jnp, optax
    from flax import nnx
    import jaxmp
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0), dtype=jnp.float16)
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
        optax.sgd(0.1), jaxmp.DynamicLossScale()), wrt=nnx.Param)
    assert jaxmp.switch_precision(optimizer, "float32", model=model) is optimizer
    assert model.dtype == jnp.float32
    assert jaxmp.get_loss_scale(optimizer.opt_state) == jaxmp.NoOpLossScale()
    assert "jaxmp.flax" not in sys.modules
  """
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 cwd=pathlib.Path(__file__).resolve().parent.parent)


# -- The controller -------------------------------------------------------------


def test_the_controller_switches_on_overflows_at_the_minimum_scale(caplog):
  tx = jaxmp.loss_scaling(optax.sgd(0.1),
                          jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0))
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  policies = []
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    for step in range(1, 7):
      _, opt_state = tx.update({"w": jnp.full(2, jnp.inf)}, opt_state, params)
      opt_state, policy = fallback.update(opt_state, step=step)
      policies.append(str(policy))
  # 4 -> 2 -> 1, then the third overflow finds the scale at its floor.
  assert policies == ["p=f32,c=f16,o=f32"] * 2 + ["p=f32,c=f32,o=f32"] * 4
  assert [event._asdict() for event in fallback.events] == [dict(
      step=3, reason="1 overflow(s) at the minimum loss scale 1",
      old_policy="p=f32,c=f16,o=f32", new_policy="p=f32,c=f32,o=f32")]
  assert fallback.policy == jaxmp.get_policy("float32") and fallback.rung == 1
  assert fallback.next_policy is None
  (record,) = [r for r in caplog.records if "switching" in r.getMessage()]
  assert record.levelno == logging.WARNING
  assert record.getMessage() == (
      "jaxmp: step 3: switching from p=f32,c=f16,o=f32 to p=f32,c=f32,o=f32: "
      "1 overflow(s) at the minimum loss scale 1.")
  # In float32 the nan steps are still skipped, but they are not fp16's fault.
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 6


def test_the_controller_reads_the_metrics_only_every_n_steps():
  _, _, state = _overflowing_opt_state()
  fallback = jaxmp.PrecisionFallback(LADDER, every=5)
  for step in (1, 2, 3, 4):
    assert fallback.check(state, step=step) is None
  assert fallback.monitor.records == []
  assert fallback.check(state, step=5) == "1 overflow(s) at the minimum loss scale 1"
  assert [r.step for r in fallback.monitor.records] == [5]


def test_a_tolerated_overflow_at_the_minimum_does_not_switch():
  _, _, state = _overflowing_opt_state(steps=2)
  fallback = jaxmp.PrecisionFallback(LADDER, every=1, max_overflows_at_min=1)
  assert fallback.check(state, step=1) is None
  _, _, state = _overflowing_opt_state(steps=3)
  assert fallback.check(state, step=2) == "2 overflow(s) at the minimum loss scale 1"


def test_the_controller_switches_on_the_overflow_rate_after_a_whole_window():
  # A static scale never reaches a floor: only the rate says float16 fails.
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(2.0**10))
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  fallback = jaxmp.PrecisionFallback(LADDER, every=2, window=8,
                                     max_overflow_rate=0.25)
  switched_at = None
  for step in range(1, 17):
    grad = jnp.inf if step % 2 else 1.0  # half the steps overflow
    _, opt_state = tx.update({"w": jnp.full(2, grad)}, opt_state, params)
    opt_state, policy = fallback.update(opt_state, step=step)
    if switched_at is None and policy == jaxmp.get_policy("float32"):
      switched_at = step
  # The first look (step 2) starts the window; a whole one has passed at 10.
  assert switched_at == 10
  assert fallback.events[0].reason == (
      "50% of the last 8 steps were skipped (loss scale 1024)")


def test_the_overflow_rate_of_the_new_policy_is_measured_from_the_switch():
  fallback = jaxmp.PrecisionFallback(("mixed_float16", "float32"), every=1,
                                     window=4, max_overflow_rate=0.5)
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(2.0))
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  for step in range(1, 6):  # every step overflows: switch at step 5
    _, opt_state = tx.update({"w": jnp.full(2, jnp.inf)}, opt_state, params)
    opt_state, _ = fallback.update(opt_state, step=step)
  assert [e.step for e in fallback.events] == [5]
  for step in range(6, 12):  # finite steps in float32: no rate from before
    _, opt_state = tx.update({"w": jnp.ones(2)}, opt_state, params)
    assert fallback.check(opt_state, step=step) is None


def test_raise_mode_raises_check_loss_scales_error():
  _, _, state = _overflowing_opt_state()
  fallback = jaxmp.PrecisionFallback(LADDER, every=1, on_failure="raise")
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as raised:
    fallback.update(state, step=1)
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as expected:
    jaxmp.check_loss_scale(state)
  assert str(raised.value) == str(expected.value)
  assert fallback.events == [] and fallback.policy == jaxmp.get_policy(LADDER[0])


def test_raise_mode_with_a_single_rung():
  _, _, state = _overflowing_opt_state()
  fallback = jaxmp.PrecisionFallback(("mixed_float16",), every=1, on_failure="raise")
  with pytest.raises(jaxmp.LossScaleAtMinimumError,
                     match="Current loss scale already at minimum"):
    fallback.update(state, step=1)


def test_a_healthy_run_is_returned_as_it_is():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
  params = {"w": jnp.ones(2)}
  opt_state = tx.init(params)
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  for step in range(1, 4):
    _, opt_state = tx.update({"w": jnp.ones(2)}, opt_state, params)
    returned, policy = fallback.update(opt_state, step=step)
    assert returned is opt_state and policy is fallback.ladder[0]
  assert fallback.events == []


def test_bfloat16_rungs_on_hardware_that_runs_bfloat16():
  report = dataclasses.replace(jaxmp.hardware_report(), platform="tpu",
                               native_bfloat16=True)
  fallback = jaxmp.PrecisionFallback(
      ("mixed_float16", "mixed_bfloat16", "float32"), hardware=report)
  assert [str(p) for p in fallback.ladder] == [
      "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32", "p=f32,c=f32,o=f32"]
  assert jaxmp.PrecisionFallback(hardware=report).ladder == (
      jaxmp.get_policy("mixed_float16"), jaxmp.get_policy("mixed_bfloat16"))


def test_the_default_ladder_on_this_cpu_falls_back_to_float32():
  assert not jaxmp.hardware_report().native_bfloat16
  assert jaxmp.PrecisionFallback().ladder == (
      jaxmp.get_policy("mixed_float16"), jaxmp.get_policy("float32"))


# -- A TrainState ---------------------------------------------------------------


class Spike(nn.Module):
  """A tiny model whose float16 forward pass overflows on large inputs."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(3)(x)


def _train_state(tx=None, loss_scale=None):
  model = Spike()
  params = model.init(jax.random.key(0), X)["params"]
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx or optax.adam(1e-2),
      policy="mixed_float16",
      loss_scale=loss_scale or jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0))


def _counted_step():
  traces = []

  @jax.jit
  def step(state, x, y):
    traces.append(None)

    def loss_fn(params, x, y):
      return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
    return state.apply_gradients(grads=grads), loss

  return step, traces


def _run_with_a_spike(state, fallback, steps=8, spike=4):
  """Steps with inputs that overflow float16 for the first ``spike`` steps."""
  step, traces = _counted_step()
  kept = {}
  for i in range(steps):
    state, _ = step(state, X * (1e5 if i < spike else 1.0), Y)
    before = state
    state = fallback.update(state)
    if state is not before:
      kept["before"], kept["after"] = before, state
  return state, traces, kept


def test_train_state_switch_rewraps_apply_fn_with_the_new_policy():
  state = jaxmp.switch_precision(_train_state(), "float32")

  def dot_dtypes(state):
    jaxpr = jax.make_jaxpr(state.apply_fn)({"params": state.params}, X)
    return [tuple(str(v.aval.dtype) for v in e.invars)
            for e in jaxpr.eqns if e.primitive.name == "dot_general"]

  assert dot_dtypes(_train_state()) == [("float16", "float16")]
  assert dot_dtypes(state) == [("float32", "float32")]


# -- NNX ------------------------------------------------------------------------


class NnxHead(nnx.Module):

  def __init__(self, rngs, head_scale=1.0):
    self.body = nnx.Linear(2, 4, rngs=rngs)
    self.head = nnx.Linear(4, 3, rngs=rngs,
                           kernel_init=nnx.initializers.constant(head_scale))

  def __call__(self, x):
    return self.head(self.body(x))


def _nnx_run(head_scale=1.0, loss_scale=None):
  model = NnxHead(nnx.Rngs(0), head_scale)
  jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(1e-3), loss_scale or jaxmp.DynamicLossScale(
          4.0, min_loss_scale=1.0)), wrt=nnx.Param)
  traces = []

  @nnx.jit
  def step(model, optimizer, x):
    traces.append(None)
    loss, grads = jaxmp.scaled_value_and_grad(
        lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2),
        jaxmp.get_loss_scale(optimizer.opt_state),
        value_and_grad=nnx.value_and_grad)(model)
    optimizer.update(model, grads)
    return loss

  return model, optimizer, step, traces


# -- A run that switches -------------------------------------------------------


def _optax_run():
  model = Spike()
  params = model.init(jax.random.key(0), X)["params"]
  tx = jaxmp.loss_scaling(optax.adam(1e-2),
                          jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0))
  traces = []

  @functools.partial(jax.jit, static_argnames="policy")
  def step(target, x, policy):
    traces.append(policy)
    params, opt_state = target

    def loss_fn(params):
      out = model.apply({"params": policy.cast_to_compute(params)},
                        policy.cast_to_compute(x))
      return jnp.mean((policy.cast_to_output(out) - Y) ** 2)

    _, grads = jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return (params, tx.init(params)), None, step, traces


def _run(framework):
  """``(target, model, step, traces)`` of a run that starts in mixed_float16.

  ``step(target, x, policy)`` returns the target after one update.
  """
  if framework == "optax":
    return _optax_run()
  if framework == "train_state":
    step, traces = _counted_step()
    return _train_state(), None, lambda state, x, _: step(state, x, Y)[0], traces
  model, optimizer, step, traces = _nnx_run()

  def nnx_step(optimizer, x, _):
    step(model, optimizer, x)  # in place
    return optimizer

  return optimizer, model, nnx_step, traces


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_switches_once_compiles_once_more_and_keeps_params_and_moments(
    framework):
  target, model, step, traces = _run(framework)
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  policy = fallback.policy
  for i in range(1, 9):
    target = step(target, X * (1e5 if i <= 4 else 1.0), policy)
    kept = _kept(target, model)
    if framework == "optax":  # the policy goes to the step, a static argument
      target, policy = fallback.update(target, step=i)
    else:  # the target holds the policy (the model its dtypes) and the step
      target = fallback.update(target, model=model)
    if fallback.events and fallback.events[-1].step == i:
      _same_arrays(_kept(target, model), kept)
  assert len(traces) == 2  # the float16 step and the float32 step, once each
  assert [e.step for e in fallback.events] == [3]
  assert jaxmp.get_loss_scale(_opt_state(target)) == jaxmp.NoOpLossScale()
  # The fourth large batch, which float16 could not represent, trains in
  # float32: three steps were skipped, not four.
  metrics = jaxmp.loss_scaling_metrics(_opt_state(target))
  assert int(metrics["skipped_steps"]) == 3 and bool(metrics["last_finite"])
  float32 = jaxmp.get_policy("float32")
  if framework == "optax":
    assert traces == [jaxmp.get_policy("mixed_float16"), float32]
  elif framework == "train_state":
    assert target.policy == float32
  else:
    assert model.head.dtype == model.body.dtype == jnp.float32


# -- Checkpoints ----------------------------------------------------------------


def test_train_state_checkpoint_after_the_switch_resumes_in_the_new_policy(tmp_path):
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  state, _, _ = _run_with_a_spike(_train_state(), fallback, steps=6)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state, fallback=fallback)

  resumed = jaxmp.PrecisionFallback(LADDER, every=1)  # a new process
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", _train_state(),
                                           fallback=resumed)
  assert restored.policy == jaxmp.get_policy("float32")
  assert restored.loss_scale == jaxmp.NoOpLossScale()
  _same_arrays(restored.params, state.params)
  _same_arrays(restored.opt_state, state.opt_state)
  assert int(restored.step) == int(state.step) == 6
  assert resumed.events == fallback.events and resumed.rung == 1
  assert resumed.policy == fallback.policy
  # The restored state steps in float32 (a fresh jit: one trace).
  step, traces = _counted_step()
  restored, _ = step(restored, X, Y)
  assert len(traces) == 1 and bool(restored.metrics["last_finite"])


def test_an_abstract_target_follows_the_switch_too(tmp_path):
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  state, _, _ = _run_with_a_spike(_train_state(), fallback, steps=5)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state, fallback=fallback)
  restored = jaxmp.flax.restore_checkpoint(
      tmp_path / "ckpt", jax.eval_shape(_train_state),
      fallback=jaxmp.PrecisionFallback(LADDER))
  assert restored.policy == jaxmp.get_policy("float32")
  _same_arrays(restored.opt_state, state.opt_state)


def test_optax_state_checkpoint_records_the_policy(tmp_path):
  _, _, state = _overflowing_opt_state()
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  state, policy = fallback.update(state, step=1)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state, fallback=fallback)
  resumed = jaxmp.PrecisionFallback(LADDER)
  target = _overflowing_opt_state(steps=0)[2]  # built in float16, as at the start
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", target,
                                           fallback=resumed)
  _same_arrays(restored, state)
  assert resumed.policy == policy == jaxmp.get_policy("float32")


def test_nnx_checkpoint_resumes_model_dtypes_and_optimizer(tmp_path):
  model, optimizer, step, _ = _nnx_run()
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  for i in range(4):
    step(model, optimizer, X * 1e5)
    fallback.update(optimizer, model=model)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", (model, optimizer), fallback=fallback)
  model2, optimizer2, _, _ = _nnx_run()
  resumed = jaxmp.PrecisionFallback(LADDER)
  jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", (model2, optimizer2),
                                fallback=resumed)
  assert model2.head.dtype == jnp.float32
  assert jaxmp.get_loss_scale(optimizer2.opt_state) == jaxmp.NoOpLossScale()
  _same_arrays(nnx.state(model2, nnx.Param), nnx.state(model, nnx.Param))
  _same_arrays(nnx.state(optimizer2), nnx.state(optimizer))
  assert resumed.events == fallback.events


def test_a_checkpoint_before_any_switch_restores_in_the_first_policy(tmp_path):
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  state = _train_state()
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", state, fallback=fallback)
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", _train_state(),
                                           fallback=jaxmp.PrecisionFallback(LADDER))
  assert restored.policy == jaxmp.get_policy("mixed_float16")
  _same_arrays(restored.opt_state, state.opt_state)


# -- Promotion: the module that overflows ---------------------------------------


def _wide_projection(key, shape, dtype=jnp.float32):
  """Each output is about 1000 times the sum of its inputs (a class-wise tilt)."""
  del key
  tilt = 1.0 + 0.01 * jnp.arange(shape[1], dtype=dtype)
  return 1e3 * jnp.ones(shape, dtype) * tilt


class OneBadModule(nn.Module):
  """Everything is tame except ``head``, an unnormalised projection.

  ``head`` sums 512 positive activations with weights near 1000: its logits
  (about 2e5) exceed float16's 65504 at any loss scale. The cotangents it
  sends back (softmax minus one-hot, through kernel columns that differ by
  1%) stay small, so in float32 it trains the rest in float16 without an
  overflow.
  """

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="norm")(x)
    h = nn.relu(nn.Dense(512, name="body")(h))
    return nn.Dense(8, name="head", kernel_init=_wide_projection)(h)


def _classifier_state():
  model = OneBadModule()
  x = jax.random.normal(jax.random.key(1), (8, 4))
  labels = jnp.arange(8) % 8
  params = model.init(jax.random.key(0), x)["params"]
  state = jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-4),
      policy="mixed_float16",
      loss_scale=jaxmp.DynamicLossScale(2.0**3, min_loss_scale=1.0))
  return state, x, labels


@jax.jit
def _classifier_step(state, x, labels):
  def loss_fn(params, x, labels):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()

  loss, grads = state.value_and_grad(loss_fn)(state.params, x, labels)
  return state.apply_gradients(grads=grads), grads


def test_only_the_overflowing_module_is_promoted_and_training_then_skips_nothing():
  state, x, labels = _classifier_state()
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  reason = None
  for _ in range(6):  # 8 -> 4 -> 2 -> 1, then an overflow at the floor
    state, grads = _classifier_step(state, x, labels)
    reason = fallback.check(state)
    if reason:
      break
  assert reason == "1 overflow(s) at the minimum loss scale 1"
  report = jaxmp.flax.find_overflowing_modules(
      state.apply_fn, {"params": state.params}, x, grads=grads)
  assert report.modules == ("head",)
  assert report.inputs_finite
  assert set(report.gradient_modules) == {"body", "norm", "head"}
  assert [(c.path, c.inputs_finite, c.outputs_finite) for c in report.calls] == [
      ("", True, False), ("norm", True, True), ("body", True, True),
      ("head", True, False)]
  policy = report.propose_policy(state.policy)
  assert policy == jaxmp.flax.ModulePolicy({"head": "float32"},
                                           default="mixed_float16", override_dtype=True)
  skipped = int(state.metrics["skipped_steps"])
  state = fallback.switch(state, policy, reason=str(report))
  assert fallback.events[-1].new_policy == str(policy)
  assert fallback.rung == 0 and fallback.next_policy == jaxmp.get_policy("float32")
  # float16 remains: the loss scale stays dynamic, where it was.
  assert isinstance(state.loss_scale, jaxmp.DynamicLossScale)
  assert float(state.loss_scale.loss_scale) == 1.0
  for _ in range(10):
    state, _ = _classifier_step(state, x, labels)
    assert fallback.check(state) is None  # the floor's count was the baseline
  assert int(state.metrics["skipped_steps"]) == skipped
  # The rest still computes in float16.
  jaxpr = jax.make_jaxpr(state.apply_fn)({"params": state.params}, x)
  dots = [str(e.invars[0].aval.dtype) for e in jaxpr.eqns
          if e.primitive.name == "dot_general"]
  assert dots == ["float16", "float32"]


def test_nnx_overflowing_module_is_found_without_changing_the_model():
  model = NnxHead(nnx.Rngs(0), head_scale=1e5)
  jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
  before = jax.tree_util.tree_map(jnp.copy, nnx.state(model))
  report = jaxmp.flax.find_overflowing_modules(model, X)
  assert report.modules == ("head",)
  _same_arrays(nnx.state(model), before)
  assert NnxHead.__call__ is NnxHead.__dict__["__call__"]  # unwrapped again
  policy = report.propose_policy("mixed_float16")
  model, optimizer, _, _ = _nnx_run(head_scale=1e5)
  jaxmp.switch_precision(optimizer, policy, model=model)
  assert model.head.dtype == jnp.float32 and model.body.dtype == jnp.float16
  assert isinstance(jaxmp.get_loss_scale(optimizer.opt_state), jaxmp.DynamicLossScale)
  assert jaxmp.flax.find_overflowing_modules(model, X).modules == ()


def test_the_innermost_producer_is_reported_however_deep():
  """model -> block -> head: head produces the inf, and neither the block nor
  the model around it (whose outputs are inf too) is reported."""

  class Block(nnx.Module):

    def __init__(self, rngs):
      self.head = NnxHead(rngs, head_scale=1e5)

    def __call__(self, x):
      return self.head(x)

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.block = Block(rngs)

    def __call__(self, x):
      return self.block(x)

  model = Model(nnx.Rngs(0))
  jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
  report = jaxmp.flax.find_overflowing_modules(model, X)
  assert [c.path for c in report.calls if not c.outputs_finite] == [
      "", "block", "block/head", "block/head/head"]
  assert report.modules == ("block/head/head",)


def test_promotion_on_top_of_a_module_policy_keeps_its_rules():
  x = jax.random.normal(jax.random.key(1), (2, 4))
  report = jaxmp.flax.find_overflowing_modules(
      jaxmp.get_policy("mixed_float16").wrap_apply(OneBadModule().apply),
      OneBadModule().init(jax.random.key(0), x), x)
  base = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16")
  policy = report.propose_policy(base)
  assert policy == jaxmp.flax.ModulePolicy(
      {"head": "float32", nn.LayerNorm: "float32"}, default="mixed_float16",
      first_match=True, override_dtype=True)


def test_the_proposed_policy_wins_over_a_declared_float16_dtype():

  class DeclaredFloat16(nn.Module):  # the model's own dtype, as in Flax's examples

    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(512, dtype=jnp.float16, name="body")(x))
      return nn.Dense(8, dtype=jnp.float16, name="head", kernel_init=_wide_projection)(h)

  model = DeclaredFloat16()
  x = jax.random.normal(jax.random.key(1), (8, 4))
  variables = model.init(jax.random.key(0), x)
  report = jaxmp.flax.find_overflowing_modules(
      jaxmp.get_policy("mixed_float16").wrap_apply(model.apply), variables, x)
  assert report.modules == ("head",)
  promoted = report.propose_policy("mixed_float16").wrap_apply(model.apply)
  ops = jaxmp.precision_report(promoted, variables, x).ops
  assert [(op.module, op.inputs) for op in ops] == [
      ("DeclaredFloat16/body", ("float16", "float16")),
      ("DeclaredFloat16/head", ("float32", "float32"))]
  assert jaxmp.flax.find_overflowing_modules(promoted, variables, x).modules == ()


def test_an_overflow_in_the_model_itself_promotes_the_whole_model():

  class Squares(nn.Module):

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(2, name="dense")(x) * 3e4
      return h * h  # the model's own operation overflows

  x = jnp.ones((1, 2))
  apply = jaxmp.get_policy("mixed_float16").wrap_apply(Squares().apply)
  report = jaxmp.flax.find_overflowing_modules(
      apply, Squares().init(jax.random.key(0), x), x)
  assert report.modules == ("",)
  assert report.propose_policy("mixed_float16") == jaxmp.get_policy("float32")
