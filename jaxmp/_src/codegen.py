"""Code generation for ``jaxmp convert``: a DeepSpeed config as jaxmp code."""

from __future__ import annotations

import numbers
from typing import Any

from jaxmp._src.deepspeed import (
  _NO_EQUIVALENT,
  _ConfigError,
  _precision,
  load_deepspeed_config,
)


def _py(value: Any) -> str:
  return repr(float(value)) if isinstance(value, float) else repr(value)


def _setting(value: Any, default: Any) -> Any:
  return default if value in ("auto", None) else value


def _optimizer_code(
    config: dict[str, Any], placeholders: list[str], notes: list[tuple[str, str]]
) -> str:
  """The optax expression equivalent to DeepSpeed's ``optimizer`` block."""
  block = config.get("optimizer")
  if block is None:
    placeholders.append("learning_rate = 1e-3  # no optimizer in the config: choose one")
    return "optax.adamw(learning_rate)"
  if not isinstance(block, dict):
    raise _ConfigError(f"DeepSpeed config: 'optimizer' must be an object, got {block!r}")
  kind = str(block.get("type", "")).lower()
  params = block.get("params") or {}
  if not isinstance(params, dict):
    raise _ConfigError(
        f"DeepSpeed config: optimizer.params must be an object, got {params!r}"
    )
  lr = params.get("lr", "auto")
  if lr in ("auto", None):
    placeholders.append(
        'learning_rate = 1e-3  # "auto" in the config: put your learning rate here'
    )
  else:
    placeholders.append(f"learning_rate = {_py(lr)}")
  args = ["learning_rate"]
  betas = _setting(params.get("betas"), None)
  if isinstance(betas, (list, tuple)) and len(betas) == 2:
    args += [f"b1={_py(betas[0])}", f"b2={_py(betas[1])}"]
  eps = _setting(params.get("eps"), None)
  if eps is not None:
    args.append(f"eps={_py(eps)}")
  weight_decay = _setting(params.get("weight_decay"), 0)
  if kind in ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"):
    decoupled = kind != "adam" or params.get("adam_w_mode", True) is not False
    if weight_decay and decoupled:
      return f"optax.adamw({', '.join(args)}, weight_decay={_py(weight_decay)})"
    if weight_decay:
      return (
          f"optax.chain(optax.add_decayed_weights({_py(weight_decay)}), "
          f"optax.adam({', '.join(args)}))"
      )
    return f"optax.adam({', '.join(args)})"
  if kind in ("lamb", "onebitlamb"):
    return f"optax.lamb({', '.join(args)}, weight_decay={_py(weight_decay)})"
  if kind == "lion":
    lion_args = [a for a in args if not a.startswith("eps=")]
    return f"optax.lion({', '.join(lion_args)}, weight_decay={_py(weight_decay)})"
  if kind == "sgd":
    momentum = _setting(params.get("momentum"), None)
    expr = "optax.sgd(learning_rate" + (
        f", momentum={_py(momentum)})" if momentum else ")"
    )
    if weight_decay:
      expr = f"optax.chain(optax.add_decayed_weights({_py(weight_decay)}), {expr})"
    return expr
  notes.append((
      "optimizer",
      f"optimizer type {block.get('type')!r} is not mapped; pick the optax "
      "optimizer by hand (optax.adamw is used as a placeholder)",
  ))
  return "optax.adamw(learning_rate)"


