"""Tests of the command line: `jaxmp convert` and `jaxmp doctor`.

The commands run in-process through ``jaxmp.__main__.main``; one smoke test
runs ``python -m jaxmp`` in a subprocess. Bad input is in the bad-input
catalogue (``tests/test_bad_input.py``).
"""

import io
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp
from jaxmp import __main__ as cli

GOOD_CONFIG = """\
{
  // From a typical fine-tuning blog post.
  "fp16": {
    "enabled": true,
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "initial_scale_power": 16,
    "hysteresis": 2,
    "min_loss_scale": 1e-5,
  },
  /* ZeRO and offload have no jaxmp equivalent. */
  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
  "gradient_accumulation_steps": 4,
}
"""


def _convert(capsys, *args):
  code = cli.main(["convert", *args])
  out, err = capsys.readouterr()
  return code, out, err


def _run_printed(code):
  namespace = {}
  exec(compile(code, "<jaxmp convert>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_convert_good_file(tmp_path, capsys):
  path = tmp_path / "ds_config.json"
  path.write_text(GOOD_CONFIG)
  code, out, err = _convert(capsys, str(path))
  assert code == 0, err
  namespace = _run_printed(out)
  policy, loss_scale = jaxmp.from_deepspeed_config(path)
  assert namespace["policy"] == policy == jaxmp.get_policy("mixed_float16")
  assert repr(namespace["loss_scale"]) == repr(loss_scale)
  assert ("tx = jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule=4, "
          "clip_global_norm=1.0)") in out
  assert "MultiSteps" not in out
  assert out.startswith(f"# jaxmp equivalent of the DeepSpeed config {path}.\n")
  warnings = err.splitlines()
  assert all(line.startswith("jaxmp convert: warning: ") for line in warnings)
  assert [line.split("'")[1] for line in warnings] == [
      "gradient_clipping", "zero_optimization", "zero_optimization.offload_param"]


def test_convert_reads_standard_input(tmp_path, capsys, monkeypatch):
  path = tmp_path / "ds_config.json"
  path.write_text(GOOD_CONFIG)
  _, from_file, _ = _convert(capsys, str(path))
  monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeff" + GOOD_CONFIG))
  code, from_stdin, err = _convert(capsys, "-")
  assert code == 0, err
  first, *rest = from_stdin.splitlines(keepends=True)
  assert first == "# jaxmp equivalent of the DeepSpeed config read from standard input.\n"
  assert rest == from_file.splitlines(keepends=True)[1:]


def test_convert_enabled_auto_warns_on_one_line(tmp_path, capsys):
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},'
                  ' "gradient_clipping": 0}')
  code, out, err = _convert(capsys, str(path))
  assert code == 0
  assert 'jaxmp.get_policy("float32")' in out
  lines = err.splitlines()
  assert len(lines) == 2 and all('.enabled is "auto"' in line for line in lines)


@pytest.mark.integration  # a process of its own
def test_convert_bad_file_in_a_subprocess():
  """The command as a user runs it: exit status 2, one line, no traceback."""
  result = subprocess.run(
      [sys.executable, "-m", "jaxmp", "convert", "-"],
      input='{"fp16": {"enabled": true,,}}', capture_output=True, text=True,
      timeout=120, check=False,
  )
  assert result.returncode == 2
  assert result.stdout == ""
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxmp convert: error: "), result.stderr
  assert re.search(r"standard input is not valid JSON.*line 1, column 27", lines[0])


def test_doctor_text_and_json(capsys):
  expected = jaxmp.hardware_report()
  assert cli.main(["doctor"]) == 0
  text = capsys.readouterr().out
  assert expected.platform in text and expected.recommended_policy in text
  assert cli.main(["doctor", "--json"]) == 0
  assert json.loads(capsys.readouterr().out) == expected.as_dict()


# ---------------------------------------------------------------------------
# Training with the printed code: accumulation over 4 micro-batches.

TRAINING_CONFIG = """\
{
  "%s": {"enabled": true%s},
  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
  "gradient_clipping": 0,
  "gradient_accumulation_steps": 4,
}
"""
PRECISIONS = {
    # name: (block, extra keys, loss scale after one overflow, rtol of the update)
    "fp16": ("fp16", ', "initial_scale_power": 8, "hysteresis": 2', 256.0, 2e-2),
    "bf16": ("bf16", "", 1.0, 5e-2),
}


def _batches(n, seed):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(n, 8, 3)).astype(np.float32)
  ys = xs @ np.array([1.0, 2.0, -1.0], np.float32) + np.float32(0.5)
  return [{"x": jnp.asarray(x), "y": jnp.asarray(y)} for x, y in zip(xs, ys)]


