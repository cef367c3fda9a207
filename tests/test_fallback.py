"""Falling back to a wider policy: the controller, the switch, promotion.

Level 2 (``PrecisionFallback``, ``switch_precision``): the switch keeps params
and optimizer state bit-identical, compiles the step once more, is logged and
recorded, survives a checkpoint, for optax, a TrainState and NNX. Level 3
(``find_overflowing_modules``): the module that overflows alone is promoted.
"""

import dataclasses
import functools
import logging
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from matmul_dtypes import matmul_dtypes
from models import bits, f32, like_flax_init

LADDER = ("mixed_float16", "float32")
X = f32(np.ones((4, 2)))

# A plain optax loop holds (params, opt_state); a TrainState, its policy; an
# nnx.Optimizer is switched in place with its model (None but for NNX).
FRAMEWORKS = ("optax", "train_state", "nnx")


class NnxHead(nnx.Module):
  def __init__(self, rngs, head_scale=1.0, body_scale=None):
    self.body = nnx.Linear(2, 4, rngs=rngs, **({} if body_scale is None else {
        "kernel_init": nnx.initializers.constant(body_scale)}))
    self.head = nnx.Linear(4, 3, rngs=rngs, kernel_init=nnx.initializers.constant(head_scale))

  def __call__(self, x):
    return self.head(self.body(x))

SCALE = jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0)
nnx_head = nnx.jit(NnxHead)  # one compile a configuration, not op by op


