"""Tests of examples/train_lm.py, the script `make demo` runs (tiny model)."""

import json
import math
import pathlib
import subprocess
import sys

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


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
  """One `--policy compare` run; float16 starts at 2**24 so that it overflows."""
  out = tmp_path_factory.mktemp("runs")
  proc = _run(*TINY, "--init-scale", "2**24", "--out", str(out), cwd=out)
  assert proc.returncode == 0, proc.stderr
  (run_dir,) = list(out.iterdir())
  return proc, run_dir


def test_writes_metrics_and_plot(compare_run):
  proc, run_dir = compare_run
  metrics = json.loads((run_dir / "metrics.json").read_text())
  assert [r["policy"] for r in metrics["results"]] == [
      "float32", "mixed_bfloat16", "mixed_float16"]
  png = (run_dir / "loss.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000
  assert "| policy | train loss | val loss |" in proc.stdout
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
  results = {r["policy"]: r for r in
             json.loads((run_dir / "metrics.json").read_text())["results"]}
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


@pytest.mark.parametrize(
    "args, message",
    [
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
