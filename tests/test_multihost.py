"""Two real processes on 127.0.0.1 train together and skip together.

Runs ``examples/pjit_multihost.py --local-processes 2`` (2 processes x 2 CPU
devices, gloo collectives, a free port chosen at run time) with an overflow
injected into one process's shard, and compares it with a 1-process x
4-device reference run in this process on four of conftest.py's devices.
"""

import importlib.util
import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.integration

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "pjit_multihost.py"
STEPS = 6
OVERFLOW_STEP = 2
LAUNCHER_TIMEOUT = 150  # each worker process
OUTER_TIMEOUT = 200  # the launcher itself
# The global batch of 8 rows is split over the "data" axis of the (2, 2) mesh:
# rows 4..7 live on process 1's devices, so the overflow hits row 4.
OVERFLOW_ROW = 4
# What JAX says when the CPU backend has no collectives for several processes.
MISSING_COLLECTIVES = (
    "aren't implemented on the CPU backend",
    "Multiprocess computations aren't implemented",
    "cpu_collectives_implementation",
)


def _load_example():
  spec = importlib.util.spec_from_file_location("pjit_multihost", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # Flax modules look up their module by name
  spec.loader.exec_module(module)
  return module


def _collectives_unavailable() -> str | None:
  implementation = getattr(jax.config, "jax_cpu_collectives_implementation", None)
  if implementation in (None, "none"):
    return (
        "this JAX has no CPU collectives backend enabled "
        f"(jax_cpu_collectives_implementation={implementation!r}); "
        "multi-process CPU runs need gloo or MPI"
    )
  return None


def _start_two_processes(metrics_dir: pathlib.Path, env) -> subprocess.Popen:
  command = [
      sys.executable, str(EXAMPLE), "--local-processes", "2",
      "--devices-per-process", "2", "--steps", str(STEPS),
      "--overflow-step", str(OVERFLOW_STEP), "--metrics-dir", str(metrics_dir),
      "--timeout", str(LAUNCHER_TIMEOUT),
  ]
  # Its own process group, so that on a timeout the launcher and the workers
  # it started are all stopped.
  return subprocess.Popen(
      command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True, env=dict(env, PYTHONUNBUFFERED="1"),
  )


def _wait(launcher: subprocess.Popen) -> str:
  try:
    output, _ = launcher.communicate(timeout=OUTER_TIMEOUT)
  except subprocess.TimeoutExpired:
    os.killpg(launcher.pid, signal.SIGKILL)
    output, _ = launcher.communicate()
    pytest.fail(f"the 2-process run did not finish in {OUTER_TIMEOUT} s:\n{output}")
  return output


def _stop(launcher: subprocess.Popen) -> None:
  if launcher.poll() is None:
    os.killpg(launcher.pid, signal.SIGKILL)
  launcher.communicate()


def _same(a, b):
  return a == b or (math.isnan(a) and math.isnan(b))


def test_two_processes_match_one_process_reference(tmp_path, compilation_cache_env):
  reason = _collectives_unavailable()
  if reason:
    pytest.skip(reason)
  if jax.device_count() < 4:
    pytest.skip("the reference needs 4 devices; tests/conftest.py sets up 8")

  # The workers share the tests' compilation cache (process 0 writes to it).
  launcher = _start_two_processes(tmp_path, compilation_cache_env)
  try:
    # The 1-process x 4-device reference, computed while the processes run.
    example = _load_example()
    reference = example.train(
        example.make_mesh(2, jax.devices()[:4]), steps=STEPS,
        overflow_step=OVERFLOW_STEP,
        overflow_row_index=OVERFLOW_ROW,
        log=lambda line: None,
    )
    output = _wait(launcher)
  finally:
    _stop(launcher)
  if launcher.returncode != 0:
    if any(marker in output for marker in MISSING_COLLECTIVES):
      pytest.skip(f"no CPU collectives backend here:\n{output[-2000:]}")
    pytest.fail(f"the 2-process run failed ({launcher.returncode}):\n"
                f"{output[-6000:]}")
  runs = [
      json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)
  ]
  assert [run["process"] for run in runs] == [0, 1]
  assert all(run["num_processes"] == 2 for run in runs)
  assert all(len(run["local_devices"]) == 2 for run in runs)
  # The overflow goes to a batch row held by the last process only.
  assert runs[0]["overflow_process"] == runs[1]["overflow_process"] == 1
  assert runs[0]["overflow_row"] == runs[1]["overflow_row"] == OVERFLOW_ROW

  # Both processes saw the same global metrics.
  keys = ("loss", "loss_scale", "skipped", "skipped_steps")
  for a, b in zip(runs[0]["steps"], runs[1]["steps"]):
    assert all(_same(a[k], b[k]) for k in keys), (a, b)

  # At the overflow step, only process 1's own examples overflowed, yet every
  # device of both processes skipped; the scale backed off.
  at = OVERFLOW_STEP
  steps0, steps1 = runs[0]["steps"], runs[1]["steps"]
  assert math.isfinite(steps0[at]["local_loss"])
  assert not math.isfinite(steps1[at]["local_loss"])
  assert steps0[at]["local_device_finite"] == [False, False]
  assert steps1[at]["local_device_finite"] == [False, False]
  assert [s["skipped"] for s in steps0] == [s == at for s in range(STEPS)]
  assert steps0[at]["loss_scale"] == steps0[at - 1]["loss_scale"] / 2
  assert steps0[-1]["skipped_steps"] == 1

  # The reference took the same steps.
  assert [r["skipped"] for r in reference] == [s["skipped"] for s in steps0]
  assert [r["skipped_steps"] for r in reference] == [
      s["skipped_steps"] for s in steps0
  ]
  assert [r["loss_scale"] for r in reference] == [s["loss_scale"] for s in steps0]
  np.testing.assert_allclose(
      [r["loss"] for r in reference], [s["loss"] for s in steps0],
      rtol=1e-6, equal_nan=True,
  )
  losses = [s["loss"] for s in steps0 if not s["skipped"]]
  assert losses[-1] < losses[0]  # it trains


def test_launcher_stops_its_processes_on_timeout(tmp_path):
  # Two seconds are not enough to start JAX and train: the launcher must stop
  # both workers, report the timeout, and leave no process behind.
  command = [
      sys.executable, str(EXAMPLE), "--local-processes", "2",
      "--timeout", "2", "--metrics-dir", str(tmp_path),
  ]
  launcher = subprocess.Popen(
      command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      start_new_session=True,
  )
  try:
    output = _wait(launcher)
  finally:
    _stop(launcher)
  assert launcher.returncode == 124, output
  assert "timed out after 2 s" in output
  with pytest.raises(ProcessLookupError):
    os.killpg(launcher.pid, 0)  # nothing is left in the launcher's group
  assert not list(tmp_path.iterdir())
