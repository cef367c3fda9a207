"""What does jaxmp.autocast cost against casting the params by hand?

The same bfloat16 train step of the benchmark transformer (the model of
``examples/train_lm.py``, as in ``overhead.py``), with ``optax.adamw``, float32
master parameters and a donated state, written five ways:

1. ``policy.cast_to_compute``: the loss casts the params with the
   ``mixed_bfloat16`` policy before ``apply``, as ``overhead.py`` and the demo
   do (the reference). Flax's ``force_fp32_for_softmax=True`` hands float32
   attention weights to the next einsum, so most of its matmuls silently run
   in float32 (the "bf16 matmuls" column);
2. ``policy.cast_to_compute, bf16 layers``: the same cast, on the model whose
   layers declare ``dtype=jnp.bfloat16``: what the reference means to run, its
   matmuls in bfloat16 but for the einsum of the float32 attention weights
   with the values (the target for autocast);
3. ``jaxmp.autocast``: the float32 loss, wrapped by
   ``jaxmp.autocast(loss_fn, "mixed_bfloat16")``;
4. ``dtype=bfloat16 modules``: the layers declare ``dtype=jnp.bfloat16`` and
   receive the float32 params as they are (each layer casts its own);
5. ``float32``: no mixed precision, for scale.

For each it reports, relative to the reference, the compiler's figures (bytes
accessed, temp memory, peak live memory, kernels), which are deterministic,
how many matmuls of the step take bfloat16 inputs and how many params are cast
more than once (read off the jaxpr and the lowered program), the compile time
(median CPU time of fresh traces, lowerings and compilations: autocast's extra
trace is part of it) and the step time (median of the per-round ratios over
interleaved rounds).

Usage::

  python benchmarks/autocast.py                  # writes benchmarks/results/autocast.{md,json}
  python benchmarks/autocast.py --d-model 32 --layers 1 --seq-len 16 \\
      --batch-size 2 --rounds 2 --steps-per-round 2 --out /tmp/bench   # tiny
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jax_core

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The jaxmp of this checkout, not whichever one is installed.
sys.path.insert(0, str(ROOT))
import jaxmp  # pylint: disable=wrong-import-position

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))
import overhead  # pylint: disable=wrong-import-position
import train_lm  # pylint: disable=wrong-import-position

REFERENCE = "policy.cast_to_compute"
TARGET = "policy.cast_to_compute, bf16 layers"
AUTOCAST = "jaxmp.autocast"
VARIANTS = (REFERENCE, TARGET, AUTOCAST, "dtype=bfloat16 modules", "float32")
# autocast's goal: bytes accessed within +2% of the bfloat16 hand cast.
BYTES_TARGET = 1.02


def make_variants(args: argparse.Namespace, names=VARIANTS):
  """The steps named ``names``, their initial states (one params tree), a batch."""
  mixed = jaxmp.get_policy("mixed_bfloat16")
  float32 = jaxmp.get_policy("float32")
  model = train_lm.make_model(args.d_model, args.layers, args.heads, args.seq_len)
  declared = train_lm.make_model(
      args.d_model, args.layers, args.heads, args.seq_len, dtype=jnp.bfloat16)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(
      rng.integers(0, 256, (args.batch_size, args.seq_len + 1)), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), batch[:, :-1])["params"]
  tx = optax.adamw(1e-3)
  losses = {
      REFERENCE: lambda: train_lm.make_loss_fn(model, mixed),
      TARGET: lambda: train_lm.make_loss_fn(declared, mixed),
      AUTOCAST: lambda: jaxmp.autocast(train_lm.make_loss_fn(model, float32), mixed),
      "dtype=bfloat16 modules": lambda: train_lm.make_loss_fn(declared, float32),
      "float32": lambda: train_lm.make_loss_fn(model, float32),
  }
  steps = {name: overhead.optax_step(losses[name](), tx) for name in names}
  states = {name: (overhead.copy_tree(params), tx.init(params)) for name in names}
  return steps, states, batch, params


def _dot_dtypes(jaxpr) -> list[tuple[str, ...]]:
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
    for inner in jax_core.jaxprs_in_params(eqn.params):
      found.extend(_dot_dtypes(inner))
  return found


def program_figures(step, state, batch) -> dict[str, int]:
  """Matmuls with bfloat16 inputs, and params cast more than once.

  Both are read before XLA optimizes: the matmuls off the step's jaxpr (the
  backward pass included), the casts off the lowered program, as
  ``stablehlo.convert`` instructions of the same argument.
  """
  dots = _dot_dtypes(jax.make_jaxpr(step)(state, batch).jaxpr)
  text = overhead.jit_step(step).lower(state, batch).as_text()
  converted = re.findall(r"stablehlo\.convert (%arg\d+)", text)
  return {
      "matmuls": len(dots),
      "bf16_matmuls": sum(d == ("bfloat16", "bfloat16") for d in dots),
      "repeated_param_casts": len(converted) - len(set(converted)),
  }


def compiler_figures(args: argparse.Namespace, names=VARIANTS, *, dumps=True):
  """The deterministic figures of the variants ``names``.

  Bytes accessed, temp memory and the program figures; with ``dumps``, also
  the peak live memory and the kernels (one more compilation each).
  """
  steps, states, batch, _ = make_variants(args, names)
  figures = {}
  for name in names:
    compiled, _, _ = overhead.compile_step(steps[name], states[name], batch)
    figures[name] = overhead.compiler_figures(compiled)
    figures[name].update(program_figures(steps[name], states[name], batch))
    if dumps:
      figures[name].update(overhead.dump_figures(steps[name], states[name], batch))
  return figures


def measure(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles and times every variant; returns the figures."""
  steps, states, batch, params = make_variants(args)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  cpu = {name: [] for name in VARIANTS}
  compiled_steps, figures = {}, {}
  for _ in range(args.compile_repeats):
    for name in VARIANTS:
      compiled, _, cpu_seconds = overhead.compile_step(
          steps[name], states[name], batch)
      cpu[name].append(cpu_seconds)
      compiled_steps[name] = compiled
  for name in VARIANTS:
    figures[name] = overhead.compiler_figures(compiled_steps[name])
    figures[name].update(program_figures(steps[name], states[name], batch))
    figures[name].update(overhead.dump_figures(steps[name], states[name], batch))
    figures[name]["compile_seconds"] = statistics.median(cpu[name])
    figures[name]["compile_cpu_seconds_all"] = cpu[name]
    print(f"compiled {name}: {figures[name]['compile_seconds']:.2f} CPU s",
          file=sys.stderr)

  for name, compiled in compiled_steps.items():
    for _ in range(args.warmup_steps):
      states[name], loss = compiled(states[name], batch)
    jax.block_until_ready(loss)
  step_seconds = {name: [] for name in VARIANTS}
  for round_index in range(args.rounds):
    shift = round_index % len(VARIANTS)
    for name in VARIANTS[shift:] + VARIANTS[:shift]:
      state = states[name]
      jax.block_until_ready(state)
      started = time.perf_counter()
      for _ in range(args.steps_per_round):
        state, loss = compiled_steps[name](state, batch)
      jax.block_until_ready((state, loss))
      step_seconds[name].append(
          (time.perf_counter() - started) / args.steps_per_round)
      states[name] = state
    print(f"round {round_index + 1}/{args.rounds}", file=sys.stderr)

  base = figures[REFERENCE]
  for name in VARIANTS:
    f = figures[name]
    f["step_seconds_median"] = statistics.median(step_seconds[name])
    f["step_seconds_all"] = step_seconds[name]
    f["time_ratio"] = statistics.median(
        [t / b for t, b in zip(step_seconds[name], step_seconds[REFERENCE])])
    f["temp_ratio"] = f["temp_bytes"] / base["temp_bytes"]
    f["peak_live_ratio"] = (
        None if base["peak_live_bytes"] is None
        else f["peak_live_bytes"] / base["peak_live_bytes"])
    f["bytes_accessed_ratio"] = f["bytes_accessed"] / base["bytes_accessed"]
    f["compile_ratio"] = f["compile_seconds"] / base["compile_seconds"]
  return {
      "config": {k: v for k, v in vars(args).items() if k != "out"},
      "parameters": int(n_params),
      "machine": overhead.machine_description(),
      "variants": figures,
  }