def _float32_loss(params, batch):
  return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_printed_code_trains_with_accumulation(tmp_path, capsys, precision):
  block, extra, scale_after_overflow, rtol = PRECISIONS[precision]
  path = tmp_path / "ds_config.json"
  path.write_text(TRAINING_CONFIG % (block, extra))
  code, out, err = _convert(capsys, str(path))
  assert code == 0, err
  namespace = _run_printed(out)
  policy, tx = namespace["policy"], namespace["tx"]
  assert "jaxmp.multi_steps(" in out

  def loss_fn(params, batch):
    params, x = policy.cast_to_compute((params, batch["x"]))
    prediction = policy.cast_to_output(x @ params["w"] + params["b"])
    return jnp.mean((prediction - batch["y"]) ** 2)

  @jax.jit
  def micro_step(params, opt_state, batch):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params = {"w": jnp.array([0.5, -0.25, 1.0]), "b": jnp.array(0.1)}
  opt_state = tx.init(params)

  def same(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: np.array_equal(np.asarray(x).view(np.uint32),
                                    np.asarray(y).view(np.uint32)), a, b)))

  # 1. Four clean micro-batches: nothing moves until the fourth, which
  # applies -lr times the mean gradient.
  batches = _batches(4, seed=0)
  start = params
  for i, batch in enumerate(batches):
    params, opt_state = micro_step(params, opt_state, batch)
    assert same(params, start) == (i < 3), i
  mean_grad = jax.tree.map(lambda *g: sum(g) / 4, *[
      jax.grad(_float32_loss)(start, batch) for batch in batches])
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, start, mean_grad)
  for key in params:
    np.testing.assert_allclose(params[key], expected[key], rtol=rtol, atol=1e-3)
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 0

  # 2. A nan in the second micro-batch skips the whole accumulated step; the
  # accumulator starts clean afterwards (not poisoned with nan).
  before = params
  bad = _batches(4, seed=1)
  bad[1] = {"x": bad[1]["x"].at[0, 0].set(jnp.nan), "y": bad[1]["y"]}
  for batch in bad:
    params, opt_state = micro_step(params, opt_state, batch)
  assert same(params, before)
  metrics = jaxmp.loss_scaling_metrics(opt_state)
  assert int(metrics["skipped_steps"]) == 1
  assert float(metrics["loss_scale"]) == scale_after_overflow
  assert all(bool(jnp.all(acc == 0)) for acc in jax.tree.leaves(opt_state.acc_grads))

  # 3. The next accumulation trains again.
  for batch in _batches(4, seed=2):
    params, opt_state = micro_step(params, opt_state, batch)
  assert not same(params, before)
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 1


# ---------------------------------------------------------------------------
# Hugging Face Trainer configs: "auto" everywhere, filled in from the Trainer's
# arguments (a TrainingArguments.to_json_string() file, or its flags).

DATA = pathlib.Path(__file__).resolve().parent / "data"
TRAINER_ARGS = str(DATA / "hf_training_args.json")  # bf16, max_grad_norm 1, 4 steps
HF_RUNS = {
    # name: (config, arguments, preset, accumulation, learning rate, weight decay)
    "bf16 from the arguments file": (
        "ds_config_zero2_bf16.json", ["--training-args", TRAINER_ARGS],
        "mixed_bfloat16", 4, 2e-4, 0.01),
    "fp16 from the flags": (
        "ds_config_zero2_fp16.json", ["--fp16", "--gradient_accumulation_steps", "4"],
        "mixed_float16", 4, 5e-5, 0.0),  # the Trainer's defaults: lr 5e-5, no decay
    "a flag overrides the arguments file": (
        "ds_config_zero2_bf16.json",
        ["--training-args", TRAINER_ARGS, "--gradient_accumulation_steps", "2"],
        "mixed_bfloat16", 2, 2e-4, 0.01),
}


@pytest.mark.parametrize("run", HF_RUNS)
def test_printed_code_of_a_hugging_face_config_trains(capsys, run):
  config, argv, preset, accumulation, learning_rate, weight_decay = HF_RUNS[run]
  code, out, err = _convert(capsys, str(DATA / config), *argv)
  assert code == 0, err
  namespace = _run_printed(out)
  policy, tx = namespace["policy"], namespace["tx"]
  assert policy == jaxmp.get_policy(preset)

  def loss_fn(params):  # gradient 0.5 per weight, of global norm 2
    w = policy.cast_to_compute(params)["w"]
    return jnp.mean(policy.cast_to_output(w * jnp.asarray(8.0, w.dtype)))

  @jax.jit
  def micro_step(params, opt_state):
    _, grads = jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(opt_state))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  start = {"w": jnp.linspace(-1.0, 1.0, 16)}
  params, opt_state = start, tx.init(start)
  for i in range(accumulation):  # gradient_accumulation_steps
    params, opt_state = micro_step(params, opt_state)
    assert np.array_equal(params["w"], start["w"]) == (i < accumulation - 1), i
  # max_grad_norm 1: AdamW's first moment holds (1 - beta1) times the
  # gradient clipped to norm 1.
  mu = optax.tree_utils.tree_get(opt_state, "mu")
  np.testing.assert_allclose(np.linalg.norm(mu["w"]) / (1 - 0.9), 1.0, rtol=1e-6)
  # learning_rate and weight_decay: Adam's first step moves each weight by lr.
  np.testing.assert_allclose(
      params["w"] - start["w"], -learning_rate * (1 + weight_decay * start["w"]),
      rtol=0, atol=2e-7)  # float32 rounding of weights near 1
  for _ in range(2 * accumulation):
    params, opt_state = micro_step(params, opt_state)
  assert int(jaxmp.loss_scaling_metrics(opt_state)["skipped_steps"]) == 0
  assert float(jnp.max(params["w"] - start["w"])) < -2 * learning_rate  # it trains on
