"""Tests of benchmarks/: the overhead table in a tiny configuration.

Only the compiler's figures (temp bytes, bytes accessed) are asserted: they are
deterministic. Step and compile times are never asserted.
"""

import json
import pathlib
import subprocess
import sys

import pytest

from models import benchmark

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
policy_speed = benchmark("policy_speed")

VARIANTS = ["unguarded", "jaxmp", "jmp manual", "optax.apply_if_finite",
            "flax DynamicScale"]
TINY = ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "16",
        "--batch-size", "4", "--rounds", "1", "--steps-per-round", "1",
        "--warmup-steps", "1", "--compile-repeats", "0"]


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("bench")
  proc = subprocess.run(
      [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), *TINY,
       "--out", str(out)],
      capture_output=True, text=True, timeout=300, check=False,
  )
  assert proc.returncode == 0, proc.stderr
  return proc, out


def test_overhead_writes_its_table(overhead_run):
  proc, out = overhead_run
  table = (out / "overhead.md").read_text()
  assert table in proc.stdout
  assert table.startswith(
      "| variant | step time | temp memory | peak live memory | bytes accessed "
      "| compile time | kernels |")
  rows = [line.split("|")[1].strip() for line in table.splitlines()[2:7]]
  assert rows == VARIANTS
  # Untimed (--compile-repeats 0): no compile-time column figures.
  assert "| unguarded | 1.000× | +0.0% | +0.000% | +0.0% | n/a | " in table
  assert " (+0) |" in table.splitlines()[2]
  assert "CPU only" in table and "JAX " in table


def test_overhead_json(overhead_run):
  _, out = overhead_run
  results = json.loads((out / "overhead.json").read_text())
  assert list(results["variants"]) == VARIANTS
  assert results["config"]["d_model"] == 32
  for figures in results["variants"].values():
    assert figures["temp_bytes"] > 0 and figures["bytes_accessed"] > 0
    assert figures["step_seconds_median"] > 0 and figures["compile_seconds"] is None
    # From XLA's dump: what is live at the peak includes the arguments.
    assert figures["peak_live_bytes"] > figures["argument_bytes"]
    assert isinstance(figures["kernels"], int) and figures["kernels"] > 0


def test_jaxmp_costs_less_than_its_peers(overhead_run):
  _, out = overhead_run
  variants = json.loads((out / "overhead.json").read_text())["variants"]
  base, ours = variants["unguarded"], variants["jaxmp"]
  # The guard adds no temp memory beyond 0.5% (no copy of the moments).
  assert ours["temp_bytes"] <= base["temp_bytes"] * 1.005
  for name in VARIANTS[2:]:
    assert ours["temp_bytes"] <= variants[name]["temp_bytes"], name
    assert ours["bytes_accessed"] < variants[name]["bytes_accessed"], name
  # At the worst moment the guard holds nothing gradient- or state-sized more
  # than the unguarded step: only the loss scale's few scalars.
  assert 0 <= ours["peak_live_bytes"] - base["peak_live_bytes"] <= 256
  # The check compiles to some kernels of its own, but fewer than the peers'.
  assert ours["kernels"] > base["kernels"]
  assert ours["kernels"] < variants["jmp manual"]["kernels"]
  assert ours["kernels"] < variants["optax.apply_if_finite"]["kernels"]


def test_policy_speed_table_says_cpu_only():
  figures = {"time_ratio": 1.0, "tokens_per_second": 1000.0, "temp_bytes": 2**20,
             "bytes_accessed": 2**30, "policy": "p=f32,c=f32,o=f32"}
  results = {
      "config": {"d_model": 8, "layers": 1, "batch_size": 2, "seq_len": 4,
                 "rounds": 1, "steps_per_round": 1},
      "parameters": 100,
      "machine": {"platform": "cpu", "device_kind": "cpu", "cpu_count": 2,
                  "jax": "0.0"},
      "policies": {"float32": figures, "mixed_fp8": {
          **figures, "time_ratio": 3.0, "time_ratio_vs_bfloat16": 2.5,
          "policy": "p=f32,c=bf16,o=f32,dot=fp8"}},
  }
  table = policy_speed.markdown(results)
  assert "| float32 (`p=f32,c=f32,o=f32`) | 1.00× | 1,000 | 1.0 MiB | 1024 MiB |" in table
  assert "| mixed_fp8 (`p=f32,c=bf16,o=f32,dot=fp8`) | 3.00× |" in table
  assert "CPU only" in table
  assert "the FP8 row's time says nothing about FP8 on a GPU" in table
  results["machine"] = {"platform": "gpu", "device_kind": "NVIDIA H200",
                        "cpu_count": 16, "jax": "0.0"}
  table = policy_speed.markdown(results)
  assert "FP8 step time vs bfloat16: 2.50×." in table and "CPU" not in table


