"""Runs the Flax examples, shortened, on scikit-learn's digits."""

import importlib.util
import pathlib
import sys

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
  spec = importlib.util.spec_from_file_location(
      f"examples_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (Linen modules) look it up
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize("name, label", [("flax_linen", "Linen"), ("flax_nnx", "NNX")])
def test_example_trains_and_prints_summary(name, label, capsys):
  summary = load(name).main(["--steps", "20", "--batch-size", "64"])
  printed = capsys.readouterr().out
  assert printed.startswith(f"{label} MLP on digits, policy p=f32,c=f16,o=f32")
  assert "test accuracy" in printed and "skipped" in printed
  assert summary["steps"] == 20
  assert summary["param_dtypes"] == ["float32"]
  assert summary["test_accuracy"] > 0.5  # chance is 0.1
  assert summary["loss_scale"] >= 1.0
