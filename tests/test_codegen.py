"""Tests of the code that ``jaxmp convert`` prints for a DeepSpeed config.

The generated code is executed here; the command line itself, and training
with the printed code, are tested in ``tests/test_cli.py``.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import optax
import pytest

import jaxmp
from jaxmp._src.codegen import (
  DEEPSPEED_GRADIENT_CLIPPING_DEFAULT,
  deepspeed_config_to_code,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"

BLOG_CONFIG = """\
{
  // Mixed precision: fp16 with dynamic loss scaling.
  "fp16": {
    "enabled": true,
    "loss_scale": 0,            // 0 means dynamic
    "initial_scale_power": 16,  // start at 2**16 = 65536
    "hysteresis": 2,            /* tolerate one overflow before backing off */
    "min_loss_scale": 1e-5,
  },
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,},
  },
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "train_micro_batch_size_per_gpu": 8,
  "wandb": {"enabled": true, "project": "https://example.org//not-a-comment"},
}
"""


def _run_code(code):
  namespace = {}
  exec(compile(code, "<generated>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_generated_code_builds_the_same_objects():
  code, left_out = deepspeed_config_to_code(BLOG_CONFIG)
  namespace = _run_code(code)
  policy, loss_scale = jaxmp.from_deepspeed_config(BLOG_CONFIG)
  assert namespace["policy"] == policy
  assert repr(namespace["loss_scale"]) == repr(loss_scale)
  assert "optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.01)" in code
  assert "clip_by_global_norm" not in code  # the wrapper clips, sharing its check
  assert "tx = jaxmp.loss_scaling(optimizer, loss_scale, clip_global_norm=1.0)" in code
  assert [key for key, _ in left_out] == [
      "zero_optimization", "zero_optimization.offload_optimizer",
      "train_micro_batch_size_per_gpu", "wandb"]
  # The optimizer really trains and skips an overflowing step.
  tx = namespace["tx"]
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  # optax's Adam bias correction raises decay to its int32 count, which strict
  # dtype promotion refuses.
  with jax.numpy_dtype_promotion("standard"):
    updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0, 1.0])}, state, params)
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1
  assert jnp.all(optax.apply_updates(params, updates)["w"] == 1.0)


@pytest.mark.parametrize("optimizer, expected", [
    ({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.1}}, "optax.adamw("),
    ({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.1, "adam_w_mode": False}},
     "optax.add_decayed_weights(0.1), optax.adam("),
    ({"type": "Adam", "params": {"lr": 0.001}}, "optax.adam(learning_rate)"),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "optax.sgd(learning_rate, momentum=0.9)"),
    ({"type": "Lamb", "params": {"lr": 0.01}}, "optax.lamb("),
    ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "eps": 1e-8}},
     "optax.lion(learning_rate, b1=0.9, b2=0.99, weight_decay=0)"),
    ({"type": "OneBitAdam", "params": {"lr": "auto"}}, "optax.adamw(learning_rate)"),
])
def test_generated_optimizers_run(optimizer, expected):
  config = {"bf16": {"enabled": True}, "optimizer": optimizer,
            "gradient_clipping": "auto", "gradient_accumulation_steps": 2}
  code, left_out = deepspeed_config_to_code(config)
  assert expected in code
  assert ("tx = jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule=2, "
          "clip_global_norm=max_grad_norm)") in code
  assert "MultiSteps" not in code and "loss_scaling(" not in code
  tx = _run_code(code)["tx"]
  params = jnp.ones(2)
  state = tx.init(params)
  updates, state = tx.update(jnp.ones(2), state, params)
  assert int(state.mini_step) == 1 and bool(jnp.all(updates == 0))
  assert ("optimizer" in [k for k, _ in left_out]) == (optimizer["type"] == "OneBitAdam")
  assert ("optimizer.params.eps" in [k for k, _ in left_out]) == (optimizer["type"] == "Lion")


def test_generated_code_float32_and_static():
  code, _ = deepspeed_config_to_code({"gradient_clipping": 0})
  assert 'get_policy("float32")' in code and "NoOpLossScale()" in code
  assert "optimizer = optax.adamw(learning_rate)" in code  # no clipping
  code, _ = deepspeed_config_to_code({"fp16": {"enabled": True, "loss_scale": 1024}})
  assert "jaxmp.StaticLossScale(1024.0)" in code
  _run_code(code)


def test_absent_gradient_clipping_clips_as_deepspeed_does():
  recorded = json.loads((DATA / "deepspeed.json").read_text(encoding="utf-8"))
  assert DEEPSPEED_GRADIENT_CLIPPING_DEFAULT == recorded["gradient_clipping_default"]
  code, left_out = deepspeed_config_to_code({})
  assert "tx = jaxmp.loss_scaling(optimizer, loss_scale, clip_global_norm=1.0)" in code
  notes = dict(left_out)
  assert "DeepSpeed 0.19.8 then clips at 1.0" in notes["gradient_clipping"]
  assert '"gradient_clipping": 0' in notes["gradient_clipping"]


def test_accumulation_auto_and_one():
  code, left_out = deepspeed_config_to_code(
      {"gradient_accumulation_steps": "auto", "gradient_clipping": 0})
  assert "tx = jaxmp.loss_scaling(optimizer, loss_scale)" in code
  assert "jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule=k)" in dict(
      left_out)["gradient_accumulation_steps"]
  for steps in (1, 1.0):
    code, _ = deepspeed_config_to_code(
        {"gradient_accumulation_steps": steps, "gradient_clipping": 0})
    assert "tx = jaxmp.loss_scaling(optimizer, loss_scale)" in code
  code, _ = deepspeed_config_to_code({"gradient_accumulation_steps": 4.0})
  assert "every_k_schedule=4, clip_global_norm=1.0)" in code


def test_keys_that_are_not_converted_are_named_with_a_suggestion():
  config = {
      "fp16": {"enabled": True, "auto_cast": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decy": 0.1,
                                                "amsgrad": False}},
      "gradient_clip": 1.0,
      "gradient_clipping": 0,
      "steps_per_print": 10,
  }
  _, left_out = deepspeed_config_to_code(config)
  notes = dict(left_out)
  assert list(notes) == ["fp16.auto_cast", "optimizer.params.weight_decy",
                         "optimizer.params.amsgrad", "gradient_clip", "steps_per_print"]
  assert "policy.cast_to_compute" in notes["fp16.auto_cast"]
  assert notes["optimizer.params.weight_decy"].endswith("Did you mean 'weight_decay'?")
  assert "Did you mean" not in notes["optimizer.params.amsgrad"]
  assert notes["gradient_clip"].endswith("Did you mean 'gradient_clipping'?")
  assert notes["steps_per_print"] == "no jaxmp equivalent; ignored."


def test_a_misspelt_precision_block_is_warned_about_not_noted():
  with pytest.warns(UserWarning, match="Did you mean 'bf16'"):
    code, left_out = deepspeed_config_to_code({"bf_16": {"enabled": True}})
  assert 'get_policy("float32")' in code
  assert "bf_16" not in dict(left_out)
