"""Fault injection at scale: inf, -inf and nan in the loss and in gradient leaves.

Every run trains a small MLP for thousands of steps inside one jitted
``lax.scan``, injecting non-finite values by a seeded pattern (random, bursts,
periodic) at rates from 0.1% to 50%. After each run:

* no parameter or optimizer-state value is non-finite;
* the parameters equal (rtol 2e-5) those of a run that simply omits the
  injected steps, made with the bare optimizer on unscaled gradients;
* the skipped-step count equals the number of injected steps;
* the loss scale never reaches 0 or inf and recovers after bursts.

The patterns and the ``DynamicLossScale`` configurations are drawn by
hypothesis, derandomized, so every run of the suite sees the same cases.
"""

import math
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

N_IN, N_HIDDEN, N_OUT, BATCH = 4, 8, 2, 8
STEPS = 2_000
SLOW_STEPS = 10_000
SITE_LOSS = 0  # site 0 is the loss; site i > 0 is gradient leaf i - 1
BAD_VALUES = np.array([np.inf, -np.inf, np.nan], np.float32)
TRUE_W = np.random.default_rng(0).normal(size=(N_IN, N_OUT)).astype(np.float32)


def init_params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "hidden": {"w": jax.random.normal(k1, (N_IN, N_HIDDEN)) / 2.0,
                 "b": jnp.zeros(N_HIDDEN)},
      "out": {"w": jax.random.normal(k2, (N_HIDDEN, N_OUT)) / 3.0,
              "b": jnp.zeros(N_OUT)},
  }


N_LEAVES = len(jax.tree_util.tree_leaves(init_params()))


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["hidden"]["w"] + params["hidden"]["b"])
  pred = h @ params["out"]["w"] + params["out"]["b"]
  return jnp.mean((pred - y) ** 2)


