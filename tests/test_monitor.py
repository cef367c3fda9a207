"""Tests of jaxmp.LossScaleMonitor on scripted sequences."""

import pathlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp


def _scripted(monitor, overflows, scale=2.0**10):
  """Feeds the monitor the metrics of a scripted run: each overflow halves the scale."""
  skipped = 0
  for step, overflow in enumerate(overflows, start=1):
    scale, skipped = (scale / 2, skipped + 1) if overflow else (scale, skipped)
    monitor.update(step, {
        "loss_scale": jnp.float32(scale), "skipped_steps": jnp.int32(skipped),
        "last_finite": jnp.bool_(not overflow), "overflows_at_min": jnp.int32(0),
        "steps_since_adjustment": jnp.int32(0), "skipped": jnp.int32(overflow)})


def test_records_every_n_steps_and_history():
  monitor = jaxmp.LossScaleMonitor(every=5, window=10, warn_rate=None)
  overflows = [False] * 20
  overflows[2] = overflows[9] = overflows[13] = True  # steps 3, 10, 14
  _scripted(monitor, overflows)
  # Not a multiple of 5: `x` is not even looked at (object() holds no state).
  assert monitor.update(21, object()) is False
  with pytest.raises(ValueError, match="no jaxmp.loss_scaling state"):
    monitor.update(25, object())
  assert monitor.history == {
      "step": [5, 10, 15, 20], "loss_scale": [512.0, 256.0, 128.0, 128.0],
      "skipped_steps": [1, 2, 3, 3], "last_finite": [True, False, True, True],
      "overflows_at_min": [0, 0, 0, 0]}
  # Steps 11..20 hold one skip (step 14).
  assert [monitor.overflow_rate(), monitor.overflow_rate(window=20),
          monitor.overflow_rate(window=5)] == [0.1, 3 / 20, 0.0]
  # The last skip was seen at the record of step 15: a lower bound of 5.
  assert monitor.steps_since_last_skip() == 5
  assert "loss scale 128" in monitor.summary()


def test_partial_window_and_exact_since_last_skip():
  monitor = jaxmp.LossScaleMonitor(every=1, window=100, warn_rate=None)
  assert monitor.overflow_rate() is None and monitor.steps_since_last_skip() is None
  assert "no loss-scaling metrics" in monitor.summary()  # nothing recorded yet
  _scripted(monitor, [True, False, False, True, False, False, False])
  # Fewer than `window` steps: measured from step 0; the last skip is step 4's.
  assert (monitor.overflow_rate(), monitor.steps_since_last_skip()) == (2 / 7, 3)


def test_warns_once_and_only_when_a_full_window_skips_too_many_steps():
  rng = np.random.default_rng(0)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _scripted(jaxmp.LossScaleMonitor(every=10, window=50, warn_rate=0.2),
              rng.random(40) < 0.5)  # window not full yet: no warning
    healthy = jaxmp.LossScaleMonitor(every=10, window=50, warn_rate=0.2)
    _scripted(healthy, [i % 20 == 0 for i in range(300)])
  assert healthy.overflow_rate() == 2 / 50  # skips at steps 261 and 281
  monitor = jaxmp.LossScaleMonitor(every=10, window=50, warn_rate=0.2)
  with pytest.warns(RuntimeWarning, match="mixed_bfloat16") as record:
    _scripted(monitor, rng.random(200) < 0.5)
  assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
  assert record[0].filename == __file__ and monitor.warned


def test_plot_writes_a_png(tmp_path):
  monitor = jaxmp.LossScaleMonitor(every=2, window=10, warn_rate=None)
  _scripted(monitor, [i % 7 == 3 for i in range(60)])
  assert pathlib.Path(monitor.plot(tmp_path / "scale.png")).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stacked_states_are_recorded_by_their_worst_member():
  """pmap replicas or vmapped runs: the smallest scale, the most skips."""
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4, min_loss_scale=4.0))
  params = jnp.ones(2)
  states = jax.vmap(lambda _: tx.init(params))(jnp.arange(3))
  step = jax.jit(jax.vmap(lambda g, s: tx.update(g, s, params)[1]))
  monitor = jaxmp.LossScaleMonitor(every=1, window=4, warn_rate=None)
  # Member 1 overflows on steps 1 to 3 (the last at the minimum), member 2 on step 3.
  for i, bad in enumerate([[1], [1], [1, 2], []], start=1):
    grads = jnp.ones((3, 2)).at[jnp.array(bad, int)].set(jnp.inf)
    states = step(grads, states)
    monitor.update(jnp.full(3, i), states)  # a replicated step count
  assert monitor.history == {
      "step": [1, 2, 3, 4], "loss_scale": [8.0, 4.0, 4.0, 4.0],
      "skipped_steps": [1, 2, 3, 3], "last_finite": [False, False, False, True],
      "overflows_at_min": [0, 0, 1, 1]}
  assert monitor.overflow_rate() == 3 / 4
  with pytest.raises(TypeError, match="step must be an integer"):
    monitor.update(jnp.array([5, 6, 5]), states)  # members disagree
