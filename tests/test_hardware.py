"""Tests of hardware: auto_policy and hardware_report."""

import dataclasses
import json

import jax
import pytest

import jaxmp


@dataclasses.dataclass
class FakeDevice:
  platform: str
  device_kind: str = "fake"
  compute_capability: str | None = None


@pytest.mark.parametrize("device, expected", [
    (FakeDevice("tpu", "TPU v5 lite"), "p=f32,c=bf16,o=f32"),
    (FakeDevice("gpu", "NVIDIA H100", "9.0"), "p=f32,c=bf16,o=f32"),
    (FakeDevice("gpu", "NVIDIA A100", "8.0"), "p=f32,c=bf16,o=f32"),
    (FakeDevice("cuda", "NVIDIA A10", "8.6"), "p=f32,c=bf16,o=f32"),
    (FakeDevice("gpu", "Tesla V100", "7.0"), "p=f32,c=f16,o=f32"),
    (FakeDevice("gpu", "Tesla T4", "7.5"), "p=f32,c=f16,o=f32"),
    (FakeDevice("rocm", "AMD Instinct MI250X"), "p=f32,c=bf16,o=f32"),
    (FakeDevice("cpu", "cpu"), "p=f32,c=f32,o=f32"),
])
def test_auto_policy_by_hardware(device, expected):
  policy = jaxmp.auto_policy(device)
  assert str(policy) == expected
  assert policy.needs_loss_scaling == (expected == "p=f32,c=f16,o=f32")


def test_hardware_report_and_auto_policy_describe_the_first_device():
  report, devices = jaxmp.hardware_report(), jax.devices()
  assert jaxmp.auto_policy() == jaxmp.auto_policy(devices[0]) == jaxmp.get_policy("auto")
  assert (report.platform, report.device_count, report.process_count, report.device_kinds) == (
      devices[0].platform, len(devices), jax.process_count(),
      tuple(sorted({d.device_kind for d in devices})))
  assert jaxmp.get_policy(report.recommended_policy) == jaxmp.auto_policy()
  assert report.recommended_loss_scale == (
      "DynamicLossScale()" if jaxmp.auto_policy().needs_loss_scaling else "NoOpLossScale()")
  as_dict = json.loads(json.dumps(report.as_dict()))
  assert (as_dict["device_kinds"], as_dict["recommended_policy"]) == (
      list(report.device_kinds), report.recommended_policy)
  if report.platform == "cpu":  # XLA:CPU emulates 16- and 8-bit floats
    assert not (report.native_bfloat16 or report.native_float16 or report.native_float8)
  lines = {line.split("  ")[1].strip(): line.rsplit(" ", 1)[1]
           for line in str(report).splitlines()[1:]}
  assert (lines["native bfloat16"], lines["recommended policy"]) == (
      "yes" if report.native_bfloat16 else "no", report.recommended_policy)
