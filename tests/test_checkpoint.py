"""Checkpoints: resumes mid-burst (Linen, NNX, a gradient accumulator), the configuration they
check (refused unless ``check_config=False``, with advice that works), overwrites that fail or are
killed. The checkpoints of a run that switched precision: tests/test_fallback.py."""

import pathlib
import shutil
import signal
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from models import LinenMLP, NnxMLP, f32, make_batch

BURST_SCALE = jaxmp.DynamicLossScale(2.0**10, period=4, min_loss_scale=2.0**6, hysteresis=3)
# 24 steps, eight overflows in a row, a checkpoint after the 12th: inside the burst.
N_STEPS, BURST, SAVE_AT = 24, range(8, 16), 12
init_params = jax.jit(lambda seed, x: LinenMLP().init(jax.random.key(seed), x)["params"])  # one jit
all_finite, batch = jax.jit(jaxmp.all_finite), lambda i: (make_batch(i)["x"], make_batch(i)["y"])
# States committed to a device (as restored ones are), one adamw: a step compiles once.
commit, ADAMW = lambda tree: jax.device_put(tree, jax.devices()[0]), optax.adamw(1e-2)


def make_state(policy="mixed_float16", loss_scale=BURST_SCALE, tx=ADAMW, features=4):
  return commit(jaxmp.flax.TrainState.create(apply_fn=LinenMLP().apply, policy=policy, tx=tx,
      params=init_params(0, np.ones((1, features), np.float32)), loss_scale=loss_scale))


@jax.jit
def train_step(state, x, y):
  loss_fn = lambda params, x, y: jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
  return state.apply_gradients(grads=state.value_and_grad(loss_fn)(state.params, x, y)[1])


def make_nnx():
  model = nnx.jit(lambda: NnxMLP(nnx.Rngs(0)))()
  jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
  opt = nnx.Optimizer(model, jaxmp.loss_scaling(ADAMW, BURST_SCALE), wrt=nnx.Param)
  nnx.update((model, opt), commit(nnx.state((model, opt))))
  return model, opt


@nnx.jit
def nnx_train_step(model, optimizer, x, y):
  _, grads = jaxmp.scaled_value_and_grad(
      lambda m: jnp.mean((m(x).astype(jnp.float32) - y) ** 2),
      jaxmp.get_loss_scale(optimizer.opt_state), value_and_grad=nnx.value_and_grad)(model)
  optimizer.update(model, grads)


def opt_state(state):
  """Of a Linen TrainState, or an NNX model and its nnx.Optimizer (a tuple)."""
  return state[1].opt_state if isinstance(state, tuple) else state.opt_state


def arrays(state):
  """A snapshot of the arrays (a TrainState's ``tx`` is a new closure in each state)."""
  return (nnx.to_pure_dict(nnx.state(state)) if isinstance(state, tuple)
          else (state.step, state.params, state.opt_state))


def run(state, steps):
  """``(state, loss scales)`` after ``steps`` (NNX objects in place)."""
  scales = []
  for i in steps:
    x, y = batch(i)  # an overflow in the burst: an inf at x[0, 0] (made in NumPy)
    args = (f32(np.where(np.indices(x.shape).sum(0) == 0, np.inf, x)) if i in BURST else x, y)
    if isinstance(state, tuple):
      nnx_train_step(*state, *args)
    else:
      state = train_step(state, *args)
    scales.append(float(jaxmp.get_loss_scale(opt_state(state)).loss_scale))
  return state, scales


