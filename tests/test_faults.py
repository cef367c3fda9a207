"""Fault injection at scale: inf, -inf and nan in the loss and in gradient leaves,
by seeded patterns and configurations (drawn by hypothesis, derandomized), over
thousands of steps of one jitted ``lax.scan``: no value becomes non-finite, the
params are the bare optimizer's on the clean steps only, every injected step is
counted, and the scale never reaches 0 or inf and recovers after bursts."""

import functools
import math
import os
import subprocess
import sys

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxmp
from models import finite, init_mlp, make_batch, mlp, mse

STEPS, SLOW_STEPS = 2_000, 10_000
BAD_VALUES = np.array([np.inf, -np.inf, np.nan], np.float32)
init_params = lambda seed=0: init_mlp(jax.random.key(seed), sizes=(4, 8, 3))
N_LEAVES = len(jax.tree_util.tree_leaves(init_params()))
loss_fn = lambda params, x, y: mse(params, {"x": x, "y": y})
# One batch of 8 per step, (x, y) with a leading step axis: y a teacher's outputs and noise.
X, NOISE = (np.asarray(v).reshape(SLOW_STEPS, 8, -1)
            for v in make_batch(1234, n=8 * SLOW_STEPS).values())
DATA = (X, np.asarray(mlp(init_params(99), X)) + np.float32(0.1) * NOISE)


def inner_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 50, SLOW_STEPS)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-4))


def wrapped(loss_scale, k=1):  # accumulating k micro-batches if k > 1
  return (jaxmp.loss_scaling(inner_optimizer(), loss_scale) if k == 1
          else jaxmp.multi_steps(inner_optimizer(), loss_scale, k))


class Plan:
  """A seeded fault plan over ``n`` steps (NumPy arrays, one entry a step): which steps are
  injected, where (site 0 is the loss, site i > 0 gradient leaf i - 1), and with which value."""

  def __init__(self, inject, seed, sites="mixed"):
    rng, n, self.inject = np.random.default_rng(seed), len(inject), np.asarray(inject, bool)
    low, high = {"loss": (0, 1), "leaf": (1, N_LEAVES + 1)}.get(sites, (0, N_LEAVES + 1))
    self.site = rng.integers(low, high, n).astype(np.int32)
    self.value = BAD_VALUES[rng.integers(0, 3, n)]
    self.element = rng.integers(0, 2**16, n, np.int32)
    edges = np.diff(np.concatenate([[0], self.inject.astype(np.int8), [0]]))
    # (start, stop) of each maximal run of injected steps.
    self.segments = list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def pattern(kind, n, rate, seed):
  """``rate`` of ``n`` steps injected at random, or every ``1 / rate``-th step."""
  if kind == "random":
    return np.random.default_rng(seed).random(n) < rate
  every = int(round(1 / rate))
  return np.arange(n) % every == seed % every


