"""How does the guard's cost scale? Leaves, parameters, clipping, accumulation.

The compiler's figures of one train step, unguarded, with jaxmp and with a
peer, in several settings:

* ``leaves``: a model of 10 or 100 float32 leaves of distinct shapes
  (``--shapes`` picks other counts), or 1000 leaves of one shape (4M
  parameters in all), whose loss is elementwise, so that the optimizer and
  the guard are most of the step (unguarded and jaxmp only; 1000 distinct
  shapes are not in the default run: one unguarded compilation of them takes
  more than ten minutes on a 2-core machine);
* ``params``: the transformer of ``examples/train_lm.py`` at 0.5M, 4M and
  30M parameters (bfloat16 compute, batch 8x128);
* ``clip``: the 4M transformer with clipping to a global norm of 1
  (``optax.clip_by_global_norm`` chained before adamw; ``clip_global_norm=``
  for jaxmp);
* ``accumulation``: the 4M transformer with 4 micro-batches per step:
  ``optax.MultiSteps(adamw, 4)``, ``jaxmp.multi_steps(adamw, ..., 4)`` and
  ``optax.MultiSteps(..., should_skip_update_fn=optax.skip_not_finite)``;
* ``train_state``: the 4M transformer through ``flax.training.TrainState``
  and ``jaxmp.flax.TrainState`` under ``mixed_bfloat16`` (with the check and
  with ``guard=False``);
* ``zero``: the 4M transformer ZeRO-style inside ``jax.shard_map`` over 8
  (simulated) devices: the params, the gradients and Adam's moments sharded,
  the params gathered for the forward pass (unguarded, jaxmp, and jaxmp with
  the plain select, ``JAXMP_INPLACE_SELECT=0``). This process asks XLA for 8
  host devices (``--xla_force_host_platform_device_count=8``, unless
  ``XLA_FLAGS`` already sets a count); the other settings run on one.

For each it reports bytes accessed, temp memory (``cost_analysis()`` and
``memory_analysis()`` of the compiled step, donated state; per device inside
``shard_map``), the non-scalar ``copy`` instructions of the optimized HLO's
entry computation, the kernel count
(from XLA's dump, as ``overhead.py`` counts it), the extra bytes accessed per
parameter over the unguarded step, and the compile time: the median CPU
seconds of this process to trace, lower and compile a fresh ``jax.jit`` of
the step, over ``--repeats`` compilations done round-robin over the variants.
Nothing is run; the step times are ``overhead.py``'s. All settings take
about ten minutes of CPU time on a 2-core machine (most of it the 1000-leaf
model and the 30M transformer); ``--settings`` picks some.

Usage::

  python benchmarks/scaling.py                     # writes benchmarks/results/scaling.{md,json}
  python benchmarks/scaling.py --settings accumulation clip --repeats 1
  python benchmarks/scaling.py --settings leaves --shapes 300 --out /tmp/scaling
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import re
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

# The jaxmp of this checkout, not whichever one is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

# The zero setting shards over 8 host devices; XLA reads the count once,
# before JAX starts. One-device programs compile the same either way.
DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={DEVICES}").strip()

import flax.training.train_state  # pylint: disable=wrong-import-position
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxmp
import jaxmp.flax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import overhead  # pylint: disable=wrong-import-position
from overhead import INITIAL_SCALE, PERIOD, SELECT_SWITCH, Variant  # pylint: disable=wrong-import-position

train_lm = overhead.train_lm
LEARNING_RATE = 1e-3
MICRO_BATCHES = 4
CLIP = 1.0
LEAF_PARAMS = 4_000_000
# The transformer of train_lm at three sizes: d_model, layers, heads.
TRANSFORMERS = {"0.5M": (128, 2, 4), "4M": (256, 5, 4), "30M": (512, 10, 8)}
PEERS = ("unguarded", "jaxmp", "optax.apply_if_finite")
DISTINCT_SHAPES = (10, 100)


class Problem(NamedTuple):
  """A train step's ingredients: its variants, the params and one batch."""

  variants: list[Variant]
  params: Any
  batch: Any


# The models.


