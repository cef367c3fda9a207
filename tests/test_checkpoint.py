"""Checkpoints: resumes, the configuration they check, overwrites.

* A checkpoint written in the middle of a burst of overflows (scale backed
  off, hysteresis budget half used, a nan in a gradient accumulator) resumes
  bit-identically, for a Linen TrainState and for an NNX model and its
  optimizer.
* A changed configuration (a loss-scale field, the policy) is refused unless
  ``check_config=False``; a float32 run's checkpoint restored into a
  ``mixed_float16`` run (and the reverse) fails with a message that says what
  to do, and what it says works.
* A forced overwrite that fails, or is killed at any moment, leaves a
  restorable checkpoint: the old one or the new one.

The checkpoints of a run that switched precision: tests/test_fallback.py.
"""

import pathlib
import shutil
import signal
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

BURST_SCALE = jaxmp.DynamicLossScale(
    2.0**10, period=4, min_loss_scale=2.0**6, hysteresis=3)
N_STEPS = 24
BURST = range(8, 16)  # eight overflows in a row
SAVE_AT = 12  # after the 12th step: inside the burst


class MLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(2)(nn.tanh(nn.Dense(8)(x)))


def make_state(policy="mixed_float16", loss_scale=BURST_SCALE, tx=None):
  model = MLP()
  params = model.init(jax.random.key(0), jnp.ones((1, 4)))["params"]
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=optax.adamw(1e-2) if tx is None else tx, policy=policy,
      loss_scale=loss_scale)


def batch(i):
  rng = np.random.default_rng(i)
  return (jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
          jnp.asarray(rng.normal(size=(8, 2)), jnp.float32))


def poison(grads, inject):
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  leaves[0] = jnp.where(inject, leaves[0].at[0].set(jnp.inf), leaves[0])
  return jax.tree_util.tree_unflatten(treedef, leaves)


@jax.jit
def train_step(state, x, y, inject):
  def loss_fn(params, x, y):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  _, grads = state.value_and_grad(loss_fn)(state.params, x, y)
  return state.apply_gradients(grads=poison(grads, inject))


def arrays(state):
  """The pytree part of a state (its ``tx`` is a new closure in each state)."""
  return state.step, state.params, state.opt_state


def run(state, steps):
  scales = []
  for i in steps:
    state = train_step(state, *batch(i), jnp.asarray(i in BURST))
    scales.append(float(state.loss_scale.loss_scale))
  return state, scales


class NnxMLP(nnx.Module):
  """MLP in NNX, with float16 layers."""

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 8, dtype=jnp.float16, rngs=rngs)
    self.dense2 = nnx.Linear(8, 2, dtype=jnp.float16, rngs=rngs)

  def __call__(self, x):
    return self.dense2(nnx.tanh(self.dense1(x))).astype(jnp.float32)


def make_nnx():
  model = NnxMLP(nnx.Rngs(0))
  return model, nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adamw(1e-2), BURST_SCALE), wrt=nnx.Param)


@nnx.jit
def nnx_train_step(model, optimizer, x, y, inject):
  loss_fn = lambda m: jnp.mean((m(x) - y) ** 2)
  _, grads = jaxmp.scaled_value_and_grad(
      loss_fn, jaxmp.get_loss_scale(optimizer.opt_state),
      value_and_grad=nnx.value_and_grad)(model)
  optimizer.update(model, poison(grads, inject))


class Linen:
  """A jaxmp.flax.TrainState, restored into a target the code builds
  (abstract, from jax.eval_shape) and into a freshly initialized one."""

  @staticmethod
  def run(state, steps):
    return run(state, steps)

  @staticmethod
  def arrays(state):
    return arrays(state)

  @staticmethod
  def targets():
    return {"abstract": jax.eval_shape(make_state), "fresh": make_state()}

  @staticmethod
  def opt_state(state):
    return state.opt_state

  @staticmethod
  def step_count(state):
    return int(state.step)


