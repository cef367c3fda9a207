"""What does guarding a mixed-precision train step cost? jaxmp against its peers.

The same jitted train step of a ~4M-parameter byte-level transformer (the model
of ``examples/train_lm.py``), with ``optax.adamw``, float32 master parameters,
bfloat16 compute and a donated state, in five variants:

1. ``unguarded``: no loss scaling, no finiteness check (the baseline);
2. ``jaxmp``: ``jaxmp.loss_scaling`` with ``jaxmp.scaled_value_and_grad``;
3. ``jmp manual``: jmp's documented pattern: scale the loss, unscale the
   gradients, ``jmp.all_finite``, ``jmp.select_tree`` over the parameters and
   the optimizer state, ``adjust``;
4. ``optax.apply_if_finite``: optax's wrapper, with a jmp loss scale adjusted
   from its ``last_finite`` flag;
5. ``flax DynamicScale``: ``DynamicScale.value_and_grad`` with a ``jnp.where``
   select of the parameters and the optimizer state, the pattern of Flax's
   ImageNet example.

Before measuring, it checks once that jaxmp's two selects (the in-place one
and the plain ``optax.tree.where`` one that ``JAXMP_INPLACE_SELECT=0`` turns
on) give bit-identical parameters, optimizer state and loss over a finite, a
skipped and a finite step, and stops if they do not.

For each it reports the compiler's figures, which are deterministic
(``memory_analysis()`` temp bytes, ``cost_analysis()`` bytes accessed), the
compile time (median of several fresh compilations), and the median step time
as a ratio to the unguarded step, measured in interleaved rounds in one
process so that a noisy machine affects every variant alike.

Usage::

  python benchmarks/overhead.py                # writes benchmarks/results/overhead.{md,json}
  python benchmarks/overhead.py --d-model 32 --layers 1 --seq-len 16 \\
      --batch-size 2 --rounds 2 --steps-per-round 2 --out /tmp/bench   # tiny
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale
from jax.experimental.compilation_cache import compilation_cache

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The jaxmp of this checkout, not whichever one is installed.
sys.path.insert(0, str(ROOT))

import jaxmp  # pylint: disable=wrong-import-position

sys.path.insert(0, str(ROOT / "examples"))
import train_lm  # pylint: disable=wrong-import-position

INITIAL_SCALE = 2.0**15
PERIOD = 2000


class Variant(NamedTuple):
  """A way to write the train step: ``init(params) -> state`` and ``step``."""

  name: str
  init: Callable[[Any], Any]
  step: Callable[[Any, Any], tuple[Any, Any]]


def clipped_adamw(learning_rate: float, clip_global_norm: float | None):
  """``optax.adamw``, after ``optax.clip_by_global_norm`` when a norm is given."""
  if clip_global_norm is None:
    return optax.adamw(learning_rate)
  return optax.chain(optax.clip_by_global_norm(clip_global_norm),
                     optax.adamw(learning_rate))


def optax_step(loss_fn, tx):
  """The unguarded train step of ``tx``: ``(params, opt_state), batch`` to
  ``(params, opt_state), loss``."""

  def step(state, batch):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  return step


def make_variants(loss_fn, learning_rate: float = 1e-3,
                  clip_global_norm: float | None = None) -> list[Variant]:
  """The five train steps; each maps ``(state, batch)`` to ``(state, loss)``.

  With ``clip_global_norm``, every variant clips: the others with
  ``optax.clip_by_global_norm`` chained before adamw, jaxmp with
  ``loss_scaling(..., clip_global_norm=...)``.
  """

  def adamw():
    return clipped_adamw(learning_rate, clip_global_norm)

  # 1. No guard.
  plain = adamw()

  def unguarded_init(params):
    return params, plain.init(params)

  unguarded_step = optax_step(loss_fn, plain)

  # 2. jaxmp.
  guarded = jaxmp.loss_scaling(
      optax.adamw(learning_rate), jaxmp.DynamicLossScale(INITIAL_SCALE, period=PERIOD),
      clip_global_norm=clip_global_norm)

  def jaxmp_init(params):
    return params, guarded.init(params)

  def jaxmp_step(state, batch):
    params, opt_state = state
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
    updates, opt_state = guarded.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  # 3. jmp's manual pattern. The scale's arrays travel in the state: a
  # jmp.DynamicLossScale itself cannot be an argument of jit(...).lower.
  def jmp_scale(scale, counter):
    return jmp.DynamicLossScale(scale, counter, period=PERIOD)

  def jmp_grads(loss_scale, params, batch):
    """The scaled loss and the unscaled gradients, as jmp's README does."""
    scaled_loss, grads = jax.value_and_grad(
        lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
    return scaled_loss, loss_scale.unscale(grads)

  def jmp_init(params):
    return params, plain.init(params), jnp.float32(INITIAL_SCALE), jnp.int32(0)

  def jmp_step(state, batch):
    params, opt_state, scale, counter = state
    loss_scale = jmp_scale(scale, counter)
    scaled_loss, grads = jmp_grads(loss_scale, params, batch)
    finite = jmp.all_finite(grads)
    updates, new_opt_state = plain.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params = jmp.select_tree(finite, new_params, params)
    opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
    loss_scale = loss_scale.adjust(finite)
    state = params, opt_state, loss_scale.loss_scale, loss_scale.counter
    return state, loss_scale.unscale(scaled_loss)

  # 4. optax.apply_if_finite with a jmp loss scale.
  if_finite = optax.apply_if_finite(adamw(), max_consecutive_errors=2**30)

  def if_finite_init(params):
    return params, if_finite.init(params), jnp.float32(INITIAL_SCALE), jnp.int32(0)

  def if_finite_step(state, batch):
    params, opt_state, scale, counter = state
    loss_scale = jmp_scale(scale, counter)
    scaled_loss, grads = jmp_grads(loss_scale, params, batch)
    updates, opt_state = if_finite.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    loss_scale = loss_scale.adjust(opt_state.last_finite)
    state = params, opt_state, loss_scale.loss_scale, loss_scale.counter
    return state, loss_scale.unscale(scaled_loss)

  # 5. Flax DynamicScale and a jnp.where select, as in Flax's ImageNet example.
  def flax_init(params):
    dynamic_scale = DynamicScale(
        growth_interval=PERIOD, fin_steps=jnp.int32(0),
        scale=jnp.float32(INITIAL_SCALE))
    return params, plain.init(params), dynamic_scale

  def flax_step(state, batch):
    params, opt_state, dynamic_scale = state
    dynamic_scale, finite, loss, grads = dynamic_scale.value_and_grad(loss_fn)(
        params, batch)
    updates, new_opt_state = plain.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    select = functools.partial(jnp.where, finite)
    params = jax.tree_util.tree_map(select, new_params, params)
    opt_state = jax.tree_util.tree_map(select, new_opt_state, opt_state)
    return (params, opt_state, dynamic_scale), loss

  return [
      Variant("unguarded", unguarded_init, unguarded_step),
      Variant("jaxmp", jaxmp_init, jaxmp_step),
      Variant("jmp manual", jmp_init, jmp_step),
      Variant("optax.apply_if_finite", if_finite_init, if_finite_step),
      Variant("flax DynamicScale", flax_init, flax_step),
  ]


def bf16_loss_fn(args: argparse.Namespace):
  """The model's loss with float32 params and bfloat16 compute; its params."""
  policy = jaxmp.get_policy("mixed_bfloat16")
  model = train_lm.make_model(args.d_model, args.layers, args.heads, args.seq_len)
  sample = jnp.zeros((args.batch_size, args.seq_len), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), sample)["params"]
  return train_lm.make_loss_fn(model, policy), params


