"""Mixed precision on one GPU, at the size people train (``make bench-gpu``).

Two byte-level decoders of ``examples/train_lm.py``, adamw, float32 master
params, donated state:

* ``gpt2-124m``: GPT-2 small's shape (d_model 768, 12 layers, 12 heads,
  sequence 1024) and parameter count: 124.4M, with a vocabulary of 25,088
  tokens, so that the untied embedding and output layer hold what GPT-2's
  tied 50,257-token embedding holds. The batch is the largest whose float32
  step fits the device beside the other steps' states, by the compiler's
  memory analysis (``largest_batch``);
* ``demo-4m``: the 4.1M-parameter model of ``overhead.py`` and
  ``policy_speed.py`` (d_model 256, 5 layers, batch 8x128).

For each model, three groups, each timed in interleaved rounds in one
process (medians):

1. precision: the demo's guarded step under float32, mixed_bfloat16,
   mixed_float16 (dynamic loss scaling) and mixed_fp8 (Flax's fp8_ops through
   ``jaxmp.flax.TrainState``, as ``policy_speed.py``): step time, tokens/s,
   MFU against the device's dense peak for that precision (``PEAK_TFLOPS``),
   and memory (the compiler's: arguments, temporaries and outputs not
   aliased; the device's process peak is in the JSON);
2. guard: ``overhead.py``'s five bfloat16 steps (unguarded, jaxmp, jmp's
   manual pattern, ``optax.apply_if_finite``, Flax's ``DynamicScale``) and
   jaxmp with the forms written for XLA:CPU (``JAXMP_INPLACE_SELECT=1``,
   ``JAXMP_GROUPED_CHECK=1``): each step time against the unguarded one;
3. profile: a ``jax.profiler`` trace each of the unguarded, the jaxmp, the
   CPU-forms and the FP8 step, their kernel time per step by category
   (GEMMs, FP8 quantize/amax, the finiteness check, the optimizer update,
   the select, the loss scale, the rest), from the kernels' HLO ops.

For a timed run: ``--budget-seconds`` caps the run. The groups run in order
of importance, each keeping back time for the ones after it (``RESERVE``); a
compilation that would not end before that is skipped and recorded, and the
rounds stop early where time runs short. An out-of-memory or any other
failure is recorded for its configuration, and the results are written after
every configuration. ``--tiny`` runs both models at a tiny size on a CPU
(the code path; no figure worth reading).

Usage::

  python benchmarks/gpu.py                      # benchmarks/results/gpu/gpu.{md,json}
  python benchmarks/gpu.py --tiny --out /tmp/g  # on a CPU, the test of the code path
"""

from __future__ import annotations

import os

if __name__ == "__main__":
  # Before JAX starts: the process takes 92% of the GPU's memory (JAX's
  # default is 75%), which gpt2-124m's batch is sized against.
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

# pylint: disable=wrong-import-position
import argparse
import collections
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import overhead  # the jaxmp of this checkout, the demo's train_lm
import policy_speed

import jaxmp
import train_lm

# Dense (no sparsity) peak TFLOP/s of the tensor cores, half the "with
# sparsity" figures of NVIDIA's H100 datasheet (SXM5, PCIe, NVL) and H200
# product brief (SXM, NVL); fp32 is the CUDA cores' figure. JAX computes
# float32 matmuls with TF32 on these GPUs by default ("Matmul precision" in
# JAX's docs), so the float32 step is set against the TF32 peak.
PEAK_TFLOPS = {
    "H100 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    "H200 SXM": {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "fp8": 1979.0},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
}
# The peak each policy's matmuls run at (mixed_fp8: the Dense layers' GEMMs;
# its attention computes in bfloat16).
POLICY_PEAK = {"float32": "tf32", "mixed_bfloat16": "bf16",
               "mixed_float16": "fp16", "mixed_fp8": "fp8"}


def peak_name(device_kind: str) -> str | None:
  """The row of ``PEAK_TFLOPS`` for a device kind, e.g. 'NVIDIA H100 80GB HBM3'."""
  for chip in ("H100", "H200"):
    if chip in device_kind:
      for form in ("PCIe", "NVL"):
        if form.lower() in device_kind.lower() and f"{chip} {form}" in PEAK_TFLOPS:
          return f"{chip} {form}"
      return f"{chip} SXM"
  return None