def deepspeed_config_to_code(
    config: Any, *, source: str = "the DeepSpeed config"
) -> tuple[str, list[tuple[str, str]]]:
  """Returns jaxmp code equivalent to a DeepSpeed config, and what it left out.

  The code builds ``policy`` and ``loss_scale`` (as
  :func:`from_deepspeed_config` does), the optax optimizer from
  ``optimizer`` and ``gradient_clipping``, and ``tx``: the optimizer wrapped
  with :func:`jaxmp.loss_scaling` (and ``optax.MultiSteps`` for
  ``gradient_accumulation_steps > 1``). ``jaxmp convert`` prints it.

  Args:
    config: as for :func:`from_deepspeed_config`.
    source: how the config is named in the code's first comment.

  Returns:
    ``(code, left_out)``: the Python code, and ``(key, advice)`` pairs for the
    keys that have no jaxmp equivalent.

  Raises:
    ValueError, TypeError: as :func:`from_deepspeed_config`.

  Example:
    >>> from jaxmp._src.codegen import deepspeed_config_to_code
    >>> code, left_out = deepspeed_config_to_code(
    ...     {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    >>> print(code.splitlines()[4])
    policy = jaxmp.get_policy("mixed_bfloat16")
    >>> left_out[0][0]
    'zero_optimization'
  """
  config = load_deepspeed_config(config)
  precision = _precision(config)
  notes = list(precision.ignored)
  placeholders: list[str] = []
  lines = [
      f"# jaxmp equivalent of {source}.",
      "import jaxmp",
      "import optax",
      "",
  ]
  preset = {"fp16-dynamic": "mixed_float16", "fp16-static": "mixed_float16",
            "bf16": "mixed_bfloat16", "float32": "float32"}[precision.mode]
  lines.append(f'policy = jaxmp.get_policy("{preset}")')
  ls = precision.loss_scale
  if precision.mode == "fp16-dynamic":
    lines += [
        "loss_scale = jaxmp.DynamicLossScale(",
        f"    loss_scale={_py(float(ls.loss_scale))},",
        f"    period={ls.period},  # loss_scale_window",
        "    factor=2.0,",
        f"    min_loss_scale={_py(ls.min_loss_scale)},",
        f"    hysteresis={ls.hysteresis},",
        f"    consecutive_hysteresis={ls.consecutive_hysteresis},",
        ")",
        "# Where the hardware runs bfloat16 (see `jaxmp doctor`), prefer:",
        '#   policy = jaxmp.get_policy("mixed_bfloat16")',
        "#   loss_scale = jaxmp.NoOpLossScale()",
    ]
  elif precision.mode == "fp16-static":
    lines.append(f"loss_scale = jaxmp.StaticLossScale({_py(float(ls.loss_scale))})")
  else:
    lines.append("loss_scale = jaxmp.NoOpLossScale()")
  lines.append("")

  optimizer = _optimizer_code(config, placeholders, notes)
  clip = config.get("gradient_clipping", 0)
  if clip == "auto":
    placeholders.append('max_grad_norm = 1.0  # "auto" in the config')
    clip_expr = "max_grad_norm"
  elif isinstance(clip, numbers.Real) and not isinstance(clip, bool) and clip >= 0:
    clip_expr = _py(clip) if clip > 0 else None
  else:
    raise _ConfigError(
        f"DeepSpeed config: gradient_clipping must be a number >= 0, got {clip!r}"
    )
  lines += placeholders
  if clip_expr is not None:
    lines += [
        "optimizer = optax.chain(",
        f"    optax.clip_by_global_norm({clip_expr}),",
        f"    {optimizer},",
        ")",
    ]
  else:
    lines.append(f"optimizer = {optimizer}")
  lines.append(
      "# Wrap the whole optimizer: it then sees unscaled gradients and skips "
      "non-finite steps."
  )
  lines.append("tx = jaxmp.loss_scaling(optimizer, loss_scale)")
  accumulation = config.get("gradient_accumulation_steps", 1)
  if accumulation not in ("auto", None, 1):
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
      raise _ConfigError(
          "DeepSpeed config: gradient_accumulation_steps must be a positive "
          f"integer, got {accumulation!r}"
      )
    lines.append(f"tx = optax.MultiSteps(tx, every_k_schedule={accumulation})")
  elif accumulation == "auto":
    notes.append((
        "gradient_accumulation_steps",
        '"auto": wrap tx in optax.MultiSteps(tx, every_k_schedule=k) to '
        "accumulate k micro-batches",
    ))
  lines += [
      "",
      "# In the training step (params in float32):",
      "#   loss_scale = jaxmp.get_loss_scale(opt_state)",
      "#   loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)",
      "#   updates, opt_state = tx.update(grads, opt_state, params)",
      "#   params = optax.apply_updates(params, updates)",
      "# with loss_fn running the model on policy.cast_to_compute(params) and",
      "# returning a float32 loss. Every N steps, outside jit:",
      "#   jaxmp.check_loss_scale(opt_state)",
  ]

  handled = {"fp16", "bf16", "bfloat16", "optimizer", "gradient_clipping",
             "gradient_accumulation_steps"}
  for key in config:
    if key in handled:
      continue
    if key in _NO_EQUIVALENT:
      notes.append((key, _NO_EQUIVALENT[key]))
      if isinstance(config[key], dict):
        notes += [
            (f"{key}.{k}", "offloading has no jaxmp equivalent")
            for k in config[key] if "offload" in k
        ]
    elif "offload" in key:
      notes.append((key, "offloading has no jaxmp equivalent"))
    else:
      notes.append((key, "no jaxmp equivalent; ignored"))
  return "\n".join(lines) + "\n", notes
