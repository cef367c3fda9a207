"""Tests of `jaxmp convert` and `jaxmp doctor` (in-process; a smoke test runs python -m jaxmp)."""

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
from models import BLOG_CONFIG

DATA = pathlib.Path(__file__).resolve().parent / "data"
BF16 = {"bf16": {"enabled": True}}


def _printed(capsys, tmp_path, config, *args):
  """`jaxmp convert` of ``config`` (a dict or text): the namespace of the code it prints
  (whose policy and loss scale are the reader's, without arguments), the code, stderr."""
  path = tmp_path / "ds_config.json"
  path.write_text(config if isinstance(config, str) else json.dumps(config))
  code, namespace = cli.main(["convert", str(path), *args]), {}
  out, err = capsys.readouterr()
  assert code == 0, err
  exec(compile(out, "<jaxmp convert>", "exec"), namespace)  # pylint: disable=exec-used
  if not args:
    policy, loss_scale = jaxmp.from_deepspeed_config(config)
    assert (namespace["policy"], repr(namespace["loss_scale"])) == (policy, repr(loss_scale))
  return namespace, out, err


def test_convert_reads_standard_input(tmp_path, capsys, monkeypatch):
  _, from_file, _ = _printed(capsys, tmp_path, BLOG_CONFIG)
  monkeypatch.setattr(sys, "stdin", io.StringIO("\ufeff" + BLOG_CONFIG))
  assert cli.main(["convert", "-"]) == 0
  first, *rest = capsys.readouterr().out.splitlines(keepends=True)
  assert from_file.startswith(
      f"# jaxmp equivalent of the DeepSpeed config {tmp_path / 'ds_config.json'}.\n")
  assert first == "# jaxmp equivalent of the DeepSpeed config read from standard input.\n"
  assert rest == from_file.splitlines(keepends=True)[1:]


def _trajectory(tx, steps):
  """The params after each of ``steps`` updates with growing gradients (norm 13, 26...)."""
  params, trajectory = {"w": jnp.array([1.0, -2.0, 3.0])}, []
  state = tx.init(params)
  with jax.numpy_dtype_promotion("standard"):  # optax's Adam raises decay to an int32 count
    for i in range(steps):
      grads = jaxmp.get_loss_scale(state).scale({"w": jnp.array([3.0, 4.0, 12.0]) * (i + 1)})
      updates, state = tx.update(grads, state, params)
      trajectory.append((params := optax.apply_updates(params, updates))["w"])
  return np.stack(trajectory)


def _with(kind, params, block=BF16, **keys):
  return {**block, "gradient_clipping": 0, "optimizer": {"type": kind, "params": params}, **keys}


