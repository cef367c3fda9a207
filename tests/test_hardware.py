"""Tests of hardware: auto_policy and hardware_report."""

import dataclasses
import json

import pytest

import jaxmp


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str = "fake"
  compute_capability: str | None = None


@pytest.mark.parametrize(
    "device, expected",
    [
        (FakeDevice("tpu", "TPU v5 lite"), "p=f32,c=bf16,o=f32"),
        (FakeDevice("gpu", "NVIDIA H100", "9.0"), "p=f32,c=bf16,o=f32"),
        (FakeDevice("gpu", "NVIDIA A100", "8.0"), "p=f32,c=bf16,o=f32"),
        (FakeDevice("cuda", "NVIDIA A10", "8.6"), "p=f32,c=bf16,o=f32"),
        (FakeDevice("gpu", "Tesla V100", "7.0"), "p=f32,c=f16,o=f32"),
        (FakeDevice("gpu", "Tesla T4", "7.5"), "p=f32,c=f16,o=f32"),
        (FakeDevice("rocm", "AMD Instinct MI250X"), "p=f32,c=bf16,o=f32"),
        (FakeDevice("cpu", "cpu"), "p=f32,c=f32,o=f32"),
    ],
)
def test_auto_policy_by_hardware(device, expected):
  policy = jaxmp.auto_policy(device)
  assert str(policy) == expected
  assert policy.needs_loss_scaling == (expected == "p=f32,c=f16,o=f32")


def test_auto_policy_defaults_to_first_device_and_the_auto_preset():
  assert str(jaxmp.auto_policy()) == "p=f32,c=f32,o=f32"  # CPU here
  assert jaxmp.get_policy("auto") == jaxmp.auto_policy()


def test_hardware_report_on_the_cpu():
  report = jaxmp.hardware_report()
  assert report.platform == "cpu"
  assert report.device_count == 8  # tests/conftest.py simulates 8 devices
  assert report.process_count == 1
  assert not (report.native_bfloat16 or report.native_float16 or report.native_float8)
  assert report.recommended_policy == "float32"
  assert report.recommended_loss_scale == "NoOpLossScale()"
  as_dict = json.loads(json.dumps(report.as_dict()))
  assert as_dict["device_kinds"] == ["cpu"]
  text = str(report)
  assert "recommended policy   float32" in text and "native bfloat16      no" in text