def transformer_loss(size: str, seq_len: int = 128, batch_size: int = 8):
  """The bfloat16 loss of train_lm's transformer, its params and a batch."""
  d_model, layers, heads = TRANSFORMERS[size]
  args = argparse.Namespace(d_model=d_model, layers=layers, heads=heads,
                            seq_len=seq_len, batch_size=batch_size)
  loss_fn, params = overhead.bf16_loss_fn(args)
  rng = np.random.default_rng(0)
  batch = jnp.asarray(rng.integers(0, 256, (batch_size, seq_len + 1)), jnp.int32)
  return loss_fn, params, batch


def leaves_loss(n_leaves: int, distinct: bool, n_params: int = LEAF_PARAMS):
  """A loss over ``n_leaves`` float32 leaves of ``n_params`` in all.

  Each leaf is ``(rows, 100)``; with ``distinct``, the rows differ by one
  from leaf to leaf, so every leaf has a shape of its own. Where there are
  more leaves than rows (1000 distinct shapes of 4M parameters), leaf ``i``
  is ``(i + 1, n_params // (n_leaves * (i + 1)))`` instead, so that the
  parameters stay ``n_params`` (rows counting up from 40 would make 54M).
  The loss is the mean of ``tanh(w * x - y) ** 2`` over each leaf, in
  bfloat16: elementwise, so that the optimizer and the guard are most of the
  step.
  """
  rows = max(n_params // (100 * n_leaves), 1)
  shapes = [(rows + (i if distinct else 0), 100) for i in range(n_leaves)]
  if distinct and n_leaves > rows:
    per_leaf = n_params // n_leaves
    shapes = [(i + 1, max(per_leaf // (i + 1), 1)) for i in range(n_leaves)]
  # NumPy draws them: jax.random would compile one sampler per distinct shape.
  rng = np.random.default_rng(0)
  params = {f"w{i:04d}": jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)
            for i, shape in enumerate(shapes)}
  policy = jaxmp.get_policy("mixed_bfloat16")

  def loss_fn(params, batch):
    x, y = policy.cast_to_compute(batch)
    terms = [jnp.mean(jnp.square(jnp.tanh(w * x - y)).astype(jnp.float32))
             for w in jax.tree_util.tree_leaves(policy.cast_to_compute(params))]
    return sum(terms) / len(terms)

  return loss_fn, params, (jnp.float32(1.5), jnp.float32(0.25))


# The variants.


def guard_variants(loss_fn, clip_global_norm: float | None = None) -> list[Variant]:
  """``overhead.py``'s unguarded step, jaxmp and optax.apply_if_finite."""
  variants = overhead.make_variants(loss_fn, LEARNING_RATE, clip_global_norm)
  return [v for v in variants if v.name in PEERS]


def accumulation_variants(loss_fn, k: int = MICRO_BATCHES,
                          clip_global_norm: float | None = None) -> list[Variant]:
  """One micro-batch of a ``k``-step accumulation, three ways.

  ``unguarded``: ``optax.MultiSteps(adamw, k)`` on the plain gradients;
  ``jaxmp``: ``jaxmp.multi_steps(adamw, DynamicLossScale(), k)``; and
  ``optax skip_not_finite``: ``optax.MultiSteps(adamw, k,
  should_skip_update_fn=optax.skip_not_finite)`` on gradients scaled and
  unscaled by a jmp loss scale, adjusted from its ``should_skip`` flag (the
  scale's arrays travel in the state, as in ``overhead.py``). With
  ``clip_global_norm``, ``optax.clip_by_global_norm`` is chained before
  adamw, and jaxmp gets ``clip_global_norm=``.
  """

  def adamw():
    return overhead.clipped_adamw(LEARNING_RATE, clip_global_norm)

  plain = optax.MultiSteps(adamw(), k)
  unguarded_step = overhead.optax_step(loss_fn, plain)

  guarded = jaxmp.multi_steps(
      optax.adamw(LEARNING_RATE), jaxmp.DynamicLossScale(INITIAL_SCALE, period=PERIOD), k,
      clip_global_norm=clip_global_norm)

  def jaxmp_step(state, batch):
    params, opt_state = state
    loss, grads = jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(opt_state))(params, batch)
    updates, opt_state = guarded.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  skipping = optax.MultiSteps(adamw(), k,
                              should_skip_update_fn=optax.skip_not_finite)

  def skipping_step(state, batch):
    params, opt_state, scale, counter = state
    loss_scale = jmp.DynamicLossScale(scale, counter, period=PERIOD)
    scaled_loss, grads = jax.value_and_grad(
        lambda p: loss_scale.scale(loss_fn(p, batch)))(params)
    updates, opt_state = skipping.update(loss_scale.unscale(grads), opt_state, params)
    loss_scale = loss_scale.adjust(jnp.logical_not(opt_state.skip_state["should_skip"]))
    state = (optax.apply_updates(params, updates), opt_state,
             loss_scale.loss_scale, loss_scale.counter)
    return state, loss_scale.unscale(scaled_loss)

  return [
      Variant("unguarded", lambda p: (p, plain.init(p)), unguarded_step),
      Variant("jaxmp", lambda p: (p, guarded.init(p)), jaxmp_step),
      Variant("optax skip_not_finite",
              lambda p: (p, skipping.init(p), jnp.float32(INITIAL_SCALE), jnp.int32(0)),
              skipping_step),
  ]


def train_state_variants(model) -> list[Variant]:
  """The step through Flax's TrainState and through jaxmp.flax.TrainState.

  Under ``mixed_bfloat16``: ``unguarded`` is ``flax.training.TrainState``
  with the policy's cast in the loss; ``jaxmp`` is
  ``jaxmp.flax.TrainState.create(..., policy="mixed_bfloat16")`` (its default
  ``NoOpLossScale``, with the check); ``jaxmp guard=False`` the same without
  the check; ``flax DynamicScale`` is Flax's TrainState with ``DynamicScale``
  and a ``jnp.where`` select, as in Flax's ImageNet example.
  """
  policy = jaxmp.get_policy("mixed_bfloat16")
  flax_state = flax.training.train_state.TrainState

  def cross_entropy(apply, params, batch):
    logits = apply({"params": params}, batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

  def unguarded_init(params):
    return flax_state.create(apply_fn=model.apply, params=params,
                             tx=optax.adamw(LEARNING_RATE))

  def unguarded_step(state, batch):
    loss, grads = jax.value_and_grad(
        lambda p: cross_entropy(state.apply_fn, policy.cast_to_compute(p), batch))(
            state.params)
    return state.apply_gradients(grads=grads), loss

  def jaxmp_init(guard):
    def init(params):
      return jaxmp.flax.TrainState.create(
          apply_fn=model.apply, params=params, tx=optax.adamw(LEARNING_RATE),
          policy=policy, guard=guard)
    return init

  def jaxmp_step(state, batch):
    loss, grads = state.value_and_grad(
        lambda p, b: cross_entropy(state.apply_fn, p, b))(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  def dynamic_scale_init(params):
    return (unguarded_init(params),
            DynamicScale(growth_interval=PERIOD, fin_steps=jnp.int32(0),
                         scale=jnp.float32(INITIAL_SCALE)))

  def dynamic_scale_step(state, batch):
    state, dynamic_scale = state
    dynamic_scale, finite, loss, grads = dynamic_scale.value_and_grad(
        lambda p: cross_entropy(state.apply_fn, policy.cast_to_compute(p), batch))(
            state.params)
    new_state = state.apply_gradients(grads=grads)
    select = functools.partial(jnp.where, finite)
    new_state = new_state.replace(
        params=jax.tree_util.tree_map(select, new_state.params, state.params),
        opt_state=jax.tree_util.tree_map(select, new_state.opt_state, state.opt_state))
    return (new_state, dynamic_scale), loss

  return [
      Variant("unguarded", unguarded_init, unguarded_step),
      Variant("jaxmp", jaxmp_init(True), jaxmp_step),
      Variant("jaxmp guard=False", jaxmp_init(False), jaxmp_step),
      Variant("flax DynamicScale", dynamic_scale_init, dynamic_scale_step),
  ]


def _shard_axis(shape: tuple[int, ...], devices: int) -> int | None:
  """The first axis of ``shape`` that ``devices`` divide, or None."""
  return next((axis for axis, size in enumerate(shape) if size % devices == 0), None)


def zero_spec(x, devices: int = DEVICES) -> P:
  """ZeRO-style: a leaf sharded over ``"d"`` on its first divisible axis.

  Scalars (Adam's count, the loss scale) and leaves no axis of which the
  devices divide are replicated.
  """
  axis = _shard_axis(jnp.shape(x), devices)
  return P() if axis is None else P(*([None] * axis), "d")


def zero_variants(loss_fn, devices: int = DEVICES) -> list[Variant]:
  """The step inside ``jax.shard_map``, ZeRO-style, over ``devices`` devices.

  Every device holds a shard of the params and of the optimizer state
  (:func:`zero_spec`) and one shard of the batch; the params are gathered
  (``all_gather``) for the forward pass, so the gradients arrive sharded
  (its transpose sums and scatters them) and every device updates its own
  shards. ``unguarded`` is adamw; ``jaxmp`` is ``loss_scaling(adamw,
  DynamicLossScale(), axis_name="d")``, whose devices agree on skipping;
  ``jaxmp plain select`` the same traced with ``JAXMP_INPLACE_SELECT=0``.
  """
  if len(jax.devices()) < devices:
    raise RuntimeError(
        f"The zero setting needs {devices} devices, found {len(jax.devices())}. "
        f"Start it with XLA_FLAGS=--xla_force_host_platform_device_count={devices}.")
  mesh = jax.make_mesh((devices,), ("d",), devices=jax.devices()[:devices],
                       axis_types=(jax.sharding.AxisType.Auto,))

  def local_loss(params, batch, specs):
    """The loss of this device's batch shard, with the params gathered
    along the axes ``specs`` (their global shapes' specs) shard them on."""
    def gather(x, spec):
      return jax.lax.all_gather(x, "d", axis=len(spec) - 1, tiled=True) if spec else x
    full = jax.tree_util.tree_map(gather, params, specs)
    # The mean over the whole batch: each device's share of it.
    return loss_fn(full, batch) / devices

  def shard_mapped(body):
    def step(state, batch):
      specs = jax.tree_util.tree_map(lambda x: zero_spec(x, devices), state)
      return jax.shard_map(functools.partial(body, param_specs=specs[0]), mesh=mesh,
                           in_specs=(specs, P("d")), out_specs=(specs, P()))(state, batch)
    return step

  def place(state):
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x, NamedSharding(mesh, zero_spec(x, devices))), state)

  plain = optax.adamw(LEARNING_RATE)

  def unguarded_body(state, batch, param_specs):
    params, opt_state = state
    loss, grads = jax.value_and_grad(local_loss)(params, batch, param_specs)
    updates, opt_state = plain.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), jax.lax.psum(loss, "d")

  guarded = jaxmp.loss_scaling(
      optax.adamw(LEARNING_RATE), jaxmp.DynamicLossScale(INITIAL_SCALE, period=PERIOD),
      axis_name="d")

  def jaxmp_body(state, batch, param_specs):
    params, opt_state = state
    loss, grads = jaxmp.scaled_value_and_grad(
        lambda p, b: local_loss(p, b, param_specs), jaxmp.get_loss_scale(opt_state))(
            params, batch)
    updates, opt_state = guarded.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), jax.lax.psum(loss, "d")

  def plain_select_body(state, batch, param_specs):
    # The switch is read when the update is traced.
    previous = os.environ.get(SELECT_SWITCH)
    os.environ[SELECT_SWITCH] = "0"
    try:
      return jaxmp_body(state, batch, param_specs)
    finally:
      if previous is None:
        del os.environ[SELECT_SWITCH]
      else:
        os.environ[SELECT_SWITCH] = previous

  return [
      Variant("unguarded", lambda p: place((p, plain.init(p))), shard_mapped(unguarded_body)),
      Variant("jaxmp", lambda p: place((p, guarded.init(p))), shard_mapped(jaxmp_body)),
      Variant("jaxmp plain select", lambda p: place((p, guarded.init(p))),
              shard_mapped(plain_select_body)),
  ]


