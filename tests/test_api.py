"""Pins the public surface: jaxmp.__all__ and jaxmp.flax.__all__."""

import importlib

import jaxmp

# The names of ../API.md (the contract), plus the documented additions.
PUBLIC = {
    # Policies.
    "Policy", "get_policy", "auto_policy", "half_dtype", "cast_to_full",
    "cast_to_half", "hardware_report", "HardwareReport", "PathPolicy",
    # Loss scales.
    "LossScale", "NoOpLossScale", "StaticLossScale", "DynamicLossScale",
    "default_loss_scale", "all_finite", "select_tree",
    # The optax wrapper.
    "loss_scaling", "LossScalingState", "get_loss_scale", "loss_scaling_metrics",
    "scaled_value_and_grad", "check_loss_scale", "LossScaleAtMinimumError",
    "multi_steps",
    # Distributed training.
    "opt_state_shardings",
    # Migration.
    "from_deepspeed_config", "from_torch_grad_scaler",
    # Diagnostics and monitoring.
    "nonfinite_paths", "grad_stats", "dtype_headroom", "suggest_loss_scale",
    "finite_mask", "report_nonfinite", "LossScaleMonitor",
    # Falling back to a wider policy (docs/when-fp16-fails.md).
    "PrecisionFallback", "PrecisionSwitch", "switch_precision",
    # The precision audit.
    "precision_report", "PrecisionReport", "PrecisionOp", "PrecisionWarning",
}

FLAX_PUBLIC = {
    "TrainState", "ModulePolicy", "nnx_scaled_value_and_grad", "nnx_keep_on_skip",
    "save_checkpoint", "restore_checkpoint", "loss_scale_config",
    "find_overflowing_modules", "OverflowReport",
}


def test_public_names_are_pinned():
  assert set(jaxmp.__all__) == PUBLIC
  assert len(jaxmp.__all__) == len(PUBLIC)  # no duplicates
  for name in jaxmp.__all__:
    assert getattr(jaxmp, name) is not None, name


def test_flax_public_names_are_pinned():
  flax_api = importlib.import_module("jaxmp.flax")
  assert set(flax_api.__all__) == FLAX_PUBLIC
  assert jaxmp.flax is flax_api
  for name in flax_api.__all__:
    assert getattr(flax_api, name) is not None, name


def test_jaxmp_works_as_a_drop_in_for_jmp():
  import jmp  # pylint: disable=g-import-not-at-top

  for name in ["Policy", "get_policy", "DynamicLossScale", "StaticLossScale",
               "NoOpLossScale", "all_finite", "select_tree", "half_dtype",
               "cast_to_full", "cast_to_half"]:
    assert hasattr(jmp, name) and hasattr(jaxmp, name), name
