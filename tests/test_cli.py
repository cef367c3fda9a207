"""Tests of the command line: `jaxmp convert` and `jaxmp doctor`.

The commands run in-process through ``jaxmp.__main__.main``; one smoke test
runs ``python -m jaxmp`` in a subprocess. The printed code is executed and
compared with what ``jaxmp.from_deepspeed_config`` reads and with optax
optimizers built by hand. Bad input is in the bad-input catalogue
(``tests/test_bad_input.py``).
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

DATA = pathlib.Path(__file__).resolve().parent / "data"
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


def _printed(capsys, tmp_path, config, *args):
  """Runs `jaxmp convert` on ``config`` (a dict, or a file's text) and the code it prints."""
  path = tmp_path / "ds_config.json"
  path.write_text(config if isinstance(config, str) else json.dumps(config))
  code, out, err = _convert(capsys, str(path), *args)
  assert code == 0, err
  namespace = {}
  exec(compile(out, "<jaxmp convert>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace, out, err


@pytest.mark.parametrize("config", [
    GOOD_CONFIG, {"fp16": {"enabled": True, "loss_scale": 1024}},
    {"bf16": {"enabled": True}}, {"gradient_clipping": 0}])
def test_printed_policy_and_loss_scale_are_the_reader_s(tmp_path, capsys, config):
  namespace, _, _ = _printed(capsys, tmp_path, config)
  policy, loss_scale = jaxmp.from_deepspeed_config(config)
  assert namespace["policy"] == policy
  assert repr(namespace["loss_scale"]) == repr(loss_scale)


def test_convert_reads_standard_input(tmp_path, capsys, monkeypatch):
  path = tmp_path / "ds_config.json"
  path.write_text(GOOD_CONFIG)
  _, from_file, _ = _convert(capsys, str(path))
  monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeff" + GOOD_CONFIG))
  code, from_stdin, err = _convert(capsys, "-")
  assert code == 0, err
  assert from_file.startswith(f"# jaxmp equivalent of the DeepSpeed config {path}.\n")
  first, *rest = from_stdin.splitlines(keepends=True)
  assert first == "# jaxmp equivalent of the DeepSpeed config read from standard input.\n"
  assert rest == from_file.splitlines(keepends=True)[1:]


def _trajectory(tx, steps):
  """The params after each of ``steps`` updates with growing gradients (norm 13, 26...)."""
  params = {"w": jnp.array([1.0, -2.0, 3.0])}
  state, trajectory = tx.init(params), []
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam raises decay to an int32 count
    for i in range(steps):
      grads = {"w": jnp.array([3.0, 4.0, 12.0]) * (i + 1)}
      updates, state = tx.update(jaxmp.get_loss_scale(state).scale(grads), state, params)
      params = optax.apply_updates(params, updates)
      trajectory.append(params["w"])
  return np.stack(trajectory)


def _tx(optimizer, clip=None, k=1):
  def build(loss_scale):
    clip_arg = {} if clip is None else {"clip_global_norm": clip}
    if k > 1:
      return jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule=k, **clip_arg)
    return jaxmp.loss_scaling(optimizer, loss_scale, **clip_arg)
  return build, k


def _with(optimizer, **keys):
  return {"bf16": {"enabled": True}, "gradient_clipping": 0, "optimizer": optimizer, **keys}


ADAMW = {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                     "weight_decay": 0.01}}
TRAINER_ARGS = str(DATA / "hf_training_args.json")  # bf16, max_grad_norm 1, 4 steps, lr 2e-4
HF_ADAMW = optax.adamw(2e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("config, args, expected", [
    (_with(ADAMW), [], _tx(optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))),
    (_with({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}), [],
     _tx(optax.adamw(1e-3, weight_decay=0.1))),
    (_with({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False}}),
     [], _tx(optax.chain(optax.add_decayed_weights(0.1), optax.adam(1e-3)))),
    (_with({"type": "Adam", "params": {"lr": 1e-3}}), [], _tx(optax.adam(1e-3))),
    (_with({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}), [],
     _tx(optax.sgd(0.1, momentum=0.9))),
    (_with({"type": "SGD", "params": {"lr": 0.1, "weight_decay": 0.1}}), [],
     _tx(optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1)))),
    (_with({"type": "Lamb", "params": {"lr": 0.01}}), [], _tx(optax.lamb(0.01, weight_decay=0.0))),
    (_with({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "eps": 1e-8}}), [],
     _tx(optax.lion(1e-4, b1=0.9, b2=0.99, weight_decay=0.0))),
    # Clipping: absent, DeepSpeed's default (recorded); accumulation: a whole float.
    ({"bf16": {"enabled": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, [],
     _tx(optax.sgd(0.1), clip=json.loads((DATA / "deepspeed.json").read_text())[
         "gradient_clipping_default"])),
    (_with(ADAMW, gradient_clipping=0.5, gradient_accumulation_steps=2.0), [],
     _tx(optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01), clip=0.5, k=2)),
    (_with(ADAMW, gradient_accumulation_steps=1.0), [],
     _tx(optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01))),
    # A Hugging Face config, "auto" everywhere: the Trainer's arguments (a file,
    # flags that override it, or flags alone with the Trainer's defaults).
    ("ds_config_zero2_bf16.json", ["--training-args", TRAINER_ARGS],
     _tx(HF_ADAMW, clip=1.0, k=4)),
    ("ds_config_zero2_bf16.json",
     ["--training-args", TRAINER_ARGS, "--gradient_accumulation_steps", "2"],
     _tx(HF_ADAMW, clip=1.0, k=2)),
    ("ds_config_zero2_fp16.json", ["--fp16", "--gradient_accumulation_steps", "4"],
     _tx(optax.adam(5e-5, b1=0.9, b2=0.999, eps=1e-8), clip=1.0, k=4)),
], ids=["adamw", "adam-decoupled", "adam-coupled", "adam", "sgd-momentum", "sgd-decay",
        "lamb", "lion", "clip-absent", "clip-accumulate", "accumulate-1",
        "hf-file", "hf-file-and-flag", "hf-flags"])
