"""Trains a small byte-level transformer LM in float32, bfloat16 and float16.

This is what ``make demo`` runs. It trains the same decoder-only transformer
(Flax Linen) on the same text with the same seed under each dtype policy and
compares them, as in Micikevicius et al., "Mixed Precision Training" (ICLR
2018): float32 master weights, half-precision compute, and dynamic loss
scaling for float16.

The text is the Python standard library's own ``.py`` source files (found
through ``sysconfig``), read as bytes, so every machine has it; ``--data PATH``
trains on a text file of your own instead. The first 95% of the bytes are the
training split and the last 5% the validation split.

Usage::

  python examples/train_lm.py                      # compare the three policies
  python examples/train_lm.py --policy mixed_float16 --init-scale '2**24'
  python examples/train_lm.py --steps 2000 --d-model 256 --layers 6   # longer
  python examples/train_lm.py --fp16-spike 100              # float16 fails for real
  python examples/train_lm.py --fp16-spike 100 --fallback   # ... and falls back
  python examples/train_lm.py --policy mixed_float16 --init-scale '2**24' --recover
  python examples/train_lm.py --fp8        # ... and FP8 matmuls (mixed_fp8)

FP8 (``--fp8`` or ``--policy mixed_fp8``) runs the matmuls of the Dense
layers and of the attention projections in float8 with delayed scaling,
through ``jaxmp.flax.ModulePolicy`` and ``jaxmp.flax.TrainState`` (which keeps
the FP8 meta). On a CPU, XLA emulates FP8: the run shows FP8's numerics (its
loss curve against bfloat16 and float32), not its speed.

Writes ``runs/<timestamp>/metrics.json`` and ``runs/<timestamp>/loss.png``
and prints a summary table.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import math
import operator
import os
import pathlib
import platform
import sys
import sysconfig
import time
from collections.abc import Sequence
from typing import Any

COMPARED_POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
FP8_POLICY = "mixed_fp8"  # what --fp8 adds
# The FP8 meta collection of Flax's fp8_ops (scales and amax histories).
FP8_META = "_overwrite_with_gradient"
FP8_NOTE = ("On a CPU, XLA emulates FP8: compare FP8's losses, not its "
            "tokens/s (FP8 runs natively on NVIDIA GPUs of compute "
            "capability 8.9 and above).")
VALIDATION_FRACTION = 0.05
# --fp16-spike: at that step the token embeddings are multiplied by
# SPIKE_FACTOR, as a divergence blows up the residual stream of a pre-LayerNorm
# transformer. The values leave float16's range (65504) at any loss scale, so
# the scale falls to its floor and overflows there: DeepSpeed's "Current loss
# scale already at minimum". The LayerNorms keep float32 and bfloat16 finite.
SPIKE_FACTOR = 2.0**20
FALLBACK_SUFFIX = "+fallback"
RECOVER_SUFFIX = "+recover"


class UsageError(Exception):
  """Bad command-line input; reported as one line, without a traceback."""


# ---------------------------------------------------------------------------
# Command line.

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def parse_number(text: str) -> float:
  """Evaluates a number or an arithmetic expression such as ``2**24``.

  Only numbers, ``+ - * / **`` and parentheses are allowed.

  Example:
    >>> parse_number("2**24"), parse_number("0.5 * 2**16")
    (16777216.0, 32768.0)
  """

  def evaluate(node):
    if isinstance(node, ast.Expression):
      return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
      left, right = evaluate(node.left), evaluate(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > 1024:
        raise ValueError("exponent too large")
      return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
      return _OPERATORS[type(node.op)](evaluate(node.operand))
    raise ValueError(f"unsupported syntax {type(node).__name__}")

  try:
    return float(evaluate(ast.parse(text.strip(), mode="eval")))
  except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as e:
    raise UsageError(
        f"cannot read the number {text!r} ({e}); write e.g. 65536 or 2**16."
    ) from None


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
  )
  parser.add_argument(
      "--policy", default="compare",
      help="compare (float32, mixed_bfloat16 and mixed_float16 in turn), "
      "float32, mixed_bfloat16, mixed_float16, mixed_fp8, auto, or any jaxmp "
      "policy string such as p=f32,c=bf16,o=f32",
  )
  parser.add_argument(
      "--fp8", action="store_true",
      help=f"also train {FP8_POLICY} (FP8 matmuls with delayed scaling, "
      "through jaxmp.flax.TrainState); on a CPU XLA emulates FP8, so this "
      "shows FP8's loss, not its speed, and the run takes longer",
  )
  parser.add_argument(
      "--data", default=None,
      help="a text file to train on (default: the Python standard library's "
      ".py files)",
  )
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--d-model", type=int, default=128)
  parser.add_argument("--layers", type=int, default=3)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
  parser.add_argument(
      "--init-scale", default="2**15",
      help="initial float16 loss scale; expressions like 2**24 are accepted",
  )
  parser.add_argument(
      "--scale-period", type=int, default=100,
      help="finite steps in a row before the float16 loss scale doubles",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
      "--fp16-spike", type=int, default=None, metavar="STEP",
      help="before step STEP, multiply the token embeddings by 2**20 (in "
      "every policy), as a divergence blows up the residual stream: float16 "
      "then overflows at the minimum loss scale",
  )
  parser.add_argument(
      "--fallback", action="store_true",
      help="also train each float16 policy under jaxmp.PrecisionFallback, "
      "which switches the run to bfloat16 (where the hardware has it) or "
      "float32 when float16 overflows at the minimum loss scale",
  )
  parser.add_argument(
      "--recover", action="store_true",
      help="also train each float16 policy with jaxmp.retry_skipped, which "
      "runs a step whose gradients overflow again inside the step (at "
      "backed-off scales, then in the wider policy) instead of skipping it; "
      "with --fallback, that run also falls back",
  )
  parser.add_argument(
      "--max-retries", type=int, default=8,
      help="with --recover, how many backed-off retries a batch gets "
      "before the wider policy; 8 reach 2**16 from --init-scale 2**24",
  )
  parser.add_argument(
      "--eval-every", type=int, default=50,
      help="steps between validation evaluations",
  )
  parser.add_argument(
      "--eval-batches", type=int, default=4,
      help="batches in each evaluation of the train and validation loss",
  )
  parser.add_argument(
      "--max-bytes", type=int, default=16_000_000,
      help="read at most this many bytes of text",
  )
  parser.add_argument("--out", default="runs", help="directory for the run folders")
  parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
  parser.add_argument("--quiet", action="store_true", help="no progress bar")
  return parser


@dataclasses.dataclass(frozen=True)
class Config:
  """The training configuration shared by every policy of a run."""

  steps: int
  batch_size: int
  seq_len: int
  d_model: int
  layers: int
  heads: int
  lr: float
  init_scale: float
  scale_period: int
  seed: int
  eval_every: int
  eval_batches: int
  fp16_spike: int | None = None
  fallback: bool = False
  recover: bool = False
  max_retries: int = 8


def check_args(args: argparse.Namespace) -> tuple[list[str], Config]:
  """Validates the arguments; returns the policy names and the config."""
  import jaxmp  # pylint: disable=import-outside-toplevel

  if args.policy == "compare":
    policies = list(COMPARED_POLICIES)
  else:
    try:
      jaxmp.get_policy(args.policy)
    except ValueError as e:
      raise UsageError(
          f"--policy: {e} Or use 'compare' to run float32, mixed_bfloat16 "
          "and mixed_float16 in turn."
      ) from None
    policies = [args.policy]
  fp8 = [p for p in policies if ",dot=fp8" in str(jaxmp.get_policy(p))]
  if args.fp8 and not fp8:
    policies.append(FP8_POLICY)
  positive = ("steps", "batch_size", "seq_len", "d_model", "layers", "heads",
              "scale_period", "eval_every", "eval_batches", "max_bytes")
  for name in positive:
    if getattr(args, name) < 1:
      raise UsageError(
          f"--{name.replace('_', '-')} must be at least 1, got "
          f"{getattr(args, name)}."
      )
  if args.d_model % args.heads:
    raise UsageError(
        f"--d-model ({args.d_model}) must be a multiple of --heads ({args.heads})."
    )
  if args.fp16_spike is not None and not 1 <= args.fp16_spike <= args.steps:
    raise UsageError(
        f"--fp16-spike must be a step from 1 to --steps ({args.steps}), got "
        f"{args.fp16_spike}."
    )
  scaled = [p for p in policies if jaxmp.get_policy(p).needs_loss_scaling
            and p not in fp8]
  for flag, given in (("--fallback", args.fallback), ("--recover", args.recover)):
    scaled_fp8 = [p for p in fp8 if jaxmp.get_policy(p).needs_loss_scaling]
    if given and scaled_fp8:
      raise UsageError(
          f"{flag} does not cover FP8 runs ({', '.join(scaled_fp8)}): they "
          "train through jaxmp.flax.TrainState with their FP8 meta; use a "
          "float16 policy without dot=fp8, such as mixed_float16."
      )
    if given and not scaled:
      raise UsageError(
          f"{flag} watches float16 runs, but no policy of this run computes "
          f"in float16 ({', '.join(policies)}); add --policy mixed_float16 or "
          "use --policy compare."
      )
  if args.fallback:
    policies += [p + FALLBACK_SUFFIX for p in scaled]
  if args.recover:
    try:
      jaxmp.retry_skipped(lambda state: (state, None), max_retries=args.max_retries)
    except (TypeError, ValueError) as e:
      raise UsageError(f"--max-retries: {e}") from None
    policies += [p + RECOVER_SUFFIX + (FALLBACK_SUFFIX if args.fallback else "")
                 for p in scaled]
  if not (math.isfinite(args.lr) and args.lr > 0):
    raise UsageError(f"--lr must be a positive number, got {args.lr}.")
  init_scale = parse_number(args.init_scale)
  if not (math.isfinite(init_scale) and 1.0 <= init_scale <= 2.0**127):
    raise UsageError(
        f"--init-scale must lie in [1, 2**127], got {args.init_scale} "
        f"(= {init_scale})."
    )
  config = Config(
      steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
      d_model=args.d_model, layers=args.layers, heads=args.heads, lr=args.lr,
      init_scale=init_scale, scale_period=args.scale_period, seed=args.seed,
      eval_every=args.eval_every, eval_batches=args.eval_batches,
      fp16_spike=args.fp16_spike, fallback=args.fallback,
      recover=args.recover, max_retries=args.max_retries,
  )
  return policies, config


# ---------------------------------------------------------------------------
# Data.


def stdlib_sources() -> list[pathlib.Path]:
  """The standard library's ``.py`` files, sorted, without tests or site-packages."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
  files = []
  for path in sorted(root.rglob("*.py")):
    if skip.isdisjoint(path.relative_to(root).parts):
      files.append(path)
  return files


