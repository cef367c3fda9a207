"""Train an Equinox MLP on scikit-learn's digits under mixed_float16 with jaxmp.

The model is a plain ``eqx.nn.MLP`` with float32 weights. The loss casts the
model and the batch to the compute dtype (float16), so every matmul runs in
float16; ``jaxmp.scaled_value_and_grad`` with
``value_and_grad=eqx.filter_value_and_grad`` differentiates the scaled loss,
``jaxmp.loss_scaling`` around adam unscales the gradients and skips the
non-finite steps, and ``eqx.apply_updates`` applies the updates. The step is an
``eqx.filter_jit``.

    python examples/equinox_mlp.py --steps 300
    python examples/equinox_mlp.py --policy mixed_bfloat16  # no loss scaling
"""

from __future__ import annotations

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jaxmp


def load_data(seed: int):
  """The 8x8 digits (shipped with scikit-learn), scaled to [0, 1], split 1500/297."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def create(policy: jaxmp.Policy, seed: int = 0, learning_rate: float = 3e-3):
  """The model (float32 weights), the optimizer and its state."""
  model = eqx.nn.MLP(64, 10, 128, depth=2, key=jax.random.key(seed))
  # A DynamicLossScale under float16, none under bfloat16.
  loss_scale = jaxmp.DynamicLossScale() if policy.needs_loss_scaling else jaxmp.NoOpLossScale()
  tx = jaxmp.loss_scaling(optax.adam(learning_rate), loss_scale)
  opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  return model, tx, opt_state


def logits_of(model, x, policy: jaxmp.Policy):
  """The forward pass in the compute dtype, logits in the output dtype."""
  model = policy.cast_to_compute(model)  # casts the arrays, keeps the rest
  return policy.cast_to_output(jax.vmap(model)(policy.cast_to_compute(x)))


def make_train_step(policy: jaxmp.Policy, tx):
  """The ``eqx.filter_jit`` step: scaled gradients, guarded update."""

  def loss_fn(model, x, y):
    logits = logits_of(model, x, policy)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @eqx.filter_jit
  def train_step(model, opt_state, x, y):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(
        loss_fn, loss_scale, value_and_grad=eqx.filter_value_and_grad)(model, x, y)
    updates, opt_state = tx.update(
        grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
    model = eqx.apply_updates(model, updates)  # unchanged on a skipped step
    return model, opt_state, loss

  return train_step


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--policy", default="mixed_float16")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  (x_train, y_train), (x_test, y_test) = load_data(args.seed)
  policy = jaxmp.get_policy(args.policy)
  model, tx, opt_state = create(policy, args.seed, args.learning_rate)
  train_step = make_train_step(policy, tx)

  @eqx.filter_jit
  def accuracy(model, x, y):
    return jnp.mean(jnp.argmax(logits_of(model, x, policy), -1) == y)

  rng = np.random.default_rng(args.seed)
  loss = jnp.nan
  for _ in range(args.steps):
    index = rng.integers(0, len(x_train), args.batch_size)
    model, opt_state, loss = train_step(
        model, opt_state, x_train[index], y_train[index])
  jaxmp.check_loss_scale(opt_state)  # raises if fp16 could not cope

  metrics = jax.device_get(jaxmp.loss_scaling_metrics(opt_state))
  params = eqx.filter(model, eqx.is_inexact_array)
  summary = {
      "steps": args.steps,
      "skipped_steps": int(metrics["skipped_steps"]),
      "loss_scale": float(metrics["loss_scale"]),
      "final_loss": float(loss),
      "test_accuracy": float(accuracy(model, x_test, y_test)),
      "param_dtypes": sorted({str(p.dtype) for p in jax.tree_util.tree_leaves(params)}),
  }
  print(
      f"Equinox MLP on digits, policy {policy}: "
      f"{summary['steps']} steps ({summary['skipped_steps']} skipped), "
      f"final loss {summary['final_loss']:.4f}, test accuracy "
      f"{summary['test_accuracy']:.3f}, loss scale {summary['loss_scale']:g}, "
      f"params {', '.join(summary['param_dtypes'])}"
  )
  return summary


if __name__ == "__main__":
  main()
