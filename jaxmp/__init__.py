"""jaxmp: mixed-precision training for JAX, Flax and optax.

Dtype policies, loss scales as pytrees, and an optax wrapper that unscales
gradients and skips non-finite steps without leaving the device. Flax pieces
live in :mod:`jaxmp.flax`.
"""

from jaxmp.accumulation import multi_steps
from jaxmp.distributed import opt_state_shardings
from jaxmp.diagnostics import (
    dtype_headroom,
    finite_mask,
    grad_stats,
    nonfinite_paths,
    report_nonfinite,
    suggest_loss_scale,
)
from jaxmp.hardware import HardwareReport, auto_policy, hardware_report
from jaxmp.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxmp.migration import from_deepspeed_config, from_torch_grad_scaler
from jaxmp.monitor import LossScaleMonitor
from jaxmp.path_policy import PathPolicy
from jaxmp.policy import (
    Policy,
    cast_to_full,
    cast_to_half,
    get_policy,
    half_dtype,
)
from jaxmp.scaling import (
    LossScaleAtMinimumError,
    LossScalingState,
    check_loss_scale,
    get_loss_scale,
    loss_scaling,
    loss_scaling_metrics,
    scaled_value_and_grad,
)
from jaxmp.tree import all_finite, select_tree

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
    "HardwareReport",
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
    "check_loss_scale",
    "LossScaleAtMinimumError",
    "multi_steps",
    # Distributed training.
    "opt_state_shardings",
    # Migration.
    "from_deepspeed_config",
    "from_torch_grad_scaler",
    # Diagnostics and monitoring.
    "nonfinite_paths",
    "grad_stats",
    "dtype_headroom",
    "suggest_loss_scale",
    "finite_mask",
    "report_nonfinite",
    "LossScaleMonitor",
]


def __getattr__(name):
  # `import jaxmp; jaxmp.flax.TrainState` works without importing Flax eagerly.
  if name == "flax":
    import importlib  # pylint: disable=g-import-not-at-top

    return importlib.import_module("jaxmp.flax")
  raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")
