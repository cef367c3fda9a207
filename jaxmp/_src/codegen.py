"""Code generation for ``jaxmp convert``: a DeepSpeed config as jaxmp code."""

from __future__ import annotations

from typing import Any

from jaxmp._src.deepspeed import (
    _PRECISION_BLOCKS,
    _ConfigError,
    _precision,
    checked,
    load_deepspeed_config,
    suggestion,
    with_trainer_args,
)
from jaxmp._src.loss_scale import INT32_MAX
from jaxmp._src.validation import check_bool, check_number

# Top-level keys with no jaxmp counterpart, and what to do instead.
_NO_EQUIVALENT = {
    "zero_optimization": "ZeRO partitioning has no jaxmp equivalent; shard "
    "params and optimizer state with jax.sharding (NamedSharding) under jit",
    "zero_allow_untested_optimizer": "ZeRO has no jaxmp equivalent",
    "zero_force_ds_cpu_optimizer": "ZeRO has no jaxmp equivalent",
    "amp": "apex AMP has no jaxmp equivalent; the dtype policy replaces it",
    "activation_checkpointing": "use jax.checkpoint (flax: nn.remat)",
    "scheduler": "use an optax schedule, e.g. "
    "optax.warmup_cosine_decay_schedule, as the learning rate",
    "train_batch_size": "the batch size is set by your data pipeline",
    "train_micro_batch_size_per_gpu": "the batch size is set by your data "
    "pipeline",
    "communication_data_type": "JAX chooses collective dtypes from the arrays",
    "prescale_gradients": "no jaxmp equivalent",
    "gradient_predivide_factor": "no jaxmp equivalent",
    "sparse_gradients": "no jaxmp equivalent",
    "data_types": "use a jaxmp.Policy for dtypes",
}

# The top-level keys that the generated code reads.
_HANDLED = (*_PRECISION_BLOCKS, "optimizer", "gradient_clipping",
            "gradient_accumulation_steps")

# DeepSpeed's gradient clipping when the key is absent (its constants module).
DEEPSPEED_GRADIENT_CLIPPING_DEFAULT = 1.0

# The optimizer params that the generated code maps, per family.
_ADAM_FAMILY = ("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam")
_MAPPED_PARAMS = {
    "adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode"),
    "lamb": ("lr", "betas", "eps", "weight_decay"),
    "lion": ("lr", "betas", "weight_decay"),
    "sgd": ("lr", "momentum", "weight_decay"),
}


def _py(value: Any) -> str:
  return repr(float(value)) if isinstance(value, float) else repr(value)


def _is_default(value: Any) -> bool:
  return value is None or value == "auto"