@pytest.mark.parametrize("framework", ["linen", "nnx"])
def test_resume_in_the_middle_of_a_fault_burst_is_bit_identical(tmp_path, framework):
  state, scales = run(make_state() if framework == "linen" else make_nnx(), range(SAVE_AT))
  # The checkpoint is written mid-burst: the last step overflowed, the scale
  # has backed off and the hysteresis budget is partly spent.
  metrics = jaxmp.loss_scaling_metrics(opt_state(state))
  loss_scale = jaxmp.get_loss_scale(opt_state(state))
  assert (bool(metrics["last_finite"]), int(metrics["skipped_steps"])) == (
      False, SAVE_AT - BURST.start)
  assert float(loss_scale.loss_scale) < max(scales)
  assert 1 <= int(loss_scale.hysteresis_left) < loss_scale.hysteresis
  jaxmp.flax.save_checkpoint(tmp_path / "mid_burst", state)
  saved = arrays(state)
  reference, reference_scales = run(state, range(SAVE_AT, N_STEPS))
  # Into an abstract target (jax.eval_shape), a fresh one, or new NNX objects.
  targets = ({"abstract": jax.eval_shape(make_state), "fresh": make_state()}
             if framework == "linen" else {"new objects": make_nnx()})
  for name, target in targets.items():
    restored = jaxmp.flax.restore_checkpoint(tmp_path / "mid_burst", target)
    if framework == "linen":  # NNX objects are restored in place
      assert isinstance(restored, jaxmp.flax.TrainState), name
      assert restored.policy == jaxmp.get_policy("mixed_float16"), name
    restored = restored if framework == "linen" else target
    assert int(target[1].step[...] if framework == "nnx" else restored.step) == SAVE_AT, name
    chex.assert_trees_all_equal(arrays(restored), saved)
    assert jaxmp.get_loss_scale(opt_state(restored)).config() == BURST_SCALE.config(), name
    resumed, resumed_scales = run(restored, range(SAVE_AT, N_STEPS))
    chex.assert_trees_all_equal(arrays(resumed), arrays(reference))
    assert resumed_scales == reference_scales, name
    assert int(jaxmp.loss_scaling_metrics(opt_state(resumed))["skipped_steps"]) == len(BURST)
    # The burst drove the scale to its minimum, and it grew again afterwards.
    assert min(scales + resumed_scales) == 2.0**6 < resumed_scales[-1], name


def test_resume_with_a_nan_in_the_gradient_accumulator(tmp_path):
  """Saved between a poisoned micro-batch and the end of its accumulation."""
  params0 = init_params(1, np.ones((1, 4), np.float32))
  tx = jaxmp.multi_steps(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10, period=2), 4)

  @jax.jit
  def micro_step(params, opt_state, x, y, inject):
    loss_fn = lambda params: jnp.mean((LinenMLP().apply({"params": params}, x) - y) ** 2)
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(opt_state))(params)
    grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, jnp.nan * g, g), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def run_micro(params, opt_state, steps):
    for i in steps:
      params, opt_state = micro_step(params, opt_state, *batch(i), jnp.asarray(i == 5))
    return params, opt_state

  params, opt_state = run_micro(*commit((params0, tx.init(params0))), range(6))
  assert not bool(all_finite(opt_state.acc_grads))  # the nan is saved
  jaxmp.flax.save_checkpoint(tmp_path / "accumulating", (params, opt_state))
  reference = run_micro(params, opt_state, range(6, 16))
  restored = jaxmp.flax.restore_checkpoint(
      tmp_path / "accumulating", jax.eval_shape(lambda: (params0, tx.init(params0))))
  chex.assert_trees_all_equal(restored, (params, opt_state))
  resumed = run_micro(*restored, range(6, 16))
  chex.assert_trees_all_equal(resumed, reference)
  # The poisoned accumulation was skipped once; the next ones were applied.
  assert int(jaxmp.loss_scaling_metrics(resumed[1])["skipped_steps"]) == 1
  assert all_finite(resumed)


@pytest.mark.parametrize("saved_policy, target_policy", [
    ("float32", "mixed_float16"), ("mixed_float16", "float32")])