# The settings: a label and how to build its problem.


def _leaves(n_leaves, distinct):
  """Unguarded and jaxmp only: a step of 1000 leaves compiles for minutes."""
  loss_fn, params, batch = leaves_loss(n_leaves, distinct)
  return Problem(guard_variants(loss_fn)[:2], params, batch)


def _transformer(size, make_variants=guard_variants):
  loss_fn, params, batch = transformer_loss(size)
  return Problem(make_variants(loss_fn), params, batch)


def _train_state(size):
  d_model, layers, heads = TRANSFORMERS[size]
  model = train_lm.make_model(d_model, layers, heads, 128)
  _, params, batch = transformer_loss(size)
  return Problem(train_state_variants(model), params, batch)


def _zero(size):
  loss_fn, params, batch = transformer_loss(size)
  return Problem(zero_variants(loss_fn), params, batch)


def leaves_settings(shapes=DISTINCT_SHAPES) -> dict[str, Callable[[], Problem]]:
  """The elementwise model: ``n`` leaves of ``n`` shapes for each ``n`` of
  ``shapes``, and 1000 leaves of one shape."""
  settings = {f"{n} leaves, {n} shapes": functools.partial(_leaves, n, True)
              for n in shapes}
  settings["1000 leaves, 1 shape"] = lambda: _leaves(1000, False)
  return settings


