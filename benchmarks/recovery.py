"""What does recovering the batch inside the step cost? ``jaxmp.Recover``.

The jitted train step of the byte-level transformer of ``examples/train_lm.py``
(``optax.adamw``, float32 master parameters, float16 compute, a donated
state), written three ways:

1. ``plain``: ``jaxmp.scaled_value_and_grad`` and ``jaxmp.loss_scaling``;
2. ``recover``: the same with ``recover=jaxmp.Recover(max_retries=4)``;
3. ``recover+fallback``: with ``fallback=`` the float32 loss as well.

For each it reports the compiler's figures for a *finite* step (which are
deterministic: ``cost_analysis()`` bytes accessed, ``memory_analysis()``
temp bytes, the peak live bytes of XLA's live-range dump), the CPU seconds of
one compilation, and the median step time over interleaved rounds. Then the
cost of a *recovered* step: the step time when the first attempt overflows
and ``k`` retries run (the scale starts ``2**k`` times too high), as a ratio
to a finite step.

Usage::

  python benchmarks/recovery.py                # writes benchmarks/results/recovery.{md,json}
  python benchmarks/recovery.py --d-model 32 --layers 1 --seq-len 16 \\
      --batch-size 2 --rounds 2 --steps-per-round 2 --out /tmp/bench   # tiny
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxmp

import overhead  # pylint: disable=wrong-import-position  # benchmarks/overhead.py
from overhead import train_lm  # the model of examples/train_lm.py

INITIAL_SCALE = 2.0**10  # finite for this model in float16
MAX_RETRIES = 4


def loss_fns(args) -> tuple[Any, Any, Any]:
  """The model's float16 and float32 losses, and its float32 params."""
  model = train_lm.make_model(args.d_model, args.layers, args.heads, args.seq_len)
  sample = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), sample)["params"]
  return (train_lm.make_loss_fn(model, jaxmp.get_policy("mixed_float16")),
          train_lm.make_loss_fn(model, jaxmp.get_policy("float32")), params)


