"""Tests of examples/train_lm.py, the script `make demo` runs (tiny model)."""

import contextlib
import io
import json
import math
import pathlib
import subprocess
import sys

import jax
import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
sys.path.insert(0, str(ROOT / "examples"))
import train_lm

TINY = ["--steps", "12", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--seq-len", "32", "--batch-size", "8", "--eval-every", "6",
        "--eval-batches", "1", "--max-bytes", "300000", "--quiet"]


def _run(*args, cwd):
  return subprocess.run(
      [sys.executable, str(SCRIPT), *args], cwd=cwd, capture_output=True,
      text=True, timeout=300, check=False,
  )


def _train(*args, out):
  """``train_lm.run(args)`` in this process; its stdout and run directory.

  The training runs call the script's ``run()`` here rather than in a process
  of their own, which would import JAX, Flax and matplotlib again (the command
  line itself is tested by ``test_bad_input_has_no_traceback``). Under
  standard dtype promotion, as the script runs: the demo's attention
  multiplies its float32 softmax by half-precision values.
  """
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout), jax.numpy_dtype_promotion("standard"):
    run_dir = train_lm.run([*args, "--out", str(out)])
  return stdout.getvalue(), run_dir


COMPARED = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8",
            "mixed_float16+recover"]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
  """One `--policy compare --fp8 --recover` run (the five runs in one call);
  float16 starts at 2**24 so that it overflows."""
  return _train(*TINY, "--init-scale", "2**24", "--fp8", "--recover",
                out=tmp_path_factory.mktemp("runs"))


def _results(run_dir):
  return {r["policy"]: r for r in
          json.loads((run_dir / "metrics.json").read_text())["results"]}


def test_writes_metrics_and_plot(compare_run):
  stdout, run_dir = compare_run
  metrics = json.loads((run_dir / "metrics.json").read_text())
  assert [r["policy"] for r in metrics["results"]] == COMPARED
  png = (run_dir / "loss.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000
  assert "| policy | train loss | val loss |" in stdout
  assert metrics["config"]["init_scale"] == 2.0**24
  for result in metrics["results"]:
    assert len(result["train"]["loss"]) == 12
    assert result["validation"]["step"] == [6, 12]
    assert all(math.isfinite(x) for x in result["train"]["loss"])
    assert result["tokens_per_second"] > 0


def test_every_policy_learns(compare_run):
  _, run_dir = compare_run
  for result in json.loads((run_dir / "metrics.json").read_text())["results"]:
    loss = result["train"]["loss"]
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, result["policy"]


def test_float16_from_2_24_overflows_and_backs_off(compare_run):
  _, run_dir = compare_run
  results = _results(run_dir)
  fp16 = results["mixed_float16"]
  assert fp16["loss_scaling"]
  assert fp16["skipped_steps"] >= 1
  assert fp16["skipped_steps"] == sum(fp16["train"]["skipped"])
  assert fp16["train"]["loss_scale"][0] == 2.0**24
  assert fp16["final_loss_scale"] < 2.0**24
  # Each skipped step halves the scale the next step runs with.
  scales, skipped = fp16["train"]["loss_scale"], fp16["train"]["skipped"]
  for step in range(len(scales) - 1):
    if skipped[step]:
      assert scales[step + 1] == scales[step] / 2
  for name in ("float32", "mixed_bfloat16"):
    assert not results[name]["loss_scaling"]
    assert results[name]["skipped_steps"] == 0


def test_runs_without_events_or_recovery_have_the_plain_table(compare_run):
  _, run_dir = compare_run
  results = _results(run_dir)
  for result in results.values():
    assert result["events"] == []
  plain = [r for name, r in results.items() if not name.endswith("+recover")]
  table = train_lm.summary_table(plain)
  assert table.startswith(
      "| policy | train loss | val loss | skipped steps | final loss scale "
      "| tokens/s | memory |\n")
  assert "lost batches per policy" not in table and "recovered steps" not in table


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory):
  """float16 with a spike at step 6: plain, under the fallback controller, and
  recovering its batches in the step under the controller."""
  stdout, run_dir = _train(
      *TINY, "--steps", "14", "--policy", "mixed_float16", "--fallback",
      "--recover", "--max-retries", "2", "--fp16-spike", "6",
      "--init-scale", "2**2", out=tmp_path_factory.mktemp("spike"))
  results = json.loads((run_dir / "metrics.json").read_text())["results"]
  return stdout, run_dir, {r["policy"]: r for r in results}


