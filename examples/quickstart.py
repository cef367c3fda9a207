"""Quick start: a classifier trained in float16 with dynamic loss scaling.

A two-layer MLP on scikit-learn's digits (8x8 images, shipped with the
package), float32 master parameters, float16 compute, and
``jaxmp.loss_scaling`` around adamw. The scale starts high on purpose
(``--init-scale``, default 2**24) so that the first float16 backward passes
really overflow: those steps are skipped, the scale backs off, and training
goes on. Prints loss, loss scale and skipped steps as it goes.

    python examples/quickstart.py --steps 300
    python examples/quickstart.py --policy mixed_bfloat16  # no loss scaling
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp


def load_digits(seed: int = 0):
  from sklearn.datasets import load_digits as sklearn_digits  # pylint: disable=g-import-not-at-top

  x, y = sklearn_digits(return_X_y=True)
  x = (x / 16.0).astype(np.float32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order].astype(np.int32)
  n_train = int(0.8 * len(x))
  return (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def init_params(key, sizes=(64, 128, 10)):
  keys = jax.random.split(key, len(sizes) - 1)
  return [
      {"w": jax.random.normal(k, (a, b)) * np.sqrt(2.0 / a), "b": jnp.zeros(b)}
      for k, a, b in zip(keys, sizes[:-1], sizes[1:])
  ]


def forward(params, x):
  for i, layer in enumerate(params):
    x = x @ layer["w"] + layer["b"]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def make_optimizer(policy: jaxmp.Policy, init_scale: float = 2.0**24):
  """adamw wrapped with loss scaling: dynamic under float16, none otherwise."""
  if policy.needs_loss_scaling:
    loss_scale = jaxmp.DynamicLossScale(init_scale, period=100)
  else:
    loss_scale = jaxmp.NoOpLossScale()
  return jaxmp.loss_scaling(optax.adamw(3e-3), loss_scale)


def make_train_step(policy: jaxmp.Policy, tx):
  """The jitted step: forward and backward in the compute dtype."""

  def loss_fn(params, x, y):
    logits = forward(policy.cast_to_compute(params), policy.cast_to_compute(x))
    logits = policy.cast_to_output(logits)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @jax.jit
  def train_step(params, opt_state, x, y):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, jaxmp.loss_scaling_metrics(opt_state)

  return train_step


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--policy", default="mixed_float16")
  parser.add_argument("--init-scale", type=float, default=2.0**24)
  parser.add_argument("--log-every", type=int, default=50)
  args = parser.parse_args(argv)
  if args.steps < 1 or args.batch_size < 1:
    parser.error("--steps and --batch-size must be positive")
  try:
    policy = jaxmp.get_policy(args.policy)
  except ValueError as e:
    parser.error(str(e))

  (x_train, y_train), (x_test, y_test) = load_digits()
  params = init_params(jax.random.key(0))
  tx = make_optimizer(policy, args.init_scale)
  opt_state = tx.init(params)
  loss_scale = jaxmp.get_loss_scale(opt_state)
  train_step = make_train_step(policy, tx)

  @jax.jit
  def accuracy(params, x, y):
    logits = forward(policy.cast_to_compute(params), policy.cast_to_compute(x))
    return jnp.mean(jnp.argmax(logits, -1) == y)

  print(f"policy {policy}, loss scale {type(loss_scale).__name__}, "
        f"{len(x_train)} training images")
  print(f"{'step':>6} {'loss':>8} {'scale':>10} {'skipped':>8}")
  rng = np.random.default_rng(0)
  for step in range(1, args.steps + 1):
    idx = rng.integers(0, len(x_train), args.batch_size)
    params, opt_state, loss, metrics = train_step(
        params, opt_state, x_train[idx], y_train[idx])
    if step % args.log_every == 0 or step == 1 or step == args.steps:
      metrics = jax.device_get(metrics)  # a host read only when logging
      print(f"{step:>6} {float(loss):>8.4f} {float(metrics['loss_scale']):>10.0f} "
            f"{int(metrics['skipped_steps']):>8}")
  jaxmp.check_loss_scale(opt_state)
  acc = float(accuracy(params, x_test, y_test))
  print(f"test accuracy {acc:.3f}; params stay "
        f"{jax.tree_util.tree_leaves(params)[0].dtype}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