SETTINGS: dict[str, dict[str, Callable[[], Problem]]] = {
    "leaves": leaves_settings(),
    "params": {
        f"transformer {size}": functools.partial(_transformer, size)
        for size in TRANSFORMERS
    },
    "clip": {
        "transformer 4M, clip 1.0": lambda: _transformer(
            "4M", functools.partial(guard_variants, clip_global_norm=CLIP)),
    },
    "accumulation": {
        f"transformer 4M, {MICRO_BATCHES} micro-batches": lambda: _transformer(
            "4M", accumulation_variants),
    },
    "train_state": {
        "transformer 4M, TrainState bf16": lambda: _train_state("4M"),
    },
    "zero": {
        f"transformer 4M, ZeRO-style shard_map over {DEVICES} devices":
            lambda: _zero("4M"),
    },
}


def state_copies(compiled) -> int:
  """The ``copy`` instructions of non-scalar buffers in the optimized HLO's
  entry computation (copies inside fusions are layout changes, not buffers).

  The guard promises no extra copy of the params or the optimizer state.
  """
  entry = compiled.as_text().split("\nENTRY", 1)[1]
  return sum(1 for line in entry.splitlines()
             if re.search(r" = [a-z0-9]+\[[0-9,]+\][^ ]* copy\(", line))


