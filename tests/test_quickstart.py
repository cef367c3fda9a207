"""The quick-start example trains in float16 and survives real overflows."""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.integration

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "quickstart.py"


def load_example():
  spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quickstart_trains_and_backs_off(capsys):
  assert load_example().main(["--steps", "120", "--log-every", "40"]) == 0
  lines = capsys.readouterr().out.splitlines()
  rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
  steps = [int(r[0]) for r in rows]
  losses = [float(r[1]) for r in rows]
  scales = [float(r[2]) for r in rows]
  skipped = [int(r[3]) for r in rows]
  assert steps == [1, 40, 80, 120]
  assert skipped[0] == 1  # 2**24 overflows float16 on the first step
  assert scales[-1] < 2**24  # ...so the scale backed off
  assert losses[-1] < 0.5 * losses[0]
  accuracy = float(lines[-1].split()[2].rstrip(";"))
  assert accuracy > 0.9
  assert "params stay float32" in lines[-1]
