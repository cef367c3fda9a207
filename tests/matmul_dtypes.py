"""Reads off a jaxpr the dtypes its matrix products and convolutions run in."""

import jax
import jax.extend as jex

MATMULS = ("dot_general", "conv_general_dilated")


def matmul_dtypes(fun, *args, **kwargs) -> list[tuple[str, tuple[str, ...]]]:
  """``(primitive, input dtypes)`` of every dot_general and conv of ``fun(*args)``.

  Traces ``fun`` with ``jax.make_jaxpr`` (nothing runs) and walks the
  sub-jaxprs too (``jit``, ``remat``, ``scan``, custom derivatives), in order.
  """
  found = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name in MATMULS:
        found.append(
            (eqn.primitive.name, tuple(str(v.aval.dtype) for v in eqn.invars)))
      for sub in jex.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(fun)(*args, **kwargs).jaxpr)
  return found


def input_dtypes(fun, *args, **kwargs) -> set[str]:
  """The set of input dtypes of all the matmuls and convs of ``fun(*args)``."""
  return {d for _, dtypes in matmul_dtypes(fun, *args, **kwargs) for d in dtypes}