def test_the_spike_drives_plain_float16_to_the_crash_condition(spike_run):
  _, _, results = spike_run
  plain = results["mixed_float16"]
  # 4 -> 2 -> 1 on steps 6 and 7; step 8 overflows at the minimum scale.
  assert plain["events"] == [{"step": 8, "event": "crash condition",
                              "detail": "overflow at the minimum loss scale"}]
  assert plain["train"]["skipped"] == [False] * 5 + [True] * 9
  assert plain["lost_batches"] == {"p=f32,c=f16,o=f32": 9}
  assert plain["final_loss_scale"] == 1.0


def test_the_fallback_run_switches_once_and_loses_no_batch_after(spike_run):
  stdout, run_dir, results = spike_run
  run = results["mixed_float16+fallback"]
  assert [e["event"] for e in run["events"]] == ["crash condition", "switch"]
  assert run["events"][1] == {"step": 8, "event": "switch",
                              "detail": "switched to p=f32,c=f32,o=f32"}
  assert run["train"]["policy"] == (["p=f32,c=f16,o=f32"] * 8
                                    + ["p=f32,c=f32,o=f32"] * 6)
  assert run["train"]["skipped"] == [False] * 5 + [True] * 3 + [False] * 6
  assert run["lost_batches"] == {"p=f32,c=f16,o=f32": 3, "p=f32,c=f32,o=f32": 0}
  assert all(math.isfinite(x) for x in run["train"]["loss"][8:])
  assert math.isfinite(run["final_val_loss"])
  assert ("| mixed_float16+fallback |" in stdout
          and "mixed_float16: 3, float32: 0 |" in stdout
          and "switch at step 8 (switched to p=f32,c=f32,o=f32)" in stdout)
  assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_the_recovering_run_recovers_the_spike_batch_and_switches(spike_run):
  stdout, _, results = spike_run
  run = results["mixed_float16+recover+fallback"]
  # Step 6 overflows at 4, 2 and 1 (the minimum: the crash condition); the
  # float32 fallback inside the step recovers the batch, and the controller
  # switches the run to float32 after it.
  assert run["events"] == [
      {"step": 6, "event": "crash condition",
       "detail": "overflow at the minimum loss scale"},
      {"step": 6, "event": "switch", "detail": "switched to p=f32,c=f32,o=f32"}]
  assert run["train"]["recovered"] == [False] * 5 + [True] + [False] * 8
  assert run["train"]["skipped"] == [False] * 14
  assert run["lost_batches"] == {"p=f32,c=f16,o=f32": 0, "p=f32,c=f32,o=f32": 0}
  assert all(math.isfinite(x) for x in run["train"]["loss"])
  assert ("| mixed_float16+recover+fallback |" in stdout
          and "| 1 | mixed_float16: 0, float32: 0 |" in stdout)


def test_recovering_from_2_24_loses_no_batch_where_plain_loses_eight(compare_run):
  stdout, run_dir = compare_run
  results = _results(run_dir)
  plain, recovering = results["mixed_float16"], results["mixed_float16+recover"]
  # Plain skipping loses a batch per halving from 2**24 down to 2**16.
  assert plain["lost_batches"] == {"p=f32,c=f16,o=f32": 8}
  assert plain["train"]["skipped"] == [True] * 8 + [False] * 4
  # With 8 retries the first batch is recomputed at 2**16 inside its step.
  assert recovering["lost_batches"] == {"p=f32,c=f16,o=f32": 0}
  assert recovering["train"]["recovered"] == [True] + [False] * 11
  assert recovering["train"]["loss_scale"][:2] == [2.0**24, 2.0**16]
  assert ("| mixed_float16 |" in stdout and "| - | mixed_float16: 8 | - |"
          in stdout)
  assert "| 1 | mixed_float16: 0 | - |" in stdout


