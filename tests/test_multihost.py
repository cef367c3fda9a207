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
STEPS, OVERFLOW_STEP = 6, 2
# The global batch of 8 rows is split over the "data" axis of the (2, 2) mesh:
# rows 4..7 live on process 1's devices, so the overflow hits row 4.
OVERFLOW_ROW = 4
# What JAX says when the CPU backend has no collectives for several processes.
MISSING_COLLECTIVES = ("aren't implemented on the CPU backend",
                       "Multiprocess computations aren't implemented",
                       "cpu_collectives_implementation")


def _launch(*args, **env):
  """The launcher in its own process group, so that all it started can be stopped."""
  return subprocess.Popen(
      [sys.executable, str(EXAMPLE), "--local-processes", "2", *map(str, args)],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
      env=dict(os.environ, **env))


def _wait(launcher: subprocess.Popen, reference=lambda: None):
  """``reference()`` while the launcher runs, then its output and that result;
  the launcher's process group is stopped whatever happens."""
  try:
    result = reference()
    output, _ = launcher.communicate(timeout=200)
  except subprocess.TimeoutExpired:
    os.killpg(launcher.pid, signal.SIGKILL)
    pytest.fail(f"the 2-process run did not finish in 200 s:\n{launcher.communicate()[0]}")
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)
      launcher.communicate()
  return output, result


def test_two_processes_match_one_process_reference(tmp_path):
  implementation = getattr(jax.config, "jax_cpu_collectives_implementation", None)
  if implementation in (None, "none"):
    pytest.skip("this JAX has no CPU collectives backend enabled (jax_cpu_collectives_"
                f"implementation={implementation!r}): multi-process CPU runs need gloo or MPI")
  if jax.device_count() < 4:
    pytest.skip("the reference needs 4 devices; tests/conftest.py sets up 8")
  launcher = _launch("--devices-per-process", 2, "--steps", STEPS, "--overflow-step",
                     OVERFLOW_STEP, "--metrics-dir", tmp_path, "--timeout", 150,
                     PYTHONUNBUFFERED="1")

  def reference():  # 1 process x 4 devices, computed while the processes run
    spec = importlib.util.spec_from_file_location("pjit_multihost", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # Flax modules look up their module by name
    spec.loader.exec_module(example)
    return example.train(example.make_mesh(2, jax.devices()[:4]), steps=STEPS,
                         overflow_step=OVERFLOW_STEP, overflow_row_index=OVERFLOW_ROW,
                         log=lambda line: None)

  output, reference = _wait(launcher, reference)
  if launcher.returncode != 0:
    if any(marker in output for marker in MISSING_COLLECTIVES):
      pytest.skip(f"no CPU collectives backend here:\n{output[-2000:]}")
    pytest.fail(f"the 2-process run failed ({launcher.returncode}):\n{output[-6000:]}")
  runs = [json.loads((tmp_path / f"process_{i}.json").read_text()) for i in range(2)]
  assert [(r["process"], r["num_processes"], len(r["local_devices"])) for r in runs] == [
      (0, 2, 2), (1, 2, 2)]
  # The overflow goes to a batch row held by the last process only.
  assert [(r["overflow_process"], r["overflow_row"]) for r in runs] == [(1, OVERFLOW_ROW)] * 2
  # Both processes saw the same global metrics.
  keys = ("loss", "loss_scale", "skipped", "skipped_steps")
  for a, b in zip(runs[0]["steps"], runs[1]["steps"]):
    assert all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in keys), (a, b)
  # At the overflow step, only process 1's own examples overflowed, yet every
  # device of both processes skipped; the scale backed off.
  steps0, steps1, at = runs[0]["steps"], runs[1]["steps"], OVERFLOW_STEP
  assert math.isfinite(steps0[at]["local_loss"]) and not math.isfinite(steps1[at]["local_loss"])
  assert steps0[at]["local_device_finite"] == steps1[at]["local_device_finite"] == [False] * 2
  assert [s["skipped"] for s in steps0] == [s == at for s in range(STEPS)]
  assert steps0[at]["loss_scale"] == steps0[at - 1]["loss_scale"] / 2
  assert steps0[-1]["skipped_steps"] == 1
  # The reference took the same steps.
  for key in ("skipped", "skipped_steps", "loss_scale"):
    assert [r[key] for r in reference] == [s[key] for s in steps0], key
  np.testing.assert_allclose([r["loss"] for r in reference], [s["loss"] for s in steps0],
                             rtol=1e-6, equal_nan=True)
  losses = [s["loss"] for s in steps0 if not s["skipped"]]
  assert losses[-1] < losses[0]  # it trains


def test_launcher_stops_its_processes_on_timeout(tmp_path):
  # Two seconds are not enough to start JAX and train: the launcher must stop
  # both workers, report the timeout, and leave no process behind.
  launcher = _launch("--timeout", 2, "--metrics-dir", tmp_path)
  output, _ = _wait(launcher)
  assert launcher.returncode == 124 and "timed out after 2 s" in output, output
  with pytest.raises(ProcessLookupError):
    os.killpg(launcher.pid, 0)  # nothing is left in the launcher's group
  assert not list(tmp_path.iterdir())
