"""A translation Transformer in the style of Flax's WMT example, in mixed precision.

An encoder-decoder whose layers declare ``dtype=jnp.float32`` (as most
published Flax models do), with padding masks, a causal mask and dropout,
trained on a synthetic task (reverse a padded token sequence). It is trained
four ways from the same initialisation and the same dropout keys:

* ``float32``: the reference;
* ``autocast-float16`` and ``autocast-bfloat16``:
  ``TrainState.create(..., policy=..., autocast=True)``, which runs every
  matmul in the half dtype whatever the layers declare, and keeps softmax,
  layer norm, the loss and the mask fill values in float32's meaning (a
  padding query, whose keys are all masked, gets a uniform row, not NaN);
* ``module-policy-float16``: ``ModulePolicy({nn.LayerNorm: "float32"},
  default="mixed_float16", override_dtype=True)``, which overrides the
  declared ``dtype`` of every layer while it runs.

    python examples/wmt_transformer.py --steps 40
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp
import jaxmp.flax

MODES = ("float32", "autocast-float16", "autocast-bfloat16",
         "module-policy-float16")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab_size: int = 32
  emb_dim: int = 32
  num_heads: int = 4
  num_layers: int = 2
  mlp_dim: int = 64
  max_len: int = 12
  dropout_rate: float = 0.1
  dtype: Any = jnp.float32  # what the layers declare, as in Flax's WMT
  deterministic: bool = False


class FeedForward(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x):
    c = self.config
    y = nn.relu(nn.Dense(c.mlp_dim, dtype=c.dtype)(x))
    y = nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)
    y = nn.Dense(x.shape[-1], dtype=c.dtype)(y)
    return nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)


class Attention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, queries, keys, mask):
    c = self.config
    y = nn.MultiHeadDotProductAttention(
        num_heads=c.num_heads, dtype=c.dtype, dropout_rate=c.dropout_rate,
        deterministic=c.deterministic)(queries, keys, mask=mask)
    return nn.Dropout(c.dropout_rate)(y, deterministic=c.deterministic)


class EncoderLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, mask):
    c = self.config
    y = nn.LayerNorm(dtype=c.dtype)(x)
    x = x + Attention(c)(y, y, mask)
    return x + FeedForward(c)(nn.LayerNorm(dtype=c.dtype)(x))


class DecoderLayer(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x, encoded, self_mask, cross_mask):
    c = self.config
    y = nn.LayerNorm(dtype=c.dtype)(x)
    x = x + Attention(c)(y, y, self_mask)
    x = x + Attention(c)(nn.LayerNorm(dtype=c.dtype)(x), encoded, cross_mask)
    return x + FeedForward(c)(nn.LayerNorm(dtype=c.dtype)(x))


class Transformer(nn.Module):
  """Encoder-decoder with a shared embedding; token 0 is padding."""

  config: Config

  @nn.compact
  def __call__(self, inputs, targets):
    c = self.config
    embed = nn.Embed(c.vocab_size, c.emb_dim, dtype=c.dtype)
    positions = self.param(
        "positions", nn.initializers.normal(0.02), (c.max_len, c.emb_dim))

    def embedded(tokens):
      x = embed(tokens) + positions[: tokens.shape[1]]
      return nn.Dropout(c.dropout_rate)(x, deterministic=c.deterministic)

    # Padding masks, as Flax's WMT example builds them (float masks in the
    # model's dtype), and a causal mask for the decoder.
    encoder_mask = nn.make_attention_mask(inputs > 0, inputs > 0, dtype=c.dtype)
    decoder_inputs = jnp.pad(targets[:, :-1], ((0, 0), (1, 0)))  # shift right
    decoder_mask = nn.combine_masks(
        nn.make_attention_mask(targets > 0, targets > 0, dtype=c.dtype),
        nn.make_causal_mask(targets, dtype=c.dtype))
    cross_mask = nn.make_attention_mask(targets > 0, inputs > 0, dtype=c.dtype)

    x = embedded(inputs)
    for _ in range(c.num_layers):
      x = EncoderLayer(c)(x, encoder_mask)
    encoded = nn.LayerNorm(dtype=c.dtype)(x)
    y = embedded(decoder_inputs)
    for _ in range(c.num_layers):
      y = DecoderLayer(c)(y, encoded, decoder_mask, cross_mask)
    y = nn.LayerNorm(dtype=c.dtype)(y)
    return embed.attend(y)  # logits through the shared embedding


def synthetic_batch(rng: np.random.Generator, batch_size: int, config: Config):
  """Token sequences of random lengths, padded with 0; the target reverses each."""
  lengths = rng.integers(3, config.max_len + 1, batch_size)
  inputs = np.zeros((batch_size, config.max_len), np.int32)
  targets = np.zeros_like(inputs)
  for row, n in enumerate(lengths):
    tokens = rng.integers(1, config.vocab_size, n)
    inputs[row, :n] = tokens
    targets[row, :n] = tokens[::-1]
  return jnp.asarray(inputs), jnp.asarray(targets)


def loss_fn(apply_fn, params, inputs, targets, dropout_key):
  """Token cross-entropy over the non-padding targets."""
  logits = apply_fn({"params": params}, inputs, targets,
                    rngs={"dropout": dropout_key})
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  weights = (targets > 0).astype(losses.dtype)
  return jnp.sum(losses * weights) / jnp.sum(weights)


def create_state(mode: str, config: Config = Config(), seed: int = 0,
                 learning_rate: float = 3e-3) -> jaxmp.flax.TrainState:
  """The training model's state under ``mode`` (one of :data:`MODES`)."""
  model = Transformer(config)
  inputs, targets = synthetic_batch(np.random.default_rng(seed), 2, config)
  params = model.init(jax.random.key(seed), inputs, targets)["params"]
  if mode == "float32":
    policy, autocast = "float32", False
  elif mode.startswith("autocast-"):
    policy, autocast = "mixed_" + mode.removeprefix("autocast-"), True
  elif mode == "module-policy-float16":
    policy = jaxmp.flax.ModulePolicy(
        {nn.LayerNorm: "float32"}, default="mixed_float16", override_dtype=True)
    autocast = False
  else:
    raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}.")
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(learning_rate),
      policy=policy, autocast=autocast)