ADAMW = ("AdamW", {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01})
OPTAX_ADAMW = optax.adamw(3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
# The Trainer's arguments: bf16, max_grad_norm 1, 4 steps, lr 2e-4.
TRAINER_ARGS = ["--training-args", str(DATA / "hf_training_args.json")]
HF_ADAMW = optax.adamw(2e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.01)


# The printed tx steps as the optimizer, or (optimizer, clip_global_norm,
# every_k_schedule), built by hand. Accumulation: a whole float, 1 is none.
@pytest.mark.parametrize("config, args, expected", [
    (_with(*ADAMW, gradient_accumulation_steps=1.0), [], OPTAX_ADAMW),
    (_with("Adam", {"lr": 1e-3, "weight_decay": 0.1}), [], optax.adamw(1e-3, weight_decay=0.1)),
    (_with("Adam", {"lr": 1e-3, "weight_decay": 0.1, "adam_w_mode": False}), [],
     optax.chain(optax.add_decayed_weights(0.1), optax.adam(1e-3))),
    (_with("Adam", {"lr": 1e-3}, {"fp16": {"enabled": True, "loss_scale": 1024}}), [],
     optax.adam(1e-3)),
    (_with("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}), [],
     optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))),
    (_with("Lamb", {"lr": 0.01}, {}), [], optax.lamb(0.01, weight_decay=0.0)),
    (_with("Lion", {"lr": 1e-4, "betas": [0.9, 0.99], "eps": 1e-8}), [],
     optax.lion(1e-4, b1=0.9, b2=0.99, weight_decay=0.0)),
    # Clipping absent: DeepSpeed's default (recorded: see test_deepspeed.py).
    ({**BF16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, [], (optax.sgd(0.1), 1.0, 1)),
    (_with(*ADAMW, gradient_clipping=0.5, gradient_accumulation_steps=2.0), [],
     (OPTAX_ADAMW, 0.5, 2)),
    # Configs of "auto"s and the Trainer's arguments: a file, flags over it, flags alone.
    ("ds_config_zero2_bf16.json", TRAINER_ARGS, (HF_ADAMW, 1.0, 4)),
    ("ds_config_zero2_bf16.json", [*TRAINER_ARGS, "--gradient_accumulation_steps", "2"],
     (HF_ADAMW, 1.0, 2)),
    ("ds_config_zero2_fp16.json", ["--fp16", "--gradient_accumulation_steps", "4"],
     (optax.adam(5e-5, b1=0.9, b2=0.999, eps=1e-8), 1.0, 4)),
], ids=["adamw-accumulate-1", "adam-decoupled", "adam-coupled", "adam-static-fp16",
        "sgd-momentum-decay", "lamb-float32", "lion", "clip-absent", "clip-accumulate",
        "hf-file", "hf-file-and-flag", "hf-flags"])
def test_printed_optimizer_clipping_and_accumulation(tmp_path, capsys, config, args, expected):
  config = (DATA / config).read_text() if isinstance(config, str) else config
  namespace, _, _ = _printed(capsys, tmp_path, config, *args)
  optimizer, clip, k = (expected, None, 1) if hasattr(expected, "init") else expected
  clip = {} if clip is None else {"clip_global_norm": clip}
  tx = (jaxmp.multi_steps(optimizer, namespace["loss_scale"], every_k_schedule=k, **clip)
        if k > 1 else jaxmp.loss_scaling(optimizer, namespace["loss_scale"], **clip))
  np.testing.assert_array_equal(_trajectory(namespace["tx"], 2 * k), _trajectory(tx, 2 * k))


@pytest.mark.filterwarnings("ignore::UserWarning")  # the reader's; convert's are asserted
def test_what_is_not_converted_is_named_on_standard_error(tmp_path, capsys):
  _, _, err = _printed(capsys, tmp_path, {
      "fp16": {"enabled": True, "auto_cast": True},
      "optimizer": {"type": "OneBitAdam",
                    "params": {"lr": 1e-3, "weight_decy": 0.1, "amsgrad": False}},
      "gradient_clip": 1.0, "gradient_accumulation_steps": "auto",
      "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
      "steps_per_print": 10, "bf_16": {"enabled": True}})
  lines = err.splitlines()  # one line each: two warnings, then the notes
  assert all(line.startswith("jaxmp convert: warning: ") for line in lines), err
  assert re.search(r'"auto" read as .*gradient_accumulation_steps as 1', lines[0])
  assert re.search(r"the key 'bf_16' is not read.*Did you mean 'bf16'", lines[1])
  notes = dict(re.findall(r"'(.+?)' is not converted: (.*)", err))
  expected = {  # each note, and what it says
      "fp16.auto_cast": "policy.cast_to_compute", "optimizer": "'OneBitAdam' is not mapped",
      "optimizer.params.weight_decy": r"Did you mean 'weight_decay'\?$",
      "optimizer.params.amsgrad": r"^(?!.*Did you mean)",
      "gradient_clipping": "DeepSpeed 0.19.8 then clips at 1.0",
      "gradient_clip": r"Did you mean 'gradient_clipping'\?$", "zero_optimization": "",
      "zero_optimization.offload_param": "", "steps_per_print": r"^no jaxmp equivalent; ignored\.$"}
  assert list(notes) == list(expected) and len(lines) == len(notes) + 2
  assert all(re.search(expected[key], note) for key, note in notes.items()), notes


@pytest.mark.integration  # a process of its own
def test_convert_bad_file_in_a_subprocess():
  """The command as a user runs it: exit status 2, one line, no traceback."""
  result = subprocess.run([sys.executable, "-m", "jaxmp", "convert", "-"],
                          input='{"fp16": {"enabled": true,,}}', capture_output=True,
                          text=True, timeout=120, check=False)
  assert (result.returncode, result.stdout, result.stderr.count("\n")) == (2, "", 1)
  assert re.match(r"jaxmp convert: error: standard input is not valid JSON.*line 1, column 27",
                  result.stderr), result.stderr


def test_doctor_text_and_json(capsys):
  report = jaxmp.hardware_report()
  assert cli.main(["doctor"]) == 0 and str(report) in capsys.readouterr().out
  assert cli.main(["doctor", "--json"]) == 0
  assert json.loads(capsys.readouterr().out) == report.as_dict()
