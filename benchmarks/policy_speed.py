"""Step time of float32, bfloat16, float16 and FP8 compute for the same model.

Runs the guarded train step of ``examples/train_lm.py`` (a ~4M-parameter
byte-level transformer, adamw, float32 master parameters, donated state)
under the ``float32``, ``mixed_bfloat16``, ``mixed_float16`` and
``mixed_fp8`` policies, in interleaved rounds in one process, and reports
each median step time as a ratio to float32, with the compiler's figures.
The FP8 step is the demo's ``jaxmp.flax.TrainState`` step (the FP8 meta
carried and guarded); the JSON also holds its ratio to bfloat16.

Half precision pays off on accelerators with fast half-precision units (GPU
tensor cores, TPU MXUs), FP8 on NVIDIA GPUs of compute capability 8.9 and
above. On a CPU, XLA converts bfloat16 and float16 matrix products to float32
and rounds the results, and emulates FP8, so expect no speed-up there: the
FP8 row's time says nothing about FP8 on a GPU.

Usage::

  python benchmarks/policy_speed.py      # writes benchmarks/results/policy_speed.{md,json}
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The jaxmp of this checkout, not whichever one is installed.
sys.path.insert(0, str(ROOT))
import jaxmp  # pylint: disable=wrong-import-position

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import overhead  # pylint: disable=wrong-import-position
import train_lm  # pylint: disable=wrong-import-position

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16", train_lm.FP8_POLICY)


def train_config(batch_size: int, seq_len: int, d_model: int, layers: int,
                 heads: int) -> train_lm.Config:
  """The demo's configuration for a benchmark of the train step."""
  return train_lm.Config(
      steps=10**6, batch_size=batch_size, seq_len=seq_len, d_model=d_model,
      layers=layers, heads=heads, lr=1e-3, init_scale=2.0**15,
      scale_period=2000, seed=0, eval_every=1, eval_batches=1)


def policy_steps(config: train_lm.Config, model, batch, init_params,
                 names=POLICIES):
  """name -> ``(jitted step, state, policy string)`` for each of ``names``.

  The step is the demo's guarded ``step(*state, batch) -> (*state,
  metrics)``; the FP8 one is its ``jaxmp.flax.TrainState`` step.
  """
  steps = {}
  for name in names:
    policy = jaxmp.get_policy(name)
    if ",dot=fp8" in str(policy):  # FP8 matmuls: the demo's TrainState step
      state = (train_lm.make_fp8_state(config, model, policy, batch[:, :-1]),)
      step = train_lm.make_fp8_train_step()
    else:
      tx = train_lm.make_optimizer(config, policy)
      params = jax.tree_util.tree_map(lambda x: x.copy(), init_params)
      state = (params, tx.init(params))
      step = train_lm.make_train_step(train_lm.make_loss_fn(model, policy), tx)
    steps[name] = (step, state, str(policy))
  return steps


def as_pair(compiled):
  """A compiled ``step(*state, batch) -> (*state, metrics)`` as
  ``step(state, batch) -> (state, metrics)``, ``state`` a tuple."""

  def step(state, batch):
    *state, metrics = compiled(*state, batch)
    return tuple(state), metrics

  return step