# The figures are those of XLA's default code generator, whatever XLA_FLAGS
# says: the test suite, which runs these benchmarks in small configurations,
# asks XLA:CPU for an older one that compiles faster (conftest.py), and that
# one makes other decisions (copies, kernels, fused arithmetic). Every
# compilation of the benchmarks passes these options; they are XLA:CPU's, so
# on an accelerator there are none.
DEFAULT_CODEGEN = ({"xla_cpu_use_fusion_emitters": True}
                   if jax.default_backend() == "cpu" else {})


def jit_step(step):
  """A fresh ``jit`` of ``step`` (no cache hit) with the state donated."""
  return jax.jit(lambda s, b: step(s, b), donate_argnums=(0,),
                 compiler_options=DEFAULT_CODEGEN)


def compile_step(step, state, batch):
  """A fresh ``jit`` (no cache hit), lowered and compiled.

  Returns the compiled step, the wall-clock seconds and the CPU seconds of
  this process (all threads) spent tracing, lowering and compiling. The CPU
  seconds are what the table compares: other processes on a shared machine
  stretch the wall-clock time but hardly the CPU time.
  """
  jitted = jit_step(step)
  started, cpu_started = time.perf_counter(), time.process_time()
  compiled = jitted.lower(state, batch).compile()
  return (compiled, time.perf_counter() - started,
          time.process_time() - cpu_started)