def step_loss(state):
  """The loss the train step differentiates: ``state.value_and_grad``'s."""
  return state.value_and_grad(
      lambda params, *batch: loss_fn(state.apply_fn, params, *batch))


@jax.jit
def train_step(state, inputs, targets, key):
  # One dropout key per step, folded from the step number as Flax's WMT does.
  dropout_key = jax.random.fold_in(key, state.step)
  loss, grads = step_loss(state)(state.params, inputs, targets, dropout_key)
  state = state.apply_gradients(grads=grads)
  return state, loss, state.metrics


def train(mode: str, steps: int = 40, batch_size: int = 16, seed: int = 0,
          config: Config = Config()) -> dict[str, list[float]]:
  """Trains under ``mode``; returns the per-step losses, skips and scales."""
  state = create_state(mode, config, seed)
  rng = np.random.default_rng(seed + 1)
  key = jax.random.key(seed + 2)
  history = {"loss": [], "skipped": [], "loss_scale": []}
  for _ in range(steps):
    state, loss, metrics = train_step(
        state, *synthetic_batch(rng, batch_size, config), key)
    history["loss"].append(float(loss))
    history["skipped"].append(int(metrics["skipped"]))
    history["loss_scale"].append(float(metrics["loss_scale"]))
  return history


def main(argv=None) -> dict[str, dict[str, list[float]]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40)
  parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
  args = parser.parse_args(argv)
  runs = {mode: train(mode, args.steps) for mode in args.modes}
  print(f"{'mode':<24}{'first loss':>12}{'last loss':>12}{'skipped':>9}"
        f"{'final scale':>13}")
  for mode, run in runs.items():
    print(f"{mode:<24}{run['loss'][0]:>12.4f}{run['loss'][-1]:>12.4f}"
          f"{sum(run['skipped']):>9}{run['loss_scale'][-1]:>13g}")
  return runs


if __name__ == "__main__":
  main()