def _run(framework, loss_scale=None, model=None, x=X, loss=None, learning_rate=1e-2):
  """``(target, model, step, traces)`` of a run that starts in mixed_float16: ``step(target, x,
  policy)`` returns the target after one update and the gradients; ``traces`` grows by one each
  time the step is traced. The model (nn.Dense(3), NnxHead: in float16 they overflow on large
  inputs) is initialized on ``x``; ``loss`` of its output, default the mean square."""
  traces, loss = [], loss or (lambda out: jnp.mean(out.astype(jnp.float32) ** 2))
  if framework == "nnx":
    model = model or nnx_head(nnx.Rngs(0))
    jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)

    @nnx.jit
    def nnx_step(model, optimizer, x):
      traces.append(None)
      _, grads = jaxmp.scaled_value_and_grad(
          lambda m: loss(m(x)), jaxmp.get_loss_scale(optimizer.opt_state),
          value_and_grad=nnx.value_and_grad)(model)
      optimizer.update(model, grads)
      return grads

    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
        optax.adam(learning_rate), loss_scale or SCALE), wrt=nnx.Param)
    return optimizer, model, lambda o, x, _: (o, nnx_step(model, o, x)), traces
  init = lambda: (model or nn.Dense(3)).init(jax.random.key(0), x)["params"]  # Dense: in NumPy
  params = like_flax_init(jax.eval_shape(init)) if model is None else jax.jit(init)()
  model = model or nn.Dense(3)
  if framework == "train_state":
    state = jaxmp.flax.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(learning_rate),
        policy="mixed_float16", loss_scale=loss_scale or SCALE)

    @jax.jit
    def state_step(state, x):
      traces.append(None)
      _, grads = state.value_and_grad(lambda p: loss(state.apply_fn({"params": p}, x)))(
          state.params)
      return state.apply_gradients(grads=grads), grads

    return state, None, lambda state, x, _: state_step(state, x), traces
  tx = jaxmp.loss_scaling(optax.adam(learning_rate), loss_scale or SCALE)

  @functools.partial(jax.jit, static_argnames="policy")
  def optax_step(target, x, policy):
    traces.append(policy)
    (params, opt_state), cast = target, policy.cast_to_compute
    _, grads = jaxmp.scaled_value_and_grad(
        lambda p: loss(policy.cast_to_output(model.apply({"params": cast(p)}, cast(x)))),
        jaxmp.get_loss_scale(opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), grads

  return (params, tx.init(params)), None, optax_step, traces


def _overflowed(framework, overflows=2):
  """A state whose scale reached its floor, and its NNX model: one finite step,
  then ``overflows`` large batches (the first halved the scale to its floor)."""
  target, model, step, _ = _run(framework, jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
  for x in (X, *[X * 1e5] * overflows):
    target = step(target, x, jaxmp.get_policy("mixed_float16"))[0]
  return target, model


def _opt_state(target):
  return target[1] if isinstance(target, tuple) else target.opt_state


def _kept(target, model):
  """What a switch keeps bit-identical: the params, inner optimizer state, step."""
  params = (nnx.state(model, nnx.Param) if model is not None
            else target[0] if isinstance(target, tuple) else target.params)
  return jax.tree_util.tree_map(np.array, (
      params, _opt_state(target).inner_state, getattr(target, "step", None)))


def _assert_in(policy, target, model):
  """``policy`` held (a TrainState) or computed in (NNX), and its kind of loss scale."""
  policy = jaxmp.get_policy(policy)
  scale = jaxmp.get_loss_scale(target)
  assert (isinstance(scale, jaxmp.DynamicLossScale) if policy.needs_loss_scaling
          else scale == jaxmp.NoOpLossScale())
  if model is not None:
    assert model.head.dtype == model.body.dtype == policy.compute_dtype
  elif not isinstance(target, tuple):  # a plain optax loop holds no policy
    assert target.policy == policy


def _dot_dtypes(fn, *args):
  return [dtypes for _, dtypes in matmul_dtypes(fn, *args)]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_switch_replaces_the_loss_scale_only_when_the_policy_needs_none(framework):
  target, model = _overflowed(framework)
  opt_state, kept = _opt_state(target), bits(_kept(target, model))
  # A policy that would store the params in bfloat16 is refused (the switch
  # keeps the float32 params bit-identical), the target left as it was.
  with pytest.raises(ValueError):
    jaxmp.switch_precision(target, "bf16", model=model)
  assert _opt_state(target) is opt_state and bits(_kept(target, model)) == kept
  _assert_in("mixed_float16", target, model)
  # A policy that still computes in float16: nothing to change, the scale stays.
  same = jaxmp.switch_precision(
      target, jaxmp.get_policy("mixed_float16").with_output_dtype(jnp.float16), model=model)
  assert _opt_state(same) is opt_state
  switched = jaxmp.switch_precision(target, "float32", model=model)
  new = _opt_state(switched)
  assert jaxmp.get_loss_scale(new) == jaxmp.NoOpLossScale()
  assert new.inner_state is opt_state.inner_state  # not even a copy
  assert bits(_kept(switched, model)) == kept
  before, after = jaxmp.loss_scaling_metrics(opt_state), jaxmp.loss_scaling_metrics(new)
  assert int(after["skipped_steps"]) == int(before["skipped_steps"]) == 2
  assert int(after["overflows_at_min"]) == 0  # a no-op scale has no floor
  _assert_in("float32", switched, model)
  # A second switch to the same policy changes nothing.
  again = jaxmp.switch_precision(switched, "float32", model=model)
  assert _opt_state(again) is new
  if framework == "optax":
    return
  assert getattr(again, "tx", None) is switched.tx
  assert getattr(again, "apply_fn", None) == getattr(switched, "apply_fn", None)
  # An optimizer built afresh from the switched one has the switched structure.
  fresh = (switched.tx.init(switched.params) if model is None
           else nnx.Optimizer(model, switched.tx, wrt=nnx.Param).opt_state)
  assert jax.tree_util.tree_structure(fresh) == jax.tree_util.tree_structure(new)
  assert jaxmp.get_loss_scale(fresh) == jaxmp.NoOpLossScale()
  if model is None:  # the TrainState's apply_fn runs under the new policy
    assert [_dot_dtypes(s.apply_fn, {"params": s.params}, X) for s in (target, switched)] == [
        [("float16",) * 2], [("float32",) * 2]]


@pytest.mark.integration  # a fresh process: this one has imported jaxmp.flax
def test_switching_an_nnx_optimizer_needs_no_import_of_jaxmp_flax():
  # No registry that an import fills: `import jaxmp` alone switches NNX.
  code = """if True:
    import sys, jax.numpy as jnp, optax, jaxmp
    from flax import nnx
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0), dtype=jnp.float16)
    optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
        optax.sgd(0.1), jaxmp.DynamicLossScale()), wrt=nnx.Param)
    assert jaxmp.switch_precision(optimizer, "float32", model=model) is optimizer
    assert model.dtype == jnp.float32
    assert jaxmp.get_loss_scale(optimizer.opt_state) == jaxmp.NoOpLossScale()
    assert "jaxmp.flax" not in sys.modules
  """
  subprocess.run([sys.executable, "-c", code], check=True, timeout=120,
                 cwd=pathlib.Path(__file__).resolve().parents[1])


def test_the_controller_switches_on_overflows_at_the_minimum_scale(caplog):
  tx = jaxmp.loss_scaling(optax.sgd(0.1), SCALE)
  params, fallback, policies = {"w": f32(np.ones(2))}, jaxmp.PrecisionFallback(LADDER, every=1), []
  opt_state, update = tx.init(params), jax.jit(tx.update)  # one program a loss scale's kind
  with caplog.at_level(logging.WARNING, logger="jaxmp"):
    for step in range(1, 7):
      _, opt_state = update({"w": f32(np.full(2, np.inf))}, opt_state, params)
      returned, policy = fallback.update(opt_state, step=step)
      assert (returned is opt_state) == (step != 3)  # a run not switched: as it is
      opt_state = returned
      policies.append(str(policy))
  # 4 -> 2 -> 1, then the third overflow finds the scale at its floor.
  assert policies == ["p=f32,c=f16,o=f32"] * 2 + ["p=f32,c=f32,o=f32"] * 4
  assert [event._asdict() for event in fallback.events] == [dict(
      step=3, reason="1 overflow(s) at the minimum loss scale 1",
      old_policy="p=f32,c=f16,o=f32", new_policy="p=f32,c=f32,o=f32")]
  assert (fallback.policy, fallback.rung, fallback.next_policy) == (
      jaxmp.get_policy("float32"), 1, None)
  (record,) = [r for r in caplog.records if "switching" in r.getMessage()]
  assert (record.levelno, record.getMessage()) == (logging.WARNING, (
      "jaxmp: step 3: switching from p=f32,c=f16,o=f32 to p=f32,c=f32,o=f32: "
      "1 overflow(s) at the minimum loss scale 1."))
  # In float32 the nan steps are still skipped, but they are not fp16's fault.
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 6


def test_check_reads_every_n_steps_tolerates_overflows_and_answers_the_next_rung():
  state = _overflowed("optax")[0][1]  # the optimizer state: one overflow at the floor
  fallback = jaxmp.PrecisionFallback(LADDER, every=5)
  assert [fallback.check(state, step=step) for step in (1, 2, 3, 4)] == [None] * 4
  assert fallback.check(state, step=5) == jaxmp.get_policy("float32")
  assert [r.step for r in fallback.monitor.records] == [5]  # read at the fifth step only
  assert fallback.events == [] and fallback.rung == 0  # check switches nothing
  tolerant = jaxmp.PrecisionFallback(LADDER, every=1, max_overflows_at_min=1)
  assert tolerant.check(state, step=1) is None
  assert tolerant.check(_overflowed("optax", 3)[0][1], step=2) == jaxmp.get_policy("float32")


def test_the_overflow_rate_is_measured_over_a_whole_window_of_the_current_policy():
  # A static scale never reaches a floor: only the rate says float16 fails.
  tx, params = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.StaticLossScale(2.0**10)), {
      "w": f32(np.ones(2))}
  opt_state, update = tx.init(params), jax.jit(tx.update)
  fallback = jaxmp.PrecisionFallback(("mixed_float16", "p=f32,c=f16,o=f16", "float32"),
                                     every=2, window=8, max_overflow_rate=0.25)
  for step in range(1, 25):
    grad = np.inf if step % 2 else 1.0  # half the steps overflow
    _, opt_state = update({"w": f32(np.full(2, grad))}, opt_state, params)
    opt_state, policy = fallback.update(opt_state, step=step)
  # The first look (step 2) starts the window; a whole one has passed at 10.
  # The next policy is measured from its switch: a whole window later, 18.
  assert [(e.step, e.reason) for e in fallback.events] == [
      (10, "50% of the last 8 steps were skipped (loss scale 1024)"),
      (18, "50% of the last 8 steps were skipped (loss scale 1024)")]
  assert policy == jaxmp.get_policy("float32")


@pytest.mark.parametrize("ladder", [LADDER, ("mixed_float16",)])
def test_raise_mode_raises_check_loss_scales_error(ladder):
  state = _overflowed("optax")[0][1]  # the optimizer state
  fallback = jaxmp.PrecisionFallback(ladder, every=1, on_failure="raise")
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as raised:
    fallback.update(state, step=1)
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as expected:
    jaxmp.check_loss_scale(state)
  assert str(raised.value) == str(expected.value)
  assert fallback.events == [] and fallback.policy == jaxmp.get_policy(LADDER[0])


def test_the_ladder_follows_the_hardware():
  f16, bf16, f32 = map(jaxmp.get_policy, ("mixed_float16", "mixed_bfloat16", "float32"))
  assert not jaxmp.hardware_report().native_bfloat16  # this CPU
  assert jaxmp.PrecisionFallback().ladder == (f16, f32)
  report = dataclasses.replace(jaxmp.hardware_report(), platform="tpu", native_bfloat16=True)
  assert jaxmp.PrecisionFallback(("mixed_float16", "mixed_bfloat16", "float32"),
                                 hardware=report).ladder == (f16, bf16, f32)
  assert jaxmp.PrecisionFallback(hardware=report).ladder == (f16, bf16)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_run_switches_once_compiles_once_more_and_keeps_params_and_moments(framework):
  target, model, step, traces = _run(framework)
  policy = (fallback := jaxmp.PrecisionFallback(LADDER, every=1)).policy
  for i in range(1, 9):
    target = step(target, X * (1e5 if i <= 4 else 1.0), policy)[0]
    kept = bits(_kept(target, model))
    if framework == "optax":  # the policy goes to the step, a static argument
      target, policy = fallback.update(target, step=i)
    else:  # the target holds the policy (the model its dtypes) and the step
      target = fallback.update(target, model=model)
    if fallback.events and fallback.events[-1].step == i:
      assert bits(_kept(target, model)) == kept
  assert len(traces) == 2  # the float16 step and the float32 step, once each
  assert [e.step for e in fallback.events] == [3]
  # The fourth large batch, which float16 could not represent, trains in
  # float32: three steps were skipped, not four.
  metrics = jaxmp.loss_scaling_metrics(_opt_state(target))
  assert int(metrics["skipped_steps"]) == 3 and bool(metrics["last_finite"])
  _assert_in("float32", target, model)  # its loss scale a NoOpLossScale
  if framework == "optax":
    assert traces == [jaxmp.get_policy("mixed_float16"), jaxmp.get_policy("float32")]


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_checkpoint_resumes_the_controller_and_the_target_in_the_saved_policy(
    framework, tmp_path):
  target, model = _overflowed(framework)  # at the floor, not switched yet
  fallback, saved = jaxmp.PrecisionFallback(LADDER, every=1), {}
  checkpointed = lambda target, model: target if model is None else (model, target)
  for name in ("before", "after"):  # the switch
    if name == "after":
      target = (fallback.update(target, step=3)[0] if framework == "optax"
                else fallback.update(target, model=model))
      assert fallback.policy == jaxmp.get_policy("float32")
    jaxmp.flax.save_checkpoint(tmp_path / name, checkpointed(target, model), fallback=fallback)
    saved[name] = bits((_kept(target, model), _opt_state(target))), list(fallback.events)
  # Into a target built in float16, as at the start of the run; abstract:
  # only shapes and dtypes (jax.eval_shape, nnx.eval_shape).
  build = lambda: _run(framework, jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
  for name, abstract in [("before", False), ("after", False), ("after", True)]:
    resumed = jaxmp.PrecisionFallback(LADDER, every=1)  # a new process
    if abstract:
      eval_shape = nnx.eval_shape if framework == "nnx" else jax.eval_shape
      (target, model), step = eval_shape(lambda: build()[:2]), None
    else:
      target, model, step, traces = build()
    restored = jaxmp.flax.restore_checkpoint(
        tmp_path / name, checkpointed(target, model), fallback=resumed)
    restored = restored if model is None else restored[1]
    policy = jaxmp.get_policy("float32" if name == "after" else "mixed_float16")
    assert (resumed.events, resumed.policy, resumed.rung) == (
        saved[name][1], policy, int(name == "after"))
    _assert_in(policy, restored, model)
    assert bits((_kept(restored, model), _opt_state(restored))) == saved[name][0]
    if name == "after" and not abstract:
      if framework != "optax":
        assert int(jax.tree_util.tree_leaves(restored.step)[0]) == 3
      # The restored state steps in float32 (a fresh jit: one trace).
      restored = step(restored, X, resumed.policy)[0]
      assert len(traces) == 1
      assert bool(jaxmp.loss_scaling_metrics(_opt_state(restored))["last_finite"])


def test_a_checkpoint_records_a_policy_off_the_ladder(tmp_path):
  # A policy given to fallback.switch (a proposal, say) is recorded whole.
  state = _overflowed("optax")[0][1]  # the optimizer state
  for i, policy in enumerate([
      jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32", "head": "float32"}, default="mixed_float16",
                              first_match=True, override_dtype=(nn.Dense,)),
      jaxmp.PathPolicy({"kernel": "float32"}, default="mixed_float16"), "p=f32,c=f16,o=f16"]):
    fallback = jaxmp.PrecisionFallback(LADDER)
    switched, _ = fallback.switch(state, policy, reason="a test", step=1)
    jaxmp.flax.save_checkpoint(tmp_path / str(i), switched, fallback=fallback)
    resumed = jaxmp.PrecisionFallback(LADDER)
    jaxmp.flax.restore_checkpoint(tmp_path / str(i), state, fallback=resumed)
    assert resumed.policy == fallback.policy == (
        jaxmp.get_policy(policy) if isinstance(policy, str) else policy)
    assert resumed.events == fallback.events and resumed.rung == 0


def _wide_projection(key, shape, dtype=jnp.float32):
  """Each output is about 1000 times the sum of its inputs (a class-wise tilt)."""
  del key
  return 1e3 * jnp.ones(shape, dtype) * (1.0 + 0.01 * jnp.arange(shape[1], dtype=dtype))


class OneBadModule(nn.Module):
  """Tame but for ``head``, which sums 512 positive activations with weights
  near 1000: its logits (about 2e5) exceed float16's 65504 at any loss scale;
  its cotangents (softmax minus one-hot, through kernel columns 1% apart) stay
  small, so in float32 it trains the rest in float16 without an overflow."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(512, name="body")(nn.LayerNorm(name="norm")(x)))
    return nn.Dense(8, name="head", kernel_init=_wide_projection)(h)


class NnxOneBadModule(nnx.Module):  # OneBadModule in NNX
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(4, rngs=rngs)
    self.body = nnx.Linear(4, 512, rngs=rngs)
    self.head = nnx.Linear(512, 8, kernel_init=_wide_projection, rngs=rngs)

  def __call__(self, x):
    return self.head(nnx.relu(self.body(self.norm(x))))


@pytest.mark.parametrize("framework", ["train_state", "nnx"])
def test_only_the_overflowing_module_is_promoted_and_training_then_skips_nothing(framework):
  x = f32(np.random.default_rng(1).normal(size=(8, 4)))
  target, model, step, _ = _run(
      framework, jaxmp.DynamicLossScale(2.0**3, min_loss_scale=1.0), x=x, learning_rate=1e-4,
      model=(nnx.jit(lambda: NnxOneBadModule(nnx.Rngs(0)))()  # one compile, not op by op
             if framework == "nnx" else OneBadModule()),
      loss=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), jnp.arange(8)).mean())
  forward = lambda t: (model, x) if model is not None else (t.apply_fn, {"params": t.params}, x)
  classes = ((NnxOneBadModule, nnx.LayerNorm, nnx.Linear) if model is not None
             else (OneBadModule, nn.LayerNorm, nn.Dense))
  fallback = jaxmp.PrecisionFallback(LADDER, every=1)
  for _ in range(6):  # 8 -> 4 -> 2 -> 1, then an overflow at the floor
    target, grads = step(target, x, None)
    if fallback.check(target) is not None:
      break
  assert fallback.check(target) == jaxmp.get_policy("float32")  # the next rung
  before = bits(_kept(target, model))
  calls = {cls: vars(cls).get("__call__") for cls in classes}
  report = jaxmp.flax.find_overflowing_modules(*forward(target), grads=grads)
  assert report.modules == ("head",) and report.inputs_finite
  assert set(report.gradient_modules) == {"body", "norm", "head"}
  assert [(c.path, c.inputs_finite, c.outputs_finite) for c in report.calls] == [
      ("", True, False), ("norm", True, True), ("body", True, True), ("head", True, False)]
  # Nothing of the model was changed: its arrays, its classes' __call__.
  assert bits(_kept(target, model)) == before
  assert {cls: vars(cls).get("__call__") for cls in classes} == calls
  policy = report.propose_policy(fallback.policy)
  assert policy == jaxmp.flax.ModulePolicy({"head": "float32"},
                                           default="mixed_float16", override_dtype=True)
  skipped = int(jaxmp.loss_scaling_metrics(_opt_state(target))["skipped_steps"])
  target = fallback.switch(target, policy, reason=str(report), model=model)
  assert fallback.events[-1].new_policy == str(policy)
  assert fallback.rung == 0 and fallback.next_policy == jaxmp.get_policy("float32")
  # float16 remains: the loss scale stays dynamic, where it was.
  loss_scale = jaxmp.get_loss_scale(_opt_state(target))
  assert isinstance(loss_scale, jaxmp.DynamicLossScale) and float(loss_scale.loss_scale) == 1.0
  for _ in range(4):
    target = step(target, x, None)[0]
    assert fallback.check(target) is None  # the floor's count was the baseline
  assert int(jaxmp.loss_scaling_metrics(_opt_state(target))["skipped_steps"]) == skipped
  # head computes in float32, the rest still in float16, and nothing overflows.
  if model is not None:
    assert model.head.dtype == jnp.float32 and model.body.dtype == jnp.float16
  assert _dot_dtypes(*forward(target)) == [("float16", "float16"), ("float32", "float32")]
  assert jaxmp.flax.find_overflowing_modules(*forward(target)).modules == ()


class FeedsAFloat16Head(nn.Module):
  """body's float16 output (9e4) overflows; promoted to float32, that output
  overflows the float16 head it feeds (so does NnxHead's with body_scale=4e4)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, name="body", kernel_init=nn.initializers.constant(3e4))(x)
    return nn.Dense(2, name="head")(h)


class DeclaredFloat16(nn.Module):  # the model's own dtype, as in Flax's examples
  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(512, dtype=jnp.float16, name="body")(x))
    return nn.Dense(8, dtype=jnp.float16, name="head", kernel_init=_wide_projection)(h)


class Squares(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(2, name="dense")(x) * 3e4
    return h * h  # the model's own operation overflows


def _forward(model, x):
  """``forward(policy)``: what find_overflowing_modules takes, under the policy."""
  as_policy = lambda p: jaxmp.flax.ModulePolicy({}, default=p) if isinstance(p, str) else p
  if isinstance(model, nnx.Module):
    return lambda policy: (as_policy(policy).set_nnx_dtypes(model), (model, x))[1]
  variables = jax.jit(model.init)(jax.random.key(0), x)
  return lambda policy: (as_policy(policy).wrap_apply(model.apply), variables, x)


F16_F32 = [("float16", "float16"), ("float32", "float32")]
PROMOTIONS = {  # the model, its batch, the base policy; what overflows, the proposal, its dots
    "downstream_linen": (lambda: _forward(FeedsAFloat16Head(), jnp.ones((1, 3))), "mixed_float16",
                         ("body",), {"body": "float32", "head": "float32"}, F16_F32[1:] * 2),
    "downstream_nnx": (lambda: _forward(nnx_head(nnx.Rngs(0), body_scale=4e4), X), "mixed_float16",
                       ("body",), {"body": "float32", "head": "float32"}, F16_F32[1:] * 2),
    "over_a_declared_float16": (
        lambda: _forward(DeclaredFloat16(), f32(np.random.default_rng(1).normal(size=(8, 4)))),
        "mixed_float16", ("head",), {"head": "float32"}, F16_F32),
    "keeping_the_rules": (
        lambda: _forward(OneBadModule(), f32(np.random.default_rng(1).normal(size=(2, 4)))),
        jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default="mixed_float16"), ("head",),
        {"head": "float32", nn.LayerNorm: "float32"}, F16_F32),
    "the_whole_model": (lambda: _forward(Squares(), jnp.ones((1, 2))), "mixed_float16", ("",),
                        None, F16_F32[1:]),
}


@pytest.mark.parametrize("case", PROMOTIONS)
def test_the_proposed_policy_promotes_what_overflows_and_runs_finite_on_its_batch(case):
  """The modules that produce the first inf and those it overflows downstream,
  over a declared dtype, keeping a ModulePolicy's rules; or the whole model."""
  forward, base, modules, rules, dots = PROMOTIONS[case]
  forward = forward()
  report = jaxmp.flax.find_overflowing_modules(*forward(base))
  assert report.modules == modules
  policy = report.propose_policy(base)
  assert policy == (jaxmp.get_policy("float32") if rules is None else jaxmp.flax.ModulePolicy(
      rules, default="mixed_float16", first_match=not isinstance(base, str), override_dtype=True))
  assert _dot_dtypes(*forward(policy)) == dots
  assert jaxmp.flax.find_overflowing_modules(*forward(policy)).modules == ()


def test_the_innermost_producer_is_reported_however_deep():
  """model -> block -> head: head produces the inf; the block and model around it are not."""

  class Calls(nnx.Module):  # its one child, by the name given
    def __init__(self, **child):
      ((self.child, module),) = child.items()
      setattr(self, self.child, module)

    def __call__(self, x):
      return getattr(self, self.child)(x)

  model = Calls(block=Calls(head=nnx_head(nnx.Rngs(0), head_scale=1e5)))
  jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
  report = jaxmp.flax.find_overflowing_modules(model, X)
  assert [c.path for c in report.calls if not c.outputs_finite] == [
      "", "block", "block/head", "block/head/head"]
  assert report.modules == ("block/head/head",)