class Nnx:
  """A model and its nnx.Optimizer, updated in place, restored into new ones."""

  @staticmethod
  def run(state, steps):
    model, optimizer = state
    scales = []
    for i in steps:
      nnx_train_step(model, optimizer, *batch(i), jnp.asarray(i in BURST))
      scales.append(float(jaxmp.get_loss_scale(optimizer.opt_state).loss_scale))
    return state, scales

  @staticmethod
  def arrays(state):
    return nnx.to_pure_dict(nnx.state(state))  # a snapshot: arrays are immutable

  @staticmethod
  def targets():
    return {"new objects": make_nnx()}

  @staticmethod
  def opt_state(state):
    return state[1].opt_state

  @staticmethod
  def step_count(state):
    return int(state[1].step[...])


@pytest.mark.parametrize("framework", [Linen, Nnx], ids=["linen", "nnx"])
def test_resume_in_the_middle_of_a_fault_burst_is_bit_identical(tmp_path, framework):
  state, scales = framework.run(make_state() if framework is Linen else make_nnx(),
                                range(SAVE_AT))
  # The checkpoint is written mid-burst: the last step overflowed, the scale
  # has backed off and the hysteresis budget is partly spent.
  metrics = jaxmp.loss_scaling_metrics(framework.opt_state(state))
  loss_scale = jaxmp.get_loss_scale(framework.opt_state(state))
  assert not bool(metrics["last_finite"])
  assert int(metrics["skipped_steps"]) == SAVE_AT - BURST.start
  assert float(loss_scale.loss_scale) < max(scales)
  assert 1 <= int(loss_scale.hysteresis_left) < loss_scale.hysteresis
  jaxmp.flax.save_checkpoint(tmp_path / "mid_burst", state)
  saved = framework.arrays(state)

  reference, reference_scales = framework.run(state, range(SAVE_AT, N_STEPS))
  reference = framework.arrays(reference)
  for name, target in framework.targets().items():
    restored = jaxmp.flax.restore_checkpoint(tmp_path / "mid_burst", target)
    if framework is Linen:
      assert isinstance(restored, jaxmp.flax.TrainState), name
      assert restored.policy == jaxmp.get_policy("mixed_float16"), name
    else:
      restored = target  # restored in place
    assert framework.step_count(restored) == SAVE_AT, name
    chex.assert_trees_all_equal(framework.arrays(restored), saved)
    # The static configuration comes back with the target.
    assert jaxmp.get_loss_scale(framework.opt_state(restored)).config() == (
        {"type": "DynamicLossScale", "period": 4, "factor": 2.0, "min_loss_scale": 64.0,
         "backoff_factor": 0.5, "max_loss_scale": float(np.finfo(np.float32).max),
         "hysteresis": 3, "consecutive_hysteresis": False}), name
    resumed, resumed_scales = framework.run(restored, range(SAVE_AT, N_STEPS))
    chex.assert_trees_all_equal(framework.arrays(resumed), reference)
    assert resumed_scales == reference_scales, name
    metrics = jaxmp.loss_scaling_metrics(framework.opt_state(resumed))
    assert int(metrics["skipped_steps"]) == len(BURST), name
    # The burst drove the scale to its minimum, and it grew again afterwards.
    assert min(scales + resumed_scales) == 2.0**6, name
    assert resumed_scales[-1] > 2.0**6, name


ACCUMULATE = 4


