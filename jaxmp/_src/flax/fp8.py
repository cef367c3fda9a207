"""FP8 matmuls in Linen modules: Flax's ``fp8_ops`` under a policy and a guard.

An FP8 policy (``dot=fp8``) makes the ``nn.Dense`` and ``nn.DenseGeneral``
modules that run under it call Flax's ``fp8_ops.Fp8DirectDotGeneralOp``
(their ``dot_general_cls`` in the copy of the module that
:class:`jaxmp.flax.ModulePolicy` runs; Linen's ``nn.Einsum`` takes none and is
refused). Flax keeps each op's scales
and amax histories, the *FP8 meta*, in the collection
``"_overwrite_with_gradient"``: the "gradient" of a meta leaf is its new
value. This module holds what jaxmp adds around Flax's ops, for Linen and
(through ``_src/flax/fp8_nnx.py``) NNX alike:

* :func:`fp8_dot_general_cls`: which op a module gets (and the refusal of
  the modules it cannot reach);
* :func:`flax_fp8_meta`: the meta of one op as Flax lays it out;
* :func:`in_step_units`: the FP8 meta of the output gradients is kept in
  *unscaled* units; for one step it is multiplied by the loss scale (the
  gradients the op sees are scaled), and its new value divided by it;
* :func:`split_fp8_grads`, :func:`keep_meta_of_ops_that_did_not_run`,
  :func:`meta_is_finite` and :func:`skip_unless_meta_finite`, which
  :meth:`jaxmp.flax.TrainState.apply_gradients` and the NNX path of
  :func:`jaxmp.scaled_value_and_grad` use to guard the meta.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


def flax_fp8_meta(amax_history_length: int) -> dict[str, jax.Array]:
  """The FP8 meta of one op, ``{name: array}``, as Flax's ops create it.

  Read from Flax's own ``fp8_ops.Fp8DotGeneralBase`` (the base of
  ``Fp8DirectDotGeneralOp`` and ``Fp8Einsum``), so that the NNX ops keep the
  same names, shapes and initial values as the Linen ones: a ``(1,)`` scale
  of ones and an ``(amax_history_length,)`` history of zeros for each of the
  input, the kernel and the output gradient.
  """
  return {name: jnp.asarray(value)
          for name, value in _flax_fp8_meta_values(amax_history_length)}


@functools.lru_cache(maxsize=None)
def _flax_fp8_meta_values(amax_history_length: int) -> tuple[tuple[str, Any], ...]:
  """The initial meta of Flax's op as read-only numpy arrays, read once per length."""
  op = fp8_ops.Fp8DotGeneralBase(amax_history_length=amax_history_length)
  variables = op.init(jax.random.key(0), method=lambda op: op.input_scale)
  values = []
  for name, value in variables[FP8_META].items():
    value = np.array(value)
    value.setflags(write=False)
    values.append((name, value))
  return tuple(values)