def test_switching_between_float32_and_float16_fails_clearly_and_the_advice_works(
    tmp_path, saved_policy, target_policy):
  of = lambda policy: make_state(policy, None if policy == "float32" else BURST_SCALE)
  saved, target = of(saved_policy), of(target_policy)
  for i in range(3):
    saved = train_step(saved, *batch(i))
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", saved)
  for check_config in (True, False):
    with pytest.raises(ValueError) as error:
      jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", target, check_config=check_config)
    message = str(error.value)
    assert (f"holds a {type(saved.loss_scale).__name__} and the target a "
            f"{type(target.loss_scale).__name__}") in message
    assert f"'policy': '{saved.policy}'" in message  # the saved configuration
    assert "params=restored.params" in message and "inner_state" in message
  # What the message advises: restore under the saved configuration, then
  # start the new run from its params (and optimizer moments).
  restored = jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", of(saved_policy))
  switched = target.replace(params=restored.params, opt_state=target.opt_state._replace(
      inner_state=restored.opt_state.inner_state))
  chex.assert_trees_all_equal((switched.params, switched.opt_state.inner_state),
                              (saved.params, saved.opt_state.inner_state))
  switched = train_step(switched, *batch(3))
  assert int(switched.metrics["skipped_steps"]) == 0 and all_finite(switched.params)
  assert switched.policy == jaxmp.get_policy(target_policy)


CONFIGURED = jaxmp.DynamicLossScale(2.0, period=7, factor=3.0, min_loss_scale=0.5,
    backoff_factor=0.25, max_loss_scale=2.0**20, hysteresis=3, consecutive_hysteresis=True)


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
  config = {k: v for k, v in CONFIGURED.config().items() if k != "type"}
  saved = "p=f32,c=f16,o=f32" if field == "policy" else config[field]
  target = make_state("mixed_float16", jaxmp.DynamicLossScale(2.0, **{**config, field: value})
                      ) if field != "policy" else make_state(value, CONFIGURED)
  with pytest.raises(ValueError) as error:
    jaxmp.flax.restore_checkpoint(configured_checkpoint, target)
  message = str(error.value)
  assert f"'{field}': {saved!r}" in message and f"'{field}': {value!r}" in message
  assert "check_config=False" in message
  restored = jaxmp.flax.restore_checkpoint(configured_checkpoint, target, check_config=False)
  assert value == (  # the target's, as asked
      str(restored.policy) if field == "policy" else getattr(restored.loss_scale, field))
  chex.assert_trees_all_equal(*[jax.tree_util.tree_leaves(arrays(s)) for s in (
      restored, make_state("mixed_float16", CONFIGURED))])  # the saved arrays


def test_a_plain_orbax_checkpoint_restores_with_orbax_and_unchecked_with_jaxmp(tmp_path):
  # With orbax alone, the static configuration lives in the target's treedef.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  state, checkpointer = make_state("mixed_float16", CONFIGURED), ocp.StandardCheckpointer()
  checkpointer.save(tmp_path / "plain", state)
  checkpointer.wait_until_finished()
  target = jax.eval_shape(lambda: make_state("mixed_float16", CONFIGURED))
  for restored in (checkpointer.restore(tmp_path / "plain", target),
                   jaxmp.flax.restore_checkpoint(tmp_path / "plain", target, check_config=False)):
    chex.assert_trees_all_equal(arrays(restored), arrays(state))
    assert restored.loss_scale.config() == CONFIGURED.config()  # from the target


@pytest.mark.parametrize("other, expected", [
    ({"tx": optax.sgd(0.1, momentum=0.9)},
     r"only in the checkpoint: opt_state/inner_state/0/count, "
     r"opt_state/inner_state/0/mu/Dense_0/bias, .* and 7 more; "
     r"only in the target: opt_state/inner_state/0/trace/Dense_0/bias"),
    ({"features": 5},
     r"shapes \(params/Dense_0/kernel: \(4, 16\) in the checkpoint, \(5, 16\) in the "
     r"target; opt_state/inner_state/0/mu/Dense_0/kernel: .*\), so it was saved for a "
     r"model of another size")], ids=["optimizer", "shapes"])
