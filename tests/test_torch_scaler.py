"""Tests of ``jaxmp.from_torch_grad_scaler`` against PyTorch's ``GradScaler``.

PyTorch's behaviour comes from ``tests/data/torch_grad_scaler.json``, recorded by
``tests/data/make_oracle_fixtures.py`` (which reruns where torch is installed);
its documented rule is re-implemented here for generated configurations.
"""

import inspect
import itertools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from models import recorder, trajectories

DATA = pathlib.Path(__file__).resolve().parent / "data"
FIXTURE = json.loads((DATA / "torch_grad_scaler.json").read_text(encoding="utf-8"))
TINY = np.finfo(np.float32).tiny  # the CPU flushes float32 subnormals to zero


def torch_reference(overflows, init_scale, growth_factor, backoff_factor, growth_interval):
  """The scale after each step of PyTorch's documented update: the float32
  scale times the (double) factor in double precision, stored as float32; a
  growth to inf is refused; the tracker resets on overflow and on growth."""
  scale, tracker = np.float32(init_scale), 0
  for overflow in overflows:
    if overflow == "1":
      scale, tracker = np.float32(float(scale) * backoff_factor), 0
    else:
      tracker += 1
      if tracker == growth_interval:
        with np.errstate(over="ignore"):  # a growth to inf is refused below
          grown = np.float32(float(scale) * growth_factor)
        scale, tracker = (grown if np.isfinite(grown) else scale), 0
    yield scale


def _ours(config, overflows):
  return trajectories(jaxmp.from_torch_grad_scaler(**config), overflows, "loss_scale", "counter")


# The recorded runs, grouped by configuration (one compilation each).
GROUPS = [list(g) for _, g in itertools.groupby(
    FIXTURE["update_kernel_runs"], key=lambda run: json.dumps(run["config"]))]


def _assert_follows(config, runs):
  """jaxmp's scale and counter equal the runs' after every step, bit for bit,
  until PyTorch's scale enters the float32 subnormals (where jaxmp stops)."""
  scales, counters = _ours(config, [r["overflows"] for r in runs])
  compared = 0
  for b, run in enumerate(runs):
    for t, (scale, tracker) in enumerate(zip(run["scales"], run["growth_trackers"])):
      if scale < TINY:
        break
      assert (scales[b, t], counters[b, t]) == (np.float32(scale), tracker), (config, b, t)
      compared += 1
  return compared


def test_defaults_are_the_recorded_grad_scaler_s():
  assert FIXTURE["generated_by"] == "tests/data/make_oracle_fixtures.py"
  assert set(FIXTURE["versions"]) >= {"torch", "python", "numpy"}
  assert len(FIXTURE["update_kernel_runs"]) >= 40
  parameters = inspect.signature(jaxmp.from_torch_grad_scaler).parameters
  assert {name: p.default for name, p in parameters.items()} == FIXTURE["grad_scaler_defaults"]
  ls = jaxmp.from_torch_grad_scaler()
  assert (float(ls.loss_scale), ls.period, ls.factor, ls.backoff_factor, ls.min_loss_scale) == (
      65536.0, 2000, 2.0, 0.5, 0.0)


def test_jaxmp_follows_the_recorded_update_kernel_step_for_step():
  """And the reference is the recorded kernel, to the last bit."""
  compared = 0
  for group in GROUPS:
    for run in group:
      assert [float(s) for s in torch_reference(run["overflows"], **run["config"])] == run["scales"]
    compared += _assert_follows(group[0]["config"], group)
  assert compared > 2500


def test_jaxmp_follows_the_recorded_examples():
  """Factors applied in double precision and rounded once (0.1, 1.1), the
  migration guide's example, and a real GradScaler driven through
  scale/step/update: scale and growth tracker, bit for bit."""
  examples = FIXTURE["examples"]
  backoff = examples["backoff by 0.1, rounded once"]["scales"][0]
  # 1126.4 * 0.1 in double precision, stored as float32, is not the float32 product.
  assert np.float32(backoff) == np.float32(112.64) != np.float32(1126.4) * np.float32(0.1)
  assert np.float32(examples["growth by 1.1, rounded once"]["scales"][0]) == np.float32(3.3)
  assert [f"{s:.6g}" for s in examples["the migration guide's example"]["scales"]] == [
      "112.64", "112.64", "123.904", "123.904", "136.294"]
  for run in [*examples.values(), FIXTURE["grad_scaler_object_run"]]:
    assert [float(s) for s in torch_reference(run["overflows"], **run["config"])] == run["scales"]
    scales, counters = _ours(run["config"], [run["overflows"]])
    assert (scales[0].tolist(), counters[0].tolist()) == (run["scales"], run["growth_trackers"])


torch_configs = st.fixed_dictionaries({
    "init_scale": st.sampled_from([65536.0, 1.0, 3.0, 1e-3, 1126.4, 7.5e30]),
    "growth_factor": st.sampled_from([2.0, 1.1, 1.5, 3.0, 10.0, 1.0001]),
    "backoff_factor": st.sampled_from([0.5, 0.1, 0.25, 0.9, 1 / 3]),
    "growth_interval": st.sampled_from([-1, 0, 1, 2, 3, 7]),
})


@settings(derandomize=True, max_examples=15, deadline=None)
@given(config=torch_configs, seed=st.integers(0, 2**16))
def test_torch_trajectory_matches_reference(config, seed):
  overflows = recorder().overflow_sequences(seed, 16, 80)
  scales, _ = _ours(config, overflows)
  for b, sequence in enumerate(overflows):
    for t, expected in enumerate(torch_reference(sequence, **config)):
      if expected < TINY:
        break
      assert scales[b, t] == expected, (b, t, config, sequence[: t + 1])


def test_disabled_and_never_growing():
  assert isinstance(jaxmp.from_torch_grad_scaler(enabled=False), jaxmp.NoOpLossScale)
  for interval in (0, -5, 2**40):
    assert jaxmp.from_torch_grad_scaler(growth_interval=interval).period == 2**31 - 1
  ls = jaxmp.from_torch_grad_scaler(init_scale=4.0, growth_interval=0)  # intact through jit
  ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
  assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 1


# Live: where torch is installed, it still gives the recording, and jaxmp follows it.
def test_live_torch_update_kernel():
  torch = pytest.importorskip("torch")
  for group in GROUPS:
    config = group[0]["config"]
    live = [recorder().torch_update_kernel(config, r["overflows"]) for r in group]
    assert live == [{k: r[k] for k in live[0]} for r in group], (torch.__version__, config)
    _assert_follows(config, [{**r, **result} for r, result in zip(group, live)])


def test_live_torch_grad_scaler_object():
  torch = pytest.importorskip("torch")
  run = FIXTURE["grad_scaler_object_run"]
  live = recorder().torch_grad_scaler_object(run["config"], run["overflows"])
  assert live == {k: run[k] for k in live}, torch.__version__
  assert _ours(run["config"], [run["overflows"]])[0][0].tolist() == live["scales"]