def fp8_dot_general_cls(module: Any, policy: Any) -> Any:
  """The ``dot_general_cls`` to give ``module`` while it runs under ``policy``.

  ``None`` when nothing is injected: the policy is not an
  FP8 policy (``dot=fp8``), or the module is not a Dense layer (activations,
  norms, convolutions and the FP8 ops themselves run in the base compute
  dtype).

  Raises:
    ValueError: for a Dense layer that has its own
      ``dot_general``/``dot_general_cls``, and for an ``nn.Einsum``, which
      takes no ``dot_general_cls`` in Linen.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if not isinstance(policy, Fp8Policy):
    return None
  name = type(module).__name__
  if isinstance(module, nn.Einsum):
    raise ValueError(
        f"{policy}: the module {name} {module.name!r} is a Linen nn.Einsum, "
        "which computes with jnp.einsum and takes no dot_general_cls, so the "
        "FP8 policy cannot reach its matmul. Give it a rule with a policy "
        "without dot=fp8 (e.g. jaxmp.flax.ModulePolicy({" + name + ": "
        "'mixed_bfloat16'}, default='mixed_fp8')), or use nn.DenseGeneral "
        "for the matmul to run in FP8.")
  if not isinstance(module, (nn.Dense, nn.DenseGeneral)):
    return None
  if module.dot_general_cls is not None or module.dot_general is not None:
    raise ValueError(
        f"{policy}: the module {name} {module.name!r} has "
        "its own dot_general/dot_general_cls, which the FP8 policy would "
        "replace. Give it its own rule with a policy without dot=fp8 (e.g. "
        "jaxmp.flax.ModulePolicy({'" + str(module.name) + "': "
        "'mixed_bfloat16'}, default='mixed_fp8')), or drop its dot_general.")
  return functools.partial(
      fp8_ops.Fp8DirectDotGeneralOp,
      amax_history_length=policy.amax_history_length)


def _leaf_name(path: tuple[Any, ...]) -> Any:
  """The name of a meta leaf (``"input_scale"``, ...) from its tree path."""
  last = path[-1] if path else None
  return getattr(last, "key", getattr(last, "name", None))


def _is_output_grad_leaf(path: tuple[Any, ...]) -> bool:
  return _leaf_name(path) in _OUTPUT_GRAD_LEAVES


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


def split_fp8_grads(tree: Any, owner: str = "TrainState") -> tuple[Any, Any] | None:
  """``(params, fp8_meta)`` of Flax's FP8 layout ``{"params": ..., FP8_META: ...}``.

  The variables (or their gradients, or a ``TrainState``'s ``params``) of a
  model with FP8 ops; ``None`` for a tree without the meta collection.

  Raises:
    ValueError: if ``tree`` holds the meta next to other keys than
      ``"params"``.
  """
  if not (isinstance(tree, Mapping) and FP8_META in tree):
    return None
  if set(tree) != {"params", FP8_META}:
    raise ValueError(
        f"{owner}: Flax's FP8 layout is {{'params': ..., {FP8_META!r}: ...}}, "
        f"got the keys {sorted(tree)}. "
        "Keep other collections (batch_stats) in fields of their own.")
  return tree["params"], tree[FP8_META]


def keep_meta_of_ops_that_did_not_run(old_meta: Any, new_meta: Any) -> Any:
  """``new_meta``, with the old meta of every op whose new input scale is 0.

  Flax's overwrite-with-gradient pattern returns each op's new meta as the
  meta's cotangent, so an op that did not run in the step (a layer skipped
  by a branch, an unused head) gets zeros: its scales would be overwritten
  with 0 and its histories emptied, and its next run would divide by a zero
  scale. A scale Flax computes is never 0 otherwise, except when the amax is
  so small (below about 1e-36) that ``fp8_max / amax`` overflows float32, where
  keeping the old scale is right too. So each op (the six leaves under one
  parent) keeps all its old meta when its new ``input_scale`` is 0. A
  ``jnp.where`` per leaf on the op's flag: no host synchronisation.
  """
  ran = {path[:-1]: jnp.all(leaf != 0)
         for path, leaf in jax.tree_util.tree_leaves_with_path(new_meta)
         if _leaf_name(path) == "input_scale"}

  def select(path, old, new):
    flag = ran.get(path[:-1])
    return new if flag is None else jnp.where(flag, new, old)

  return jax.tree_util.tree_map_with_path(select, old_meta, new_meta)


def meta_is_finite(fp8_meta: Any) -> jax.Array:
  """Whether every leaf of the new FP8 meta is finite (a scalar bool).

  Flax's ops saturate: an inf output gradient is clipped to the FP8 maximum,
  so the weight gradients it gives can be finite while its amax is inf. The
  guard therefore looks at the new meta too.
  """
  return all_finite(fp8_meta)


def skip_unless_meta_finite(grads: Any, new_meta: Any) -> Any:
  """``grads``, made nan where the new FP8 meta is not finite.

  The loss-scaling optimizer then treats the step as non-finite (it skips
  the update and backs the loss scale off), and the meta is kept with the
  rest. A ``jnp.where`` on one flag: no host synchronisation.
  """
  finite = meta_is_finite(new_meta)
  return jax.tree_util.tree_map(
      lambda g: jnp.where(finite, g, jnp.asarray(jnp.nan, g.dtype)), grads)