def compiler_figures(compiled) -> dict[str, float]:
  memory = compiled.memory_analysis()
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return {
      "temp_bytes": int(memory.temp_size_in_bytes),
      "argument_bytes": int(memory.argument_size_in_bytes),
      "bytes_accessed": float(cost["bytes accessed"]),
      "flops": float(cost.get("flops", float("nan"))),
  }


@contextlib.contextmanager
def dumped_compilation(step, state, batch):
  """``step`` compiled once more with XLA's dump: yields the compiled step and
  the folder of dumped files, which is deleted afterwards.

  A program found in JAX's persistent compilation cache (the tests keep one)
  is not compiled again, so XLA would dump nothing: the cache is off for this
  compilation. JAX decides once whether it uses the cache; reset_cache makes
  it decide again.
  """
  jitted = jit_step(step)
  with tempfile.TemporaryDirectory() as tmp:
    cache_was_on = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
      compiled = jitted.lower(state, batch).compile(compiler_options={"xla_dump_to": tmp})
    finally:
      jax.config.update("jax_enable_compilation_cache", cache_was_on)
      compilation_cache.reset_cache()
    yield compiled, pathlib.Path(tmp)


def dump_figures(step, state, batch) -> dict[str, int | None]:
  """Peak live bytes and kernel count: ``compile_dumped(...)[1]``."""
  return compile_dumped(step, state, batch)[1]


def compile_dumped(step, state, batch):
  """``step`` compiled once more, with XLA's dump, and the peak live bytes
  and kernel count read from the dump.

  ``temp_bytes`` is the size of the one block XLA packs every temporary buffer
  into, so it moves with how well the buffers happen to pack. The live-range
  dump gives what must really be held at the worst moment: the sum of the
  buffers live at the peak (arguments included). The number of kernel modules
  XLA compiled (its ``*.ir-no-opt.ll`` files, one per distinct fused kernel on
  the CPU) is, with their size, what the compile time grows with. Both are
  deterministic. Other back ends write no LLVM modules (``kernels`` is None)
  and may write no live-range file (``peak_live_bytes`` is None); the table
  then says n/a.
  """
  on_cpu = jax.default_backend() == "cpu"
  with dumped_compilation(step, state, batch) as (compiled, dump):
    live_ranges = sorted(dump.glob("*after_optimizations-live-range.txt"))
    # Kernel modules are dumped as LLVM IR by the CPU back end only.
    kernels = len(list(dump.glob("*.ir-no-opt.ll"))) if on_cpu else None
    if not live_ranges and not on_cpu:
      return compiled, {"peak_live_bytes": None, "kernels": kernels}
    if len(live_ranges) != 1:
      raise RuntimeError(
          "benchmarks/overhead.py expected XLA to dump one live-range file for "
          f"the train step, found {len(live_ranges)}. This JAX/XLA version dumps "
          "other files; update compile_dumped() to its format.")
    text = live_ranges[0].read_text()
  _, found, peak_section = text.partition("Live ranges at")
  cumulative = [int(n) for n in re.findall(r"cumulative: (\d+) bytes", peak_section)]
  if not found or not cumulative:
    raise RuntimeError(
        f"{live_ranges[0].name} has no 'Live ranges at ... (peak)' section; "
        "update compile_dumped() to this XLA version's dump format.")
  return compiled, {"peak_live_bytes": max(cumulative), "kernels": kernels}


def copy_tree(tree):
  return jax.tree_util.tree_map(lambda x: x.copy(), tree)


SELECT_SWITCH = "JAXMP_INPLACE_SELECT"
CHECKED_STEPS = ("finite", "skipped", "finite")


