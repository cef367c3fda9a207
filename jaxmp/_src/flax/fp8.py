"""FP8 matmuls in Linen modules: Flax's ``fp8_ops`` under a policy and a guard.

An :class:`jaxmp.Fp8Policy` makes the ``nn.Dense`` and ``nn.DenseGeneral``
modules that run under it call Flax's ``fp8_ops.Fp8DirectDotGeneralOp``
(injected as their ``dot_general_cls`` by the :class:`jaxmp.flax.ModulePolicy`
interceptor). Flax keeps each op's scales and amax histories, the *FP8 meta*,
in the collection ``"_overwrite_with_gradient"``: the "gradient" of a meta
leaf is its new value. This module holds what jaxmp adds around Flax's ops:

* :func:`fp8_dot_general_cls`: which op a module gets (and the refusal of the
  modules it cannot reach);
* :func:`in_step_units`: the FP8 meta of the output gradients is kept in
  *unscaled* units; for one step it is multiplied by the loss scale (the
  gradients the op sees are scaled), and its new value divided by it;
* :func:`split_fp8_grads` and :func:`meta_is_finite`, which
  :meth:`jaxmp.flax.TrainState.apply_gradients` uses to guard the meta.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxmp._src.loss_scale import all_finite
from jaxmp._src.policy import Fp8Policy

# The Flax collection of the FP8 meta (scales and amax histories).
FP8_META = fp8_ops.OVERWRITE_WITH_GRADIENT

# The meta leaves measured on the output gradients: in the loss scale's units
# inside a step, stored without it.
_OUTPUT_GRAD_LEAVES = ("output_grad_scale", "output_grad_amax_history")


def uses_fp8(policies: Any) -> bool:
  """Whether any of ``policies`` (an iterable of policies or None) is FP8."""
  return any(isinstance(p, Fp8Policy) for p in policies)


def fp8_dot_general_cls(module: Any, policy: Any) -> Any:
  """The ``dot_general_cls`` to give ``module`` while it runs under ``policy``.

  ``None`` when nothing is injected: the policy is not an
  :class:`jaxmp.Fp8Policy`, or the module is not a Dense layer (activations,
  norms, convolutions and the FP8 ops themselves run in the base compute
  dtype).

  Raises:
    ValueError: for an ``nn.Einsum`` under an FP8 policy (Flax's ``nn.Einsum``
      takes no ``dot_general_cls``), or a Dense layer that has its own
      ``dot_general``/``dot_general_cls``.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if not isinstance(policy, Fp8Policy):
    return None
  if isinstance(module, nn.Einsum):
    raise ValueError(
        f"{policy}: the module {type(module).__name__} {module.name!r} is an "
        "nn.Einsum, whose matmul Flax gives no hook (no dot_general_cls), so "
        "it cannot run in FP8 without editing the model. Give it its own "
        "rule, e.g. jaxmp.flax.ModulePolicy({nn.Einsum: 'mixed_bfloat16'}, "
        "default='mixed_fp8'), or build it with Flax's fp8_ops.Fp8Einsum in "
        "the model.")
  if not isinstance(module, (nn.Dense, nn.DenseGeneral)):
    return None
  if module.dot_general_cls is not None or module.dot_general is not None:
    raise ValueError(
        f"{policy}: the module {type(module).__name__} {module.name!r} has "
        "its own dot_general/dot_general_cls, which the FP8 policy would "
        "replace. Give it its own rule with a policy without dot=fp8 (e.g. "
        "jaxmp.flax.ModulePolicy({'" + str(module.name) + "': "
        "'mixed_bfloat16'}, default='mixed_fp8')), or drop its dot_general.")
  return functools.partial(
      fp8_ops.Fp8DirectDotGeneralOp,
      amax_history_length=policy.amax_history_length)


def _is_output_grad_leaf(path: tuple[Any, ...]) -> bool:
  last = path[-1] if path else None
  return getattr(last, "key", getattr(last, "name", None)) in _OUTPUT_GRAD_LEAVES


@jax.custom_vjp
def _to_scaled_units(x: jax.Array, loss_scale: jax.Array) -> jax.Array:
  return x * loss_scale.astype(x.dtype)


def _to_scaled_units_fwd(x, loss_scale):
  return _to_scaled_units(x, loss_scale), loss_scale


def _to_scaled_units_bwd(loss_scale, new_value):
  # Flax's ops return a meta leaf's new value as its cotangent: it comes back
  # in the step's (scaled) units and is stored without the loss scale.
  return new_value / loss_scale.astype(new_value.dtype), jnp.zeros_like(loss_scale)


_to_scaled_units.defvjp(_to_scaled_units_fwd, _to_scaled_units_bwd)


def in_step_units(fp8_meta: Any, loss_scale: jax.Array) -> Any:
  """The FP8 meta as the ops of one step at ``loss_scale`` must see it.

  The output-gradient scales and amax histories are stored in unscaled units;
  the op quantizes the *scaled* output gradient, so for the step they are
  multiplied by the loss scale, and the new values the op returns (as the
  meta's cotangents) are divided by it. With a power-of-two loss scale both
  are exact, so after a finite step the stored meta equals what Flax's own
  rule gives at loss scale 1, and a change of loss scale moves the FP8 range
  with it instead of overflowing (saturating) or wasting it for a whole
  history window. The input and kernel meta is used as it is.
  """
  loss_scale = jnp.asarray(loss_scale, jnp.float32)

  def convert(path, leaf):
    return _to_scaled_units(leaf, loss_scale) if _is_output_grad_leaf(path) else leaf

  return jax.tree_util.tree_map_with_path(convert, fp8_meta)


def split_fp8_grads(grads: Any) -> tuple[Any, Any] | None:
  """``(param_grads, new_fp8_meta)`` of ``{"params": ..., FP8_META: ...}``.

  ``None`` when ``grads`` holds no FP8 meta (the plain gradients of the
  params).

  Raises:
    ValueError: if ``grads`` holds the meta next to other keys than
      ``"params"``.
  """
  if not (isinstance(grads, Mapping) and FP8_META in grads):
    return None
  if set(grads) != {"params", FP8_META}:
    raise ValueError(
        f"The gradients hold the FP8 meta ({FP8_META!r}) next to "
        f"{sorted(k for k in grads if k != FP8_META)}; expected exactly "
        f"{{'params': param_grads, {FP8_META!r}: new_meta}}, as "
        "state.value_and_grad returns them.")
  return grads["params"], grads[FP8_META]


def meta_is_finite(fp8_meta: Any) -> jax.Array:
  """Whether every leaf of the new FP8 meta is finite (a scalar bool).

  Flax's ops saturate: an inf output gradient is clipped to the FP8 maximum,
  so the weight gradients it gives can be finite while its amax is inf. The
  guard therefore looks at the new meta too.
  """
  return all_finite(fp8_meta)