def markdown(results: dict[str, Any]) -> str:
  """The results as a Markdown table, with the set-up it ran on."""
  config, machine = results["config"], results["machine"]
  variants = results["variants"]
  base = variants[REFERENCE]
  lines = [
      "| variant | bf16 matmuls | bytes accessed | temp memory | peak live memory "
      "| compile time | step time | kernels | repeated param casts |",
      "|---|---|---|---|---|---|---|---|---|",
  ]
  for name, f in variants.items():
    peak = ("n/a" if f["peak_live_ratio"] is None
            else overhead.percent(f["peak_live_ratio"]))
    kernels = "n/a" if f["kernels"] is None else str(f["kernels"])
    lines.append(
        f"| {name} | {f['bf16_matmuls']} of {f['matmuls']} | "
        f"{overhead.percent(f['bytes_accessed_ratio'])} | "
        f"{overhead.percent(f['temp_ratio'])} | {peak} | "
        f"{f['compile_ratio']:.2f}× | {f['time_ratio']:.3f}× | {kernels} | "
        f"{f['repeated_param_casts']} |")
  ours, target = variants[AUTOCAST], variants[TARGET]
  lines += [
      "",
      f"Relative to `{REFERENCE}`: {base['bytes_accessed'] / 2**20:.1f} MiB "
      f"accessed, {base['temp_bytes'] / 2**20:.2f} MiB temp memory, "
      + ("" if base["peak_live_bytes"] is None else
         f"{base['peak_live_bytes'] / 2**20:.2f} MiB live at the peak, ")
      + f"{base['compile_seconds']:.2f} CPU seconds to trace and compile, "
      f"{base['step_seconds_median'] * 1e3:.1f} ms per step. Against "
      f"`{TARGET}` (the bfloat16 hand cast), autocast accesses "
      f"{overhead.percent(ours['bytes_accessed'] / target['bytes_accessed'])} "
      f"bytes (goal: at most {overhead.percent(BYTES_TARGET, 0)}) and compiles in "
      f"{ours['compile_seconds'] / target['compile_seconds']:.2f}× the time "
      "(goal: at most 1.2×).",
      "",
      f"Model: {results['parameters']:,}-parameter byte-level transformer "
      f"(d_model {config['d_model']}, {config['layers']} layers, "
      f"{config['heads']} heads), batch {config['batch_size']}×"
      f"{config['seq_len']}, adamw, float32 params, bfloat16 compute, donated "
      f"state. Compile time: median CPU time of {config['compile_repeats']} "
      "fresh traces and compilations; step time: median of the per-round "
      f"ratios over {config['rounds']} interleaved rounds of "
      f"{config['steps_per_round']} steps.",
      "",
      f"Machine: {machine['platform']} ({machine['device_kind']}, "
      f"{machine['cpu_count']} cores), JAX {machine['jax']}, flax "
      f"{machine['flax']}. " + (
          "CPU only: no GPU was available; the compiler figures are exact, "
          "compile and step times were taken on a shared, loaded machine. On "
          "the CPU, XLA converts bfloat16 matmul inputs to float32, so "
          "bfloat16 saves no time and costs some memory traffic."
          if machine["platform"] == "cpu" else
          f"Accelerator: {machine['device_kind']}; the compiler figures are "
          "exact, step times vary by a few percent between runs."),
  ]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  parser = overhead.model_parser(__doc__, rounds=10)
  parser.add_argument("--compile-repeats", type=int, default=3)
  overhead.add_out_argument(parser, "autocast")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  results = measure(args)
  overhead.write_results(args.out, "autocast", results, markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
