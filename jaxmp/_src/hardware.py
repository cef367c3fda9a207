"""Hardware-aware defaults: the preset :func:`auto_policy` picks and :func:`hardware_report`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def _compute_capability(device: Any) -> float | None:
  """An NVIDIA device's compute capability as a float, else None."""
  try:
    return float(getattr(device, "compute_capability", None))
  except (TypeError, ValueError):
    return None


def _native_support(device: Any) -> dict[str, bool]:
  """Which low-precision dtypes ``device`` computes natively."""
  cc = _compute_capability(device)
  if device.platform == "tpu":
    return {"bfloat16": True, "float16": False, "float8": False}
  if device.platform in ("gpu", "cuda") and cc is not None:  # NVIDIA
    return {"bfloat16": cc >= 8.0, "float16": cc >= 6.0, "float8": cc >= 8.9}
  amd = device.platform in ("gpu", "rocm")  # AMD Instinct (MI100 and newer)
  return {"bfloat16": amd, "float16": amd, "float8": False}


def recommended_preset(device: Any) -> str:
  """The preset for ``device``: ``mixed_bfloat16``, else ``mixed_float16``, else ``float32``."""
  if not isinstance(getattr(device, "platform", None), str):
    raise TypeError(
        f"auto_policy expects a JAX device or None, got {device!r}. Pass a "
        "device such as jax.devices()[0] (or jax.devices('gpu')[0]).")
  native = _native_support(device)
  return ("mixed_bfloat16" if native["bfloat16"] else
          "mixed_float16" if native["float16"] else "float32")


@dataclasses.dataclass(frozen=True)
class HardwareReport:
  """What :func:`hardware_report` found. ``str()`` gives a readable report."""

  jax_version: str
  platform: str
  device_count: int
  process_count: int
  device_kinds: tuple[str, ...]
  compute_capability: str | None
  native_bfloat16: bool
  native_float16: bool
  native_float8: bool
  recommended_policy: str
  recommended_loss_scale: str

  def as_dict(self) -> dict[str, Any]:
    """Returns the report as a JSON-serialisable dict."""
    return {**dataclasses.asdict(self), "device_kinds": list(self.device_kinds)}

  def __str__(self) -> str:
    rows = [
        ("jax version", self.jax_version),
        ("platform", self.platform),
        ("devices", f"{self.device_count} ({', '.join(self.device_kinds)}) in "
         f"{self.process_count} process(es)"),
        ("compute capability", self.compute_capability or "n/a"),
        *((f"native {t}", "yes" if getattr(self, f"native_{t}") else "no")
          for t in ("bfloat16", "float16", "float8")),
        ("recommended policy", self.recommended_policy),
        ("recommended scale", self.recommended_loss_scale),
    ]
    return "\n".join(["jaxmp hardware report", *(f"  {k:<20} {v}" for k, v in rows)])


def hardware_report() -> HardwareReport:
  """Reports the platform, its native low-precision dtypes and what to use.

  The command ``jaxmp doctor`` (``--json`` for machine output) prints it.

  Example:
    >>> import jaxmp
    >>> report = jaxmp.hardware_report()
    >>> report.platform, report.recommended_loss_scale  # on the CPU
    ('cpu', 'NoOpLossScale()')
  """
  devices = jax.devices()
  device = devices[0]
  native = _native_support(device)
  preset = recommended_preset(device)
  return HardwareReport(
      jax_version=jax.__version__,
      platform=device.platform,
      device_count=len(devices),
      process_count=jax.process_count(),
      device_kinds=tuple(sorted({d.device_kind for d in devices})),
      compute_capability=None if _compute_capability(device) is None
      else str(device.compute_capability),
      native_bfloat16=native["bfloat16"],
      native_float16=native["float16"],
      native_float8=native["float8"],
      recommended_policy=preset,
      # Of the presets, only float16 compute needs loss scaling.
      recommended_loss_scale="DynamicLossScale()" if preset == "mixed_float16"
      else "NoOpLossScale()",
  )
