"""Train an NNX MLP on scikit-learn's digits under mixed_float16 with jaxmp.

nnx.Optimizer takes jaxmp.loss_scaling as its optimizer; a ModulePolicy sets
the layers' compute dtype (float16, the LayerNorm float32) without touching
the model code; jaxmp.scaled_value_and_grad with nnx.value_and_grad gives the
scaled gradients.

    python examples/flax_nnx.py --steps 300
    python examples/flax_nnx.py --policy mixed_bfloat16  # no loss scaling
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import jaxmp
import jaxmp.flax


class MLP(nnx.Module):
  """Linear -> ReLU -> LayerNorm -> Linear; nothing about dtypes here."""

  def __init__(self, rngs: nnx.Rngs, hidden: int = 128):
    self.dense1 = nnx.Linear(64, hidden, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.dense2 = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.norm(nnx.relu(self.dense1(x))))


def load_data(seed: int):
  """The 8x8 digits (shipped with scikit-learn), scaled to [0, 1], split 1500/297."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  return (x[:1500], y[:1500]), (x[1500:], y[1500:])


def create(policy: jaxmp.Policy, seed: int = 0, learning_rate: float = 3e-3):
  """The model, its layers set to compute under ``policy`` (the LayerNorm in
  float32), and its optimizer with the loss scale the policy needs."""
  model = MLP(nnx.Rngs(seed))
  jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"}, default=policy).set_nnx_dtypes(model)
  # A DynamicLossScale under float16, none under bfloat16.
  loss_scale = jaxmp.DynamicLossScale() if policy.needs_loss_scaling else jaxmp.NoOpLossScale()
  optimizer = nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.adam(learning_rate), loss_scale), wrt=nnx.Param)
  return model, optimizer


def train_step(model, optimizer, x, y, policy: jaxmp.Policy):

  def loss_fn(model):
    logits = policy.cast_to_output(model(policy.cast_to_compute(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  loss_scale = jaxmp.get_loss_scale(optimizer.opt_state)
  loss, grads = jaxmp.scaled_value_and_grad(
      loss_fn, loss_scale, value_and_grad=nnx.value_and_grad)(model)
  optimizer.update(model, grads)  # unscales; skips the step if not finite
  return loss


@nnx.jit
def accuracy(model, x, y):
  return jnp.mean(jnp.argmax(model(x), -1) == y)


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
  policy = jaxmp.get_policy(args.policy)
  model, optimizer = create(policy, args.seed, args.learning_rate)
  # The policy is fixed for the run: bound before jitting.
  step = nnx.jit(functools.partial(train_step, policy=policy))

  rng = np.random.default_rng(args.seed)
  loss = jnp.nan
  for _ in range(args.steps):
    index = rng.integers(0, len(x_train), args.batch_size)
    loss = step(model, optimizer, x_train[index], y_train[index])
  jaxmp.check_loss_scale(optimizer.opt_state)  # raises if fp16 could not cope

  metrics = jax.device_get(jaxmp.loss_scaling_metrics(optimizer.opt_state))
  params = nnx.state(model, nnx.Param)
  summary = {
      "steps": int(optimizer.step[...]),
      "skipped_steps": int(metrics["skipped_steps"]),
      "loss_scale": float(metrics["loss_scale"]),
      "final_loss": float(loss),
      "test_accuracy": float(accuracy(model, x_test, y_test)),
      "param_dtypes": sorted({str(p.dtype) for p in jax.tree_util.tree_leaves(params)}),
  }
  print(
      f"NNX MLP on digits, policy {policy} (LayerNorm in float32): "
      f"{summary['steps']} steps ({summary['skipped_steps']} skipped), "
      f"final loss {summary['final_loss']:.4f}, test accuracy "
      f"{summary['test_accuracy']:.3f}, loss scale {summary['loss_scale']:g}, "
      f"params {', '.join(summary['param_dtypes'])}"
  )
  return summary


if __name__ == "__main__":
  main()