def make_data(n_steps, seed=1234):
  """One batch per step, ``(x, y)`` with a leading step axis."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n_steps, BATCH, N_IN)).astype(np.float32)
  noise = rng.normal(size=(n_steps, BATCH, N_OUT)).astype(np.float32)
  return x, np.tanh(x @ TRUE_W) + np.float32(0.1) * noise


DATA = make_data(SLOW_STEPS)


def inner_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 50, SLOW_STEPS)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=1e-4))


# ---------------------------------------------------------------------------
# Fault plans: which steps are injected, where, and with which value.


class Plan:
  """A seeded fault plan over ``n`` steps (NumPy arrays, one entry a step)."""

  def __init__(self, inject, seed, sites="mixed"):
    rng = np.random.default_rng(seed)
    n = len(inject)
    self.inject = np.asarray(inject, bool)
    if sites == "loss":
      self.site = np.zeros(n, np.int32)
    elif sites == "leaf":
      self.site = rng.integers(1, N_LEAVES + 1, n).astype(np.int32)
    else:
      self.site = rng.integers(0, N_LEAVES + 1, n).astype(np.int32)
    self.value = BAD_VALUES[rng.integers(0, 3, n)]
    self.element = rng.integers(0, 2**16, n).astype(np.int32)

  @property
  def n_injected(self):
    return int(self.inject.sum())

  def injected_segments(self):
    """(start, stop) of each maximal run of injected steps."""
    edges = np.diff(np.concatenate([[0], self.inject.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def random_pattern(n, rate, seed):
  return np.random.default_rng(seed).random(n) < rate


def burst_pattern(n, n_bursts, length, seed, clean_tail):
  """``n_bursts`` bursts of ``length`` steps, all before the last ``clean_tail``."""
  rng = np.random.default_rng(seed)
  inject = np.zeros(n, bool)
  slots = np.sort(rng.choice((n - clean_tail) // (2 * length), n_bursts, replace=False))
  for slot in slots:
    inject[slot * 2 * length: slot * 2 * length + length] = True
  return inject


def periodic_pattern(n, every, offset):
  inject = np.zeros(n, bool)
  inject[offset::every] = True
  return inject


# ---------------------------------------------------------------------------
# The two runs: with loss scaling and injected faults, and the reference.


def poison_grads(grads, inject, site, value, element):
  leaves, treedef = jax.tree_util.tree_flatten(grads)
  poisoned = []
  for i, g in enumerate(leaves):
    bad = g.reshape(-1).at[element % g.size].set(value).reshape(g.shape)
    poisoned.append(jnp.where(inject & (site == i + 1), bad, g))
  return jax.tree_util.tree_unflatten(treedef, poisoned)


def faulty_step(params, opt_state, x, y, inject, site, value, element):
  # The wrapper is rebuilt around the loss scale held in the state, so one
  # jitted function serves every configuration (jit recompiles per config).
  tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.get_loss_scale(opt_state))
  loss_factor = jnp.where(inject & (site == SITE_LOSS), value, jnp.float32(1))
  faulty_loss = lambda p: loss_fn(p, x, y) * loss_factor
  loss_scale = jaxmp.get_loss_scale(opt_state)
  _, grads = jaxmp.scaled_value_and_grad(faulty_loss, loss_scale)(params)
  grads = poison_grads(grads, inject, site, value, element)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


@jax.jit
def _run_with_faults(params, opt_state, xs):
  def body(carry, xs):
    params, opt_state = faulty_step(*carry, *xs)
    return (params, opt_state), jaxmp.get_loss_scale(opt_state).loss_scale

  (params, opt_state), scales = jax.lax.scan(body, (params, opt_state), xs)
  return params, opt_state, scales


def run_with_faults(loss_scale, params, plan):
  """Trains over ``plan``; returns params, state and the scale after each step."""
  opt_state = jaxmp.loss_scaling(inner_optimizer(), loss_scale).init(params)
  n = len(plan.inject)
  xs = (DATA[0][:n], DATA[1][:n], plan.inject, plan.site, plan.value, plan.element)
  params, opt_state, scales = _run_with_faults(params, opt_state, xs)
  return params, opt_state, np.asarray(scales)


@jax.jit
def _run_reference(params, x, y, valid):
  inner = inner_optimizer()

  def body(carry, xs):
    params, state = carry
    x, y, valid = xs
    grads = jax.grad(loss_fn)(params, x, y)
    updates, new_state = inner.update(grads, state, params)
    new_params = optax.apply_updates(params, updates)
    # Padding at the end only, so that all runs of a length share one program.
    keep = lambda new, old: jnp.where(valid, new, old)
    return (jax.tree_util.tree_map(keep, new_params, params),
            jax.tree_util.tree_map(keep, new_state, state)), None

  return jax.lax.scan(body, (params, inner.init(params)), (x, y, valid))[0]


def run_reference(params, plan):
  """The bare optimizer on the unscaled gradients of the clean steps only."""
  n = len(plan.inject)
  clean = np.flatnonzero(~plan.inject)
  steps = np.zeros(n, np.int64)
  steps[: len(clean)] = clean
  valid = np.arange(n) < len(clean)
  return _run_reference(params, DATA[0][steps], DATA[1][steps], valid)


def float_leaves(tree):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)
          if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)]


def assert_all_finite(tree, what):
  for leaf in float_leaves(tree):
    assert np.all(np.isfinite(leaf)), f"non-finite value in the {what}"


def backoffs_to_recover(loss_scale, n_overflows):
  """Growth periods needed to undo ``n_overflows`` back-offs."""
  per_backoff = math.log(1 / loss_scale.backoff_factor) / math.log(loss_scale.factor)
  return math.ceil(n_overflows * per_backoff - 1e-9)


def check_scale_trajectory(loss_scale, plan, scales):
  """Never 0 or inf, within [min, max], backs off and recovers after bursts."""
  assert np.all(np.isfinite(scales)) and np.all(scales > 0)
  assert scales.min() >= np.float32(loss_scale.min_loss_scale)
  assert scales.max() <= np.float32(loss_scale.max_loss_scale)
  before = np.concatenate([[np.float32(loss_scale.loss_scale)], scales])
  n = len(plan.inject)
  recovered = 0
  for start, stop in plan.injected_segments():
    if before[start] > loss_scale.min_loss_scale:
      # Enough overflows in a row to exhaust the hysteresis budget back off.
      if stop - start >= loss_scale.hysteresis:
        assert scales[stop - 1] < before[start], (start, stop)
    next_fault = next((a for a, _ in plan.injected_segments() if a >= stop), n)
    needed = loss_scale.period * (backoffs_to_recover(loss_scale, stop - start) + 1)
    if next_fault - stop >= needed:
      # A growth above max_loss_scale is refused, so the scale may stop short.
      target = min(before[start], loss_scale.max_loss_scale / loss_scale.factor)
      assert scales[stop + needed - 1] >= target * (1 - 1e-5), (start, stop)
      recovered += 1
  return recovered


def check_run(loss_scale, plan, params0):
  params, opt_state, scales = run_with_faults(loss_scale, params0, plan)
  assert_all_finite(params, "parameters")
  assert_all_finite(opt_state, "optimizer state")
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == plan.n_injected
  ref_params, ref_state = run_reference(params0, plan)
  chex.assert_trees_all_close(params, ref_params, rtol=2e-5, atol=1e-6)
  chex.assert_trees_all_close(opt_state.inner_state, ref_state, rtol=2e-5, atol=1e-6)
  recovered = check_scale_trajectory(loss_scale, plan, scales)
  return scales, recovered


# ---------------------------------------------------------------------------
# Injection patterns drawn by hypothesis, under three fixed configurations
# (data only: each configuration compiles once).

CONFIGS = {
    "jmp-like": jaxmp.DynamicLossScale(2.0**15, period=20),
    "deepspeed-like": jaxmp.DynamicLossScale(
        2.0**12, period=10, min_loss_scale=2.0**-4, hysteresis=2,
        max_loss_scale=2.0**36),
    "non-binary": jaxmp.DynamicLossScale(
        2.0**10, period=3, factor=1.5, backoff_factor=0.8, max_loss_scale=2.0**30),
}

PATTERNS = settings(derandomize=True, max_examples=6, deadline=None)
SITES = st.sampled_from(["loss", "leaf", "mixed"])
CONFIG_NAMES = st.sampled_from(sorted(CONFIGS))
SEEDS = st.integers(0, 2**16)


@pytest.mark.integration
@PATTERNS
@given(config=CONFIG_NAMES, sites=SITES, seed=SEEDS,
       rate=st.sampled_from([0.001, 0.01, 0.1, 0.5]))
@example(config="jmp-like", sites="mixed", seed=1, rate=0.5)  # the extremes
@example(config="non-binary", sites="leaf", seed=2, rate=0.001)
def test_random_faults(config, sites, seed, rate):
  plan = Plan(random_pattern(STEPS, rate, seed), seed, sites)
  check_run(CONFIGS[config], plan, init_params(seed % 5))


@pytest.mark.integration
@PATTERNS
@given(config=CONFIG_NAMES, sites=SITES, seed=SEEDS,
       n_bursts=st.integers(1, 4), length=st.sampled_from([2, 10, 40]))
@example(config="deepspeed-like", sites="loss", seed=3, n_bursts=4, length=40)
def test_burst_faults(config, sites, seed, n_bursts, length):
  loss_scale = CONFIGS[config]
  tail = loss_scale.period * (backoffs_to_recover(loss_scale, length) + 1)
  plan = Plan(burst_pattern(STEPS, n_bursts, length, seed, tail), seed, sites)
  scales, recovered = check_run(loss_scale, plan, init_params(seed % 5))
  assert recovered >= 1  # at least the last burst is followed by a recovery
  assert scales.min() < scales.max()


@pytest.mark.integration
@PATTERNS
@given(config=CONFIG_NAMES, sites=SITES, seed=SEEDS,
       every=st.sampled_from([2, 7, 100, 1000]))
@example(config="jmp-like", sites="leaf", seed=4, every=2)
def test_periodic_faults(config, sites, seed, every):
  plan = Plan(periodic_pattern(STEPS, every, seed % every), seed, sites)
  check_run(CONFIGS[config], plan, init_params(seed % 5))


# ---------------------------------------------------------------------------
# DynamicLossScale configurations drawn by hypothesis.


@st.composite
def dynamic_loss_scales(draw):
  factor = draw(st.sampled_from([2.0, 4.0, 1.5]))
  period = draw(st.sampled_from([1, 3, 10, 50, 400]))
  init_power = draw(st.integers(0, 24))
  # Below 2**40 the scaled float32 gradients of this model never overflow, so
  # every skipped step is an injected one. Slowly growing scales may keep the
  # default maximum (the largest float32).
  max_powers = [init_power, 30, 40] + ([None] if period >= 400 else [])
  max_power = draw(st.sampled_from(max_powers))
  return jaxmp.DynamicLossScale(
      2.0**init_power,
      period=period,
      factor=factor,
      min_loss_scale=2.0 ** draw(st.integers(-10, min(init_power, 4))),
      backoff_factor=draw(st.sampled_from([None, 0.5, 0.25, 0.8])),
      max_loss_scale=None if max_power is None else 2.0**max_power,
      hysteresis=draw(st.integers(1, 3)),
      consecutive_hysteresis=draw(st.booleans()),
  )


@pytest.mark.integration
@settings(derandomize=True, max_examples=5, deadline=None)
@given(loss_scale=dynamic_loss_scales(), sites=SITES, seed=SEEDS,
       rate=st.sampled_from([0.001, 0.05, 0.3]))
def test_loss_scale_configurations(loss_scale, sites, seed, rate):
  inject = random_pattern(STEPS, rate, seed)
  inject[STEPS // 4: STEPS // 4 + 20] = True  # and one burst
  check_run(loss_scale, Plan(inject, seed, sites), init_params(seed % 5))


# ---------------------------------------------------------------------------
# The edges of the scale's range.


@pytest.mark.integration
def test_scale_tops_out_below_inf_and_unscales_exactly_there():
  """With the default maximum the scale climbs to 2**127 and never becomes inf.

  At 2**127 the reciprocal of the scale is a float32 subnormal, which the CPU
  flushes to zero; the gradients must still be unscaled exactly (they were
  silently zeroed before this was fixed), so the run still equals the
  reference.
  """
  loss_scale = jaxmp.DynamicLossScale(2.0**100, period=1)
  plan = Plan(random_pattern(STEPS, 0.01, 5), 5)
  scales, _ = check_run(loss_scale, plan, init_params(1))
  assert scales.max() == 2.0**127 and np.all(np.isfinite(scales))
  grads = {"w": jnp.array([1e-3, 1.0, -1.5, 1e-30], jnp.float32)}
  top = jaxmp.DynamicLossScale(2.0**127)
  for unscale in (top.unscale, jax.jit(top.unscale)):
    chex.assert_trees_all_equal(unscale(top.scale(grads)), grads)


def test_scale_never_reaches_zero_even_without_a_floor():
  """``min_loss_scale=0`` (PyTorch's choice) stops at 2**-126, not at 0."""
  loss_scale = jaxmp.DynamicLossScale(1.0, min_loss_scale=0.0)

  @jax.jit
  def overflow_many_times(loss_scale):
    step = lambda ls, _: (ls.adjust(jnp.array(False)), ls.loss_scale)
    return jax.lax.scan(step, loss_scale, None, length=300)

  final, scales = overflow_many_times(loss_scale)
  scales = np.asarray(scales)
  tiny = np.finfo(np.float32).tiny
  assert scales.min() == tiny and float(final.loss_scale) == tiny
  assert np.all(scales > 0)
  assert int(final.overflows_at_min) == 300 - 126
  with pytest.raises(jaxmp.LossScaleAtMinimumError):
    jaxmp.check_loss_scale(final)


# ---------------------------------------------------------------------------
# Gradient accumulation under faults.

K = 4
ACCUMULATED_STEPS = 500
ACCUMULATION_SCALE = jaxmp.DynamicLossScale(2.0**10, period=5)
accumulation_tx = jaxmp.multi_steps(inner_optimizer(), ACCUMULATION_SCALE, K)


@jax.jit
def _run_accumulation(params, opt_state, xs):
  def body(carry, xs):
    params, opt_state = carry
    x, y, inject, value = xs
    _, grads = jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(opt_state))(params, x, y)
    grads = jax.tree_util.tree_map(lambda g: jnp.where(inject, value * g, g), grads)
    updates, opt_state = accumulation_tx.update(grads, opt_state, params)
    zero_accumulator = jnp.all(jnp.stack(
        [jnp.all(a == 0) for a in jax.tree_util.tree_leaves(opt_state.acc_grads)]))
    out = (jaxmp.get_loss_scale(opt_state).loss_scale, opt_state.mini_step,
           zero_accumulator)
    return (optax.apply_updates(params, updates), opt_state), out

  return jax.lax.scan(body, (params, opt_state), xs)