def burst_pattern(n, n_bursts, length, seed, clean_tail):
  """``n_bursts`` bursts of ``length`` steps, all before the last ``clean_tail``."""
  inject = np.zeros(n, bool)
  for slot in np.random.default_rng(seed).choice(
      (n - clean_tail) // (2 * length), n_bursts, replace=False):
    inject[slot * 2 * length: slot * 2 * length + length] = True
  return inject


def faulty_step(params, opt_state, x, y, inject, site, value, element, k=1):
  # The wrapper is rebuilt around the loss scale held in the state, so one
  # jitted function serves every configuration (jit recompiles per config).
  loss_scale = jaxmp.get_loss_scale(opt_state)
  tx = wrapped(loss_scale, k)
  loss_factor = jnp.where(inject & (site == 0), value, jnp.float32(1))
  _, grads = jaxmp.scaled_value_and_grad(
      lambda p: loss_fn(p, x, y) * loss_factor, loss_scale)(params)
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  leaves = [jnp.where(inject & (site == i + 1), g.reshape(-1).at[element % g.size].set(
      value).reshape(g.shape), g) for i, g in enumerate(leaves)]
  updates, opt_state = tx.update(jax.tree_util.tree_unflatten(treedef, leaves),
                                 opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@functools.partial(jax.jit, static_argnums=3)
def _run_with_faults(params, opt_state, xs, k):
  carry, states = jax.lax.scan(lambda carry, xs: (faulty_step(*carry, *xs, k=k),) * 2,
                               (params, opt_state), xs)
  return *carry, states[1]


def run_with_faults(loss_scale, params, plan, k=1):
  """Params, state and the states after each step of training over ``plan``."""
  n = len(plan.inject)
  return _run_with_faults(params, wrapped(loss_scale, k).init(params), (
      DATA[0][:n], DATA[1][:n], plan.inject, plan.site, plan.value, plan.element), k)


scales_of = lambda states: np.asarray(jaxmp.get_loss_scale(states).loss_scale)


@functools.partial(jax.jit, static_argnums=3)
def _run_reference(params, xs, clean, k):
  inner = inner_optimizer() if k == 1 else optax.MultiSteps(inner_optimizer(), k)

  def body(carry, xs):
    (params, state), (x, y, clean) = carry, xs
    updates, new_state = inner.update(jax.grad(loss_fn)(params, x, y), state, params)
    keep = lambda new, old: jnp.where(clean, new, old)
    return jax.tree_util.tree_map(keep, (optax.apply_updates(params, updates), new_state),
                                  (params, state)), None

  return jax.lax.scan(body, (params, inner.init(params)), (*xs, clean))[0]


def run_reference(params, clean, k=1):
  """The bare optimizer (in optax.MultiSteps for k > 1) on the ``clean`` steps only."""
  return _run_reference(params, (DATA[0][:len(clean)], DATA[1][:len(clean)]), clean, k)


def backoffs_to_recover(loss_scale, n_overflows):
  """Growth periods needed to undo ``n_overflows`` back-offs."""
  per_backoff = math.log(1 / loss_scale.backoff_factor) / math.log(loss_scale.factor)
  return math.ceil(n_overflows * per_backoff - 1e-9)


def check_scale_trajectory(loss_scale, plan, scales):
  """Never 0 or inf, within [min, max], backs off and recovers after bursts."""
  assert np.all(np.isfinite(scales)) and np.all(scales > 0) and np.float32(
      loss_scale.min_loss_scale) <= scales.min() <= scales.max() <= loss_scale.max_loss_scale
  before = np.concatenate([[np.float32(loss_scale.loss_scale)], scales])
  recovered = 0
  for start, stop in plan.segments:
    # Enough overflows in a row to exhaust the hysteresis budget back off.
    if before[start] > loss_scale.min_loss_scale and stop - start >= loss_scale.hysteresis:
      assert scales[stop - 1] < before[start], (start, stop)
    next_fault = next((a for a, _ in plan.segments if a >= stop), len(plan.inject))
    needed = loss_scale.period * (backoffs_to_recover(loss_scale, stop - start) + 1)
    if next_fault - stop >= needed:
      # A growth above max_loss_scale is refused, so the scale may stop short.
      target = min(before[start], loss_scale.max_loss_scale / loss_scale.factor)
      assert scales[stop + needed - 1] >= target * (1 - 1e-5), (start, stop)
      recovered += 1
  return recovered


def check_run(loss_scale, plan, params0):
  params, opt_state, states = run_with_faults(loss_scale, params0, plan)
  scales = scales_of(states)
  assert finite((params, opt_state))
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == int(plan.inject.sum())
  ref_params, ref_state = run_reference(params0, ~plan.inject)
  chex.assert_trees_all_close((params, opt_state.inner_state), (ref_params, ref_state),
                              rtol=2e-5, atol=1e-6)
  return scales, check_scale_trajectory(loss_scale, plan, scales)


CONFIGS = {
    "jmp-like": jaxmp.DynamicLossScale(2.0**15, period=20),
    "deepspeed-like": jaxmp.DynamicLossScale(
        2.0**12, period=10, min_loss_scale=2.0**-4, hysteresis=2, max_loss_scale=2.0**36),
    "non-binary": jaxmp.DynamicLossScale(
        2.0**10, period=3, factor=1.5, backoff_factor=0.8, max_loss_scale=2.0**30),
}
SITES = st.sampled_from(["loss", "leaf", "mixed"])
SEEDS = st.integers(0, 2**16)


@st.composite
def dynamic_loss_scales(draw):
  period = draw(st.sampled_from([1, 3, 10, 50, 400]))
  init_power = draw(st.integers(0, 24))
  # Below 2**40 the scaled float32 gradients of this model never overflow, so every skipped step is
  # an injected one. Slowly growing scales may keep the default maximum (the largest float32).
  max_power = draw(st.sampled_from([init_power, 30, 40] + ([None] if period >= 400 else [])))
  return jaxmp.DynamicLossScale(
      2.0**init_power, period=period, factor=draw(st.sampled_from([2.0, 4.0, 1.5])),
      min_loss_scale=2.0 ** draw(st.integers(-10, min(init_power, 4))),
      backoff_factor=draw(st.sampled_from([None, 0.5, 0.25, 0.8])),
      max_loss_scale=None if max_power is None else 2.0**max_power,
      hysteresis=draw(st.integers(1, 3)), consecutive_hysteresis=draw(st.booleans()))


@pytest.mark.integration
@settings(derandomize=True, max_examples=14, deadline=None)
@given(loss_scale=st.one_of(st.sampled_from(sorted(CONFIGS)).map(CONFIGS.get),
                            dynamic_loss_scales()),
       sites=SITES, seed=SEEDS, kind=st.sampled_from(["random", "periodic"]),
       rate=st.sampled_from([0.001, 0.01, 0.1, 0.5]), burst=st.booleans())
@example(loss_scale=CONFIGS["jmp-like"], sites="mixed", seed=1, kind="random", rate=0.5,
         burst=False)  # the extremes
@example(loss_scale=CONFIGS["non-binary"], sites="leaf", seed=2, kind="random", rate=0.001,
         burst=False)
@example(loss_scale=CONFIGS["jmp-like"], sites="leaf", seed=4, kind="periodic", rate=0.5,
         burst=False)
def test_random_faults(loss_scale, sites, seed, kind, rate, burst):
  """Random or periodic faults, maybe a burst, under any configuration."""
  inject = pattern(kind, STEPS, rate, seed)
  inject[STEPS // 4: STEPS // 4 + 20] |= burst
  check_run(loss_scale, Plan(inject, seed, sites), init_params(seed % 5))


@pytest.mark.integration
@settings(derandomize=True, max_examples=6, deadline=None)
@given(config=st.sampled_from(sorted(CONFIGS)), sites=SITES, seed=SEEDS,
       n_bursts=st.integers(1, 4), length=st.sampled_from([2, 10, 40]))
@example(config="deepspeed-like", sites="loss", seed=3, n_bursts=4, length=40)
def test_burst_faults(config, sites, seed, n_bursts, length):
  loss_scale = CONFIGS[config]
  tail = loss_scale.period * (backoffs_to_recover(loss_scale, length) + 1)
  plan = Plan(burst_pattern(STEPS, n_bursts, length, seed, tail), seed, sites)
  scales, recovered = check_run(loss_scale, plan, init_params(seed % 5))
  assert recovered >= 1  # at least the last burst is followed by a recovery
  assert scales.min() < scales.max()


@pytest.mark.slow
@settings(derandomize=True, max_examples=12, deadline=None)
@given(loss_scale=dynamic_loss_scales(), sites=SITES, seed=SEEDS,
       kind=st.sampled_from(["random", "burst", "periodic"]),
       rate=st.sampled_from([0.001, 0.01, 0.1, 0.5]))
def test_long_runs(loss_scale, sites, seed, kind, rate):
  """The slow variant: 10,000 steps (`make test-slow`)."""
  tail = loss_scale.period * (backoffs_to_recover(loss_scale, 50) + 1)
  inject = (burst_pattern(SLOW_STEPS, 5, 50, seed, min(tail, SLOW_STEPS // 2))
            if kind == "burst" else pattern(kind, SLOW_STEPS, rate, seed))
  check_run(loss_scale, Plan(inject, seed, sites), init_params(seed % 5))


@pytest.mark.integration
def test_scale_tops_out_below_inf_and_unscales_exactly_there():
  """With the default maximum the scale climbs to 2**127, never inf; there its
  reciprocal is a float32 subnormal, which the CPU flushes to zero, and the
  gradients are still unscaled exactly: the run equals the reference."""
  plan = Plan(pattern("random", STEPS, 0.01, 5), 5)
  scales, _ = check_run(jaxmp.DynamicLossScale(2.0**100, period=1), plan, init_params(1))
  assert scales.max() == 2.0**127 and np.all(np.isfinite(scales))
  grads = {"w": jnp.array([1e-3, 1.0, -1.5, 1e-30], jnp.float32)}
  top = jaxmp.DynamicLossScale(2.0**127)
  for unscale in (top.unscale, jax.jit(top.unscale)):
    chex.assert_trees_all_equal(unscale(top.scale(grads)), grads)


def test_scale_never_reaches_zero_even_without_a_floor():
  """``min_loss_scale=0`` (PyTorch's choice) stops at 2**-126, not at 0."""
  final, scales = jax.jit(lambda ls: jax.lax.scan(
      lambda ls, _: (ls.adjust(jnp.array(False)), ls.loss_scale), ls, None, length=300))(
          jaxmp.DynamicLossScale(1.0, min_loss_scale=0.0))
  assert np.asarray(scales).min() == float(final.loss_scale) == np.finfo(np.float32).tiny
  assert np.all(np.asarray(scales) > 0) and int(final.overflows_at_min) == 300 - 126
  with pytest.raises(jaxmp.LossScaleAtMinimumError):
    jaxmp.check_loss_scale(final)


@pytest.mark.integration
def test_accumulation_under_random_faults():
  """A bad micro-batch skips its accumulated step; the next starts clean."""
  k, loss_scale, params0 = 4, jaxmp.DynamicLossScale(2.0**10, period=5), init_params(2)
  inject = pattern("random", 500 * k, 0.03, 11)
  inject[40 * k: 44 * k] = True  # four bad accumulations in a row
  params, opt_state, states = run_with_faults(loss_scale, params0, Plan(inject, 11), k)
  assert finite((params, opt_state))
  bad = inject.reshape(-1, k).any(axis=1)
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == int(bad.sum())
  # After every emitted step the accumulator is exactly zero.
  emitted = np.asarray(states.mini_step) == 0
  assert emitted.sum() == len(bad)
  assert not any(np.any(a[emitted]) for a in jax.tree_util.tree_leaves(states.acc_grads))
  # The scale is adjusted once per accumulated step: it backs off once per
  # bad accumulation, whatever the number of bad micro-batches in it.
  expected = jax.lax.scan(lambda ls, bad: (ls.adjust(~bad),) * 2, loss_scale, bad)[1]
  np.testing.assert_array_equal(scales_of(states)[k - 1::k], expected.loss_scale)
  # The params are those of optax.MultiSteps on the clean accumulations only.
  chex.assert_trees_all_close(params, run_reference(params0, np.repeat(~bad, k), k)[0],
                              rtol=2e-5, atol=1e-6)


def test_persistent_overflow_reaches_the_minimum_and_check_loss_scale_explains():
  loss_scale = jaxmp.DynamicLossScale(2.0**10, period=5, min_loss_scale=4.0)
  n, params0 = 50, init_params(3)
  params, opt_state, states = run_with_faults(loss_scale, params0, Plan(np.ones(n, bool), 0))
  np.testing.assert_array_equal(scales_of(states), [2.0 ** max(9 - i, 2) for i in range(n)])
  chex.assert_trees_all_equal(params, params0)
  # Eight back-offs take 2**10 to 4; the next 42 overflows find it there.
  assert int(jaxmp.loss_scaling_metrics(opt_state)["overflows_at_min"]) == n - 8
  jaxmp.check_loss_scale(opt_state, max_overflows_at_min=n - 8)
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as error:
    jaxmp.check_loss_scale(opt_state)
  message = str(error.value)
  assert message.startswith("Current loss scale already at minimum (4.0)") and all(
      remedy in message for remedy in ("bfloat16", "auto_policy()", "learning rate",
                                       "lip gradients", "bad data", "nonfinite_paths")), message


# A float16 forward pass that overflows at every step, whatever the scale.
TRAINING_SCRIPT = '''
import jax, jax.numpy as jnp, optax, jaxmp
loss_fn = lambda p: jnp.sum((1e3 * p).astype(jnp.float16) ** 3).astype(jnp.float32)
tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**15))
params, state = jnp.ones(4), tx.init(jnp.ones(4))

@jax.jit
def train_step(params, state):
  grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(state))(params)[1]
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state

for step in range(1, 1001):
  params, state = train_step(params, state)
  if step % 10 == 0:
    print("step", step, flush=True)
    jaxmp.check_loss_scale(state)
'''


@pytest.mark.integration
def test_training_loop_stops_with_the_remedies_not_a_jax_traceback(tmp_path):
  (script := tmp_path / "train.py").write_text(TRAINING_SCRIPT)
  result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
  assert result.returncode == 1, result.stderr
  # 2**15 backs off 15 times to the minimum of 1; overflows 16 to 20 find it
  # there, so the check after step 20 stops the loop.
  assert result.stdout.split() == ["step", "10", "step", "20"]
  stderr = result.stderr.rstrip()
  # The output ends with the message itself, remedies included.
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as error:
    jaxmp.check_loss_scale(jaxmp.DynamicLossScale(1.0).adjust(jnp.array(False)))
  assert stderr.endswith(str(error.value).split("\n", 1)[1].rstrip())
  assert ("LossScaleAtMinimumError: Current loss scale already at minimum (1.0): "
          "5 overflow(s) at the minimum scale.") in stderr
  frames = [line for line in stderr.splitlines() if line.startswith('  File "')]
  assert len(frames) == 2, stderr  # the loop, then check_loss_scale
  assert str(script) in frames[0] and "checks.py" in frames[1]
  assert "jax/_src" not in stderr and "jaxlib" not in stderr


def primitive_names(jaxpr):
  return {eqn.primitive.name for eqn in jaxpr.eqns}.union(*(
      primitive_names(sub) for eqn in jaxpr.eqns
      for sub in jax.extend.core.jaxprs_in_params(eqn.params)))


def test_a_faulty_step_never_syncs_branches_or_retraces():
  loss_scale, params = CONFIGS["deepspeed-like"], init_params(4)
  opt_state = jaxmp.loss_scaling(inner_optimizer(), loss_scale).init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, opt_state, *fault):
    params, opt_state = faulty_step(params, opt_state, *fault)
    return params, opt_state, jaxmp.loss_scaling_metrics(opt_state)

  plan = Plan(pattern("random", 40, 0.5, 9), 9)
  faults = [jax.device_put((DATA[0][i], DATA[1][i], plan.inject[i], plan.site[i],
                            plan.value[i], plan.element[i])) for i in range(40)]
  names = primitive_names(jax.make_jaxpr(step)(params, opt_state, *faults[0]).jaxpr)
  assert not names & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}
  step(params, opt_state, *faults[0])  # compiled outside the guard
  with jax.transfer_guard("disallow"):
    for fault in faults:
      params, opt_state, metrics = step(params, opt_state, *fault)
  assert int(metrics["skipped_steps"]) == int(plan.inject.sum()) > 0
  assert float(metrics["loss_scale"]) != float(loss_scale.loss_scale)