def test_printed_optimizer_clipping_and_accumulation(tmp_path, capsys, config, args, expected):
  if isinstance(config, str):
    config = (DATA / config).read_text()
  namespace, _, _ = _printed(capsys, tmp_path, config, *args)
  build, k = expected
  np.testing.assert_array_equal(_trajectory(namespace["tx"], 2 * k),
                                _trajectory(build(namespace["loss_scale"]), 2 * k))


def test_what_is_not_converted_is_named_on_standard_error(tmp_path, capsys):
  config = {
      "fp16": {"enabled": True, "auto_cast": True},
      "optimizer": {"type": "OneBitAdam",
                    "params": {"lr": 1e-3, "weight_decy": 0.1, "amsgrad": False}},
      "gradient_clip": 1.0,
      "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
      "steps_per_print": 10,
      "bf_16": {"enabled": True},
  }
  _, _, err = _printed(capsys, tmp_path, config)
  lines = err.splitlines()  # one line each
  assert all(line.startswith("jaxmp convert: warning: ") for line in lines), err
  notes = dict(re.findall(r"'(.+?)' is not converted: (.*)", err))
  assert list(notes) == [
      "fp16.auto_cast", "optimizer", "optimizer.params.weight_decy",
      "optimizer.params.amsgrad", "gradient_clipping", "gradient_clip",
      "zero_optimization", "zero_optimization.offload_param", "steps_per_print"]
  assert len(lines) == len(notes) + 2  # and two warnings:
  assert re.search(r'"auto" read as .*gradient_accumulation_steps as 1', lines[0])
  assert re.search(r"the key 'bf_16' is not read.*Did you mean 'bf16'", lines[1])
  assert "policy.cast_to_compute" in notes["fp16.auto_cast"]
  assert "'OneBitAdam' is not mapped" in notes["optimizer"]
  assert notes["optimizer.params.weight_decy"].endswith("Did you mean 'weight_decay'?")
  assert "Did you mean" not in notes["optimizer.params.amsgrad"]
  assert 'DeepSpeed 0.19.8 then clips at 1.0' in notes["gradient_clipping"]
  assert notes["gradient_clip"].endswith("Did you mean 'gradient_clipping'?")
  assert notes["steps_per_print"] == "no jaxmp equivalent; ignored."


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
