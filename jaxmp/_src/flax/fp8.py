"""FP8 matmuls: Flax's ``fp8_ops`` under an FP8 policy, for Linen and NNX.

A Linen Dense layer gets Flax's ``Fp8DirectDotGeneralOp`` as its
``dot_general_cls``; an NNX matmul layer an op calling Flax's
``fp8_scaled_dot_general`` with its meta in :class:`Fp8Meta` variables. As
in Flax, a meta leaf's gradient is its new value. jaxmp stores the
output-gradient meta in unscaled units, keeps the meta of an op that did not
run, and skips a step whose new meta is not finite; the meta is state kept
with :func:`jaxmp.keep_on_skip`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops
from jax import lax

from jaxmp._src.loss_scale import all_finite
from jaxmp._src.policy import Fp8Policy

FP8_META = fp8_ops.OVERWRITE_WITH_GRADIENT  # Flax's collection of the meta
# The meta measured on the output gradients: scaled in a step, stored unscaled.
_OUTPUT_GRAD = ("output_grad_scale", "output_grad_amax_history")


def _own_matmul(policy: Any, layer: str, path: str, attribute: str) -> ValueError:
  return ValueError(
      f"{policy}: the {layer} at {path or '(root)'!r} has its own {attribute}, "
      "which the FP8 policy would replace. Give it its own rule with a policy "
      f"without dot=fp8 (e.g. jaxmp.flax.ModulePolicy({{'{path}': "
      f"'mixed_bfloat16'}}, default='mixed_fp8')), or drop its {attribute}.")


def fp8_dot_general_cls(module: Any, policy: Any, path: str) -> Any:
  """The ``dot_general_cls`` a Linen module gets under ``policy``, or None."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if not isinstance(policy, Fp8Policy):
    return None
  if isinstance(module, nn.Einsum):
    raise ValueError(
        f"{policy}: the module Einsum at {path!r} is a Linen nn.Einsum, which "
        "computes with jnp.einsum and takes no dot_general_cls, so the FP8 "
        "policy cannot reach its matmul. Give it a rule with a policy without "
        "dot=fp8 (e.g. jaxmp.flax.ModulePolicy({Einsum: 'mixed_bfloat16'}, "
        "default='mixed_fp8')), or use nn.DenseGeneral for the matmul to run "
        "in FP8.")
  if not isinstance(module, (nn.Dense, nn.DenseGeneral)):
    return None
  if module.dot_general_cls is not None or module.dot_general is not None:
    raise _own_matmul(policy, type(module).__name__, path, "dot_general")
  return functools.partial(fp8_ops.Fp8DirectDotGeneralOp,
                           amax_history_length=policy.amax_history_length)


def _is_output_grad(path: tuple[Any, ...]) -> bool:
  return getattr(path[-1], "key", getattr(path[-1], "name", None)) in _OUTPUT_GRAD


@jax.custom_vjp
def _to_scaled_units(x: jax.Array, loss_scale: jax.Array) -> jax.Array:
  return x * loss_scale.astype(x.dtype)


def _to_scaled_units_fwd(x, loss_scale):
  return _to_scaled_units(x, loss_scale), loss_scale


def _to_scaled_units_bwd(loss_scale, new_value):
  # Flax's ops return a meta leaf's new value as its cotangent: in the step's
  # (scaled) units, stored without the loss scale.
  return new_value / loss_scale.astype(new_value.dtype), jnp.zeros_like(loss_scale)


_to_scaled_units.defvjp(_to_scaled_units_fwd, _to_scaled_units_bwd)


def in_step_units(fp8_meta: Any, loss_scale: jax.Array) -> Any:
  """The meta as the ops of a step at ``loss_scale`` see it.

  The op quantizes the *scaled* output gradient, so its stored (unscaled)
  output-gradient meta is multiplied by the loss scale for the step, and the
  new values it returns are divided by it: exact for a power-of-two scale, so
  the FP8 range moves with the loss scale instead of saturating.
  """
  loss_scale = jnp.asarray(loss_scale, jnp.float32)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: _to_scaled_units(leaf, loss_scale)
      if _is_output_grad(path) else leaf, fp8_meta)


