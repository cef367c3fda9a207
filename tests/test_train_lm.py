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
sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

TINY = ["--steps", "12", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--seq-len", "32", "--batch-size", "8", "--eval-every", "6",
        "--eval-batches", "1", "--max-bytes", "300000", "--quiet"]
F16, F32 = "p=f32,c=f16,o=f32", "p=f32,c=f32,o=f32"
COMPARED = ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]  # with --fp8


def _train(*args, out):
  """``train_lm.run(args)`` in this process, under standard promotion as the script runs
  (the demo's attention multiplies its float32 softmax by half-precision values)."""
  stdout = io.StringIO()
  with contextlib.redirect_stdout(stdout), jax.numpy_dtype_promotion("standard"):
    run_dir = train_lm.run([*args, "--out", str(out)])
  return stdout.getvalue(), json.loads((run_dir / "metrics.json").read_text()), run_dir


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
  """`--policy compare --fp8 --recover` (five runs); float16 starts at 2**24: it overflows."""
  stdout, metrics, run_dir = _train(*TINY, "--init-scale", "2**24", "--fp8", "--recover",
                                    out=tmp_path_factory.mktemp("runs"))
  return stdout, metrics, run_dir, {r["policy"]: r for r in metrics["results"]}


def test_writes_metrics_plot_and_table_and_every_policy_learns(compare_run):
  stdout, metrics, run_dir, results = compare_run
  assert [r["policy"] for r in metrics["results"]] == [*COMPARED, "mixed_float16+recover"]
  png = (run_dir / "loss.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000
  assert "| policy | train loss | val loss |" in stdout and metrics["config"]["init_scale"] == 2**24
  for result in metrics["results"]:
    loss = result["train"]["loss"]
    assert len(loss) == 12 and all(math.isfinite(x) for x in loss)
    assert sum(loss[-3:]) / 3 < sum(loss[:3]) / 3 - 0.3, result["policy"]
    assert result["validation"]["step"] == [6, 12] and result["tokens_per_second"] > 0
    assert result["events"] == []
  # Without events or recovery, the plain table.
  table = train_lm.summary_table([r for name, r in results.items()
                                  if not name.endswith("+recover")])
  assert table.startswith(
      "| policy | train loss | val loss | skipped steps | final loss scale "
      "| tokens/s | memory |\n")
  assert "lost batches per policy" not in table and "recovered steps" not in table


def test_float16_from_2_24_backs_off_losing_eight_batches_and_recovering_none(compare_run):
  stdout, _, _, results = compare_run
  plain, recovering = results["mixed_float16"], results["mixed_float16+recover"]
  # Plain skipping loses a batch per halving (the next step's scale) down to 2**16.
  assert plain["loss_scaling"] and plain["train"]["skipped"] == [True] * 8 + [False] * 4
  assert plain["skipped_steps"] == 8 and plain["lost_batches"] == {F16: 8}
  assert plain["train"]["loss_scale"] + [plain["final_loss_scale"]] == [
      2.0**(24 - t) for t in range(8)] + [2.0**16] * 5
  assert [(results[n]["loss_scaling"], results[n]["skipped_steps"])
          for n in ("float32", "mixed_bfloat16")] == [(False, 0)] * 2
  # With 8 retries the first batch is recomputed at 2**16 inside its step.
  assert (recovering["lost_batches"], recovering["train"]["recovered"],
          recovering["train"]["loss_scale"][:2]) == ({F16: 0}, [True] + [False] * 11,
                                                     [2**24, 2**16])
  assert "| - | mixed_float16: 8 | - |" in stdout and "| 1 | mixed_float16: 0 | - |" in stdout


def test_the_fp8_run_trains_with_finite_fp8_meta(compare_run):
  """The demo's 7 matmuls (4 attention projections, 2 MLP layers, the head) train in FP8
  through TrainState; the meta it ends with is finite and written (Flax starts at 1)."""
  stdout, _, _, results = compare_run
  run, meta = results["mixed_fp8"], results["mixed_fp8"]["fp8_meta"]
  assert (run["policy_string"], run["loss_scaling"], run["skipped_steps"]) == (
      "p=f32,c=bf16,o=f32,dot=fp8", False, 0) and math.isfinite(run["final_val_loss"])
  assert (meta["matmuls"], meta["finite"], sorted(meta["scales"])) == (
      7, True, ["input_scale", "kernel_scale", "output_grad_scale"])
  assert all(0 < low <= high < 1 for low, high in meta["scales"].values())
  assert "| mixed_fp8 |" in stdout and "mixed_fp8: 7 matmuls in FP8" in stdout
  # The note that XLA emulates FP8 is the CPU's only.
  assert ("XLA emulates FP8" in stdout) == (jax.devices()[0].platform == "cpu")


@pytest.fixture(scope="module")
def spike_run(tmp_path_factory):
  """float16, a spike at step 6: plain, under the fallback controller, and recovering too."""
  stdout, metrics, run_dir = _train(
      *TINY, "--steps", "14", "--policy", "mixed_float16", "--fallback",
      "--recover", "--max-retries", "2", "--fp16-spike", "6",
      "--init-scale", "2**2", out=tmp_path_factory.mktemp("spike"))
  return stdout, run_dir, {r["policy"]: r for r in metrics["results"]}


def test_the_spike_drives_plain_float16_to_the_crash_condition(spike_run):
  plain = spike_run[2]["mixed_float16"]
  # 4 -> 2 -> 1 on steps 6 and 7; step 8 overflows at the minimum scale.
  assert plain["events"] == [{"step": 8, "event": "crash condition",
                              "detail": "overflow at the minimum loss scale"}]
  assert (plain["train"]["skipped"], plain["lost_batches"], plain["final_loss_scale"]) == (
      [False] * 5 + [True] * 9, {F16: 9}, 1.0)


def test_the_fallback_run_switches_once_and_loses_no_batch_after(spike_run):
  stdout, run_dir, results = spike_run
  run = results["mixed_float16+fallback"]
  assert [e["event"] for e in run["events"]] == ["crash condition", "switch"]
  assert run["events"][1] == {"step": 8, "event": "switch", "detail": f"switched to {F32}"}
  assert (run["train"]["policy"], run["train"]["skipped"], run["lost_batches"]) == (
      [F16] * 8 + [F32] * 6, [False] * 5 + [True] * 3 + [False] * 6, {F16: 3, F32: 0})
  assert all(math.isfinite(x) for x in [*run["train"]["loss"][8:], run["final_val_loss"]])
  assert "| mixed_float16+fallback |" in stdout and "mixed_float16: 3, float32: 0 |" in stdout
  assert f"switch at step 8 (switched to {F32})" in stdout
  assert (run_dir / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_the_recovering_run_recovers_the_spike_batch_and_switches(spike_run):
  stdout, _, results = spike_run
  run = results["mixed_float16+recover+fallback"]
  # Step 6 overflows at 4, 2 and 1 (the minimum: the crash condition); the float32
  # fallback inside the step recovers the batch, and the controller then switches.
  assert run["events"] == [
      {"step": 6, "event": "crash condition", "detail": "overflow at the minimum loss scale"},
      {"step": 6, "event": "switch", "detail": f"switched to {F32}"}]
  assert (run["train"]["recovered"], run["train"]["skipped"], run["lost_batches"]) == (
      [False] * 5 + [True] + [False] * 8, [False] * 14, {F16: 0, F32: 0})
  assert all(math.isfinite(x) for x in run["train"]["loss"])
  assert ("| mixed_float16+recover+fallback |" in stdout
          and "| 1 | mixed_float16: 0, float32: 0 |" in stdout)


@pytest.mark.parametrize("args, policies", [
    (["--fp8"], COMPARED), (["--fp8", "--policy", "mixed_fp8"], ["mixed_fp8"]),
    (["--fp8", "--fallback"], [*COMPARED, "mixed_float16+fallback"])])
def test_fp8_flag_adds_mixed_fp8_to_the_compared_policies(args, policies):
  assert train_lm.check_args(train_lm.build_parser().parse_args(args))[0] == policies


@pytest.mark.parametrize("args, message", [
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
])
def test_bad_input_is_one_line(args, message, tmp_path, capsys):
  (tmp_path / "empty.txt").write_bytes(b"")
  args = [a.replace("{empty}", str(tmp_path / "empty.txt")) for a in args]
  assert train_lm.main([*args, "--out", str(tmp_path / "runs")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("train_lm.py: error: ") and message in err and "\n" not in err
  assert not (tmp_path / "runs").exists()


def test_bad_input_has_no_traceback(tmp_path):
  proc = subprocess.run(
      [sys.executable, str(ROOT / "examples" / "train_lm.py"), "--data",
       str(tmp_path / "missing.txt")], cwd=tmp_path, capture_output=True, text=True,
      timeout=300, check=False)
  assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr


def test_parse_number_and_a_user_text_file(tmp_path):
  assert [train_lm.parse_number(s) for s in ("2**24", " 65536 ", "(2**8) * 0.5")] == [
      2.0**24, 65536.0, 128.0]
  with pytest.raises(train_lm.UsageError, match="unsupported"):
    train_lm.parse_number("__import__('os')")
  (tmp_path / "text.txt").write_bytes(b"hello world\n" * 100)
  data, source = train_lm.load_text(str(tmp_path / "text.txt"), 10**6)
  assert len(data) == 1200 and source == str(tmp_path / "text.txt")
  train, val = train_lm.split_text(data, seq_len=32)
  assert len(train) + len(val) == 1200 and len(val) == 60