@jax.jit
def _reference_accumulation(params, x, y, valid):
  reference = optax.MultiSteps(inner_optimizer(), K)

  def body(carry, xs):
    params, state = carry
    x, y, valid = xs
    updates, new_state = reference.update(jax.grad(loss_fn)(params, x, y), state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jnp.where(valid, new, old)
    return (jax.tree_util.tree_map(keep, new_params, params),
            jax.tree_util.tree_map(keep, new_state, state)), None

  return jax.lax.scan(body, (params, reference.init(params)), (x, y, valid))[0]


@pytest.mark.integration
def test_accumulation_under_random_faults():
  """A bad micro-batch skips its accumulated step; the next starts clean."""
  n = ACCUMULATED_STEPS * K
  rng = np.random.default_rng(11)
  inject = rng.random(n) < 0.03
  inject[40 * K: 44 * K] = True  # four bad accumulations in a row
  value = BAD_VALUES[rng.integers(0, 3, n)]
  params0 = init_params(2)
  (params, opt_state), (scales, mini_steps, zero_accumulator) = _run_accumulation(
      params0, accumulation_tx.init(params0), (DATA[0][:n], DATA[1][:n], inject, value))
  assert_all_finite(params, "parameters")
  assert_all_finite(opt_state, "optimizer state")

  bad_accumulations = inject.reshape(ACCUMULATED_STEPS, K).any(axis=1)
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == int(bad_accumulations.sum())
  # After every emitted step the accumulator is exactly zero.
  emitted = np.asarray(mini_steps) == 0
  assert emitted.sum() == ACCUMULATED_STEPS
  assert np.all(np.asarray(zero_accumulator)[emitted])
  # The scale is adjusted once per accumulated step: it backs off once per
  # bad accumulation, whatever the number of bad micro-batches in it.
  expected = ACCUMULATION_SCALE
  expected_scales = []
  adjust = jax.jit(lambda ls, finite: ls.adjust(finite))
  for bad in bad_accumulations:
    expected = adjust(expected, jnp.asarray(not bad))
    expected_scales.append(float(expected.loss_scale))
  np.testing.assert_array_equal(np.asarray(scales)[K - 1::K], expected_scales)
  # And the parameters are those of optax.MultiSteps on the clean
  # accumulations only.
  clean = np.repeat(~bad_accumulations, K)
  rows = np.flatnonzero(clean)
  padded = np.zeros(n, np.int64)
  padded[: len(rows)] = rows
  ref_params, _ = _reference_accumulation(
      params0, DATA[0][padded], DATA[1][padded], np.arange(n) < len(rows))
  chex.assert_trees_all_close(params, ref_params, rtol=2e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Persistent overflow: down to the minimum scale, and a clear stop.


def test_persistent_overflow_reaches_the_minimum_and_check_loss_scale_explains():
  loss_scale = jaxmp.DynamicLossScale(2.0**10, period=5, min_loss_scale=4.0)
  n = 50
  plan = Plan(np.ones(n, bool), 0)
  params0 = init_params(3)
  params, opt_state, scales = run_with_faults(loss_scale, params0, plan)
  np.testing.assert_array_equal(
      scales, [2.0 ** max(9 - i, 2) for i in range(n)])  # halves down to 4
  chex.assert_trees_all_equal(params, params0)
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  # Eight back-offs take 2**10 to 4; the next 42 overflows find it there.
  assert int(metrics["overflows_at_min"]) == n - 8
  jaxmp.check_loss_scale(opt_state, max_overflows_at_min=n - 8)
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as error:
    jaxmp.check_loss_scale(opt_state)
  message = str(error.value)
  assert message.startswith("Current loss scale already at minimum (4.0)")
  for remedy in ("bfloat16", "auto_policy()", "learning rate", "lip gradients",
                 "bad data", "nonfinite_paths"):
    assert remedy in message, remedy


TRAINING_SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np, optax, jaxmp

# Large inputs and no normalisation: float16 activations overflow in the
# forward pass at every step, whatever the loss scale.
policy = jaxmp.get_policy("mixed_float16")
rng = np.random.default_rng(0)
params = {"w1": jnp.asarray(rng.normal(size=(16, 64)), jnp.float32),
          "w2": jnp.asarray(rng.normal(size=(64, 1)), jnp.float32)}
x = jnp.asarray(2000 * rng.normal(size=(32, 16)), jnp.float32)
y = jnp.zeros((32, 1), jnp.float32)


def loss_fn(params, x, y):
  p, x = policy.cast_to_compute((params, x))
  out = policy.cast_to_output(jax.nn.relu(x @ p["w1"]) @ p["w2"])
  return jnp.mean((out - y) ** 2)


tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale(2.0**15))
state = tx.init(params)


@jax.jit
def train_step(params, state):
  loss_scale = jaxmp.get_loss_scale(state)
  _, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, x, y)
  updates, state = tx.update(grads, state, params)
  return optax.apply_updates(params, updates), state