@dataclasses.dataclass(frozen=True)
class Model:
  name: str
  d_model: int
  layers: int
  heads: int
  seq_len: int
  vocab: int
  batch_size: int | None  # None: the largest whose float32 step fits


MODELS = (Model("gpt2-124m", 768, 12, 12, 1024, 25_088, None),
          Model("demo-4m", 256, 5, 4, 128, 256, 8))
TINY = (Model("gpt2-124m", 16, 1, 2, 8, 512, None),
        Model("demo-4m", 16, 1, 2, 8, 256, 2))
TINY_BATCH = 2  # gpt2-124m's where the backend reports no memory limit
# The seconds each group keeps back for the groups after it (compiling
# gpt2-124m's steps takes the longest); the timed rounds of a group take at
# most ROUNDS_SECONDS.
RESERVE = {("gpt2-124m", "precision"): 150, ("gpt2-124m", "guard"): 75,
           ("demo-4m", "precision"): 35, ("demo-4m", "guard"): 10}
ROUNDS_SECONDS = 45
CPU_FORMS = "jaxmp, CPU forms"
PROFILED = ("unguarded", "jaxmp", CPU_FORMS, "mixed_fp8")


# -- Building the steps -------------------------------------------------------


def make_model(spec: Model):
  return train_lm.build_model_module()(
      d_model=spec.d_model, num_layers=spec.layers, num_heads=spec.heads,
      max_len=spec.seq_len, vocab_size=spec.vocab)


def make_batch(spec: Model, batch_size: int) -> jax.Array:
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.integers(0, spec.vocab, (batch_size, spec.seq_len + 1)),
                     jnp.int32)


@contextlib.contextmanager
def environment(**values: str):
  """The process environment with ``values`` set, restored afterwards."""
  previous = {k: os.environ.get(k) for k in values}
  os.environ.update(values)
  try:
    yield
  finally:
    for k, v in previous.items():
      if v is None:
        del os.environ[k]
      else:
        os.environ[k] = v


def with_cpu_forms(variant: overhead.Variant) -> overhead.Variant:
  """``variant`` traced with the select and the check written for XLA:CPU."""

  def step(state, batch):
    with environment(JAXMP_INPLACE_SELECT="1", JAXMP_GROUPED_CHECK="1"):
      return variant.step(state, batch)

  return overhead.Variant(CPU_FORMS, variant.init, step)


@dataclasses.dataclass
class Config:
  """One step to measure: ``lower(state, batch)`` gives its lowered program;
  ``pair`` turns the compiled program into ``step(state, batch) -> (state, out)``."""
  name: str
  lower: Any
  state: Any
  pair: Any
  policy: str


def precision_configs(spec: Model, model, batch, params,
                      names=policy_speed.POLICIES) -> list[Config]:
  config = policy_speed.train_config(batch.shape[0], spec.seq_len, spec.d_model,
                                     spec.layers, spec.heads)
  return [Config(name, lambda s, b, step=step: step.lower(*s, b), state,
                 policy_speed.as_pair, policy)
          for name, (step, state, policy) in policy_speed.policy_steps(
              config, model, batch, params, names).items()]


def guard_configs(model, params) -> list[Config]:
  policy = jaxmp.get_policy("mixed_bfloat16")
  variants = overhead.make_variants(train_lm.make_loss_fn(model, policy))
  variants.append(with_cpu_forms(variants[1]))
  return [Config(v.name, lambda s, b, v=v: jax.jit(
      lambda s, b: v.step(s, b), donate_argnums=(0,)).lower(s, b),
                 v.init(overhead.copy_tree(params)), lambda c: c, str(policy))
          for v in variants]


# -- Memory ---------------------------------------------------------------------


