"""Tests of ``jaxmp.from_torch_grad_scaler`` against PyTorch's ``GradScaler``.

PyTorch's behaviour comes from ``tests/data/torch_grad_scaler.json``, recorded
from the real PyTorch by ``tests/data/make_oracle_fixtures.py`` (its version is
in the file), so these tests need no torch. PyTorch's documented rule is also
re-implemented here in plain Python (checked against the recording), for
generated configurations and sequences. Where torch is installed, the
recorders run again and the live results must match jaxmp and the file.
"""

import importlib.util
import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp

DATA = pathlib.Path(__file__).resolve().parent / "data"
FIXTURE = json.loads((DATA / "torch_grad_scaler.json").read_text(encoding="utf-8"))
TINY = np.finfo(np.float32).tiny  # the CPU flushes float32 subnormals to zero


def torch_reference(overflows, init_scale, growth_factor, backoff_factor,
                    growth_interval):
  """PyTorch's documented GradScaler update, with a float32 scale.

  The float32 scale is multiplied by the (double) factor in double precision
  and stored back as float32; a growth to inf is refused; the growth tracker
  resets on overflow and on growth. Yields the scale after each step.
  """
  scale = np.float32(init_scale)
  tracker = 0
  for overflow in overflows:
    if overflow:
      scale = np.float32(float(scale) * backoff_factor)
      tracker = 0
    else:
      tracker += 1
      if tracker == growth_interval:
        with np.errstate(over="ignore"):  # a growth to inf is refused below
          grown = np.float32(float(scale) * growth_factor)
        if np.isfinite(grown):
          scale = grown
        tracker = 0
    yield scale


@jax.jit
def _run_trajectories(loss_scale, finite_flags):
  """Per-step (scale, counter) for flags[batch, steps]; compiles once per config."""

  def step(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter)

  return jax.vmap(lambda flags: jax.lax.scan(step, loss_scale, flags)[1])(finite_flags)


def _trajectories(config, overflows):
  scales, counters = _run_trajectories(
      jaxmp.from_torch_grad_scaler(**config), jnp.asarray(~np.asarray(overflows)))
  return np.asarray(scales), np.asarray(counters)


def _flags(strings):
  return np.array([[c == "1" for c in s] for s in strings])


def _grouped_runs():
  groups = {}
  for run in FIXTURE["update_kernel_runs"]:
    groups.setdefault(json.dumps(run["config"]), []).append(run)
  return list(groups.values())


# ---------------------------------------------------------------------------
# Against the recording of PyTorch.


def test_defaults_are_the_recorded_grad_scaler_s():
  assert FIXTURE["generated_by"] == "tests/data/make_oracle_fixtures.py"
  assert set(FIXTURE["versions"]) >= {"torch", "python", "numpy"}
  assert len(FIXTURE["update_kernel_runs"]) >= 40
  parameters = inspect.signature(jaxmp.from_torch_grad_scaler).parameters
  ours = {name: p.default for name, p in parameters.items()}
  assert ours == FIXTURE["grad_scaler_defaults"]
  ls = jaxmp.from_torch_grad_scaler()
  assert float(ls.loss_scale) == 65536.0
  assert (ls.period, ls.factor, ls.backoff_factor, ls.min_loss_scale) == (2000, 2.0, 0.5, 0.0)


def test_jaxmp_follows_the_recorded_update_kernel_step_for_step():
  """Scale and growth tracker equal PyTorch's after every step, bit for bit.

  Runs stop being compared where PyTorch's scale enters the float32
  subnormals, where jaxmp stops (documented).
  """
  compared = 0
  for group in _grouped_runs():
    config = group[0]["config"]
    scales, counters = _trajectories(config, _flags([r["overflows"] for r in group]))
    for b, run in enumerate(group):
      for t, (scale, tracker) in enumerate(zip(run["scales"], run["growth_trackers"])):
        if scale < TINY:
          break
        assert scales[b, t] == np.float32(scale), (config, b, t)
        assert counters[b, t] == tracker, (config, b, t)
        compared += 1
  assert compared > 2500