def make_steps(loss16, loss32) -> dict[str, Any]:
  """The three train steps: ``(params, opt_state), batch -> (state, loss)``."""
  tx = jaxmp.loss_scaling(optax.adamw(1e-3), jaxmp.DynamicLossScale(INITIAL_SCALE))

  def plain(state, batch):
    params, opt_state = state
    loss, grads = jaxmp.scaled_value_and_grad(
        loss16, jaxmp.get_loss_scale(opt_state))(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def recovering(recover):
    def step(state, batch):
      params, opt_state = state
      loss, grads, recovery = jaxmp.scaled_value_and_grad(
          loss16, jaxmp.get_loss_scale(opt_state), recover=recover)(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params, recovery=recovery)
      return (optax.apply_updates(params, updates), opt_state), loss
    return step

  return {
      "plain": plain,
      "recover": recovering(jaxmp.Recover(max_retries=MAX_RETRIES)),
      "recover+fallback": recovering(
          jaxmp.Recover(max_retries=MAX_RETRIES, fallback=loss32)),
  }, tx


def with_scale(state, scale: float):
  """``state`` with its loss scale set to ``scale`` (the rest shared)."""
  params, opt_state = state
  loss_scale = dataclasses.replace(
      jaxmp.get_loss_scale(opt_state), loss_scale=jnp.float32(scale))
  return params, opt_state._replace(loss_scale=loss_scale)


def compile_figures(steps, state, batch, dumps: bool = True) -> dict[str, dict[str, Any]]:
  """Compiler figures and compile CPU seconds of each step, on ``state``."""
  figures = {}
  for name, step in steps.items():
    compiled, _, cpu_seconds = overhead.compile_step(step, state, batch)
    figures[name] = overhead.compiler_figures(compiled)
    if dumps:
      figures[name].update(overhead.dump_figures(step, state, batch))
    figures[name]["compile_seconds"] = cpu_seconds
    figures[name]["compiled"] = compiled
  return figures


def time_rounds(runs: dict[str, Any], args) -> dict[str, list[float]]:
  """Seconds per step of each ``run() -> outputs``, in interleaved rounds."""
  names = list(runs)
  for name in names:
    for _ in range(args.warmup_steps):
      jax.block_until_ready(runs[name]())
  seconds = {name: [] for name in names}
  for round_index in range(args.rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      started = time.perf_counter()
      for _ in range(args.steps_per_round):
        out = runs[name]()
      jax.block_until_ready(out)
      seconds[name].append((time.perf_counter() - started) / args.steps_per_round)
  return seconds


def measure(args) -> dict[str, Any]:
  loss16, loss32, params = loss_fns(args)
  steps, tx = make_steps(loss16, loss32)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.integers(0, 256, (args.batch_size, args.seq_len + 1)),
                      jnp.int32)
  state = (params, tx.init(params))
  figures = compile_figures(steps, state, batch, dumps=not args.no_dump)

  # Finite steps, donated state: each call gets a fresh copy.
  def finite_run(name):
    compiled = figures[name]["compiled"]
    return lambda: compiled(overhead.copy_tree(state), batch)

  # A recovered step: the scale is 2**MAX_RETRIES times too high, so the
  # first attempt and the retries before the last overflow (not donated).
  too_high = None
  probe = jax.jit(lambda s, b: jaxmp.scaled_value_and_grad(
      loss16, jaxmp.get_loss_scale(s[1]), recover=jaxmp.Recover(MAX_RETRIES))(
          s[0], b)[2])
  for exponent in range(11, 40):
    candidate = with_scale(state, 2.0**exponent)
    info = probe(candidate, batch)
    if int(info.retries) == MAX_RETRIES and bool(info.finite):
      too_high = candidate
      break
  recovered = jax.jit(steps["recover"])
  runs = {name: finite_run(name) for name in steps}
  if too_high is not None:  # copies too, as the finite runs do
    runs["recover, 4 retries"] = lambda: recovered(overhead.copy_tree(too_high), batch)
  seconds = time_rounds(runs, args)

  base = figures["plain"]
  results = {}
  for name, times in seconds.items():
    f = dict(figures.get(name, {}))
    f.pop("compiled", None)
    f["step_seconds_median"] = statistics.median(times)
    f["step_seconds_all"] = times
    results[name] = f
  plain_time = results["plain"]["step_seconds_median"]
  for name, f in results.items():
    f["time_ratio"] = f["step_seconds_median"] / plain_time
    if name in figures:
      for key in ("bytes_accessed", "temp_bytes", "peak_live_bytes", "compile_seconds"):
        if f.get(key) is not None and base.get(key):
          f[f"{key}_ratio"] = f[key] / base[key]
  return {
      "config": {k: v for k, v in vars(args).items() if k != "out"},
      "parameters": int(sum(x.size for x in jax.tree_util.tree_leaves(params))),
      "machine": overhead.machine_description(),
      "recovered_scale_found": too_high is not None,
      "variants": results,
  }


def markdown(results: dict[str, Any]) -> str:
  def pct(ratio):
    return "n/a" if ratio is None else f"{(ratio - 1) * 100:+.2f}%"

  lines = [
      f"Recovery on the train_lm transformer ({results['parameters']:,} parameters, "
      f"float16 compute), {results['machine'].get('platform', '')}.",
      "",
      "| step | bytes accessed | temp | peak live | compile (CPU s) | step time |",
      "|---|---|---|---|---|---|",
  ]
  for name, f in results["variants"].items():
    if "bytes_accessed" in f:
      lines.append(
          f"| {name} | {pct(f.get('bytes_accessed_ratio', 1.0))} | "
          f"{pct(f.get('temp_bytes_ratio', 1.0))} | "
          f"{pct(f.get('peak_live_bytes_ratio'))} | "
          f"{f['compile_seconds']:.2f} | {f['time_ratio']:.2f}x |")
    else:
      lines.append(f"| {name} | | | | | {f['time_ratio']:.2f}x |")
  lines.append("")
  lines.append("Ratios are to `plain`; step times are medians of interleaved rounds "
               "(each step includes a copy of the state, as the donated steps need).")
  return "\n".join(lines) + "\n"


def build_parser():
  parser = overhead.model_parser(__doc__, rounds=5)
  parser.add_argument("--no-dump", action="store_true",
                      help="skip XLA's live-range dump (no peak live bytes)")
  parser.add_argument("--out", default=str(overhead.ROOT / "benchmarks" / "results"),
                      help="directory for recovery.md and recovery.json")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  results = measure(args)
  overhead.write_results(args.out, "recovery", results, markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