def memory_bytes(compiled) -> int:
  """What the step holds at once, by the compiler: its arguments, its
  temporaries and the outputs that do not reuse a donated argument."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.temp_size_in_bytes
             + m.output_size_in_bytes - m.alias_size_in_bytes)


def largest_batch(lower_at, limit: int, held: int) -> dict[str, Any]:
  """The largest batch whose step fits 90% of ``limit`` bytes beside ``held`` ones.

  ``lower_at(batch_size)`` lowers the step, and the compiler's memory analysis
  (without autotuning on a GPU: memory, not speed, is asked) gives what it
  holds. The memory at batches of 4 and 8 gives a line, where the line meets
  the target gives a batch, and that batch is compiled to check; where it
  does not fit, the line through it and the nearest smaller batch gives the
  next (two checks at most; ``fits`` says whether the batch returned was
  checked and fits). XLA's memory grows a little faster than the batch, so
  the first guess tends to be a little too large.
  """
  def memory_at(batch_size):
    lowered = lower_at(batch_size)
    try:
      no_autotuning = ({"xla_gpu_autotune_level": 0}
                       if jax.default_backend() == "gpu" else {})
      compiled = lowered.compile(compiler_options={**overhead.DEFAULT_CODEGEN,
                                                   **no_autotuning})
    except Exception:  # pylint: disable=broad-except
      compiled = lowered.compile(compiler_options=overhead.DEFAULT_CODEGEN)
    return memory_bytes(compiled)

  target = int(0.9 * limit) - held
  memory = {4: memory_at(4), 8: memory_at(8)}

  def meets(lower: int, upper: int) -> int:
    slope = max((memory[upper] - memory[lower]) / (upper - lower), 1.0)
    return max(lower + int((target - memory[lower]) // slope), 1)

  batch = meets(4, 8)
  for _ in range(2):
    if batch not in memory:
      memory[batch] = memory_at(batch)
    if memory[batch] <= target:
      break
    smaller = [b for b in memory if b < batch]
    batch = (max(min(meets(max(smaller), batch), batch - 1), 1) if smaller
             else max(batch // 2, 1))
  return {"batch_size": batch, "fits": memory.get(batch, target + 1) <= target,
          "memory_by_batch": {str(b): m for b, m in sorted(memory.items())},
          "target_bytes": target, "limit_bytes": limit, "held_bytes": held,
          "rule": "the compiler's memory at batches of 4 and 8, a line through "
          "them to 90% of the limit less the other states, checked at the "
          "batch chosen"}


def state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree_util.tree_leaves(state))


def device_memory() -> dict[str, int] | None:
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return None
  return {k: int(stats[k]) for k in ("bytes_limit", "peak_bytes_in_use",
                                      "bytes_in_use") if k in stats}


# -- The profile ---------------------------------------------------------------

# The lines of a device plane that repeat its kernels (xprof's derived ones).
DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Ops",
                 "Framework Name Scope", "Source code", "XLA TraceMe")
CATEGORIES = ("GEMMs", "FP8 quantize/amax", "finiteness check",
              "optimizer update", "select", "loss scale", "other")
# A kernel holding the select and the update is counted as the update; the
# time of every kernel holding the select is reported apart.


def _frames(hlo: str) -> dict[str, list[str]]:
  """stack_frame_id -> the files of its frames, innermost first, from the
  tables at the top of an HLO module's text (empty when it has none)."""
  def table(name):
    part = re.search(rf"^{name}\n(.*?)\n\n", hlo, re.S | re.M)
    return dict(re.findall(r"^(\d+) (.*)$", part.group(1), re.M)) if part else {}
  files = {k: v.strip('"') for k, v in table("FileNames").items()}
  locations = {k: re.search(r"file_name_id=(\d+)", v).group(1)
               for k, v in table("FileLocations").items()}
  stack = {k: re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v).groups()
           for k, v in table("StackFrames").items()}
  frames = {}
  for frame in stack:
    chain, current = [], frame
    while current in stack and len(chain) < len(stack):
      location, parent = stack[current]
      chain.append(files.get(locations.get(location, ""), ""))
      current = str(int(parent) - 1)  # 1-based, 0 for none
    frames[frame] = chain
  return frames


# Where the innermost frame of an op's source lies, for each category.
GUARD_FILES = r"jaxmp/_src/(loss_scale|loss_scaling|value_and_grad)\.py|/jmp/|dynamic_scale"
OPTIMIZER_FILES = r"optax/(?!losses)|jaxmp/_src/jaxpr\.py"  # jaxpr.py: the re-evaluated update