def check_select_paths(loss_fn, params, batch) -> dict[str, Any]:
  """Runs jaxmp's step with both selects; raises unless bit-identical.

  The step is traced afresh under ``JAXMP_INPLACE_SELECT=1`` (the in-place
  select, the default) and ``=0`` (the plain ``optax.tree.where``), and run
  over a finite step, a step whose gradients get an inf (skipped), and another
  finite step. Every leaf of the parameters, the optimizer state and the loss
  must have the same bytes.
  """
  tx = jaxmp.loss_scaling(
      optax.adamw(1e-3), jaxmp.DynamicLossScale(INITIAL_SCALE, period=PERIOD))

  def step(state, batch, poison):
    params, opt_state = state
    loss_scale = jaxmp.get_loss_scale(opt_state)
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params, batch)
    grads = jax.tree_util.tree_map(lambda g: g + poison.astype(g.dtype), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  def run(switch: str) -> list[bytes]:
    previous = os.environ.get(SELECT_SWITCH)
    os.environ[SELECT_SWITCH] = switch
    try:
      jitted = jax.jit(lambda s, b, p: step(s, b, p),  # a fresh trace
                       compiler_options=DEFAULT_CODEGEN)
      state, outputs = (copy_tree(params), tx.init(params)), []
      for kind in CHECKED_STEPS:
        poison = jnp.float32(jnp.inf if kind == "skipped" else 0.0)
        state, loss = jitted(state, batch, poison)
        outputs.append((state, loss))
    finally:
      if previous is None:
        del os.environ[SELECT_SWITCH]
      else:
        os.environ[SELECT_SWITCH] = previous
    finite = [bool(s[1].last_finite) for s, _ in outputs]
    if finite != [kind == "finite" for kind in CHECKED_STEPS]:
      raise RuntimeError(f"select check: expected steps {CHECKED_STEPS}, got "
                         f"last_finite {finite}")
    # A skip keeps the params and the inner optimizer state bit-identical.
    before, after = (jax.tree_util.tree_leaves(
        (outputs[i][0][0], outputs[i][0][1].inner_state)) for i in (0, 1))
    kept = sum(np.asarray(a).tobytes() != np.asarray(b).tobytes()
               for a, b in zip(before, after))
    if kept:
      raise RuntimeError(f"select check ({SELECT_SWITCH}={switch}): the skipped "
                         f"step changed {kept} leaves of the params and "
                         f"inner optimizer state.")
    return [[np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
            for out in outputs]

  inplace, plain = run("1"), run("0")
  differing = {kind: sum(a.tobytes() != b.tobytes() for a, b in zip(x, y))
               for kind, x, y in zip(CHECKED_STEPS, inplace, plain)}
  if any(differing.values()):
    worst = max(
        float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))
                     / np.maximum(np.abs(b.astype(np.float64)), 1e-30)))
        for x, y in zip(inplace, plain) for a, b in zip(x, y)
        if a.dtype.kind == "f" and a.tobytes() != b.tobytes())
    raise RuntimeError(
        f"The in-place and the plain select of jaxmp.loss_scaling differ, by "
        f"step, in {differing} of {len(inplace[0])} leaves (largest relative "
        f"difference {worst:.2e}); each kept its state bit-identical on the "
        f"skipped step.")
  return {"steps": list(CHECKED_STEPS), "leaves_compared": len(inplace[0]),
          "bit_identical": True}