def test_a_mismatched_checkpoint_is_refused_quietly_before_any_array_is_read(
    tmp_path, other, expected, capfd, caplog):
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", make_state())
  target = make_state(**other)
  capfd.readouterr()
  for check_config in (True, False):
    with pytest.raises(ValueError, match=expected):
      jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", target, check_config=check_config)
  assert capfd.readouterr() == ("", "")
  assert not [r for r in caplog.records if r.levelno >= 30]  # no warnings logged


# A forced overwrite never loses the checkpoint it replaces. For each line "path value kill_at", a
# child forked (JAX starts in it, never in the parent) saves `value`s over the checkpoint at `path`
# and SIGKILLs itself before its `kill_at`-th os.rename or shutil.rmtree (each filesystem step of
# the overwrite, orbax's and jaxmp's); its exit code is the answer (-9 if killed).
KILLED_SAVES = """
import itertools, os, shutil, signal, sys, traceback
import numpy as np
import jaxmp.flax

for line in sys.stdin:
  path, value, kill_at = line.split()
  if (pid := os.fork()) == 0:
    calls = itertools.count(1)

    def dying(function):
      def call(*args, **kwargs):
        if next(calls) == int(kill_at):
          os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)
      return call

    os.rename, shutil.rmtree = dying(os.rename), dying(shutil.rmtree)
    try:
      jaxmp.flax.save_checkpoint(
          path, {name: np.full((64, 64), float(value), np.float32) for name in "abc"}, force=True)
    except BaseException:  # pylint: disable=broad-except
      traceback.print_exc()
      os._exit(1)
    os._exit(0)
  print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""


def filled(value):
  return {name: np.full((64, 64), value, np.float32) for name in "abc"}


def restored_value(path):
  values = {float(v) for leaf in jaxmp.flax.restore_checkpoint(path, filled(0.0)).values()
            for v in np.unique(leaf)}
  assert len(values) == 1, values  # all old or all new, never a mixture
  return values.pop()


@pytest.mark.integration  # a process that forks a child per moment
def test_a_forced_overwrite_killed_at_any_moment_leaves_a_restorable_checkpoint(tmp_path):
  jaxmp.flax.save_checkpoint(tmp_path / "original", filled(1.0))
  saves = subprocess.Popen(  # from the root, so that it imports this jaxmp
      [sys.executable, "-c", KILLED_SAVES], cwd=pathlib.Path(__file__).resolve().parents[1],
      text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
  outcomes = []
  try:
    for kill_at in range(1, 40):
      work = tmp_path / f"kill_{kill_at}"
      shutil.copytree(tmp_path / "original", work / "ckpt")
      print(work / "ckpt", 2.0, kill_at, file=saves.stdin, flush=True)
      returncode = int(saves.stdout.readline())
      killed = returncode == -signal.SIGKILL
      assert killed or returncode == 0, returncode  # the child's traceback is on stderr
      outcomes.append(restored_value(work / "ckpt"))
      # Whatever the killed save left, the next forced save cleans up and completes.
      jaxmp.flax.save_checkpoint(work / "ckpt", filled(3.0), force=True)
      assert restored_value(work / "ckpt") == 3.0
      assert sorted(p.name for p in work.iterdir()) == ["ckpt"]
      if not killed:
        break
  finally:
    saves.stdin.close()
    saves.wait(timeout=120)
  assert outcomes[-1] == 2.0 and not killed  # the save ran to its end
  # The moments span the overwrite: kills left the old checkpoint, or (after the swap) the new.
  assert 1.0 in outcomes[:-1] and 2.0 in outcomes[:-1]


def test_a_failed_forced_overwrite_keeps_the_old_checkpoint(tmp_path):
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", filled(1.0))
  with pytest.raises(ValueError, match="Unsupported type"):
    jaxmp.flax.save_checkpoint(tmp_path / "ckpt", {"a": "not an array"}, force=True)
  assert restored_value(tmp_path / "ckpt") == 1.0
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", filled(2.0), force=True)
  assert restored_value(tmp_path / "ckpt") == 2.0