def _category(text: str, frames: dict[str, list[str]]) -> tuple[str, bool]:
  """The category of a kernel's HLO (its fused computation and the calling
  instruction), and whether it holds the guard's select.

  Each instruction is placed by its op and the innermost frames of the
  Python that traced it; the kernel takes the first category, in the order
  of ``CATEGORIES``, of any of its instructions.
  """
  found, select = set(), False
  for line in text.splitlines():
    op = re.search(r"= [^=]*?\b([a-z][a-z0-9-]*)\(", line)
    if not op:
      continue
    op = op.group(1)
    chain = re.findall(r'source_file="([^"]+)"', line) or frames.get(
        (re.findall(r"stack_frame_id=(\d+)", line) or [""])[0], [])
    inner = (chain + [""])[0]
    if op in ("dot", "convolution") or (op == "custom-call" and re.search(
        r'custom_call_target="[^"]*(gemm|matmul|cublas|cudnn)', line, re.I)):
      found.add("GEMMs")
    elif "fp8_ops" in inner or "_src/flax/fp8" in inner:
      found.add("FP8 quantize/amax")
    elif op == "is-finite" and re.search(GUARD_FILES + "|" + OPTIMIZER_FILES, inner):
      found.add("finiteness check")
    elif op == "select" and ("inplace_select" in " ".join(chain[:3])
                             or "loss_scaling" in inner):
      found.add("select")  # of the state (jaxmp) or of the updates
      select = True
    elif re.search(OPTIMIZER_FILES, inner):
      found.add("optimizer update")
    elif re.search(GUARD_FILES, inner):
      found.add("loss scale")
  return next((c for c in CATEGORIES if c in found), "other"), select


def hlo_kernels(hlo: str) -> dict[str, tuple[str, bool]]:
  """Instruction name -> (category, holds the select), for every instruction
  of an optimized HLO module that may run as a kernel."""
  frames = _frames(hlo)
  computations = dict(re.findall(
      r"^(?:ENTRY )?%(\S+) \(.*?\n(.*?)\n}", hlo, re.S | re.M))
  kernels = {}
  for body in computations.values():
    for line in body.splitlines():
      found = re.match(r"\s*(?:ROOT )?%(\S+) = .*?\b([a-z][a-z0-9-]*)\(", line)
      if not found or found.group(2) in ("parameter", "constant", "tuple",
                                         "get-tuple-element", "bitcast"):
        continue
      called = re.search(r"calls=%([\w.-]+)", line)
      text = computations.get(called.group(1), "") + "\n" + line if called else line
      kernels[found.group(1)] = _category(text, frames)
  return kernels


def profile(step, state, batch, compiled, steps: int):
  """Kernel time per step by category, from a ``jax.profiler`` trace of
  ``steps`` steps; returns it (or ``{"skipped": reason}``) and the state."""
  module = re.match(r"HloModule (\S+?),", compiled.as_text()).group(1)
  kernels = hlo_kernels(compiled.as_text())
  with tempfile.TemporaryDirectory() as tmp:
    out = None
    with jax.profiler.trace(tmp):
      for _ in range(steps):
        state, out = step(state, batch)
      jax.block_until_ready((state, out))
    traces = sorted(pathlib.Path(tmp).rglob("*.xplane.pb"))
    if not traces:
      return {"skipped": "jax.profiler wrote no .xplane.pb file"}, state
    data = jax.profiler.ProfileData.from_file(str(traces[-1]))
  planes = [p for p in data.planes if p.name.startswith("/device:")]
  on_device = bool(planes)
  planes = planes or [p for p in data.planes if p.name.startswith("/host:CPU")]
  events, modules = [], set()  # (hlo op, kernel name, ns) of this program
  for plane in planes:
    lines = [l for l in plane.lines if l.name not in DERIVED_LINES]
    streams = [l for l in lines if l.name.startswith("Stream")]
    for line in (streams if on_device and streams else lines):
      for event in line.events:
        stats = dict(event.stats)
        modules.add(str(stats.get("hlo_module")))
        if str(stats.get("hlo_module", module)).startswith(module) and (
            on_device or "hlo_op" in stats):
          events.append((str(stats.get("hlo_op")), event.name, event.duration_ns))
    if on_device and not any(op in kernels for op, _, _ in events):
      # Kernels without their HLO op: take the derived line of XLA's ops.
      events += [(e.name, e.name, e.duration_ns) for l in plane.lines
                 if l.name == "XLA Ops" for e in l.events]
  times, counts = collections.defaultdict(float), collections.Counter()
  by_kernel = collections.defaultdict(float)
  select_ns = 0.0
  for op, name, ns in events:
    category, select = kernels.get(op, ("other", False))
    times[category] += ns
    counts[category] += 1
    by_kernel[(op, category, name)] += ns
    select_ns += ns if select else 0.0
  total = sum(times.values())
  if not total:
    return {"skipped": f"the trace holds no kernel of {module} (on "
            f"{'a device' if on_device else 'the host'}; modules seen: "
            f"{sorted(modules)[:8]})"}, state
  per_step = lambda ns: ns / steps / 1e3  # microseconds
  top = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:15]
  return {
      "where": "device kernels" if on_device else "host thunks (on a CPU: "
               "XLA's thunks, not device kernels)",
      "steps_traced": steps,
      "us_per_step": {c: per_step(times[c]) for c in CATEGORIES if c in times},
      "kernels_per_step": {c: counts[c] / steps for c in CATEGORIES if c in counts},
      "total_us_per_step": per_step(total),
      "select_us_per_step": per_step(select_ns),
      "unattributed_kernels": sum(op not in kernels for op, _, _ in events),
      "top_kernels": [{"hlo_op": op, "category": c, "kernel": name,
                       "us_per_step": per_step(ns)} for (op, c, name), ns in top],
  }, state