def test_the_reference_is_the_recorded_update_kernel():
  for run in [*FIXTURE["update_kernel_runs"], *FIXTURE["examples"].values()]:
    flags = [c == "1" for c in run["overflows"]]
    assert [float(s) for s in torch_reference(flags, **run["config"])] == run["scales"]


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
    scales, counters = _trajectories(run["config"], _flags([run["overflows"]]))
    assert scales[0].tolist() == run["scales"]
    assert counters[0].tolist() == run["growth_trackers"]


torch_configs = st.fixed_dictionaries({
    "init_scale": st.sampled_from([65536.0, 1.0, 3.0, 1e-3, 1126.4, 7.5e30]),
    "growth_factor": st.sampled_from([2.0, 1.1, 1.5, 3.0, 10.0, 1.0001]),
    "backoff_factor": st.sampled_from([0.5, 0.1, 0.25, 0.9, 1 / 3]),
    "growth_interval": st.sampled_from([-1, 0, 1, 2, 3, 7]),
})


def _sequences(seed, batch, steps):
  """Overflow flags[batch, steps]: rates from rare to almost always."""
  rng = np.random.default_rng(seed)
  rates = np.linspace(0.02, 0.95, batch)
  return rng.random((batch, steps)) < rates[:, None]


@settings(derandomize=True, max_examples=15, deadline=None)
@given(config=torch_configs, seed=st.integers(0, 2**16))
def test_torch_trajectory_matches_reference(config, seed):
  overflows = _sequences(seed, batch=16, steps=80)
  scales, _ = _trajectories(config, overflows)
  for b, sequence in enumerate(overflows):
    for t, expected in enumerate(torch_reference(sequence, **config)):
      if expected < TINY:
        break
      assert scales[b, t] == expected, (b, t, config, sequence[: t + 1].astype(int).tolist())


# ---------------------------------------------------------------------------
# The options.


def test_disabled_and_never_growing():
  assert isinstance(jaxmp.from_torch_grad_scaler(enabled=False), jaxmp.NoOpLossScale)
  for interval in (0, -5, 2**40):
    assert jaxmp.from_torch_grad_scaler(growth_interval=interval).period == 2**31 - 1
  # Never growing keeps the pytree intact through jit.
  ls = jaxmp.from_torch_grad_scaler(init_scale=4.0, growth_interval=0)
  ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
  assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 1


# ---------------------------------------------------------------------------
# Live: where torch is installed, it still gives the recording, and jaxmp
# follows it.


def _recorder():
  spec = importlib.util.spec_from_file_location(
      "make_oracle_fixtures", DATA / "make_oracle_fixtures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_live_torch_update_kernel():
  torch = pytest.importorskip("torch")
  recorder = _recorder()
  for group in _grouped_runs():
    config = group[0]["config"]
    live = [recorder.torch_update_kernel(config, r["overflows"]) for r in group]
    scales, counters = _trajectories(config, _flags([r["overflows"] for r in group]))
    for b, (run, result) in enumerate(zip(group, live)):
      assert result == {k: run[k] for k in result}, (torch.__version__, config)
      for t, scale in enumerate(result["scales"]):
        if scale < TINY:
          break
        assert (scales[b, t], counters[b, t]) == (
            np.float32(scale), result["growth_trackers"][t]), (config, b, t)


def test_live_torch_grad_scaler_object():
  torch = pytest.importorskip("torch")
  run = FIXTURE["grad_scaler_object_run"]
  live = _recorder().torch_grad_scaler_object(run["config"], run["overflows"])
  assert live == {k: run[k] for k in live}, torch.__version__
  scales, _ = _trajectories(run["config"], _flags([run["overflows"]]))
  assert scales[0].tolist() == live["scales"]
