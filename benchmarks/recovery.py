"""What does recovering the batch inside the step cost? ``jaxmp.retry_skipped``.

The jitted train step of the byte-level transformer of ``examples/train_lm.py``
(``optax.adamw``, float32 master parameters, float16 compute, a donated
state), written three ways:

1. ``plain``: ``jaxmp.scaled_value_and_grad`` and ``jaxmp.loss_scaling``;
2. ``retry_skipped``: ``jaxmp.retry_skipped(plain, max_retries=4)``, the
   whole step in a do-while loop;
3. ``retry_skipped+fallback``: with ``fallback=`` the same step on the
   float32 loss as well.

For each it reports the compiler's figures for a *finite* step (which are
deterministic: ``cost_analysis()`` bytes accessed, ``memory_analysis()``
temp bytes, the peak live bytes of XLA's dumps, by distinct buffer: see
:func:`peak_live_bytes`), the CPU seconds of one compilation, and the median
step time over interleaved rounds. It checks that a finite step of each
recovering variant gives the same bytes as ``plain`` (params, optimizer
state, loss). Then the cost of a *recovered* step: the step time when the
first attempt overflows and ``k`` retries run (the scale starts ``2**k``
times too high), as a ratio to a finite step.

Usage::

  python benchmarks/recovery.py                # writes benchmarks/results/recovery.{md,json}
  python benchmarks/recovery.py --d-model 32 --layers 1 --seq-len 16 \\
      --batch-size 2 --rounds 2 --steps-per-round 2 --out /tmp/bench   # tiny
"""

from __future__ import annotations

import dataclasses
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

# overhead puts this checkout first on the path, so jaxmp is this checkout's.
import overhead  # pylint: disable=wrong-import-position  # benchmarks/overhead.py
import jaxmp  # pylint: disable=wrong-import-position
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


def make_steps(loss16, loss32) -> tuple[dict[str, Any], Any]:
  """The train steps, each ``(params, opt_state), batch -> (state, loss)``."""
  tx = jaxmp.loss_scaling(optax.adamw(1e-3), jaxmp.DynamicLossScale(INITIAL_SCALE))

  def step_of(loss_fn):
    def step(state, batch):
      params, opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          loss_fn, jaxmp.get_loss_scale(opt_state))(params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)
      return (optax.apply_updates(params, updates), opt_state), loss
    return step

  plain = step_of(loss16)

  def retrying(fallback=None):
    recovering = jaxmp.retry_skipped(
        plain, max_retries=MAX_RETRIES, fallback=fallback)
    return lambda state, batch: recovering(state, batch)[:2]

  return {
      "plain": plain,
      "retry_skipped": retrying(),
      "retry_skipped+fallback": retrying(fallback=step_of(loss32)),
  }, tx


def with_scale(state, scale: float):
  """``state`` with its loss scale set to ``scale`` (the rest shared)."""
  params, opt_state = state
  loss_scale = dataclasses.replace(
      jaxmp.get_loss_scale(opt_state), loss_scale=jnp.float32(scale))
  return params, opt_state._replace(loss_scale=loss_scale)


def distinct_peak(live_ranges: str, buffer_assignment: str) -> int:
  """The peak of the bytes live at once, each buffer counted once.

  ``live_ranges`` is XLA's ``*-live-range.txt`` dump (``name{index}:start-end``
  per value, both ends included: an instruction's operands and results are
  live together), ``buffer_assignment`` its ``*-buffer-assignment.txt``
  (which allocation and offset hold each value). Values that share a buffer
  (a while loop's carried state and the arguments it was passed, an output
  written in place over a donated argument) are counted once.
  """
  where = {}
  allocation = None
  for line in buffer_assignment.splitlines():
    found = re.match(r"allocation (\d+):", line)
    if found:
      allocation = int(found.group(1))
      continue
    found = re.match(r"\s*value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> "
                     r"\(size=(\d+),offset=(\d+)\)", line)
    if found and allocation is not None:
      name = found.group(1) + (found.group(2) or "{}")
      where[name] = (allocation, int(found.group(4)), int(found.group(3)))
  ranges = live_ranges.partition("BufferLiveRange:")[2].partition("Live ranges at")[0]
  spans: dict[tuple[int, int], list[list[int]]] = {}
  for line in ranges.splitlines():
    found = re.match(r"\s*(\S+):(\d+)-(\d+)\s*$", line)
    if not found:
      continue
    if found.group(1) not in where:
      raise RuntimeError(
          f"benchmarks/recovery.py: the live-range dump names {found.group(1)}, "
          "which the buffer assignment does not; update distinct_peak() to "
          "this XLA version's dump format.")
    allocation, offset, size = where[found.group(1)]
    spans.setdefault((allocation, offset), []).append(
        [int(found.group(2)), int(found.group(3)), size])
  events = []
  for intervals in spans.values():  # one buffer: merge its overlapping values
    intervals.sort()
    current = intervals[0]
    for start, end, size in intervals[1:]:
      if start <= current[1]:
        current[1], current[2] = max(current[1], end), max(current[2], size)
      else:
        events += [(current[0], current[2]), (current[1] + 1, -current[2])]
        current = [start, end, size]
    events += [(current[0], current[2]), (current[1] + 1, -current[2])]
  live = peak = 0
  for _, change in sorted(events, key=lambda event: (event[0], event[1])):
    live += change
    peak = max(peak, live)
  return peak