def measure_problem(problem: Problem, repeats: int, dumps: bool = True
                    ) -> dict[str, dict[str, Any]]:
  """The figures of every variant of ``problem`` (see the module's docstring).

  With ``repeats=0`` (the tests, which assert no time) nothing is timed: the
  one compilation XLA dumps gives every figure, and the compile seconds and
  ratios are None.
  """
  if repeats == 0 and not dumps:
    raise ValueError("measure_problem needs repeats >= 1 or dumps=True: "
                     "there would be nothing to compile")
  n_params = sum(x.size for x in jax.tree_util.tree_leaves(problem.params))
  states = {v.name: v.init(overhead.copy_tree(problem.params)) for v in problem.variants}
  cpu = {v.name: [] for v in problem.variants}
  figures = {}
  for repeat in range(repeats):
    for variant in problem.variants:
      compiled, _, cpu_seconds = overhead.compile_step(
          variant.step, states[variant.name], problem.batch)
      cpu[variant.name].append(cpu_seconds)
      if repeat == 0:
        figures[variant.name] = overhead.compiler_figures(compiled)
        figures[variant.name]["copies"] = state_copies(compiled)
  base_name = problem.variants[0].name
  for variant in problem.variants:
    if dumps:
      compiled, dump = overhead.compile_dumped(
          variant.step, states[variant.name], problem.batch)
      if variant.name not in figures:  # untimed: the dumped compilation's figures
        figures[variant.name] = overhead.compiler_figures(compiled)
        figures[variant.name]["copies"] = state_copies(compiled)
      figures[variant.name].update(dump)
    f = figures[variant.name]
    f["compile_seconds"] = statistics.median(cpu[variant.name]) if repeats else None
    f["compile_cpu_seconds_all"] = cpu[variant.name]
    f["parameters"] = int(n_params)
    f["leaves"] = len(jax.tree_util.tree_leaves(problem.params))
  base = figures[base_name]
  for f in figures.values():
    f["bytes_accessed_ratio"] = f["bytes_accessed"] / base["bytes_accessed"]
    f["temp_ratio"] = f["temp_bytes"] / base["temp_bytes"]
    f["compile_ratio"] = (f["compile_seconds"] / base["compile_seconds"]
                          if repeats else None)
    f["extra_bytes_per_param"] = (f["bytes_accessed"] - base["bytes_accessed"]) / n_params
  return figures