def test_the_fp8_run_trains_with_finite_fp8_meta(compare_run):
  """--fp8: the demo's 7 matmuls (4 attention projections, 2 MLP layers, the
  head) train in FP8 through TrainState; the meta it ends with is finite and
  was written (Flax starts every scale at 1)."""
  stdout, run_dir = compare_run
  run = _results(run_dir)["mixed_fp8"]
  assert run["policy_string"] == "p=f32,c=bf16,o=f32,dot=fp8"
  assert not run["loss_scaling"] and run["skipped_steps"] == 0
  meta = run["fp8_meta"]
  assert meta["matmuls"] == 7 and meta["finite"]
  assert sorted(meta["scales"]) == ["input_scale", "kernel_scale",
                                    "output_grad_scale"]
  for low, high in meta["scales"].values():
    assert 0 < low <= high < 1 and math.isfinite(high)
  assert math.isfinite(run["final_val_loss"])
  assert "| mixed_fp8 |" in stdout
  assert "mixed_fp8: 7 matmuls in FP8" in stdout
  # The note that XLA emulates FP8 is the CPU's only.
  assert ("XLA emulates FP8" in stdout) == (jax.devices()[0].platform == "cpu")


def test_fp8_flag_adds_mixed_fp8_to_the_compared_policies():
  args = train_lm.build_parser().parse_args(["--fp8"])
  policies, _ = train_lm.check_args(args)
  assert policies == ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]
  args = train_lm.build_parser().parse_args(["--fp8", "--policy", "mixed_fp8"])
  assert train_lm.check_args(args)[0] == ["mixed_fp8"]
  args = train_lm.build_parser().parse_args(["--fp8", "--fallback"])
  assert train_lm.check_args(args)[0] == [
      "float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8",
      "mixed_float16+fallback"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--policy", "float32", "--fallback"], "--fallback watches float16 runs"),
        (["--policy", "float32", "--recover"], "--recover watches float16 runs"),
        (["--recover", "--max-retries", "-1"], "--max-retries: jaxmp.retry_skipped: max_retries"),
        (["--policy", "p=f32,c=f16,o=f32,dot=fp8", "--fallback"],
         "--fallback does not cover FP8 runs (p=f32,c=f16,o=f32,dot=fp8)"),
        (["--fp16-spike", "0"], "--fp16-spike must be a step from 1 to --steps"),
        (["--data", "no/such/file.txt"], "no such file"),
        (["--data", "{empty}"], "empty"),
        (["--policy", "float17"], "Unknown policy 'float17'"),
        (["--init-scale", "2**"], "cannot read the number"),
        (["--steps", "0"], "--steps must be at least 1"),
    ],
)
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  args = [a.replace("{empty}", str(empty)) for a in args]
  assert train_lm.main([*args, "--out", str(tmp_path / "runs")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("train_lm.py: error: ") and message in err
  assert "\n" not in err
  assert not (tmp_path / "runs").exists()


def test_bad_input_has_no_traceback(tmp_path):
  proc = _run("--data", str(tmp_path / "missing.txt"), cwd=tmp_path)
  assert proc.returncode == 2
  assert proc.stderr.strip().count("\n") == 0
  assert "Traceback" not in proc.stderr


def test_parse_number():
  assert train_lm.parse_number("2**24") == 2.0**24
  assert train_lm.parse_number(" 65536 ") == 65536.0
  assert train_lm.parse_number("(2**8) * 0.5") == 128.0
  with pytest.raises(train_lm.UsageError, match="unsupported"):
    train_lm.parse_number("__import__('os')")


def test_user_text_file(tmp_path):
  text = tmp_path / "text.txt"
  text.write_bytes(b"hello world\n" * 100)
  data, source = train_lm.load_text(str(text), 10**6)
  assert len(data) == 1200 and source == str(text)
  train, val = train_lm.split_text(data, seq_len=32)
  assert len(train) + len(val) == 1200 and len(val) == 60