def load_text(path: str | None, max_bytes: int):
  """Returns the training text as a uint8 NumPy array and a description."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  if path is not None:
    file = pathlib.Path(path)
    if not file.is_file():
      raise UsageError(f"--data: no such file: {path}")
    with open(file, "rb") as f:
      text = f.read(max_bytes)
    source = str(file)
  else:
    chunks, total = [], 0
    for file in stdlib_sources():
      chunk = file.read_bytes()
      chunks.append(chunk)
      total += len(chunk)
      if total >= max_bytes:
        break
    text = b"".join(chunks)[:max_bytes]
    source = f"Python {platform.python_version()} standard library ({len(chunks)} .py files)"
  if not text:
    raise UsageError(f"--data: the file is empty: {path}")
  return np.frombuffer(text, dtype=np.uint8), source


def split_text(text, seq_len: int):
  """Splits the bytes into a fixed train and validation part."""
  n_val = max(int(len(text) * VALIDATION_FRACTION), seq_len + 1)
  train, val = text[:-n_val], text[-n_val:]
  if len(train) < seq_len + 1:
    raise UsageError(
        f"--data: the text has {len(text)} bytes; it needs at least "
        f"{2 * (seq_len + 1)} for --seq-len {seq_len} (lower --seq-len)."
    )
  return train, val


def fixed_windows(text, count: int, seq_len: int):
  """``count`` evenly spaced windows of ``seq_len + 1`` bytes (for evaluation)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  starts = np.linspace(0, len(text) - seq_len - 1, count).astype(np.int64)
  return np.stack([text[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def random_windows(rng, text, batch_size: int, seq_len: int):
  """A batch of random windows of ``seq_len + 1`` bytes."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  starts = rng.integers(0, len(text) - seq_len, size=batch_size)
  return np.stack([text[s:s + seq_len + 1] for s in starts]).astype(np.int32)


# ---------------------------------------------------------------------------
# Model, loss and steps (imported lazily so that bad input fails fast).


def build_model_module():
  """Defines the Linen modules; returns the ``Transformer`` class."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  class Block(nn.Module):
    """A pre-LayerNorm transformer block; computes in its inputs' dtype.

    ``dtype``, when set, is declared on every layer (Flax's own way to
    choose the compute dtype); None leaves it to the inputs.
    """

    num_heads: int
    dtype: Any = None

    @nn.compact
    def __call__(self, x, mask):
      d_model = x.shape[-1]
      h = nn.LayerNorm(dtype=self.dtype)(x)
      h = nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads, force_fp32_for_softmax=True, dtype=self.dtype
      )(h, mask=mask)
      x = x + h
      h = nn.LayerNorm(dtype=self.dtype)(x)
      h = nn.Dense(4 * d_model, dtype=self.dtype)(h)
      h = nn.gelu(h)
      h = nn.Dense(d_model, dtype=self.dtype)(h)
      return x + h

  class Transformer(nn.Module):
    """A decoder-only byte-level transformer.

    By default the modules leave ``dtype`` unset, so they compute in the
    dtype of the parameters they are given: cast the float32 master
    parameters with ``policy.cast_to_compute`` before ``apply``.
    """

    d_model: int
    num_layers: int
    num_heads: int
    max_len: int
    vocab_size: int = 256
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype)(tokens)
      position = self.param(
          "position", nn.initializers.normal(0.02), (self.max_len, self.d_model)
      )
      x = x + position[: tokens.shape[-1]].astype(x.dtype)
      mask = nn.make_causal_mask(tokens, dtype=jnp.bool_)
      for _ in range(self.num_layers):
        x = Block(self.num_heads, dtype=self.dtype)(x, mask)
      x = nn.LayerNorm(dtype=self.dtype)(x)
      return nn.Dense(self.vocab_size, dtype=self.dtype)(x)

  return Transformer


def make_model(d_model: int, num_layers: int, num_heads: int, max_len: int,
               dtype: Any = None):
  """Returns a ``Transformer`` (a Flax Linen module).

  ``dtype`` is declared on every layer when given (the benchmarks compare
  ``dtype=jnp.bfloat16`` with casting the params); None computes in the
  dtype of the params.
  """
  return build_model_module()(
      d_model=d_model, num_layers=num_layers, num_heads=num_heads, max_len=max_len,
      dtype=dtype,
  )


def next_byte_loss(logits, targets):
  """The mean cross entropy of the next byte, in float32."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def make_loss_fn(model, policy):
  """The mean next-byte cross entropy, computed under ``policy``."""

  def loss_fn(params, batch):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = model.apply({"params": policy.cast_to_compute(params)}, inputs)
    return next_byte_loss(policy.cast_to_output(logits), targets)

  return loss_fn


def make_inner_optimizer(config: Config):
  """AdamW with warm-up and cosine decay and clipping (not yet loss-scaled)."""
  import optax  # pylint: disable=import-outside-toplevel

  warmup = max(1, min(100, config.steps // 10))
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, config.lr, warmup, max(config.steps, warmup + 1), config.lr / 10
  )
  return optax.chain(
      optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1)
  )


def make_loss_scale(config: Config, policy):
  """A dynamic loss scale for float16 compute, else the no-op scale.

  float32 and bfloat16 (and FP8 on a bfloat16 base, whose per-tensor scales
  cover FP8's range) get the no-op scale, so that every policy runs the same
  guarded step and reports the same metrics.
  """
  import jaxmp  # pylint: disable=import-outside-toplevel

  if policy.needs_loss_scaling:
    return jaxmp.DynamicLossScale(config.init_scale, period=config.scale_period)
  return jaxmp.NoOpLossScale()


def make_optimizer(config: Config, policy):
  """:func:`make_inner_optimizer` wrapped with :func:`jaxmp.loss_scaling`."""
  import jaxmp  # pylint: disable=import-outside-toplevel

  return jaxmp.loss_scaling(make_inner_optimizer(config),
                            make_loss_scale(config, policy))


def spike_embeddings(params):
  """The params with the token embeddings multiplied by SPIKE_FACTOR."""
  embed = dict(params["Embed_0"])
  embed["embedding"] = embed["embedding"] * SPIKE_FACTOR
  return {**params, "Embed_0": embed}


def scaled_gradients(loss_fn):
  """The gradients of a batch, as every run here takes them.

  Returns ``gradients(params, opt_state, batch) -> (loss, grads,
  update_args)``: the loss, the gradients of the loss scaled by the state's
  loss scale, and the keyword arguments the step passes on to ``tx.update``
  (none here). A way of taking gradients that tells the optimizer more about
  the batch returns them there; give it to :func:`make_train_step`.
  """
  import jaxmp  # pylint: disable=import-outside-toplevel

  def gradients(params, opt_state, batch):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
    return loss, grads, {}

  return gradients


def make_train_step(loss_fn, tx, *, gradients=scaled_gradients, recover=None):
  """One guarded step: scaled gradients, update or skip, adjust the scale.

  ``gradients(loss_fn)`` builds the function that takes the gradients of a
  batch (default :func:`scaled_gradients`). With ``recover`` (see
  :func:`recover_config`), the step is wrapped with :func:`jaxmp.retry_skipped`,
  which runs a skipped step again inside the step, and the metrics say
  whether this batch was recovered (``gradients`` is not used then).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel

  import jaxmp  # pylint: disable=import-outside-toplevel

  if recover is not None:
    def step_of(loss_fn):
      def step(state, batch):
        params, opt_state = state
        loss, grads = jaxmp.scaled_value_and_grad(
            loss_fn, jaxmp.get_loss_scale(opt_state))(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss
      return step

    recovering = jaxmp.retry_skipped(
        step_of(loss_fn), max_retries=recover["max_retries"],
        fallback=step_of(recover["fallback"]))

    def recovering_train_step(params, opt_state, batch):
      (params, opt_state), loss, info = recovering((params, opt_state), batch)
      metrics = jaxmp.loss_scaling_metrics(opt_state)
      metrics["loss"] = loss
      metrics["recovered"] = info.finite & ((info.retries > 0) | info.fell_back)
      metrics["fell_back"] = info.finite & info.fell_back
      return params, opt_state, metrics

    return jax.jit(recovering_train_step, donate_argnums=(0, 1))

  batch_gradients = gradients(loss_fn)

  def train_step(params, opt_state, batch):
    loss, grads, update_args = batch_gradients(params, opt_state, batch)
    updates, opt_state = tx.update(grads, opt_state, params, **update_args)
    params = optax.apply_updates(params, updates)
    metrics = jaxmp.loss_scaling_metrics(opt_state)
    metrics["loss"] = loss
    return params, opt_state, metrics

  return jax.jit(train_step, donate_argnums=(0, 1))


def make_fp8_state(config: Config, model, policy, sample):
  """The ``jaxmp.flax.TrainState`` of an FP8 run, its FP8 meta in ``params``.

  ``jaxmp.flax.ModulePolicy({}, default=policy)`` injects Flax's FP8 op into
  every ``nn.Dense`` and ``nn.DenseGeneral`` (the attention projections
  included) without editing the model; the attention scores, the norms,
  the embeddings and the loss compute in the base dtype (bfloat16). The
  params are those of the other runs (same seed, same names); ``state.params``
  is Flax's FP8 layout, ``{"params": ..., "_overwrite_with_gradient": meta}``.
  """
  import jax  # pylint: disable=import-outside-toplevel

  import jaxmp.flax  # pylint: disable=import-outside-toplevel

  module_policy = jaxmp.flax.ModulePolicy({}, default=policy)
  variables = module_policy.wrap_apply(model.init)(
      jax.random.PRNGKey(config.seed), sample)
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=variables, tx=make_inner_optimizer(config),
      policy=module_policy, loss_scale=make_loss_scale(config, policy))


def fp8_eval_loss(state, batch):
  """The loss of ``state`` on ``batch`` (no update; the meta is only read)."""
  logits = state.apply_fn(state.params, batch[:, :-1])
  return next_byte_loss(logits, batch[:, 1:])


def make_fp8_train_step():
  """One guarded FP8 step: ``(state, batch) -> (state, metrics)``.

  The loss takes the variables, meta included, as in Flax; the "gradient"
  of the meta is its new value, which ``apply_gradients`` writes on a finite
  step and keeps bit-identical on a skipped one.
  """
  import jax  # pylint: disable=import-outside-toplevel

  import jaxmp  # pylint: disable=import-outside-toplevel

  def train_step(state, batch):
    def loss_fn(variables, batch):
      logits = state.apply_fn(variables, batch[:, :-1])
      return next_byte_loss(logits, batch[:, 1:])

    loss, grads = state.value_and_grad(loss_fn)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    metrics = jaxmp.loss_scaling_metrics(state.opt_state)
    metrics["loss"] = loss
    return state, metrics

  return jax.jit(train_step, donate_argnums=0)


def fp8_meta_summary(fp8_meta) -> dict[str, Any]:
  """How many matmuls ran in FP8, whether the meta is finite, and the range
  of each kind of scale (1.0 before the first step)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  scales: dict[str, list[float]] = {}
  finite = True
  for path, leaf in jax.tree_util.tree_leaves_with_path(jax.device_get(fp8_meta)):
    leaf = np.asarray(leaf)
    finite = finite and bool(np.isfinite(leaf).all())
    name = path[-1].key
    if name.endswith("_scale"):
      scales.setdefault(name, []).append(float(leaf.reshape(())))
  return {
      "matmuls": len(scales.get("kernel_scale", ())),
      "finite": finite,
      "scales": {name: [min(values), max(values)]
                 for name, values in sorted(scales.items())},
  }


def wider_policy() -> str:
  """bfloat16 where the hardware runs it natively, else float32.

  jaxmp refuses a bfloat16 fallback on hardware without it.
  """
  import jaxmp  # pylint: disable=import-outside-toplevel

  return "mixed_bfloat16" if jaxmp.hardware_report().native_bfloat16 else "float32"


def fallback_controller(policy_name: str):
  """The PrecisionFallback of a ``+fallback`` run: float16, then one wider policy."""
  import jaxmp  # pylint: disable=import-outside-toplevel

  return jaxmp.PrecisionFallback((policy_name, wider_policy()), every=1)


def recover_config(config: Config, model):
  """What a ``+recover`` run retries with: the backed-off retries, then the
  loss under the wider policy (:func:`wider_policy`)."""
  import jaxmp  # pylint: disable=import-outside-toplevel

  return {"max_retries": config.max_retries,
          "fallback": make_loss_fn(model, jaxmp.get_policy(wider_policy()))}


# ---------------------------------------------------------------------------
# Training.


def format_scale(value: float, needs_scaling: bool) -> str:
  """``2^15`` for powers of two, ``-`` when the policy uses no loss scale."""
  if not needs_scaling:
    return "-"
  exponent = math.log2(value) if value > 0 else float("nan")
  if math.isfinite(exponent) and exponent == int(exponent):
    return f"2^{int(exponent)}"
  return f"{value:.4g}"


def memory_figure(compiled) -> dict[str, Any]:
  """Peak device memory where the backend reports it, else XLA's estimate."""
  import jax  # pylint: disable=import-outside-toplevel

  stats = jax.local_devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return {"bytes": int(stats["peak_bytes_in_use"]), "source": "device peak"}
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {"bytes": None, "source": "unavailable"}
  total = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
           + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  return {"bytes": int(total), "source": "XLA estimate of the step"}


def train(run_name: str, config: Config, train_text, val_text,
          progress: bool, gradients=scaled_gradients) -> dict[str, Any]:
  """Trains one policy; returns its metrics.

  ``run_name`` is a policy, or a float16 policy with ``+fallback``: the run
  then starts in that policy and a :class:`jaxmp.PrecisionFallback` switches
  it to a wider one when float16 fails (the step is compiled once more).
  With ``+recover`` (before ``+fallback`` when both), the step recovers a
  batch whose update would be skipped, inside the step
  (:func:`jaxmp.retry_skipped` with :func:`recover_config`).
  ``gradients`` is how the step takes the gradients of a batch (see
  :func:`make_train_step`). A policy with FP8 matmuls (``dot=fp8``)
  trains a ``jaxmp.flax.TrainState`` instead (:func:`make_fp8_state`), whose
  FP8 meta is summarised in the result.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tqdm  # pylint: disable=import-outside-toplevel

  import jaxmp  # pylint: disable=import-outside-toplevel

  falls_back = run_name.endswith(FALLBACK_SUFFIX)
  recovers = run_name.removesuffix(FALLBACK_SUFFIX).endswith(RECOVER_SUFFIX)
  policy_name = run_name.removesuffix(FALLBACK_SUFFIX).removesuffix(RECOVER_SUFFIX)
  fallback = fallback_controller(policy_name) if falls_back else None
  policy = jaxmp.get_policy(policy_name)
  fp8 = ",dot=fp8" in str(policy)  # FP8 matmuls (the policy grammar)
  if fp8 and (falls_back or recovers or gradients is not scaled_gradients):
    raise ValueError(
        f"{run_name}: an FP8 run trains its TrainState step "
        "(make_fp8_train_step), without +fallback, +recover or gradients=; "
        f"train {policy_name} alone.")
  model = make_model(config.d_model, config.layers, config.heads, config.seq_len)
  recover = recover_config(config, model) if recovers else None
  rng = np.random.default_rng(config.seed)
  sample = jnp.zeros((config.batch_size, config.seq_len), jnp.int32)
  # What the step carries: (params, opt_state), or (TrainState,) for FP8.
  if fp8:
    state = make_fp8_state(config, model, policy, sample)
    carry, params = (state,), state.params["params"]
    step_fn, evaluate = make_fp8_train_step(), jax.jit(fp8_eval_loss)
  else:
    loss_fn = make_loss_fn(model, policy)
    tx = make_optimizer(config, policy)
    params = model.init(jax.random.PRNGKey(config.seed), sample)["params"]
    params = policy.cast_to_param(params)
    carry = (params, tx.init(params))
    step_fn = make_train_step(loss_fn, tx, gradients=gradients, recover=recover)
    evaluate = jax.jit(loss_fn)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))

  def opt_state_of(carry):
    return carry[0].opt_state if fp8 else carry[1]

  batch = random_windows(rng, train_text, config.batch_size, config.seq_len)
  started = time.perf_counter()
  compiled = step_fn.lower(*carry, batch).compile()
  compile_seconds = time.perf_counter() - started
  train_eval = fixed_windows(train_text, config.eval_batches * config.batch_size,
                             config.seq_len)
  val_eval = fixed_windows(val_text, config.eval_batches * config.batch_size,
                           config.seq_len)

  def mean_loss(carry, windows):
    # The params, or the FP8 run's TrainState (params and meta).
    losses = [evaluate(carry[0], windows[i:i + config.batch_size])
              for i in range(0, len(windows), config.batch_size)]
    return float(np.mean(jax.device_get(losses)))

  history = {"loss": [], "loss_scale": [], "skipped": [], "recovered": [],
             "policy": []}
  val_history = {"step": [], "loss": []}
  events = []  # the crash condition, and switches of the policy
  bar = tqdm.tqdm(total=config.steps, desc=f"{run_name:>14}", unit="step",
                  disable=not progress, mininterval=0.5, dynamic_ncols=True)
  train_seconds, skipped = 0.0, 0
  scale_used = float(jax.device_get(
      jaxmp.get_loss_scale(opt_state_of(carry)).loss_scale))
  for step in range(1, config.steps + 1):
    if step == config.fp16_spike and fp8:
      variables = carry[0].params
      carry = (carry[0].replace(params={
          **variables, "params": spike_embeddings(variables["params"])}),)
    elif step == config.fp16_spike:
      carry = (spike_embeddings(carry[0]), carry[1])
    started = time.perf_counter()
    *carry, metrics = compiled(*carry, batch)
    carry = tuple(carry)
    metrics = jax.device_get(metrics)
    train_seconds += time.perf_counter() - started
    batch = random_windows(rng, train_text, config.batch_size, config.seq_len)
    loss, scale = float(metrics["loss"]), float(metrics["loss_scale"])
    skipped = int(metrics["skipped_steps"])
    history["loss"].append(loss)
    # The scale this step ran with; none (nan: a gap in the plot) once the
    # run switched to a policy without loss scaling.
    history["loss_scale"].append(
        scale_used if policy.needs_loss_scaling else float("nan"))
    scale_used = scale
    history["skipped"].append(not bool(metrics["last_finite"]))
    history["recovered"].append(bool(metrics.get("recovered", False)))
    history["policy"].append(str(policy))
    if not events and int(metrics["overflows_at_min"]) > 0:
      events.append({"step": step, "event": "crash condition",
                     "detail": "overflow at the minimum loss scale"})
    if fallback is not None:
      opt_state, new_policy = fallback.update(carry[1], step=step)
      carry = (carry[0], opt_state)
      if new_policy != policy:
        policy = new_policy
        loss_fn = make_loss_fn(model, policy)
        evaluate = jax.jit(loss_fn)
        if not policy.needs_loss_scaling:
          recover = None  # nothing left to back off or to fall back to
        compiled = make_train_step(
            loss_fn, tx, gradients=gradients, recover=recover).lower(
                *carry, batch).compile()
        events.append({"step": step, "event": "switch",
                       "detail": f"switched to {policy}"})
    if step % config.eval_every == 0 or step == config.steps:
      val_history["step"].append(step)
      val_history["loss"].append(mean_loss(carry, val_eval))
    bar.set_postfix_str(
        f"loss={loss:.3f} scale={format_scale(scale, policy.needs_loss_scaling)} "
        f"skipped={skipped}", refresh=False)
    bar.update(1)
  bar.close()

  tokens = config.steps * config.batch_size * config.seq_len
  lost = {}  # skipped batches per policy, in the order the run went through them
  for name, skipped_step in zip(history["policy"], history["skipped"]):
    lost[name] = lost.get(name, 0) + int(skipped_step)
  result = {
      "policy": run_name,
      "policy_string": str(jaxmp.get_policy(policy_name)),
      "loss_scaling": jaxmp.get_policy(policy_name).needs_loss_scaling,
      "recovers": recovers,
      "lost_batches": lost,
      "recovered_steps": sum(history["recovered"]),
      "events": events,
      "parameters": int(n_params),
      "final_train_loss": mean_loss(carry, train_eval),
      "final_val_loss": val_history["loss"][-1],
      "skipped_steps": skipped,
      "final_loss_scale": scale_used,
      "final_loss_scaling": policy.needs_loss_scaling,
      "tokens_per_second": tokens / train_seconds,
      "compile_seconds": compile_seconds,
      "memory": memory_figure(compiled),
      "train": history,
      "validation": val_history,
  }
  if fp8:
    result["fp8_meta"] = fp8_meta_summary(carry[0].params[FP8_META])
  return result


# ---------------------------------------------------------------------------
# Reporting.


def format_bytes(count: int | None) -> str:
  if count is None:
    return "n/a"
  return f"{count / 2**20:.1f} MiB"


def preset_name(policy_string: str) -> str:
  """``mixed_float16`` for ``p=f32,c=f16,o=f32``; other policies as they are."""
  import jaxmp  # pylint: disable=import-outside-toplevel

  for name in COMPARED_POLICIES + (FP8_POLICY,):
    if str(jaxmp.get_policy(name)) == policy_string:
      return name
  return policy_string


def summary_table(results: Sequence[dict[str, Any]]) -> str:
  """The summary as a Markdown table.

  When a run met float16's crash condition or switched policy, or recovered
  its batches in the step, more columns say so: the batches recovered, the
  batches lost (skipped) under each policy the run went through, and the
  events with their steps.
  """
  recovers = any(r.get("recovers") for r in results)
  events = recovers or any(r.get("events") for r in results)
  lines = [
      "| policy | train loss | val loss | skipped steps | final loss scale "
      "| tokens/s | memory |" + (" recovered steps |" if recovers else "")
      + (" lost batches per policy | events |" if events else ""),
      "|---|---|---|---|---|---|---|" + ("---|" if recovers else "")
      + ("---|---|" if events else ""),
  ]
  for r in results:
    memory = r["memory"]
    line = (
        f"| {r['policy']} | {r['final_train_loss']:.3f} | "
        f"{r['final_val_loss']:.3f} | {r['skipped_steps']} | "
        f"{format_scale(r['final_loss_scale'], r.get('final_loss_scaling', r['loss_scaling']))} | "
        f"{r['tokens_per_second']:,.0f} | {format_bytes(memory['bytes'])} |"
    )
    if recovers:
      line += f" {r['recovered_steps'] if r.get('recovers') else '-'} |"
    if events:
      lost = ", ".join(f"{preset_name(name)}: {count}"
                       for name, count in r["lost_batches"].items())
      happened = "; ".join(
          f"{e['event']} at step {e['step']} ({e['detail']})" for e in r["events"])
      line += f" {lost} | {happened or '-'} |"
    lines.append(line)
  sources = sorted({r["memory"]["source"] for r in results})
  lines.append("")
  lines.append(f"memory: {', '.join(sources)}.")
  for r in results:
    if "fp8_meta" in r:
      lines += ["", fp8_note(r)]
  return "\n".join(lines)


def fp8_note(result: dict[str, Any]) -> str:
  """What an FP8 run's meta ended as, and what its tokens/s mean on a CPU."""
  meta = result["fp8_meta"]
  ranges = ", ".join(
      f"{name.removesuffix('_scale').replace('_', ' ')} {low:.3g} to {high:.3g}"
      for name, (low, high) in meta["scales"].items())
  note = (
      f"{result['policy']}: {meta['matmuls']} matmuls in FP8 (E4M3 forward, "
      f"E5M2 gradients, delayed scaling); FP8 meta "
      f"{'finite' if meta['finite'] else 'NOT finite'}, scales {ranges}.")
  import jax  # pylint: disable=import-outside-toplevel

  if jax.devices()[0].platform == "cpu":
    note += " " + FP8_NOTE
  return note


def _smooth(values, window: int):
  import numpy as np  # pylint: disable=import-outside-toplevel

  values = np.asarray(values, dtype=np.float64)
  return np.convolve(values, np.ones(window) / window, mode="valid")


def mark_events(ax, results: Sequence[dict[str, Any]]) -> None:
  """Vertical lines at the switches (solid) and crash conditions (dotted).

  A run that switched is marked at its switch only.
  """
  for r in results:
    events = r.get("events", ())
    if any(e["event"] == "switch" for e in events):
      events = [e for e in events if e["event"] == "switch"]
    for e in events:
      switch = e["event"] == "switch"
      ax.axvline(e["step"], color="black", linestyle="-" if switch else ":",
                 linewidth=1.0, alpha=0.7,
                 label=f"{r['policy']}: {e['detail']} (step {e['step']})")


def plot(results: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Loss curves of every policy; the float16 loss scale with skipped steps.

  Panels: the train loss (a running mean over 10 steps) and the validation
  loss; when float32 ran too, each policy's train loss minus float32's (so
  that curves hidden under each other show); the loss scale of the runs that
  use loss scaling, with the skipped steps marked (and the steps whose batch
  was recovered inside the step, circled). Vertical lines mark where a run
  switched policy (solid) or met float16's crash condition (dotted).
  """
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  styles = {"float32": "-", "mixed_bfloat16": "--", "mixed_float16": ":",
            FP8_POLICY: (0, (5, 1, 1, 1, 1, 1))}
  reference = next((r for r in results if r["policy"] == "float32"), None)
  others = [r for r in results if r is not reference] if reference else []
  scaled = [r for r in results if r["loss_scaling"]]
  panels = ["loss"] + (["difference"] if others else []) + (["scale"] if scaled else [])
  heights = {"loss": 3.2, "difference": 1.8, "scale": 2.4}
  # Many runs or events: the legends go to the right of the panels, where
  # they cover no curve.
  beside = len(results) + sum(len(r.get("events", ())) for r in results) > 4

  def legend(ax, **kwargs):
    if beside:
      ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
      ax.legend(fontsize=8, **kwargs)

  fig, axes = plt.subplots(
      len(panels), 1, sharex=True, squeeze=False,
      figsize=(12.5 if beside else 8, sum(heights[p] for p in panels) + 0.6),
      gridspec_kw={"height_ratios": [heights[p] for p in panels]})
  axes = dict(zip(panels, axes[:, 0]))
  n_steps = len(results[0]["train"]["loss"])
  window = max(1, min(10, n_steps // 10))
  steps = np.arange(1, n_steps + 1)[window - 1:]

  ax = axes["loss"]
  for r in results:
    style = styles.get(r["policy"], "-.")
    (line,) = ax.plot(steps, _smooth(r["train"]["loss"], window),
                      linestyle=style, linewidth=1.6, label=f"{r['policy']} train")
    ax.plot(r["validation"]["step"], r["validation"]["loss"], "o",
            color=line.get_color(), markersize=4,
            label=f"{r['policy']} validation")
  mark_events(ax, results)
  ax.set_ylabel("cross entropy\n(nats/byte)")
  names = [r["policy"] for r in results]
  title = " vs ".join(names)
  ax.set_title("Byte-level transformer LM: " + title if len(title) <= 60
               else "Byte-level transformer LM:\n" + title)
  legend(ax, ncol=2)
  ax.grid(alpha=0.3)

  if others:
    ax = axes["difference"]
    base = _smooth(reference["train"]["loss"], window)
    ax.axhline(0.0, color="black", linewidth=0.8)
    for r in others:
      color = f"C{results.index(r)}"
      ax.plot(steps, _smooth(r["train"]["loss"], window) - base,
              linestyle=styles.get(r["policy"], "-."), color=color,
              label=f"{r['policy']} - float32")
    ax.set_ylabel("train loss\nminus float32")
    legend(ax)
    ax.grid(alpha=0.3)

  for r in scaled:
    ax = axes["scale"]
    used = np.asarray(r["train"]["loss_scale"])
    all_steps = np.arange(1, len(used) + 1)
    ax.step(all_steps, used, where="post", color=f"C{results.index(r)}",
            label=f"{r['policy']} loss scale (used by each step)")
    skipped = np.flatnonzero(np.asarray(r["train"]["skipped"]))
    ax.plot(all_steps[skipped], used[skipped], "x", color="red",
            label=f"{r['policy']}: skipped steps ({len(skipped)})")
    if r.get("recovers"):
      recovered = np.flatnonzero(np.asarray(r["train"]["recovered"]))
      ax.plot(all_steps[recovered], used[recovered], "o", markersize=5,
              markerfacecolor="none", color="green",
              label=f"{r['policy']}: recovered steps ({len(recovered)})")
    ax.set_yscale("log", base=2)
    mark_events(ax, [r])
    ax.set_ylabel("loss scale")
    legend(ax)
    ax.grid(alpha=0.3)
  axes[panels[-1]].set_xlabel("step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def machine_description() -> dict[str, Any]:
  import jax  # pylint: disable=import-outside-toplevel

  device = jax.devices()[0]
  return {
      "platform": device.platform,
      "device_kind": device.device_kind,
      "cpu_count": os.cpu_count(),
      "python": platform.python_version(),
      "jax": jax.__version__,
  }


def run(argv: Sequence[str] | None = None) -> pathlib.Path:
  """Parses ``argv``, trains, writes the outputs; returns the run directory."""
  args = build_parser().parse_args(argv)
  policies, config = check_args(args)
  text, source = load_text(args.data, args.max_bytes)
  train_text, val_text = split_text(text, config.seq_len)
  run_dir = pathlib.Path(args.out) / datetime.datetime.now().strftime(
      "%Y%m%d-%H%M%S-%f")
  run_dir.mkdir(parents=True, exist_ok=False)
  print(f"data: {source}: {len(train_text):,} train bytes, "
        f"{len(val_text):,} validation bytes", file=sys.stderr)

  results = [train(p, config, train_text, val_text, progress=not args.quiet)
             for p in policies]
  print(f"\nmodel: {results[0]['parameters']:,} parameters; {config.steps} "
        f"steps of {config.batch_size}x{config.seq_len} bytes\n")
  print(summary_table(results))
  metrics = {
      "config": dataclasses.asdict(config),
      "data": {"source": source, "train_bytes": len(train_text),
               "validation_bytes": len(val_text)},
      "machine": machine_description(),
      "results": results,
  }
  (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
  written = [run_dir / "metrics.json"]
  if not args.no_plot:
    plot(results, run_dir / "loss.png")
    written.append(run_dir / "loss.png")
  print("\nwrote " + ", ".join(str(p) for p in written))
  return run_dir


def main(argv: Sequence[str] | None = None) -> int:
  try:
    run(argv)
  except UsageError as e:
    print(f"train_lm.py: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("train_lm.py: interrupted", file=sys.stderr)
    return 130
  return 0


if __name__ == "__main__":
  sys.exit(main())