def measure(args: argparse.Namespace) -> dict[str, Any]:
  """Compiles and times every variant; returns the figures."""
  loss_fn, params = bf16_loss_fn(args)
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
  variants = make_variants(loss_fn)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.integers(0, 256, (args.batch_size, args.seq_len + 1)),
                      jnp.int32)
  select_check = check_select_paths(loss_fn, params, batch)
  print(f"select check: bit-identical over {select_check['steps']}",
        file=sys.stderr)

  # Compile every variant several times, round-robin, so that a busy moment
  # of the machine does not fall on one variant only.
  states = {v.name: v.init(copy_tree(params)) for v in variants}
  wall = {v.name: [] for v in variants}
  cpu = {v.name: [] for v in variants}
  figures, compiled_steps = {}, {}
  for _ in range(args.compile_repeats):
    for variant in variants:
      compiled, wall_seconds, cpu_seconds = compile_step(
          variant.step, states[variant.name], batch)
      wall[variant.name].append(wall_seconds)
      cpu[variant.name].append(cpu_seconds)
      compiled_steps[variant.name] = compiled
  for variant in variants:
    name = variant.name
    dumped, dump = compile_dumped(variant.step, states[name], batch)
    # Untimed (--compile-repeats 0, as the tests run it), the dumped
    # compilation is the one that runs the steps.
    compiled_steps.setdefault(name, dumped)
    figures[name] = compiler_figures(compiled_steps[name])
    figures[name].update(dump)
    figures[name]["compile_seconds"] = statistics.median(cpu[name]) if cpu[name] else None
    figures[name]["compile_cpu_seconds_all"] = cpu[name]
    figures[name]["compile_wall_seconds_all"] = wall[name]
    if cpu[name]:
      print(f"compiled {name}: {figures[name]['compile_seconds']:.2f} CPU s",
            file=sys.stderr)

  warm_up(compiled_steps, states, batch, args.warmup_steps)
  names = list(compiled_steps)
  step_seconds = interleaved_rounds(compiled_steps, states, batch, args.rounds,
                                    args.steps_per_round)

  base = figures["unguarded"]
  base_times = step_seconds["unguarded"]
  for name in names:
    f = figures[name]
    f["step_seconds_median"] = statistics.median(step_seconds[name])
    f["step_seconds_all"] = step_seconds[name]
    ratios = [t / b for t, b in zip(step_seconds[name], base_times)]
    f["time_ratio"] = statistics.median(ratios)
    f["temp_ratio"] = f["temp_bytes"] / base["temp_bytes"]
    f["peak_live_ratio"] = (
        None if base["peak_live_bytes"] is None
        else f["peak_live_bytes"] / base["peak_live_bytes"])
    f["bytes_accessed_ratio"] = f["bytes_accessed"] / base["bytes_accessed"]
    f["compile_ratio"] = (None if f["compile_seconds"] is None
                          else f["compile_seconds"] / base["compile_seconds"])
  return {
      "config": {k: v for k, v in vars(args).items() if k != "out"},
      "parameters": int(n_params),
      "machine": machine_description(),
      "select_check": select_check,
      "variants": figures,
  }


def warm_up(steps, states, batch, count: int) -> None:
  """Runs each ``step(state, batch) -> (state, out)`` ``count`` times,
  updating ``states`` (name -> state)."""
  for name, step in steps.items():
    out = None
    for _ in range(count):
      states[name], out = step(states[name], batch)
    jax.block_until_ready(out)


def interleaved_rounds(steps, states, batch, rounds: int, steps_per_round: int,
                       deadline: float | None = None) -> dict[str, list[float]]:
  """The seconds per step of each round, by name, of ``steps`` (name ->
  ``step(state, batch) -> (state, out)``), timed in interleaved rounds whose
  order rotates every round, so that a busy moment of the machine falls on
  every step alike. Updates ``states``; stops after the round that ends past
  ``deadline`` (``time.monotonic()``), if given.
  """
  names = list(steps)
  seconds = {name: [] for name in names}
  for round_index in range(rounds):
    shift = round_index % len(names)
    for name in names[shift:] + names[:shift]:
      step, state = steps[name], states[name]
      jax.block_until_ready(state)
      started = time.perf_counter()
      for _ in range(steps_per_round):
        state, out = step(state, batch)
      jax.block_until_ready((state, out))
      seconds[name].append((time.perf_counter() - started) / steps_per_round)
      states[name] = state
    print(f"round {round_index + 1}/{rounds}", file=sys.stderr)
    if deadline is not None and time.monotonic() > deadline:
      break
  return seconds


def machine_description() -> dict[str, Any]:
  """The demo's description of the machine, plus the peers' versions."""
  return {
      **train_lm.machine_description(),
      **{name: importlib.metadata.version(name) for name in ("optax", "flax", "jmp")},
  }


def percent(ratio: float, digits: int = 1) -> str:
  return f"{(ratio - 1) * 100:+.{digits}f}%"