# -- The run ----------------------------------------------------------------------


def failure(error: BaseException) -> str:
  text = f"{type(error).__name__}: {error}"
  if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
    return "out of memory: " + text.splitlines()[0][:300]
  return text.splitlines()[0][:300]


class Run:
  """The run's results, written after every change, and its clock."""

  def __init__(self, args, results):
    self.args, self.results = args, results
    self.started = time.monotonic()
    self.deadline = self.started + args.budget_seconds

  def left(self, reserve: float = 0.0) -> float:
    return self.deadline - reserve - time.monotonic()

  def write(self) -> None:
    out = pathlib.Path(self.args.out)
    out.mkdir(parents=True, exist_ok=True)
    self.results["elapsed_seconds"] = time.monotonic() - self.started
    (out / "gpu.json").write_text(json.dumps(self.results, indent=1))
    try:
      table = markdown(self.results)
    except Exception as error:  # pylint: disable=broad-except
      table = f"Partial results; see gpu.json ({failure(error)}).\n"
    (out / "gpu.md").write_text(table)


def run_group(run: Run, group: dict[str, Any], configs, batch, reserve: float,
              base: str, model_flops: float, tokens: int) -> None:
  """Compiles, times and profiles one group's configurations into ``group``,
  keeping ``reserve`` seconds of the budget for the groups after it."""
  rows, compiled, states = group.setdefault("rows", {}), {}, {}
  longest = 0.0  # the longest compilation of this group so far
  for c in configs:
    row = rows.setdefault(c.name, {"policy": c.policy})
    if run.left(reserve) < 1.2 * longest + 5:
      row["skipped"] = "the time budget"
      run.write()
      continue
    try:
      started = time.perf_counter()
      program = c.lower(c.state, batch).compile(compiler_options=overhead.DEFAULT_CODEGEN)
      row["compile_seconds"] = time.perf_counter() - started
      longest = max(longest, row["compile_seconds"])
      row.update(overhead.compiler_figures(program))
      row["memory_bytes"] = memory_bytes(program)
      step = c.pair(program)
      state, out = c.state, None
      for _ in range(run.args.warmup_steps):
        state, out = step(state, batch)
      jax.block_until_ready(out)
      compiled[c.name], states[c.name] = (step, program), state
    except Exception as error:  # pylint: disable=broad-except
      row["failed"] = failure(error)
    c.state = None  # donated, or held in states
    print(f"{c.name}: {row.get('failed') or row.get('skipped') or 'compiled'}",
          file=sys.stderr)
    run.write()
  group["device_memory"] = device_memory()
  if not compiled:
    return
  try:
    seconds = overhead.interleaved_rounds(
        {name: s for name, (s, _) in compiled.items()}, states, batch,
        run.args.rounds, run.args.steps_per_round,
        deadline=time.monotonic() + min(ROUNDS_SECONDS, run.left(reserve + 15)))
  except Exception as error:  # pylint: disable=broad-except
    group["timing_failed"] = failure(error)
    run.write()
    return
  group["rounds"] = len(next(iter(seconds.values())))
  peak = run.results["peak"]
  for name, times in seconds.items():
    row = rows[name]
    row["step_seconds_all"] = times
    row["step_seconds_median"] = statistics.median(times)
    row["tokens_per_second"] = tokens / row["step_seconds_median"]
    for other in (base, "mixed_bfloat16"):
      if other in seconds:
        row[f"time_ratio_vs_{other}"] = statistics.median(
            t / b for t, b in zip(times, seconds[other]))
    if peak and name in POLICY_PEAK:
      kind = POLICY_PEAK[name]
      row["mfu"] = model_flops / row["step_seconds_median"] / (
          PEAK_TFLOPS[peak][kind] * 1e12)
      row["mfu_peak"] = f"{kind} {PEAK_TFLOPS[peak][kind]:g} TFLOP/s"
  run.write()
  for name in PROFILED:
    if name not in compiled or run.left(reserve) < 10:
      continue
    try:
      step, program = compiled[name]
      group.setdefault("profile", {})[name], states[name] = profile(
          step, states[name], batch, program, steps=1 if run.args.tiny else 3)
    except Exception as error:  # pylint: disable=broad-except
      group.setdefault("profile", {})[name] = {"skipped": failure(error)}
    run.write()