def measure(args: argparse.Namespace,
            on_setting: Callable[[dict[str, Any]], None] = lambda _: None
            ) -> dict[str, Any]:
  """Measures every setting of ``args.settings``; ``on_setting`` sees the
  results so far after each one."""
  results = {"config": {"settings": args.settings, "repeats": args.repeats,
                        "shapes": args.shapes},
             "machine": overhead.machine_description(), "settings": {}}
  settings = dict(SETTINGS, leaves=leaves_settings(args.shapes))
  for group in args.settings:
    for label, build in settings[group].items():
      results["settings"][label] = measure_problem(build(), args.repeats)
      print(f"measured {label}", file=sys.stderr)
      on_setting(results)
  return results


def markdown(results: dict[str, Any]) -> str:
  """The results as one Markdown table, each setting against its unguarded step."""
  lines = [
      "| setting | variant | bytes accessed | extra B/param | temp memory | kernels "
      "| compile (CPU s) | compile |",
      "|---|---|---|---|---|---|---|---|",
  ]
  for label, figures in results["settings"].items():
    base = next(iter(figures.values()))
    leaves = "" if "leaves" in label else f", {base['leaves']} leaves"
    label = f"{label} ({base['parameters'] / 1e6:.2g}M params{leaves})"
    for name, f in figures.items():
      kernels = "n/a" if f.get("kernels") is None else (
          f"{f['kernels']} ({f['kernels'] - base['kernels']:+d})")
      lines.append(
          f"| {label} | {name} | {overhead.percent(f['bytes_accessed_ratio'], 2)} | "
          f"{f['extra_bytes_per_param']:+.2f} | {overhead.percent(f['temp_ratio'], 2)} | "
          f"{kernels} | {f['compile_seconds']:.2f} | {f['compile_ratio']:.2f}× |")
  copies = [(label, name, f["copies"]) for label, figures in results["settings"].items()
            for name, f in figures.items() if "copies" in f]
  if copies:
    lines += ["", "| setting | variant | copies of non-scalar buffers |", "|---|---|---|"]
    lines += [f"| {label} | {name} | {n} |" for label, name, n in copies]
  machine = results["machine"]
  lines += [
      "",
      "Each setting against its first variant (the unguarded step). Bytes "
      "accessed and temp memory: `cost_analysis()` and `memory_analysis()` of "
      "the compiled step with a donated state; extra B/param: the extra bytes "
      "accessed per parameter per step; kernels: kernel modules XLA compiled; "
      f"compile: median CPU seconds of {results['config']['repeats']} fresh "
      "traces and compilations, done round-robin over the variants. Copies: "
      "`copy` instructions of non-scalar buffers in the optimized HLO's entry "
      "computation (per device inside `shard_map`).",
      "",
      f"Machine: {machine['platform']} ({machine['device_kind']}, "
      f"{machine['cpu_count']} cores), JAX {machine['jax']}, optax "
      f"{machine['optax']}, flax {machine['flax']}, jmp {machine['jmp']}.",
  ]
  return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  parser.add_argument("--settings", nargs="+", choices=list(SETTINGS),
                      default=list(SETTINGS))
  parser.add_argument("--shapes", type=int, nargs="+", default=list(DISTINCT_SHAPES),
                      help="distinct leaf shapes of the leaves setting's models "
                           "(besides 1000 leaves of one shape)")
  parser.add_argument("--repeats", type=int, default=1,
                      help="fresh compilations per variant for the compile time")
  overhead.add_out_argument(parser, "scaling")
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be 1 or more (the table compares compile "
                 f"times), got {args.repeats}")
  # The benchmark transformer's attention spreads float32 on purpose
  # (autocast.py measures that); TrainState.value_and_grad would say so.
  warnings.simplefilter("ignore", jaxmp.PrecisionWarning)
  # The results so far are written after each setting: a long run that is
  # stopped keeps what it measured.
  results = measure(args, lambda partial: overhead.write_results(
      args.out, "scaling", partial, markdown(partial)))
  print(f"wrote {args.out}/scaling.md", file=sys.stderr)
  del results
  return 0


if __name__ == "__main__":
  sys.exit(main())