def test_resume_with_a_nan_in_the_gradient_accumulator(tmp_path):
  """Saved between a poisoned micro-batch and the end of its accumulation."""
  model = MLP()
  params0 = model.init(jax.random.key(1), jnp.ones((1, 4)))["params"]
  make_tx = lambda: jaxmp.multi_steps(
      optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10, period=2), ACCUMULATE)
  tx = make_tx()

  @jax.jit
  def micro_step(params, opt_state, x, y, inject):
    def loss_fn(params):
      return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

    loss_scale = jaxmp.get_loss_scale(opt_state)
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params)
    grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, jnp.nan * g, g), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run_micro(params, opt_state, steps):
    for i in steps:
      params, opt_state = micro_step(params, opt_state, *batch(i), jnp.asarray(i == 5))
    return params, opt_state

  params, opt_state = run_micro(params0, tx.init(params0), range(6))
  assert not bool(jaxmp.all_finite(opt_state.acc_grads))  # the nan is saved
  jaxmp.flax.save_checkpoint(tmp_path / "accumulating", (params, opt_state))
  reference = run_micro(params, opt_state, range(6, 16))

  target = jax.eval_shape(lambda: (params0, make_tx().init(params0)))
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "accumulating", target)
  chex.assert_trees_all_equal(restored, (params, opt_state))
  resumed = run_micro(*restored, range(6, 16))
  chex.assert_trees_all_equal(resumed, reference)
  # The poisoned accumulation was skipped once; the next ones were applied.
  assert int(jaxmp.loss_scaling_metrics(resumed[1])["skipped_steps"]) == 1
  assert jaxmp.all_finite(resumed)


# ---------------------------------------------------------------------------
# Switching precision between a checkpoint and the run that restores it.


def trained(policy, loss_scale=None):
  state = make_state(policy, loss_scale)
  for i in range(3):
    state = train_step(state, *batch(i), jnp.asarray(False))
  return state


@pytest.mark.parametrize("saved_policy, target_policy", [
    ("float32", "mixed_float16"),
    ("mixed_float16", "float32"),
])
def test_switching_between_float32_and_float16_fails_clearly_and_the_advice_works(
    tmp_path, saved_policy, target_policy):
  saved = trained(saved_policy, None if saved_policy == "float32" else BURST_SCALE)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", saved)
  default_scale = lambda policy: None if policy == "float32" else BURST_SCALE
  target = make_state(target_policy, default_scale(target_policy))
  saved_type = type(saved.loss_scale).__name__
  target_type = type(target.loss_scale).__name__
  for check_config in (True, False):
    with pytest.raises(ValueError) as error:
      jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", target, check_config=check_config)
    message = str(error.value)
    assert f"holds a {saved_type} and the target a {target_type}" in message
    assert f"'policy': '{saved.policy}'" in message  # the saved configuration
    assert "params=restored.params" in message and "inner_state" in message

  # What the message advises: restore under the saved configuration, then
  # start the new run from its params (and optimizer moments).
  restored = jaxmp.flax.restore_checkpoint(
      tmp_path / "ckpt", make_state(saved_policy, default_scale(saved_policy)))
  fresh = make_state(target_policy, default_scale(target_policy))
  switched = fresh.replace(
      params=restored.params,
      opt_state=fresh.opt_state._replace(inner_state=restored.opt_state.inner_state))
  chex.assert_trees_all_equal(switched.params, saved.params)
  chex.assert_trees_all_equal(switched.opt_state.inner_state, saved.opt_state.inner_state)
  switched = train_step(switched, *batch(3), jnp.asarray(False))
  assert int(switched.metrics["skipped_steps"]) == 0
  assert jaxmp.all_finite(switched.params)
  assert switched.policy == jaxmp.get_policy(target_policy)


CONFIGURED = jaxmp.DynamicLossScale(
    2.0, period=7, factor=3.0, min_loss_scale=0.5, backoff_factor=0.25,
    max_loss_scale=2.0**20, hysteresis=3, consecutive_hysteresis=True)
STATIC_FIELDS = ("period", "factor", "min_loss_scale", "backoff_factor",
                 "max_loss_scale", "hysteresis", "consecutive_hysteresis")


@pytest.fixture(scope="module")
def configured_checkpoint(tmp_path_factory):
  """A checkpoint of a state under CONFIGURED, saved once: the cases below only read it."""
  path = tmp_path_factory.mktemp("configured") / "ckpt"
  jaxmp.flax.save_checkpoint(path, make_state("mixed_float16", CONFIGURED))
  return path


