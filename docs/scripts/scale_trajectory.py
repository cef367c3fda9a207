"""Draws the loss-scale trajectory figure of the "Loss scaling" page.

A float16 gradient overflows when ``loss_scale * g`` exceeds 65504, where
``g`` is the largest gradient of the unscaled loss. This script simulates
``g`` over 2,000 steps (it shrinks as training converges, with noise and a few
spikes), runs ``jaxmp.DynamicLossScale.adjust`` over it with ``jax.lax.scan``
for two configurations, and plots the scale, the float16 ceiling
``65504 / g`` and the skipped steps.

Run from the repository root:

    python docs/scripts/scale_trajectory.py [--out docs/images/scale_trajectory.png]
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

import jaxmp  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

FLOAT16_MAX = 65504.0
STEPS = 2000
DEFAULT_OUT = pathlib.Path(__file__).parent.parent / "images" / "scale_trajectory.png"


def simulated_max_gradient(steps: int, seed: int = 0) -> np.ndarray:
  """The largest |gradient| of the unscaled loss at each step (simulated).

  It shrinks slowly as training converges, with noise and three isolated
  spikes (a bad batch, say).
  """
  rng = np.random.default_rng(seed)
  t = np.arange(steps)
  log2_g = -3.0 - 1.5 * t / steps + 0.15 * rng.standard_normal(steps)
  for spike in (steps * 3 // 10, steps * 55 // 100, steps * 8 // 10):
    log2_g[spike] += 5.0
  return 2.0**log2_g


def trajectory(loss_scale: jaxmp.DynamicLossScale, max_gradient: np.ndarray):
  """Runs ``adjust`` over the steps; returns the scale used and finiteness."""

  def step(loss_scale, g):
    scale = loss_scale.loss_scale
    finite = scale * g <= FLOAT16_MAX
    return loss_scale.adjust(finite), (scale, finite)

  _, (scales, finite) = jax.lax.scan(
      step, loss_scale, jnp.asarray(max_gradient, jnp.float32)
  )
  return np.asarray(scales), np.asarray(finite)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
  args = parser.parse_args(argv)

  g = simulated_max_gradient(STEPS)
  configs = {
      "2.0**24, period=100": jaxmp.DynamicLossScale(2.0**24, period=100),
      "2.0**24, period=100, hysteresis=2, consecutive_hysteresis=True": (
          jaxmp.DynamicLossScale(
              2.0**24, period=100, hysteresis=2, consecutive_hysteresis=True
          )
      ),
  }
  fig, axes = plt.subplots(
      len(configs), 1, figsize=(9, 5.5), sharex=True, constrained_layout=True
  )
  steps = np.arange(STEPS)
  for ax, (label, loss_scale) in zip(axes, configs.items()):
    scales, finite = trajectory(loss_scale, g)
    ax.semilogy(steps, FLOAT16_MAX / g, color="0.8", lw=0.8,
                label="float16 ceiling 65504 / max|g|")
    ax.semilogy(steps, scales, color="C0", lw=1.6, label="loss scale")
    skipped = ~finite
    ax.scatter(steps[skipped], scales[skipped], color="C3", s=14, zorder=3,
               label=f"skipped step ({skipped.sum()})")
    ax.set_yscale("log", base=2)
    ax.set_ylabel("scale")
    ax.set_title(f"DynamicLossScale({label})", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
  axes[-1].set_xlabel("step")
  args.out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(args.out, dpi=110)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