def _optimizer_code(
    config: dict[str, Any], placeholders: list[str], notes: list[tuple[str, str]]
) -> str:
  """The optax expression equivalent to DeepSpeed's ``optimizer`` block."""
  block = config.get("optimizer")
  if block is None:
    placeholders.append("learning_rate = 1e-3  # no optimizer in the config: choose one")
    return "optax.adamw(learning_rate)"
  if not isinstance(block, dict):
    raise _ConfigError(
        f"DeepSpeed config: 'optimizer' must be an object such as "
        f'{{"type": "AdamW", "params": {{"lr": 1e-3}}}}, got {block!r}'
    )
  kind = block.get("type", "")
  if not isinstance(kind, str):
    raise _ConfigError(
        f'DeepSpeed config: optimizer.type must be a string such as "AdamW", '
        f"got {kind!r}"
    )
  kind = kind.lower()
  params = block.get("params") or {}
  if not isinstance(params, dict):
    raise _ConfigError(
        f"DeepSpeed config: optimizer.params must be an object, got {params!r}"
    )

  def number(key: str, **bounds: Any) -> Any:
    return checked(check_number, f"optimizer.params.{key}", params[key], **bounds)

  if _is_default(params.get("lr", "auto")):
    placeholders.append(
        'learning_rate = 1e-3  # "auto" in the config: put your learning rate here'
    )
  else:
    lr = number("lr", minimum=0, advice='Give the learning rate, e.g. 1e-3, or "auto".')
    placeholders.append(f"learning_rate = {_py(lr)}")
  args = ["learning_rate"]
  if not _is_default(params.get("betas")):
    betas = params["betas"]
    if not isinstance(betas, (list, tuple)) or len(betas) != 2:
      raise _ConfigError(
          "DeepSpeed config: optimizer.params.betas must be a list of two "
          f"numbers such as [0.9, 0.999], got {betas!r}"
      )
    for i, beta in enumerate(betas):
      beta = checked(check_number, f"optimizer.params.betas[{i}]", beta,
                     minimum=0, maximum=1, exclusive_maximum=True)
      args.append(f"b{i + 1}={_py(beta)}")
  eps = []
  if not _is_default(params.get("eps")):
    eps = [f"eps={_py(number('eps', minimum=0))}"]
  weight_decay = 0
  if not _is_default(params.get("weight_decay")):
    weight_decay = number("weight_decay", minimum=0)

  family = ("adam" if kind in _ADAM_FAMILY else "lamb" if kind in ("lamb", "onebitlamb")
            else kind if kind in _MAPPED_PARAMS else None)
  if family is None:
    notes.append((
        "optimizer",
        f"optimizer type {block.get('type')!r} is not mapped; pick the optax "
        "optimizer by hand (optax.adamw is used as a placeholder)",
    ))
    return "optax.adamw(learning_rate)"
  for key in params:
    if key not in _MAPPED_PARAMS[family]:
      notes.append((
          f"optimizer.params.{key}",
          "not mapped to an optax argument; set it by hand if it matters."
          + suggestion(key, _MAPPED_PARAMS[family]),
      ))
  if family != "lion":  # optax.lion has no eps
    args += eps
  if family == "adam":
    adam_w_mode = params.get("adam_w_mode", True)
    if not _is_default(adam_w_mode):
      adam_w_mode = checked(check_bool, "optimizer.params.adam_w_mode", adam_w_mode,
                            advice="Write true or false, without quotes.")
    decoupled = kind != "adam" or adam_w_mode is not False
    if weight_decay and decoupled:
      return f"optax.adamw({', '.join(args)}, weight_decay={_py(weight_decay)})"
    if weight_decay:
      return (
          f"optax.chain(optax.add_decayed_weights({_py(weight_decay)}), "
          f"optax.adam({', '.join(args)}))"
      )
    return f"optax.adam({', '.join(args)})"
  if family == "lamb":
    return f"optax.lamb({', '.join(args)}, weight_decay={_py(weight_decay)})"
  if family == "lion":
    return f"optax.lion({', '.join(args)}, weight_decay={_py(weight_decay)})"
  momentum = None
  if not _is_default(params.get("momentum")):
    momentum = number("momentum", minimum=0)
  expr = "optax.sgd(learning_rate" + (f", momentum={_py(momentum)})" if momentum else ")")
  if weight_decay:
    expr = f"optax.chain(optax.add_decayed_weights({_py(weight_decay)}), {expr})"
  return expr


def _clipping(config: dict[str, Any], placeholders: list[str],
              notes: list[tuple[str, str]]) -> str | None:
  """The max norm expression for ``optax.clip_by_global_norm``, or None."""
  if "gradient_clipping" not in config:
    notes.append((
        "gradient_clipping",
        "absent: DeepSpeed 0.19.8 then clips at "
        f"{DEEPSPEED_GRADIENT_CLIPPING_DEFAULT} (0.18.0 did not clip), and so "
        'does the code; write "gradient_clipping": 0 in the config to turn '
        "clipping off",
    ))
    return _py(DEEPSPEED_GRADIENT_CLIPPING_DEFAULT)
  clip = config["gradient_clipping"]
  if clip == "auto":
    placeholders.append('max_grad_norm = 1.0  # "auto" in the config')
    return "max_grad_norm"
  clip = checked(check_number, "gradient_clipping", clip, minimum=0,
                 advice="Use 0 for no clipping, or the max global norm, e.g. 1.0.")
  return _py(clip) if clip > 0 else None


def _accumulation(config: dict[str, Any], notes: list[tuple[str, str]]) -> int:
  steps = config.get("gradient_accumulation_steps")
  if steps is None:
    return 1
  if steps == "auto":
    notes.append((
        "gradient_accumulation_steps",
        '"auto": to accumulate k micro-batches per step, build tx with '
        "jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule=k)",
    ))
    return 1
  return checked(check_number, "gradient_accumulation_steps", steps,
                 integer=True, minimum=1, maximum=INT32_MAX,
                 advice="Use the number of micro-batches per optimizer step.")


