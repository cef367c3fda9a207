"""Hardware-aware defaults: :func:`auto_policy` and :func:`hardware_report`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


def _compute_capability(device: Any) -> float | None:
  """Returns an NVIDIA device's compute capability as a float, else None."""
  cc = getattr(device, "compute_capability", None)
  if cc is None:
    return None
  try:
    return float(cc)
  except (TypeError, ValueError):
    return None


def _is_nvidia(device: Any) -> bool:
  if device.platform not in ("gpu", "cuda"):
    return False
  return _compute_capability(device) is not None


def _native_support(device: Any) -> dict[str, bool]:
  """Which low-precision dtypes the device computes natively."""
  platform = device.platform
  if platform == "tpu":
    return {"bfloat16": True, "float16": False, "float8": False}
  if _is_nvidia(device):
    cc = _compute_capability(device)
    return {"bfloat16": cc >= 8.0, "float16": cc >= 6.0, "float8": cc >= 8.9}
  if platform in ("gpu", "rocm"):
    # AMD Instinct GPUs (MI100 and newer) run bf16 and fp16 matrix cores.
    return {"bfloat16": True, "float16": True, "float8": False}
  return {"bfloat16": False, "float16": False, "float8": False}


def recommended_preset(device: Any) -> str:
  """The name of the policy preset recommended for ``device``.

  ``"mixed_bfloat16"`` where bfloat16 is native, else ``"mixed_float16"``
  where float16 is, else ``"float32"``.

  Raises:
    TypeError: if ``device`` is not a JAX device (e.g. a platform name).
  """
  if not isinstance(getattr(device, "platform", None), str):
    raise TypeError(
        f"auto_policy expects a JAX device or None, got {device!r}. Pass a "
        "device such as jax.devices()[0] (or jax.devices('gpu')[0])."
    )
  native = _native_support(device)
  if native["bfloat16"]:
    return "mixed_bfloat16"
  if native["float16"]:
    return "mixed_float16"
  return "float32"


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
    d = dataclasses.asdict(self)
    d["device_kinds"] = list(self.device_kinds)
    return d

  def __str__(self) -> str:
    yes_no = lambda b: "yes" if b else "no"
    lines = [
        "jaxmp hardware report",
        f"  jax version          {self.jax_version}",
        f"  platform             {self.platform}",
        f"  devices              {self.device_count} "
        f"({', '.join(self.device_kinds)}) in {self.process_count} process(es)",
        f"  compute capability   {self.compute_capability or 'n/a'}",
        f"  native bfloat16      {yes_no(self.native_bfloat16)}",
        f"  native float16       {yes_no(self.native_float16)}",
        f"  native float8        {yes_no(self.native_float8)}",
        f"  recommended policy   {self.recommended_policy}",
        f"  recommended scale    {self.recommended_loss_scale}",
    ]
    return "\n".join(lines)


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
  cc = _compute_capability(device)
  # Of the presets, only float16 compute needs loss scaling.
  if preset == "mixed_float16":
    loss_scale = "DynamicLossScale()"
  else:
    loss_scale = "NoOpLossScale()"
  return HardwareReport(
      jax_version=jax.__version__,
      platform=device.platform,
      device_count=len(devices),
      process_count=jax.process_count(),
      device_kinds=tuple(sorted({d.device_kind for d in devices})),
      compute_capability=None if cc is None else str(device.compute_capability),
      native_bfloat16=native["bfloat16"],
      native_float16=native["float16"],
      native_float8=native["float8"],
      recommended_policy=preset,
      recommended_loss_scale=loss_scale,
  )