def dumped_compile(step, state, batch):
  """``step`` compiled with XLA's dump, and its peak live bytes by distinct
  buffer (:func:`distinct_peak`).

  ``overhead.dump_figures`` sums the values XLA lists at its peak moment; in
  a step with a ``while`` loop, XLA lists the loop's carried state and the
  arguments it was passed as separate values at the moment one hands over to
  the other, though they are one buffer, so that sum counts the whole state
  twice. None where XLA dumps no live ranges (not on the CPU).
  """
  with overhead.dumped_compilation(step, state, batch) as (compiled, dump):
    return compiled, _peak_from_dump(dump)


def _peak_from_dump(dump: pathlib.Path) -> int | None:
  """:func:`distinct_peak` of the files XLA dumped into ``dump``."""
  live_ranges = sorted(dump.glob("*after_optimizations-live-range.txt"))
  assignments = sorted(dump.glob("*after_optimizations-buffer-assignment.txt"))
  if len(live_ranges) != 1 or len(assignments) != 1:
    if jax.default_backend() != "cpu":
      return None
    raise RuntimeError(
        "benchmarks/recovery.py expected one live-range and one "
        f"buffer-assignment file, found {len(live_ranges)} and "
        f"{len(assignments)}; update dumped_compile() to this XLA version.")
  return distinct_peak(live_ranges[0].read_text(), assignments[0].read_text())


def compile_figures(steps, state, batch, dumps: bool = True, timed: bool = True
                    ) -> dict[str, dict[str, Any]]:
  """Compiler figures and compile CPU seconds of each step, on ``state``.

  The time is that of a compilation without the dump (which writes files);
  with ``timed=False`` (the tests, which assert no time) the one dumped
  compilation gives every figure, and ``compile_seconds`` is None.
  """
  figures = {}
  for name, step in steps.items():
    cpu_seconds = peak = None
    if timed or not dumps:
      compiled, _, cpu_seconds = overhead.compile_step(step, state, batch)
    if dumps:
      dumped, peak = dumped_compile(step, state, batch)
      compiled = compiled if timed else dumped
    figures[name] = overhead.compiler_figures(compiled)
    if dumps:
      figures[name]["peak_live_bytes"] = peak
    figures[name]["compile_seconds"] = cpu_seconds
    figures[name]["compiled"] = compiled
  return figures


def check_finite_steps_match(figures, state, batch) -> dict[str, bool]:
  """Whether a finite step of each recovering variant gives ``plain``'s bytes.

  Runs one step of each compiled variant on a copy of ``state`` (they are
  donated) and compares every leaf of the params, the optimizer state and the
  loss, byte for byte.
  """
  def leaves(name):
    out = figures[name]["compiled"](overhead.copy_tree(state), batch)
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(out)]

  reference = leaves("plain")
  return {name: leaves(name) == reference for name in figures if name != "plain"}


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
  matches = check_finite_steps_match(figures, state, batch)

  # Finite steps, donated state: each call gets a fresh copy.
  def finite_run(name):
    compiled = figures[name]["compiled"]
    return lambda: compiled(overhead.copy_tree(state), batch)

  # A recovered step: the scale is 2**MAX_RETRIES times too high, so the
  # first attempt and the retries before the last overflow.
  too_high = None
  probe = jax.jit(lambda s, b: jaxmp.retry_skipped(
      steps["plain"], max_retries=MAX_RETRIES)(s, b)[2])
  for exponent in range(11, 40):
    candidate = with_scale(state, 2.0**exponent)
    info = probe(candidate, batch)
    if int(info.retries) == MAX_RETRIES and bool(info.finite):
      too_high = candidate
      break
  runs = {name: finite_run(name) for name in steps}
  if too_high is not None:  # copies too, as the finite runs do
    for name in ("retry_skipped",):
      compiled = figures[name]["compiled"]
      runs[f"{name}, {MAX_RETRIES} retries"] = (
          lambda compiled=compiled: compiled(overhead.copy_tree(too_high), batch))
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
      "finite_step_matches_plain": matches,
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
  same = [name for name, match in results["finite_step_matches_plain"].items() if match]
  differ = [name for name, match in results["finite_step_matches_plain"].items()
            if not match]
  lines += [
      "",
      "Ratios are to `plain`; step times are medians of interleaved rounds "
      "(each step includes a copy of the state, as the donated steps need). "
      "Peak live: the most bytes live at once, arguments included, each buffer "
      "counted once (a while loop's carried state shares the buffers of the "
      "arguments it was passed).",
      "",
      "A finite step gives the bytes of `plain` (params, optimizer state, loss): "
      + (", ".join(f"`{name}`" for name in same) or "none")
      + (f"; it does NOT for {', '.join(f'`{name}`' for name in differ)}" if differ else "")
      + ".",
  ]
  return "\n".join(lines) + "\n"


def build_parser():
  parser = overhead.model_parser(__doc__, rounds=5)
  parser.add_argument("--no-dump", action="store_true",
                      help="skip XLA's live-range dump (no peak live bytes)")
  overhead.add_out_argument(parser, "recovery")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  results = measure(args)
  overhead.write_results(args.out, "recovery", results, markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