for step in range(1, 1001):
  params, state = train_step(params, state)
  if step % 10 == 0:
    print("step", step, flush=True)
    jaxmp.check_loss_scale(state)
print("finished")
'''


@pytest.mark.integration
def test_training_loop_stops_with_the_remedies_not_a_jax_traceback(
    tmp_path, compilation_cache_env):
  script = tmp_path / "train.py"
  script.write_text(TRAINING_SCRIPT)
  env = {**compilation_cache_env, "JAX_PLATFORMS": "cpu"}
  result = subprocess.run([sys.executable, str(script)], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
  assert result.returncode == 1, result.stderr
  # 2**15 backs off 15 times to the minimum of 1; overflows 16 to 20 find it
  # there, so the check after step 20 stops the loop.
  assert result.stdout.split() == ["step", "10", "step", "20"]
  stderr = result.stderr.rstrip()
  # The output ends with the message itself, remedies included.
  at_min = jaxmp.DynamicLossScale(1.0).adjust(jnp.array(False))
  with pytest.raises(jaxmp.LossScaleAtMinimumError) as error:
    jaxmp.check_loss_scale(at_min)
  remedies = str(error.value).split("\n", 1)[1]
  assert stderr.endswith(remedies.rstrip())
  assert ("LossScaleAtMinimumError: Current loss scale already at minimum (1.0): "
          "5 overflow(s) at the minimum scale.") in stderr
  frames = [line for line in stderr.splitlines() if line.startswith('  File "')]
  assert len(frames) == 2, stderr  # the loop, then check_loss_scale
  assert str(script) in frames[0] and "checks.py" in frames[1]
  assert "jax/_src" not in stderr and "jaxlib" not in stderr


# ---------------------------------------------------------------------------
# The slow variant: 10,000 steps (`make test-slow`).


@pytest.mark.slow
@settings(derandomize=True, max_examples=12, deadline=None)
@given(loss_scale=dynamic_loss_scales(), sites=SITES, seed=SEEDS,
       pattern=st.sampled_from(["random", "burst", "periodic"]),
       rate=st.sampled_from([0.001, 0.01, 0.1, 0.5]))
def test_long_runs(loss_scale, sites, seed, pattern, rate):
  if pattern == "random":
    inject = random_pattern(SLOW_STEPS, rate, seed)
  elif pattern == "burst":
    tail = loss_scale.period * (backoffs_to_recover(loss_scale, 50) + 1)
    inject = burst_pattern(SLOW_STEPS, 5, 50, seed, min(tail, SLOW_STEPS // 2))
  else:
    inject = periodic_pattern(SLOW_STEPS, int(round(1 / rate)), seed % 7)
  check_run(loss_scale, Plan(inject, seed, sites), init_params(seed % 5))


# ---------------------------------------------------------------------------
# No host synchronisation, no branch, no retrace: whatever the step's outcome.


def primitive_names(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      names |= primitive_names(sub)
  return names


def test_a_faulty_step_never_syncs_branches_or_retraces():
  loss_scale = CONFIGS["deepspeed-like"]
  params = init_params(4)
  opt_state = jaxmp.loss_scaling(inner_optimizer(), loss_scale).init(params)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, opt_state, x, y, inject, site, value, element):
    params, opt_state = faulty_step(params, opt_state, x, y, inject, site, value, element)
    return params, opt_state, jaxmp.loss_scaling_metrics(opt_state)

  plan = Plan(random_pattern(40, 0.5, 9), 9)
  args = lambda i: (DATA[0][i], DATA[1][i], plan.inject[i], plan.site[i],
                    plan.value[i], plan.element[i])
  names = primitive_names(jax.make_jaxpr(step)(params, opt_state, *args(0)).jaxpr)
  assert not names & {"cond", "while", "pure_callback", "io_callback", "debug_callback"}
  device_args = [jax.device_put(args(i)) for i in range(40)]
  step(params, opt_state, *device_args[0])  # compiled outside the guard
  with jax.transfer_guard("disallow"):
    for i in range(40):
      params, opt_state, metrics = step(params, opt_state, *device_args[i])
  assert int(metrics["skipped_steps"]) == plan.n_injected > 0
  assert float(metrics["loss_scale"]) != float(loss_scale.loss_scale)
