"""Forms of the finiteness check and XLA flags, against the compile time.

One process measures the unguarded step and jaxmp's step of one model under
the ``XLA_FLAGS`` it was started with, with one form of the check in
``jaxmp.loss_scaling``: bytes accessed, temp memory, kernel modules and the
CPU seconds of trace, lower and compile (as ``scaling.py`` measures them),
and appends them as one JSON line to ``--out``. The forms:

* ``by-shape`` (``jaxmp.all_finite``, the default): the leaves grouped by
  shape and dtype, one variadic ``lax.reduce`` over the tuple of each group's
  ``isfinite`` operands (one reduce op per distinct shape);
* ``per-leaf`` (the check jaxmp shipped before): ``jnp.all(jnp.isfinite(x))``
  per leaf, stacked and reduced;
* ``pairs``: one two-operand reduce per leaf (jaxmp's reduce applied to each
  leaf alone).

XLA flags must be set before JAX starts, so each flag is one process::

  XLA_FLAGS=--xla_backend_optimization_level=1 \\
    python benchmarks/check_forms.py --model transformer --label "opt level 1"
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scaling  # pylint: disable=wrong-import-position

overhead = scaling.overhead
import jaxmp._src.loss_scaling as loss_scaling_module  # pylint: disable=wrong-import-position
from jaxmp._src.loss_scale import leaf_finite_flags  # pylint: disable=wrong-import-position


def all_finite_per_leaf(tree: Any) -> jax.Array:
  """The check jaxmp shipped before: ``jnp.all(jnp.isfinite(x))`` per leaf."""
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


FORMS = {"per-leaf": all_finite_per_leaf, "by-shape": loss_scaling_module.all_finite,
         "pairs": all_finite_pairs}

MODELS = {
    "transformer": lambda: scaling._transformer("4M"),  # pylint: disable=protected-access
    "shapes100": lambda: scaling._leaves(100, True),  # pylint: disable=protected-access
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--model", choices=list(MODELS), required=True)
  parser.add_argument("--form", choices=list(FORMS), default="by-shape")
  parser.add_argument("--label", default="default flags")
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--out", default="check_forms.jsonl")
  args = parser.parse_args(argv)
  loss_scaling_module.all_finite = FORMS[args.form]
  problem = MODELS[args.model]()
  figures = scaling.measure_problem(
      scaling.Problem(problem.variants[:2], problem.params, problem.batch), args.repeats)
  record = {"model": args.model, "form": args.form, "label": args.label,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "figures": {name: {k: f[k] for k in (
                "bytes_accessed", "temp_bytes", "kernels", "compile_seconds",
                "compile_cpu_seconds_all", "bytes_accessed_ratio", "compile_ratio",
                "extra_bytes_per_param")} for name, f in figures.items()}}
  with open(args.out, "a", encoding="utf-8") as out:
    out.write(json.dumps(record) + "\n")
  g, u = figures["jaxmp"], figures["unguarded"]
  print(f"{args.model} {args.form} [{args.label}]: unguarded {u['kernels']} kernels "
        f"{u['compile_seconds']:.2f} s; jaxmp {g['kernels']} kernels "
        f"{g['compile_seconds']:.2f} s ({g['compile_ratio']:.2f}x), bytes "
        f"{(g['bytes_accessed_ratio'] - 1) * 100:+.2f}%")
  return 0


if __name__ == "__main__":
  sys.exit(main())
