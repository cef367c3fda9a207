"""jaxmp: mixed-precision training for JAX, Flax and optax.

Dtype policies, loss scales as pytrees, and an optax wrapper that unscales
gradients and skips non-finite steps without leaving the device. Flax pieces
live in :mod:`jaxmp.flax`.
"""

from jaxmp._src.accumulation import multi_steps
from jaxmp._src.autocast import autocast
from jaxmp._src.autocast_rules import autocast_rules
from jaxmp._src.checks import LossScaleAtMinimumError, check_loss_scale
from jaxmp._src.deepspeed import from_deepspeed_config
from jaxmp._src.diagnostics import (
    dtype_headroom,
    grad_stats,
    nonfinite_paths,
    suggest_loss_scale,
)
from jaxmp._src.fallback import (
    PrecisionFallback,
    switch_precision,
)
from jaxmp._src.hardware import hardware_report
from jaxmp._src.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    all_finite,
    select_tree,
)
from jaxmp._src.loss_scaling import (
    LossScalingState,
    get_loss_scale,
    keep_on_skip,
    loss_scaling,
    loss_scaling_metrics,
)
from jaxmp._src.monitor import LossScaleMonitor
from jaxmp._src.path_policy import PathPolicy
from jaxmp._src.policy import (
    Policy,
    auto_policy,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from jaxmp._src.precision_audit import (
    PrecisionReport,
    PrecisionWarning,
    precision_report,
)
from jaxmp._src.recovery import RecoveryInfo, retry_skipped
from jaxmp._src.torch_scaler import from_torch_grad_scaler
from jaxmp._src.value_and_grad import scaled_value_and_grad

__version__ = "0.1.0"

__all__ = [
    # Policies.
    "Policy",
    "get_policy",
    "auto_policy",
    "half_dtype",
    "PathPolicy",
    "cast_to_full",
    "cast_to_half",
    "hardware_report",
    # Automatic mixed precision.
    "autocast",
    "autocast_rules",
    # Loss scales.
    "LossScale",
    "NoOpLossScale",
    "StaticLossScale",
    "DynamicLossScale",
    "all_finite",
    "select_tree",
    # The optax wrapper.
    "loss_scaling",
    "LossScalingState",
    "get_loss_scale",
    "loss_scaling_metrics",
    "scaled_value_and_grad",
    "keep_on_skip",
    "retry_skipped",
    "RecoveryInfo",
    "check_loss_scale",
    "LossScaleAtMinimumError",
    "multi_steps",
    # Migration.
    "from_deepspeed_config",
    "from_torch_grad_scaler",
    # Diagnostics and monitoring.
    "nonfinite_paths",
    "grad_stats",
    "dtype_headroom",
    "suggest_loss_scale",
    "LossScaleMonitor",
    # Falling back to a wider policy.
    "PrecisionFallback",
    "switch_precision",
    # The precision audit.
    "precision_report",
    "PrecisionReport",
    "PrecisionWarning",
]


def __getattr__(name):
  # `import jaxmp; jaxmp.flax.TrainState` works without importing Flax eagerly.
  if name == "flax":
    import importlib  # pylint: disable=g-import-not-at-top

    return importlib.import_module("jaxmp.flax")
  raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