def measure(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles and times the step under each policy; returns the figures."""
  config = train_config(args.batch_size, args.seq_len, args.d_model,
                        args.layers, args.heads)
  model = train_lm.make_model(args.d_model, args.layers, args.heads, args.seq_len)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(
      rng.integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32)
  init_params = model.init(jax.random.PRNGKey(0), batch[:, :-1])["params"]
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(init_params))

  figures, compiled_steps, states = {}, {}, {}
  for name, (step, state, policy) in policy_steps(
      config, model, batch, init_params).items():
    started = time.perf_counter()
    compiled = step.lower(*state, batch).compile(
        compiler_options=overhead.DEFAULT_CODEGEN)
    figures[name] = overhead.compiler_figures(compiled)
    figures[name]["compile_seconds"] = time.perf_counter() - started
    figures[name]["policy"] = policy
    compiled_steps[name], states[name] = as_pair(compiled), state
    print(f"compiled {name}", file=sys.stderr)

  overhead.warm_up(compiled_steps, states, batch, args.warmup_steps)
  step_seconds = overhead.interleaved_rounds(
      compiled_steps, states, batch, args.rounds, args.steps_per_round)

  base = step_seconds["float32"]
  for name in POLICIES:
    f = figures[name]
    f["step_seconds_median"] = statistics.median(step_seconds[name])
    f["step_seconds_all"] = step_seconds[name]
    f["time_ratio"] = statistics.median(
        [t / b for t, b in zip(step_seconds[name], base)])
    f["tokens_per_second"] = (
        args.batch_size * args.seq_len / f["step_seconds_median"])
  bf16 = step_seconds["mixed_bfloat16"]
  figures[train_lm.FP8_POLICY]["time_ratio_vs_bfloat16"] = statistics.median(
      [t / b for t, b in zip(step_seconds[train_lm.FP8_POLICY], bf16)])
  return {
      "config": {k: v for k, v in vars(args).items() if k != "out"},
      "parameters": int(n_params),
      "machine": overhead.machine_description(),
      "policies": figures,
  }


def markdown(results: dict[str, Any]) -> str:
  config, machine = results["config"], results["machine"]
  lines = [
      "| policy | step time vs float32 | tokens/s | temp memory | bytes accessed |",
      "|---|---|---|---|---|",
  ]
  for name, f in results["policies"].items():
    lines.append(
        f"| {name} (`{f['policy']}`) | {f['time_ratio']:.2f}× | "
        f"{f['tokens_per_second']:,.0f} | {f['temp_bytes'] / 2**20:.1f} MiB | "
        f"{f['bytes_accessed'] / 2**20:.0f} MiB |"
    )
  platform = machine["platform"]
  note = (
      "CPU only: no GPU or TPU was available for this run. On the CPU, XLA "
      "computes bfloat16 and float16 matrix products in float32 and rounds "
      "the results, so half precision brings no speed-up here; expect one "
      "on GPUs with tensor cores and on TPUs."
      if platform == "cpu" else f"Accelerator: {machine['device_kind']}."
  )
  fp8 = [f for f in results["policies"].values() if ",dot=fp8" in f["policy"]]
  if fp8 and platform == "cpu":
    note += (" The CPU emulates FP8 (each float8 matmul is converted to a "
             "wider type), so the FP8 row's time says nothing about FP8 on a "
             "GPU; FP8 runs natively on NVIDIA GPUs of compute capability 8.9 "
             "and above.")
  elif fp8 and "time_ratio_vs_bfloat16" in fp8[0]:
    note += (f" FP8 step time vs bfloat16: "
             f"{fp8[0]['time_ratio_vs_bfloat16']:.2f}×.")
  lines += [
      "",
      f"Model: {results['parameters']:,}-parameter byte-level transformer "
      f"(d_model {config['d_model']}, {config['layers']} layers), batch "
      f"{config['batch_size']}×{config['seq_len']}, the guarded train step of "
      "examples/train_lm.py (adamw, float32 master params, donated state; "
      "dynamic loss scaling for float16; FP8 through jaxmp.flax.TrainState "
      "with its meta). Median of the per-round ratios over "
      f"{config['rounds']} interleaved rounds of {config['steps_per_round']} steps.",
      "",
      f"Machine: {platform} ({machine['device_kind']}, {machine['cpu_count']} "
      f"cores), JAX {machine['jax']}. {note}",
  ]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  parser = overhead.model_parser(__doc__, rounds=10)
  overhead.add_out_argument(parser, "policy_speed")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  results = measure(args)
  overhead.write_results(args.out, "policy_speed", results, markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
