"""Tests of the command line: `jaxmp convert`, `jaxmp doctor`, errors."""

import json
import subprocess
import sys

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
    "min_loss_scale": 1e-5
  },
  /* ZeRO and offload have no jaxmp equivalent. */
  "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
  "gradient_accumulation_steps": 4
}
"""


def _jaxmp(*args, timeout=120):
  return subprocess.run(
      [sys.executable, "-m", "jaxmp", *args],
      capture_output=True, text=True, timeout=timeout, check=False,
  )


def test_convert_good_file(tmp_path, capsys):
  path = tmp_path / "ds_config.json"
  path.write_text(GOOD_CONFIG)
  assert cli.main(["convert", str(path)]) == 0
  out, err = capsys.readouterr()
  namespace = {}
  exec(out, namespace)  # pylint: disable=exec-used
  policy, loss_scale = jaxmp.from_deepspeed_config(path)
  assert namespace["policy"] == policy == jaxmp.get_policy("mixed_float16")
  assert repr(namespace["loss_scale"]) == repr(loss_scale)
  assert "optax.MultiSteps(tx, every_k_schedule=4)" in out
  warnings = err.splitlines()
  assert all(line.startswith("jaxmp convert: warning: ") for line in warnings)
  assert any("'zero_optimization'" in line for line in warnings)
  assert any("'zero_optimization.offload_param'" in line for line in warnings)


def test_convert_bad_file_in_a_subprocess(tmp_path):
  """The one run of the real command: `python -m jaxmp`, its exit code, stderr."""
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": true,,}}')
  result = _jaxmp("convert", str(path))
  assert result.returncode == 2
  assert result.stdout == ""
  assert "Traceback" not in result.stderr
  lines = result.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("jaxmp convert: error: ")
  assert "not valid JSON" in lines[0] and "line 1" in lines[0]


def test_convert_missing_file(tmp_path, capsys):
  assert cli.main(["convert", str(tmp_path / "missing.json")]) == 2
  out, err = capsys.readouterr()
  assert out == "" and len(err.splitlines()) == 1 and "no such file" in err


@pytest.mark.parametrize("config, match", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis"),
    ({"fp16": {"enabled": True, "min_loss_scale": 1e9}}, "above the initial"),
    ({"optimizer": "adam"}, "'optimizer' must be an object"),
    ({"gradient_clipping": -1}, "gradient_clipping"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
])
def test_convert_bad_values(tmp_path, capsys, config, match):
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(config))
  assert cli.main(["convert", str(path)]) == 2
  out, err = capsys.readouterr()
  assert out == ""
  assert len(err.splitlines()) == 1 and match in err


def test_convert_enabled_auto_warns_on_one_line(tmp_path, capsys):
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}}')
  assert cli.main(["convert", str(path)]) == 0
  out, err = capsys.readouterr()
  assert 'jaxmp.get_policy("float32")' in out
  lines = err.splitlines()
  assert len(lines) == 2 and all('.enabled is "auto"' in line for line in lines)


def test_doctor_text_and_json(capsys):
  assert cli.main(["doctor"]) == 0
  assert "cpu" in capsys.readouterr().out.lower()
  assert cli.main(["doctor", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["platform"] == "cpu"