def split_fp8_grads(tree: Any, owner: str = "TrainState") -> tuple[Any, Any] | None:
  """``(params, meta)`` of Flax's layout ``{"params": ..., FP8_META: ...}``, or None."""
  if not (isinstance(tree, Mapping) and FP8_META in tree):
    return None
  if set(tree) != {"params", FP8_META}:
    raise ValueError(
        f"{owner}: Flax's FP8 layout is {{'params': ..., {FP8_META!r}: ...}}, "
        f"got the keys {sorted(tree)}. Keep other collections (batch_stats) in "
        "fields of their own.")
  return tree["params"], tree[FP8_META]


def keep_meta_of_ops_that_did_not_run(old_meta: Any, new_meta: Any) -> Any:
  """``new_meta``, with the old meta of each op whose new ``input_scale`` is 0.

  An op that did not run in the step gets zeros as its "gradient"; written
  back, its scales would be 0.
  """
  ran = {path[:-1]: jnp.all(leaf != 0)
         for path, leaf in jax.tree_util.tree_leaves_with_path(new_meta)
         if getattr(path[-1], "key", getattr(path[-1], "name", None)) == "input_scale"}
  return jax.tree_util.tree_map_with_path(
      lambda path, old, new: new if path[:-1] not in ran
      else jnp.where(ran[path[:-1]], new, old), old_meta, new_meta)


def skip_unless_meta_finite(grads: Any, new_meta: Any) -> Any:
  """``grads``, made nan where the new meta is not finite.

  Flax's ops saturate an inf output gradient, so the weight gradients may be
  finite while the new amax is not: the loss-scaling optimizer then skips.
  """
  finite = all_finite(new_meta)
  return jax.tree_util.tree_map(
      lambda g: jnp.where(finite, g, jnp.asarray(jnp.nan, g.dtype)), grads)


# NNX: the ops and their meta.


class Fp8Meta(nnx.Variable):
  """The NNX variable type of the FP8 meta: scales and amax histories.

  Under an FP8 policy, :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes` gives
  each ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` an FP8 op
  whose six meta arrays, named and initialised as in Flax's Linen
  ``fp8_ops``, are variables of this type. It is no ``nnx.Param``, so an
  ``nnx.Optimizer(..., wrt=nnx.Param)`` never sees it; use it as an NNX
  filter.

  Args:
    value: a ``(1,)`` scale or an ``(amax_history_length,)`` history.
    **metadata: NNX variable metadata.

  Example:
    >>> import jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> _ = jaxmp.flax.ModulePolicy({}, default="mixed_fp8").set_nnx_dtypes(model)
    >>> meta = nnx.state(model, jaxmp.flax.Fp8Meta)
    >>> meta["dot_general"]["input_scale"][...]
    Array([1.], dtype=float32)
  """

  def __init__(self, value: Any, **metadata: Any):
    super().__init__(value, **metadata)


# NNX's metaclass shows inspect (*args, **kwargs): the signature of __init__.
Fp8Meta.__signature__ = inspect.signature(Fp8Meta.__init__).replace(
    parameters=list(inspect.signature(Fp8Meta.__init__).parameters.values())[1:])


class Fp8Op(nnx.Module):
  """The meta of one FP8 matmul, laid out as Flax's Linen op's."""

  def __init__(self, amax_history_length: int):
    self.amax_history_length = amax_history_length
    for kind in ("input", "kernel", "output_grad"):
      setattr(self, f"{kind}_amax_history",
              Fp8Meta(jnp.zeros((amax_history_length,), jnp.float32)))
      setattr(self, f"{kind}_scale", Fp8Meta(jnp.ones((1,), jnp.float32)))

  def _dot_general(self, compute_dtype: Any) -> Any:
    return functools.partial(
        fp8_ops.fp8_scaled_dot_general,
        lhs_scale=self.input_scale[...], rhs_scale=self.kernel_scale[...],
        grad_scale=self.output_grad_scale[...],
        lhs_amax_history=self.input_amax_history[...],
        rhs_amax_history=self.kernel_amax_history[...],
        grad_amax_history=self.output_grad_amax_history[...],
        quantize_compute_type=compute_dtype)


