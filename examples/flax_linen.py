"""Train a Linen MLP on scikit-learn's digits under mixed_float16 with jaxmp.

The model code is plain Flax: no dtype arguments. jaxmp.flax.TrainState runs
it under the policy (float16 compute, float32 master weights and logits) with
dynamic loss scaling, and a ModulePolicy keeps the LayerNorm in float32.

    python examples/flax_linen.py --steps 300
    python examples/flax_linen.py --policy mixed_bfloat16  # no loss scaling
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxmp
import jaxmp.flax


class MLP(nn.Module):
  """Dense -> ReLU -> LayerNorm -> Dense; nothing about dtypes here."""

  hidden: int = 128

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.hidden)(x))
    x = nn.LayerNorm()(x)
    return nn.Dense(10)(x)


def load_data(seed: int):
  """The 8x8 digits (shipped with scikit-learn), scaled to [0, 1], split 1500/297."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def create_state(policy: str = "mixed_float16", seed: int = 0,
                 learning_rate: float = 3e-3) -> jaxmp.flax.TrainState:
  """The model under ``policy``, but for the LayerNorm, which stays float32."""
  model = MLP()
  params = model.init(jax.random.key(seed), jnp.ones((1, 64)))["params"]
  module_policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"}, default=policy)
  # No loss_scale given: create picks a DynamicLossScale under float16 and
  # none under bfloat16.
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(learning_rate),
      policy=module_policy)


@jax.jit
def train_step(state, x, y):

  def loss_fn(params, x, y):
    logits = state.apply_fn({"params": params}, x)  # float32 logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
  return state.apply_gradients(grads=grads), loss


@jax.jit
def accuracy(state, x, y):
  logits = state.apply_fn({"params": state.params}, x)
  return jnp.mean(jnp.argmax(logits, -1) == y)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--policy", default="mixed_float16",
                      help="the policy of every module but the LayerNorm")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  (x_train, y_train), (x_test, y_test) = load_data(args.seed)
  state = create_state(args.policy, args.seed, args.learning_rate)
  policy = state.policy

  rng = np.random.default_rng(args.seed)
  loss = jnp.nan
  for _ in range(args.steps):
    index = rng.integers(0, len(x_train), args.batch_size)
    state, loss = train_step(state, x_train[index], y_train[index])
  jaxmp.check_loss_scale(state.opt_state)  # raises if fp16 could not cope

  metrics = jax.device_get(state.metrics)
  summary = {
      "steps": int(state.step),
      "skipped_steps": int(metrics["skipped_steps"]),
      "loss_scale": float(metrics["loss_scale"]),
      "final_loss": float(loss),
      "test_accuracy": float(accuracy(state, x_test, y_test)),
      "param_dtypes": sorted({str(p.dtype) for p in jax.tree_util.tree_leaves(state.params)}),
  }
  print(
      f"Linen MLP on digits, policy {policy.default} (LayerNorm in float32): "
      f"{summary['steps']} steps ({summary['skipped_steps']} skipped), "
      f"final loss {summary['final_loss']:.4f}, test accuracy "
      f"{summary['test_accuracy']:.3f}, loss scale {summary['loss_scale']:g}, "
      f"params {', '.join(summary['param_dtypes'])}"
  )
  return summary


if __name__ == "__main__":
  main()