def model_flops_per_step(params, spec: Model, batch_size: int) -> float:
  """6 x matmul params + 12 x layers x d_model x sequence, per token (PaLM's
  count, attention without the causal saving), times the batch's tokens."""
  dense = sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(params)
              if jax.tree_util.keystr(path).endswith("['kernel']"))
  per_token = 6 * dense + 12 * spec.layers * spec.d_model * spec.seq_len
  return float(per_token * batch_size * spec.seq_len)


def run_model(run: Run, spec: Model) -> None:
  entry = run.results["models"].setdefault(spec.name, {"spec": dataclasses.asdict(spec)})
  model = make_model(spec)
  params = jax.jit(model.init)(jax.random.PRNGKey(0),
                               jnp.zeros((1, spec.seq_len), jnp.int32))["params"]
  entry["parameters"] = int(sum(x.size for x in jax.tree_util.tree_leaves(params)))
  batch_size = spec.batch_size or run.args.batch_size
  memory = device_memory()
  if batch_size is None and memory and "bytes_limit" in memory:
    try:
      probe = precision_configs(spec, model, make_batch(spec, 1), params,
                                names=("float32",))[0]
      # The guard group's six states are live at once.
      entry["batch_rule"] = largest_batch(
          lambda b: probe.lower(probe.state, make_batch(spec, b)),
          memory["bytes_limit"], held=5 * state_bytes(probe.state))
      batch_size = entry["batch_rule"]["batch_size"]
    except Exception as error:  # pylint: disable=broad-except
      batch_size = TINY_BATCH * 4
      entry["batch_rule"] = {"failed": failure(error),
                             "rule": f"fixed at {batch_size} after the failure"}
    probe = None
  elif batch_size is None:
    batch_size = TINY_BATCH
    entry["batch_rule"] = {"rule": "fixed: this backend reports no memory limit"}
  entry["batch_size"] = batch_size
  batch = make_batch(spec, batch_size)
  flops = model_flops_per_step(params, spec, batch_size)
  entry["model_flops_per_step"] = flops
  groups = entry.setdefault("groups", {})
  for name, base, build in (
      ("precision", "float32", lambda: precision_configs(spec, model, batch, params)),
      ("guard", "unguarded", lambda: guard_configs(model, params))):
    reserve = 0 if run.args.tiny else RESERVE[(spec.name, name)]
    if run.left(reserve) < 20:
      groups[name] = {"skipped": "the time budget"}
      continue
    group = groups.setdefault(name, {})
    try:
      run_group(run, group, build(), batch, reserve, base, flops,
                batch_size * spec.seq_len)
    except Exception as error:  # pylint: disable=broad-except
      group["failed"] = failure(error)
    run.write()


def versions() -> dict[str, str]:
  found = {}
  for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin",
               "flax", "optax", "jmp", "numpy"):
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
      found[name] = importlib.metadata.version(name)
  return found