def _no_out_sharding(out_sharding: Any) -> None:
  if out_sharding is not None:
    raise ValueError(
        "jaxmp's FP8 op: Flax's fp8_scaled_dot_general takes no out_sharding, "
        f"but the layer was called with out_sharding={out_sharding!r}. Call "
        "the layer without it (shard the result with jax.sharding.reshard), "
        "or give the layer a policy without dot=fp8.")


class Fp8DotGeneral(Fp8Op):
  """An ``nnx.Linear``'s ``dot_general`` in FP8, as Flax's ``Fp8DirectDotGeneralOp``."""

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    del precision  # fp8_scaled_dot_general sets its own
    _no_out_sharding(out_sharding)
    lhs = jnp.asarray(lhs, rhs.dtype)
    return self._dot_general(rhs.dtype)(
        lhs, rhs, dimension_numbers,
        preferred_element_type=preferred_element_type or lhs.dtype)


class Fp8Einsum(Fp8Op):
  """An ``nnx.Einsum``'s ``einsum_op`` in FP8, as Flax's ``fp8_ops.Fp8Einsum``."""

  def __call__(self, einsum_str, lhs, rhs, precision=None,
               preferred_element_type=None, out_sharding=None):
    _no_out_sharding(out_sharding)
    return jnp.einsum(einsum_str, lhs.astype(rhs.dtype), rhs, precision=precision,
                      preferred_element_type=preferred_element_type,
                      _dot_general=self._dot_general(rhs.dtype))


def nnx_fp8_op(module: Any, policy: Any, path: str,
               switching: bool) -> tuple[str, Any, str | None] | None:
  """``(attribute, value, path if an FP8 op comes off)`` that gives an NNX
  layer its matmul under ``policy``, or None to leave it.

  A layer with an FP8 op of the same history length keeps it (and its meta).
  Another FP8 op comes off (its meta with it) only when ``switching``
  (:func:`jaxmp.switch_precision`); else it is refused.
  """
  if isinstance(module, nnx.Einsum):
    attribute, default, op_type = "einsum_op", jnp.einsum, Fp8Einsum
  elif isinstance(module, nnx.Linear):
    attribute, default, op_type = "dot_general", lax.dot_general, Fp8DotGeneral
  elif isinstance(module, nnx.LinearGeneral):
    attribute, default, op_type = "dot_general", None, Fp8DotGeneral
  else:
    return None
  current, fp8 = getattr(module, attribute), isinstance(policy, Fp8Policy)
  new = nnx.data(op_type(policy.amax_history_length)) if fp8 else nnx.static(default)
  layer = type(module).__name__
  if isinstance(current, Fp8Op):
    if fp8 and current.amax_history_length == policy.amax_history_length:
      return None
    if not switching:
      raise ValueError(
          f"set_nnx_dtypes: the {layer} at {path or '(root)'!r} already has "
          "jaxmp's FP8 op from an earlier set_nnx_dtypes, with an amax history "
          f"of {current.amax_history_length}, which {policy} would change. "
          "Build the model anew and call set_nnx_dtypes once with the policy "
          "you want (or switch it with jaxmp.switch_precision).")
    return attribute, new, path
  if not fp8:
    return None
  if isinstance(module, nnx.LinearGeneral) and module.dot_general_cls is not None:
    raise _own_matmul(policy, layer, path, "dot_general_cls")
  if current is not default:
    raise _own_matmul(policy, layer, path, attribute)
  return attribute, new, None