def markdown(results: dict[str, Any]) -> str:
  """The results as a Markdown table, with the set-up it ran on."""
  config, machine = results["config"], results["machine"]
  lines = [
      "| variant | step time | temp memory | peak live memory | bytes accessed "
      "| compile time | kernels |",
      "|---|---|---|---|---|---|---|",
  ]
  base = results["variants"]["unguarded"]
  for name, f in results["variants"].items():
    # Figures a back end does not dump are None (see dump_figures).
    peak = ("n/a" if f["peak_live_ratio"] is None
            else percent(f["peak_live_ratio"], digits=3))
    kernels = "n/a" if f["kernels"] is None else (
        f"{f['kernels']} ({f['kernels'] - base['kernels']:+d})")
    compile_ratio = "n/a" if f["compile_ratio"] is None else f"{f['compile_ratio']:.2f}×"
    lines.append(
        f"| {name} | {f['time_ratio']:.3f}× | {percent(f['temp_ratio'])} | {peak} | "
        f"{percent(f['bytes_accessed_ratio'])} | {compile_ratio} | "
        f"{kernels} |"
    )
  lines += [
      "",
      f"Relative to the unguarded step: {base['step_seconds_median'] * 1e3:.1f} ms "
      f"per step, {base['temp_bytes'] / 2**20:.2f} MiB temp memory, "
      + ("" if base["peak_live_bytes"] is None else
         f"{base['peak_live_bytes'] / 2**20:.2f} MiB live at the peak (arguments "
         "included), ")
      + f"{base['bytes_accessed'] / 2**20:.1f} MiB accessed"
      + ("" if base["compile_seconds"] is None else
         f", {base['compile_seconds']:.2f} CPU seconds to trace and compile")
      + ". Temp "
      "memory is XLA's packed block of temporaries; peak live memory is what is "
      "held at the worst moment (XLA's live-range dump); kernels are the kernel "
      "modules XLA compiled.",
      "",
      f"Model: {results['parameters']:,}-parameter byte-level transformer "
      f"(d_model {config['d_model']}, {config['layers']} layers, {config['heads']} "
      f"heads), batch {config['batch_size']}×{config['seq_len']}, adamw, float32 "
      "params, bfloat16 compute, donated state. Step time: median of the per-round "
      f"ratios over {config['rounds']} interleaved rounds of "
      f"{config['steps_per_round']} steps; compile time: "
      + (f"median CPU time of {config['compile_repeats']} fresh traces and "
         "compilations." if config["compile_repeats"] else
         "not measured (--compile-repeats 0)."),
      "",
  ]
  check = results.get("select_check")
  if check is not None:
    lines += [
        "Select paths: jaxmp's in-place select and the plain `optax.tree.where` "
        f"select (`{SELECT_SWITCH}=0`) gave bit-identical parameters, optimizer "
        f"state and loss over a {', a '.join(check['steps'][:-1])} and a "
        f"{check['steps'][-1]} step "
        f"({check['leaves_compared']} leaves compared).",
        "",
    ]
  lines += [
      f"Machine: {machine['platform']} ({machine['device_kind']}, "
      f"{machine['cpu_count']} cores), Python {machine['python']}, JAX "
      f"{machine['jax']}, optax {machine['optax']}, flax {machine['flax']}, "
      f"jmp {machine['jmp']}. " + (
          "CPU only: no GPU was available; step times on a shared machine are "
          "noisy (a few percent), the compiler figures are exact."
          if machine["platform"] == "cpu" else
          f"Accelerator: {machine['device_kind']}; the compiler figures are "
          "exact, step times vary by a few percent between runs."),
  ]
  return "\n".join(lines) + "\n"


def model_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
  """The flags both benchmarks share: the model's size and the rounds."""
  parser = argparse.ArgumentParser(
      description=doc.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--layers", type=int, default=5)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--seq-len", type=int, default=128)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=rounds)
  parser.add_argument("--steps-per-round", type=int, default=5)
  parser.add_argument("--warmup-steps", type=int, default=2)
  return parser


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
  """``--out``: the directory for ``<name>.md`` and ``<name>.json``."""
  parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                      help=f"directory for {name}.md and {name}.json")


def write_results(out: str, name: str, results: dict[str, Any], table: str) -> None:
  """Writes ``name.json`` and ``name.md`` into ``out`` and prints the table."""
  path = pathlib.Path(out)
  path.mkdir(parents=True, exist_ok=True)
  (path / f"{name}.json").write_text(json.dumps(results, indent=1))
  (path / f"{name}.md").write_text(table)
  print(table)


def build_parser() -> argparse.ArgumentParser:
  parser = model_parser(__doc__, rounds=15)
  def repeats(text: str) -> int:
    if not text.isdigit():
      raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text!r}")
    return int(text)

  parser.add_argument(
      "--compile-repeats", type=repeats, default=5,
      help="fresh compilations of each variant to time (0: none, no compile time)")
  add_out_argument(parser, "overhead")
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  results = measure(args)
  write_results(args.out, "overhead", results, markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