def measure(args) -> dict[str, Any]:
  device = jax.devices()[0]
  results = {
      "date": datetime.date.today().isoformat(),
      "machine": overhead.machine_description(),
      "versions": versions(),
      "hardware": jaxmp.hardware_report().as_dict(),  # `jaxmp doctor`
      "tiny": args.tiny,
      "config": {k: v for k, v in vars(args).items() if k != "out"},
      "peak": peak_name(device.device_kind) if device.platform == "gpu" else None,
      "peak_tflops": PEAK_TFLOPS,
      "models": {},
  }
  run = Run(args, results)
  run.write()
  for spec in TINY if args.tiny else MODELS:
    try:
      run_model(run, spec)
    except Exception as error:  # pylint: disable=broad-except
      results["models"].setdefault(spec.name, {})["failed"] = failure(error)
    run.write()
  return results


# -- The table ----------------------------------------------------------------------


def _time(row, key) -> str:
  return f"{row[key]:.3f}×" if key in row else "n/a"


def markdown(results: dict[str, Any]) -> str:
  machine, v = results["machine"], results["versions"]
  lines = [
      f"Run: `make bench-gpu` (benchmarks/gpu.py) on {machine['device_kind']} "
      f"({machine['platform']}), {results['date']}; JAX {v.get('jax')}, jaxlib "
      f"{v.get('jaxlib')}, flax {v.get('flax')}, optax {v.get('optax')}, jmp "
      f"{v.get('jmp')}; compute capability "
      f"{results['hardware']['compute_capability']}, native FP8: "
      f"{results['hardware']['native_float8']}." + (
          " Tiny models (--tiny): the code path, no figure worth reading."
          if results["tiny"] else ""),
      "",
      "MFU: 6 × matmul parameters + 12 × layers × d_model × sequence FLOPs per "
      "token over the dense peak of " + (
          f"an {results['peak']} (NVIDIA's datasheet): TF32 for float32, BF16, "
          "FP16, FP8 (FP8's attention runs in bfloat16)."
          if results["peak"] else "the device: none known for it, so n/a."),
  ]
  for name, entry in results["models"].items():
    lines += ["", f"## {name}"]
    if "failed" in entry and "groups" not in entry:
      lines += ["", f"Failed: {entry['failed']}"]
      continue
    spec = entry.get("spec", {})
    rule = entry.get("batch_rule", {})
    lines += ["", f"{entry.get('parameters', 0):,} parameters (d_model "
              f"{spec.get('d_model')}, {spec.get('layers')} layers, "
              f"{spec.get('heads')} heads, vocabulary {spec.get('vocab')}), batch "
              f"{entry.get('batch_size')}×{spec.get('seq_len')}"
              + (f" (the largest whose float32 step fits, by the compiler: "
                 f"{rule['memory_by_batch'][str(entry['batch_size'])] / 2**30:.1f} "
                 f"GiB of a {rule['limit_bytes'] / 2**30:.1f} GiB limit)"
                 if str(entry.get("batch_size")) in rule.get("memory_by_batch", {})
                 else "") + "."]
    for group_name, group in entry.get("groups", {}).items():
      lines.append("")
      if "rows" not in group:
        lines.append(f"{group_name}: {group.get('failed') or group.get('skipped')}")
        continue
      if group_name == "precision":
        lines += ["| precision | step time | vs float32 | vs bfloat16 | tokens/s "
                  "| MFU | memory (compiler) |", "|---|---|---|---|---|---|---|"]
      else:
        lines += ["| guard (bfloat16) | step time | vs unguarded | memory (compiler) "
                  "| bytes accessed |", "|---|---|---|---|---|"]
      for row_name, row in group["rows"].items():
        if "step_seconds_median" not in row:
          lines.append(f"| {row_name} | {row.get('failed') or row.get('skipped') or 'not timed'} |")
          continue
        ms = f"{row['step_seconds_median'] * 1e3:.2f} ms"
        mib = f"{row['memory_bytes'] / 2**20:,.0f} MiB"
        if group_name == "precision":
          mfu = (f"{row['mfu'] * 100:.1f}% ({row['mfu_peak']})" if "mfu" in row
                 else "n/a")
          lines.append(
              f"| {row_name} | {ms} | {_time(row, 'time_ratio_vs_float32')} | "
              f"{_time(row, 'time_ratio_vs_mixed_bfloat16')} | "
              f"{row['tokens_per_second']:,.0f} | {mfu} | {mib} |")
        else:
          base = group["rows"].get("unguarded", {}).get("bytes_accessed")
          traffic = (f"{(row['bytes_accessed'] / base - 1) * 100:+.1f}%" if base
                     else "n/a")
          lines.append(
              f"| {row_name} | {ms} | {_time(row, 'time_ratio_vs_unguarded')} | "
              f"{mib} | {traffic} |")
      lines += ["", f"Medians of {group.get('rounds', 0)} interleaved rounds of "
                f"{results['config']['steps_per_round']} steps."]
      for profiled, prof in group.get("profile", {}).items():
        if "us_per_step" not in prof:
          lines.append(f"Profile of {profiled}: skipped ({prof.get('skipped')}).")
          continue
        parts = ", ".join(f"{c} {us:,.0f} µs ({prof['kernels_per_step'][c]:g})"
                          for c, us in prof["us_per_step"].items())
        lines.append(f"Profile of {profiled} ({prof['where']}, µs per step and "
                     f"kernels): {parts}; total {prof['total_us_per_step']:,.0f} µs, "
                     f"of which kernels holding the guard's select "
                     f"{prof['select_us_per_step']:,.0f} µs.")
  lines += ["", "Targets (gpt2-124m): " + targets_text(results)]
  return "\n".join(lines) + "\n"