@pytest.mark.parametrize("field, value", [
    ("period", 8), ("factor", 2.0), ("min_loss_scale", 0.25),
    ("backoff_factor", 0.5), ("max_loss_scale", 2.0**21), ("hysteresis", 2),
    ("consecutive_hysteresis", False), ("policy", "p=f32,c=bf16,o=f32"),
])
def test_any_changed_configuration_field_is_named(configured_checkpoint, field, value):
  kwargs = {name: getattr(CONFIGURED, name) for name in STATIC_FIELDS}
  saved = "p=f32,c=f16,o=f32" if field == "policy" else getattr(CONFIGURED, field)
  if field != "policy":
    kwargs[field] = value
  target = make_state(value if field == "policy" else "mixed_float16",
                      jaxmp.DynamicLossScale(2.0, **kwargs))
  with pytest.raises(ValueError) as error:
    jaxmp.flax.restore_checkpoint(configured_checkpoint, target)
  message = str(error.value)
  assert f"'{field}': {saved!r}" in message and f"'{field}': {value!r}" in message
  assert "check_config=False" in message
  restored = jaxmp.flax.restore_checkpoint(configured_checkpoint, target, check_config=False)
  got = str(restored.policy) if field == "policy" else getattr(restored.loss_scale, field)
  assert got == value  # the target's, as asked
  chex.assert_trees_all_equal(jax.tree_util.tree_leaves(arrays(restored)), jax.tree_util.tree_leaves(
      arrays(make_state("mixed_float16", CONFIGURED))))  # the saved arrays


def test_a_plain_orbax_checkpoint_restores_with_orbax_and_unchecked_with_jaxmp(tmp_path):
  # With orbax alone, the static configuration lives in the target's treedef.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  state = make_state("mixed_float16", CONFIGURED)
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "plain", state)
  checkpointer.wait_until_finished()
  target = jax.eval_shape(lambda: make_state("mixed_float16", CONFIGURED))
  for restored in (checkpointer.restore(tmp_path / "plain", target),
                   jaxmp.flax.restore_checkpoint(tmp_path / "plain", target,
                                                 check_config=False)):
    chex.assert_trees_all_equal(arrays(restored), arrays(state))
    assert restored.loss_scale.config() == CONFIGURED.config()  # from the target


# ---------------------------------------------------------------------------
# A checkpoint of another optimizer or model size: refused before orbax reads.


@pytest.mark.parametrize("other", ["optimizer", "shapes"])
def test_a_mismatched_checkpoint_is_refused_quietly_before_any_array_is_read(
    tmp_path, other, capfd, caplog):
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", make_state())
  if other == "optimizer":
    target = make_state(tx=optax.sgd(0.1, momentum=0.9))
    expected = (r"only in the checkpoint: opt_state/inner_state/0/count, "
                r"opt_state/inner_state/0/mu/Dense_0/bias, .* and 3 more; "
                r"only in the target: opt_state/inner_state/0/trace/Dense_0/bias")
  else:

    class Wider(nn.Module):

      @nn.compact
      def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(16)(x)))

    params = Wider().init(jax.random.key(0), jnp.ones((1, 4)))["params"]
    target = jaxmp.flax.TrainState.create(
        apply_fn=Wider().apply, params=params, tx=optax.adamw(1e-2),
        policy="mixed_float16", loss_scale=BURST_SCALE)
    expected = (r"shapes \(params/Dense_0/kernel: \(8, 2\) in the checkpoint, "
                r"\(16, 2\) in the target; params/Dense_1/bias: \(8,\) in the "
                r"checkpoint, \(16,\) in the target; .* and 3 more\), so it was "
                r"saved for a model of another size")
  capfd.readouterr()
  for check_config in (True, False):
    with pytest.raises(ValueError, match=expected):
      jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", target, check_config=check_config)
  captured = capfd.readouterr()
  assert captured.err == "" and captured.out == ""
  assert not [r for r in caplog.records if r.levelno >= 30]  # no warnings logged


