"""Reads off a jaxpr the dtypes its matrix products and convolutions run in."""

import jax
import jax.extend as jex

MATMULS = ("dot_general", "conv_general_dilated")


def all_eqns(jaxpr):
  """Every equation of ``jaxpr`` (closed or open) and of the programs inside it."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
    yield eqn
    for inner in jex.core.jaxprs_in_params(eqn.params):
      yield from all_eqns(inner)


def matmul_dtypes(fun, *args, **kwargs) -> list[tuple[str, tuple[str, ...]]]:
  """``(primitive, input dtypes)`` of every dot_general and conv of ``fun(*args)``.

  Traces ``fun`` with ``jax.make_jaxpr`` (nothing runs) and walks the
  sub-jaxprs too (``jit``, ``remat``, ``scan``, custom derivatives), in order.
  """
  return [(e.primitive.name, tuple(str(v.aval.dtype) for v in e.invars))
          for e in all_eqns(jax.make_jaxpr(fun)(*args, **kwargs)) if e.primitive.name in MATMULS]


def input_dtypes(fun, *args, **kwargs) -> set[str]:
  """The set of input dtypes of all the matmuls and convs of ``fun(*args)``."""
  return {d for _, dtypes in matmul_dtypes(fun, *args, **kwargs) for d in dtypes}