def targets(results: dict[str, Any]) -> dict[str, Any]:
  """The issue's targets at gpt2-124m: the measured ratio and whether met."""
  groups = results["models"].get("gpt2-124m", {}).get("groups", {})
  precision = groups.get("precision", {}).get("rows", {})
  guard = groups.get("guard", {}).get("rows", {})
  checks = {
      "bfloat16 / float32 <= 0.6": (precision.get("mixed_bfloat16", {}), "time_ratio_vs_float32", 0.6),
      "float16 guarded / bfloat16 <= 1.03": (precision.get("mixed_float16", {}), "time_ratio_vs_mixed_bfloat16", 1.03),
      "FP8 / bfloat16 <= 0.85": (precision.get("mixed_fp8", {}), "time_ratio_vs_mixed_bfloat16", 0.85),
      "jaxmp / unguarded <= 1.02": (guard.get("jaxmp", {}), "time_ratio_vs_unguarded", 1.02),
  }
  found = {name: {"ratio": row[key], "met": row[key] <= bound}
           for name, (row, key, bound) in checks.items() if key in row}
  jmp_row, ours = guard.get("jmp manual", {}), guard.get("jaxmp", {})
  if "time_ratio_vs_unguarded" in jmp_row and "time_ratio_vs_unguarded" in ours:
    found["jaxmp <= jmp manual"] = {
        "ratio": ours["time_ratio_vs_unguarded"] / jmp_row["time_ratio_vs_unguarded"],
        "met": ours["time_ratio_vs_unguarded"] <= jmp_row["time_ratio_vs_unguarded"]}
  return found


def targets_text(results) -> str:
  found = targets(results)
  if not found:
    return "not measured."
  return "; ".join(f"{name}: {t['ratio']:.3f} ({'met' if t['met'] else 'NOT met'})"
                   for name, t in found.items()) + "."


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--tiny", action="store_true",
                      help="tiny models, one round: the code path, on a CPU")
  parser.add_argument("--budget-seconds", type=float, default=420.0,
                      help="the whole run's time, compilation included")
  parser.add_argument("--batch-size", type=int, default=None,
                      help="gpt2-124m's batch (default: the largest that fits)")
  parser.add_argument("--rounds", type=int, default=None, help="default 10, tiny 1")
  parser.add_argument("--steps-per-round", type=int, default=None,
                      help="default 5, tiny 1")
  parser.add_argument("--warmup-steps", type=int, default=None,
                      help="default 2, tiny 1")
  parser.add_argument("--out", default=str(overhead.ROOT / "benchmarks" / "results" / "gpu"))
  return parser


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)
  if args.rounds is None:
    args.rounds = 1 if args.tiny else 10
  if args.steps_per_round is None:
    args.steps_per_round = 1 if args.tiny else 5
  if args.warmup_steps is None:
    args.warmup_steps = 1 if args.tiny else 2
  results = measure(args)
  print(markdown(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