# ---------------------------------------------------------------------------
# A forced overwrite never loses the checkpoint it replaces.

# A process that imports jaxmp.flax once, then, for each line "path value
# kill_at" it reads, forks a child that saves a state of `value`s over the
# checkpoint at `path` and SIGKILLs itself just before its `kill_at`-th call of
# os.rename or shutil.rmtree: each filesystem step of the overwrite (orbax's
# and jaxmp's) is a moment to die at. It answers each line with the child's
# exit code (-9 when killed). JAX starts in each child, never in the parent,
# so that forking is safe.
KILLED_SAVES = """
import os, shutil, signal, sys, traceback
import numpy as np
import jaxmp.flax

for line in sys.stdin:
  path, value, kill_at = line.split()
  pid = os.fork()
  if pid == 0:
    try:
      calls = [0]

      def dying(function):
        def call(*args, **kwargs):
          calls[0] += 1
          if calls[0] == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
          return function(*args, **kwargs)
        return call

      os.rename, shutil.rmtree = dying(os.rename), dying(shutil.rmtree)
      state = {name: np.full((64, 64), float(value), np.float32) for name in ("a", "b", "c")}
      jaxmp.flax.save_checkpoint(path, state, force=True)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      os._exit(1)
    os._exit(0)
  print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def filled(value):
  return {name: np.full((64, 64), value, np.float32) for name in ("a", "b", "c")}


def restored_value(path):
  restored = jaxmp.flax.restore_checkpoint(path, filled(0.0))
  values = {float(v) for leaf in restored.values() for v in np.unique(leaf)}
  assert len(values) == 1, values  # all old or all new, never a mixture
  return values.pop()


@pytest.mark.integration  # a process that forks a child per moment
def test_a_forced_overwrite_killed_at_any_moment_leaves_a_restorable_checkpoint(
    tmp_path):
  root = pathlib.Path(__file__).resolve().parents[1]  # so it imports this jaxmp
  jaxmp.flax.save_checkpoint(tmp_path / "original", filled(1.0))
  saves = subprocess.Popen([sys.executable, "-c", KILLED_SAVES], cwd=root, text=True,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  outcomes = []
  try:
    for kill_at in range(1, 40):
      work = tmp_path / f"kill_{kill_at}"
      shutil.copytree(tmp_path / "original", work / "ckpt")
      saves.stdin.write(f"{work / 'ckpt'} 2.0 {kill_at}\n")
      saves.stdin.flush()
      returncode = int(saves.stdout.readline())
      killed = returncode == -signal.SIGKILL
      assert killed or returncode == 0, returncode  # the child's traceback is on stderr
      outcomes.append(restored_value(work / "ckpt"))
      # Whatever the killed save left beside the checkpoint, the next forced
      # save cleans up and completes.
      jaxmp.flax.save_checkpoint(work / "ckpt", filled(3.0), force=True)
      assert restored_value(work / "ckpt") == 3.0
      assert sorted(p.name for p in work.iterdir()) == ["ckpt"]
      if not killed:
        break
  finally:
    saves.stdin.close()
    saves.wait(timeout=120)
  assert outcomes[-1] == 2.0 and not killed  # the save ran to its end
  # The moments span the overwrite: some kills left the old checkpoint,
  # others (after the swap) the new one.
  assert 1.0 in outcomes[:-1] and 2.0 in outcomes[:-1]


def test_a_failed_forced_overwrite_keeps_the_old_checkpoint(tmp_path):
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", filled(1.0))
  with pytest.raises(ValueError, match="Unsupported type"):
    jaxmp.flax.save_checkpoint(tmp_path / "ckpt", {"a": "not an array"}, force=True)
  assert restored_value(tmp_path / "ckpt") == 1.0
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", filled(2.0), force=True)
  assert restored_value(tmp_path / "ckpt") == 2.0
