"""Forms of the finiteness check and XLA flags, against the compile time.

One process measures the unguarded step and jaxmp's step of one model under
the ``XLA_FLAGS`` it was started with, with one form of the check in
``jaxmp.loss_scaling``: bytes accessed, temp memory, kernel modules and the
CPU seconds of trace, lower and compile (as ``scaling.py`` measures them),
and appends them as one JSON line to ``--out``. The forms:

* ``by-shape`` (``jaxmp.all_finite`` on a CPU, the default): the leaves grouped by
  shape and dtype, one variadic ``lax.reduce`` over the tuple of each group's
  ``isfinite`` operands (one reduce op per distinct shape);
* ``per-leaf`` (the check jaxmp shipped before, and its form off a CPU):
  ``jnp.all(jnp.isfinite(x))`` per leaf, stacked and reduced;
* ``pairs``: one two-operand reduce per leaf (jaxmp's reduce applied to each
  leaf alone);
* ``by-size``: the leaves grouped by size whatever their shape, flattened, one
  variadic reduce per size (fewer kernels; not shipped, because flattening a
  leaf sharded on a trailing axis makes XLA all-gather it under ``jit``);
* ``group-flag``: ``by-shape`` with one flag per group rather than per leaf.

``--forms by-shape,by-size`` measures several forms in one process, round
robin with the unguarded step, and reports each form's median of the
per-round compile ratios (compile times drift within a process, so ratios of
the same round are the fairer comparison).

XLA flags must be set before JAX starts, so each flag is one process::

  XLA_FLAGS=--xla_backend_optimization_level=1 \\
    python benchmarks/check_forms.py --model transformer --label "opt level 1"
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scaling  # pylint: disable=wrong-import-position

overhead = scaling.overhead
import jaxmp._src.loss_scaling as loss_scaling_module  # pylint: disable=wrong-import-position
from jaxmp._src.loss_scale import leaf_finite_flags  # pylint: disable=wrong-import-position


def all_finite_per_leaf(tree: Any) -> jax.Array:
  """``jnp.all(jnp.isfinite(x))`` per leaf: ``jaxmp.all_finite`` off a CPU."""
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]).all()


def all_finite_pairs(tree: Any) -> jax.Array:
  """``jaxmp.all_finite``'s decision, one two-operand reduce per leaf."""
  flags = [jnp.array(True)]
  for x in jax.tree_util.tree_leaves(tree):
    flags += leaf_finite_flags([x])
  return jnp.stack(flags).all()


def _and_each(accumulated, values):
  return tuple(jnp.logical_and(a, v) for a, v in zip(accumulated, values))


def _and_into_first(accumulated, values):
  """ANDs every operand's value into the first output, so one output is the
  whole group's flag."""
  first = functools.reduce(jnp.logical_and, values, accumulated[0])
  return (first,) + _and_each(accumulated[1:], values[1:])


def _grouped_check(tree: Any, key, flatten: bool, one_flag: bool) -> jax.Array:
  """The floating leaves grouped by ``key(leaf)``, one variadic reduce of at
  most 64 of a group's ``isfinite`` operands at a time (flattened first with
  ``flatten``); with ``one_flag`` each reduce gives one flag, not one per leaf."""
  groups: dict[Any, list[jax.Array]] = {}
  for x in jax.tree_util.tree_leaves(tree):
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
      groups.setdefault(key(x), []).append(x)
  flags = [jnp.array(True)]
  for leaves in groups.values():
    for start in range(0, len(leaves), 64):
      operands = [jnp.isfinite(x) for x in leaves[start:start + 64]]
      operands = [x.reshape(-1) for x in operands] if flatten else operands
      operands = operands * 2 if len(operands) == 1 else operands
      reduced = jax.lax.reduce(operands, [np.bool_(True)] * len(operands),
                               _and_into_first if one_flag else _and_each,
                               tuple(range(operands[0].ndim)))
      flags += reduced[:1] if one_flag else reduced
  return jnp.stack(flags).all()


def all_finite_by_size(tree: Any) -> jax.Array:
  """The leaves grouped by size, flattened, one variadic reduce per size."""
  return _grouped_check(tree, lambda x: x.size, flatten=True, one_flag=False)


def all_finite_group_flag(tree: Any) -> jax.Array:
  """``by-shape``, with one flag per group instead of one per leaf."""
  return _grouped_check(tree, lambda x: x.shape, flatten=False, one_flag=True)


FORMS = {"per-leaf": all_finite_per_leaf, "by-shape": loss_scaling_module.all_finite,
         "pairs": all_finite_pairs, "by-size": all_finite_by_size,
         "group-flag": all_finite_group_flag}

MODELS = {
    "transformer": lambda: scaling._transformer("4M"),  # pylint: disable=protected-access
    "shapes100": lambda: scaling._leaves(100, True),  # pylint: disable=protected-access
}


def with_form(variant: scaling.Variant, form: str) -> scaling.Variant:
  """``variant`` traced with ``form`` as ``loss_scaling``'s check."""

  def step(state, batch):
    loss_scaling_module.all_finite = FORMS[form]
    return variant.step(state, batch)

  return scaling.Variant(form, variant.init, step)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=list(MODELS), required=True)
  parser.add_argument("--forms", default="by-shape",
                      help="comma-separated forms, measured round robin: "
                      + ", ".join(FORMS))
  parser.add_argument("--label", default="default flags")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--out", default="check_forms.jsonl")
  args = parser.parse_args(argv)
  forms = args.forms.split(",")
  unknown = [f for f in forms if f not in FORMS]
  if unknown:
    parser.error(f"unknown forms {unknown}; choose from {list(FORMS)}")
  problem = MODELS[args.model]()
  unguarded, guarded = problem.variants[:2]
  variants = [unguarded] + [with_form(guarded, form) for form in forms]
  figures = scaling.measure_problem(
      scaling.Problem(variants, problem.params, problem.batch), args.repeats)
  base = figures[unguarded.name]["compile_cpu_seconds_all"]
  for f in figures.values():
    f["compile_ratio_per_round"] = statistics.median(
        x / b for x, b in zip(f["compile_cpu_seconds_all"], base))
  record = {"model": args.model, "forms": forms, "label": args.label,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "figures": {name: {k: f[k] for k in (
                "bytes_accessed", "temp_bytes", "kernels", "compile_seconds",
                "compile_cpu_seconds_all", "bytes_accessed_ratio", "compile_ratio",
                "compile_ratio_per_round", "extra_bytes_per_param")}
                        for name, f in figures.items()}}
  with open(args.out, "a", encoding="utf-8") as out:
    out.write(json.dumps(record) + "\n")
  u = figures[unguarded.name]
  print(f"{args.model} [{args.label}]: unguarded {u['kernels']} kernels "
        f"{u['compile_seconds']:.2f} s")
  for form in forms:
    g = figures[form]
    print(f"  {form}: {g['kernels']} kernels {g['compile_seconds']:.2f} s "
          f"({g['compile_ratio_per_round']:.2f}x per round), bytes "
          f"{(g['bytes_accessed_ratio'] - 1) * 100:+.2f}%")
  return 0


if __name__ == "__main__":
  sys.exit(main())