def test_overhead_table_names_an_accelerator():
  overhead = benchmark("overhead")

  def figures(ratio, kernels):
    return {"time_ratio": ratio, "temp_ratio": ratio, "peak_live_ratio": None,
            "bytes_accessed_ratio": ratio, "compile_ratio": ratio,
            "kernels": kernels, "step_seconds_median": 0.01,
            "temp_bytes": 2**20, "peak_live_bytes": None,
            "bytes_accessed": 2**30, "compile_seconds": 2.0}

  results = {
      "config": {"d_model": 8, "layers": 1, "heads": 1, "batch_size": 2,
                 "seq_len": 4, "rounds": 1, "steps_per_round": 1,
                 "compile_repeats": 1},
      "parameters": 100,
      "machine": {"platform": "gpu", "device_kind": "NVIDIA H200",
                  "cpu_count": 16, "python": "3.11", "jax": "0.0",
                  "optax": "0.0", "flax": "0.0", "jmp": "0.0"},
      "variants": {"unguarded": figures(1.0, None),
                   "jaxmp": figures(1.015, None)},
  }
  table = overhead.markdown(results)
  # Kernel modules are counted from LLVM dumps, which only the CPU writes; a
  # back end that dumps no live ranges has no peak live figure.
  assert "| jaxmp | 1.015× | +1.5% | n/a | +1.5% | 1.01× | n/a |" in table
  assert "live at the peak" not in table
  assert "Accelerator: NVIDIA H200" in table and "CPU only" not in table


def test_scaling_table_puts_each_setting_against_its_unguarded_step():
  scaling = benchmark("scaling")

  def figures(ratio, kernels, extra):
    return {"bytes_accessed_ratio": ratio, "temp_ratio": 1.0, "kernels": kernels,
            "compile_seconds": 2.0 * ratio, "compile_ratio": ratio,
            "extra_bytes_per_param": extra, "parameters": 4_100_000, "leaves": 86}

  results = {
      "config": {"settings": ["params"], "repeats": 3},
      "machine": {"platform": "cpu", "device_kind": "cpu", "cpu_count": 2,
                  "jax": "0.0", "optax": "0.0", "flax": "0.0", "jmp": "0.0"},
      "settings": {"transformer 4M": {"unguarded": figures(1.0, 130, 0.0),
                                      "jaxmp": figures(1.01, 179, 4.03)}},
  }
  table = scaling.markdown(results)
  assert table.startswith("| setting | variant | bytes accessed | extra B/param |")
  assert ("| transformer 4M (4.1M params, 86 leaves) | jaxmp | +1.00% | +4.03 | "
          "+0.00% | 179 (+49) | 2.02 | 1.01× |") in table
  assert "median CPU seconds of 3 fresh traces" in table


def test_the_forms_check_forms_measures_decide_as_all_finite_does():
  # benchmarks/README.md compares these forms by their cost only because they
  # take the same decisions; the table is the one of tests/test_loss_scaling.py.
  check_forms = benchmark("check_forms")
  from test_loss_scaling import DECISIONS  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  forms = {name: jax.jit(form) for name, form in check_forms.FORMS.items()}
  for case, grads, expected in DECISIONS:
    decided = {name: bool(form(grads)) for name, form in forms.items()}
    assert decided == dict.fromkeys(forms, expected), case