def deepspeed_config_to_code(
    config: Any, *, source: str = "the DeepSpeed config", training_args: Any = None
) -> tuple[str, list[tuple[str, str]]]:
  """Returns jaxmp code equivalent to a DeepSpeed config, and what it left out.

  The code builds ``policy`` and ``loss_scale`` (as
  :func:`jaxmp.from_deepspeed_config` does), the optax optimizer from
  ``optimizer``, and ``tx``: the optimizer wrapped with
  :func:`jaxmp.loss_scaling`, or with :func:`jaxmp.multi_steps` for
  ``gradient_accumulation_steps > 1``, with ``gradient_clipping`` as their
  ``clip_global_norm`` (the clipping shares the finiteness check's
  reduction). ``jaxmp convert`` prints it.

  Numbers must be JSON numbers: a quoted number, a bool, ``NaN`` or
  ``Infinity`` where a number belongs raises, so the code never holds a value
  that optax would refuse or train into nan.

  Args:
    config: as for :func:`jaxmp.from_deepspeed_config`.
    source: how the config is named in the code's first comment.
    training_args: the Hugging Face Trainer's arguments, as for
      :func:`jaxmp.from_deepspeed_config`: its ``"auto"`` values are filled
      in from them, clipping and accumulation included.

  Returns:
    ``(code, left_out)``: the Python code, and ``(key, advice)`` pairs for the
    keys that are not converted.

  Raises:
    ValueError, TypeError: as :func:`jaxmp.from_deepspeed_config`.

  Example:
    >>> from jaxmp._src.codegen import deepspeed_config_to_code
    >>> code, left_out = deepspeed_config_to_code(
    ...     {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    >>> print(code.splitlines()[4])
    policy = jaxmp.get_policy("mixed_bfloat16")
    >>> [key for key, _ in left_out]
    ['gradient_clipping', 'zero_optimization']
  """
  config = load_deepspeed_config(config)
  if training_args is not None:
    config = with_trainer_args(config, training_args)
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
  clip = _clipping(config, placeholders, notes)
  accumulation = _accumulation(config, notes)
  lines += placeholders
  lines.append(f"optimizer = {optimizer}")
  lines.append(
      "# Wrap the whole optimizer: it then sees unscaled gradients and skips "
      "non-finite steps."
  )
  clip_arg = ""
  if clip is not None:
    lines.append(
        f"# gradient_clipping: clips the unscaled gradients to a global norm of "
        f"{clip}, checking them in the same reduction.")
    clip_arg = f", clip_global_norm={clip}"
  if accumulation > 1:
    lines += [
        f"# Accumulates {accumulation} micro-batches per step; a non-finite "
        "micro-batch skips its whole",
        "# step, and the next accumulation starts from a zero accumulator.",
        f"tx = jaxmp.multi_steps(optimizer, loss_scale, every_k_schedule="
        f"{accumulation}{clip_arg})",
    ]
  else:
    lines.append(f"tx = jaxmp.loss_scaling(optimizer, loss_scale{clip_arg})")
  per_batch = "micro-batch" if accumulation > 1 else "batch"
  lines += [
      "",
      f"# In the training step, once per {per_batch} (params in float32):",
      "#   loss_scale = jaxmp.get_loss_scale(opt_state)",
      "#   loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)",
      "#   updates, opt_state = tx.update(grads, opt_state, params)",
      "#   params = optax.apply_updates(params, updates)",
      "# with loss_fn running the model on policy.cast_to_compute(params) and",
      "# returning a float32 loss. Every N steps, outside jit:",
      "#   jaxmp.check_loss_scale(opt_state)",
  ]

  for key in config:
    if key in _HANDLED:
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
    elif not suggestion(key, _PRECISION_BLOCKS):  # those get a warning
      notes.append((key, "no jaxmp equivalent; ignored."
                    + suggestion(key, (*_HANDLED, *_NO_EQUIVALENT))))
  return "\n".join(lines) + "\n", notes
