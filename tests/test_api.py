"""Pins the public surface: jaxmp.__all__ and jaxmp.flax.__all__.

That jaxmp has every public name of jmp is tested by tests/test_jmp_suite.py
(jmp's own tests) and tests/test_migration.py.
"""

import importlib

import jaxmp

# The names of ../API.md (the contract), plus the documented additions.
PUBLIC = {
    # Policies.
    "Policy", "get_policy", "auto_policy", "half_dtype", "cast_to_full",
    "cast_to_half", "hardware_report", "PathPolicy",
    # Automatic mixed precision.
    "autocast", "autocast_rules",
    # Loss scales.
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale",
    "all_finite", "select_tree",
    # The optax wrapper.
    "loss_scaling", "LossScalingState", "get_loss_scale", "loss_scaling_metrics",
    "scaled_value_and_grad", "check_loss_scale", "LossScaleAtMinimumError",
    "multi_steps", "RecoveryInfo", "keep_on_skip", "retry_skipped",
    # Migration.
    "from_deepspeed_config", "from_torch_grad_scaler",
    # Diagnostics and monitoring.
    "nonfinite_paths", "grad_stats", "dtype_headroom", "suggest_loss_scale",
    "LossScaleMonitor",
    # Falling back to a wider policy (docs/loss-scaling.md).
    "PrecisionFallback", "switch_precision",
    # The precision audit.
    "precision_report", "PrecisionReport", "PrecisionWarning",
}

FLAX_PUBLIC = {
    "TrainState", "ModulePolicy", "Fp8Meta",
    "save_checkpoint", "restore_checkpoint", "find_overflowing_modules",
}


def test_public_names_are_pinned():
  assert sorted(jaxmp.__all__) == sorted(PUBLIC)  # no name added, removed or repeated
  assert [name for name in jaxmp.__all__ if not hasattr(jaxmp, name)] == []


def test_flax_public_names_are_pinned():
  flax_api = importlib.import_module("jaxmp.flax")
  assert sorted(flax_api.__all__) == sorted(FLAX_PUBLIC)
  assert [name for name in flax_api.__all__ if not hasattr(flax_api, name)] == []
