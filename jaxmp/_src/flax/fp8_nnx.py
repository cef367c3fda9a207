"""FP8 matmuls in NNX layers: Flax's ``fp8_scaled_dot_general`` behind the
layers' own hooks, its meta in NNX variables of the type :class:`Fp8Meta`.

Flax has FP8 ops for Linen only (``flax.linen.fp8_ops``), but its NNX layers
take the matmul as an argument: ``nnx.Linear(dot_general=...)``,
``nnx.LinearGeneral(dot_general=...)``, ``nnx.Einsum(einsum_op=...)``. Under an
FP8 policy (``dot=fp8``), :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`
attaches to each such layer an op of this module (:func:`attach_fp8_op`): an
``nnx.Module`` holding the scales and amax histories in :class:`Fp8Meta`
variables, laid out as Flax's Linen ops lay them out (:func:`flax_fp8_meta`),
whose call is Flax's own ``fp8_ops.fp8_scaled_dot_general``. As in Linen, the
gradient of a meta variable is its new value;
:func:`jaxmp.scaled_value_and_grad` takes it and writes it, and
:func:`jaxmp.keep_on_skip` keeps the meta on a skipped step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax.numpy as jnp
from jax import lax
from flax import nnx
from flax.linen import fp8_ops

from jaxmp._src.flax.fp8 import flax_fp8_meta
from jaxmp._src.policy import Fp8Policy
from jaxmp._src.rules import module_path


class Fp8Meta(nnx.Variable):
  """The NNX variable type of the FP8 meta: the scales and amax histories.

  Under an FP8 policy (``"mixed_fp8"``),
  :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes` gives each chosen
  ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` an FP8 op (its
  ``dot_general`` or ``einsum_op``) whose six meta arrays, named as in Flax's
  Linen ``fp8_ops`` (``input_scale``, ``input_amax_history``,
  ``kernel_scale``, ``kernel_amax_history``, ``output_grad_scale``,
  ``output_grad_amax_history``), are variables of this type. It is not an
  ``nnx.Param``: an ``nnx.Optimizer(..., wrt=nnx.Param)`` never sees it. Use
  it as an NNX filter, ``nnx.state(model, jaxmp.flax.Fp8Meta)``. The
  output-gradient scale and history are stored in unscaled units (see the
  FP8 guide).

  Args:
    value: the array: a ``(1,)`` scale or an ``(amax_history_length,)``
      amax history (float32).
    **metadata: NNX variable metadata, passed on to ``nnx.Variable``.

  Example:
    >>> import jax, jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> _ = jaxmp.flax.ModulePolicy({}, default="mixed_fp8").set_nnx_dtypes(model)
    >>> meta = nnx.state(model, jaxmp.flax.Fp8Meta)
    >>> sorted(meta["dot_general"])[:2], meta["dot_general"]["input_scale"][...]
    (['input_amax_history', 'input_scale'], Array([1.], dtype=float32))
    >>> len(jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))  # kernel, bias
    2
  """

  def __init__(self, value: Any, **metadata: Any):
    super().__init__(value, **metadata)


# NNX's metaclass shows inspect a signature of (*args, **kwargs): the real one.
Fp8Meta.__signature__ = inspect.signature(Fp8Meta.__init__).replace(
    parameters=tuple(inspect.signature(Fp8Meta.__init__).parameters.values())[1:])


class _Fp8Op(nnx.Module):
  """The meta of one FP8 matmul, in :class:`Fp8Meta` variables."""

  def __init__(self, amax_history_length: int):
    self.amax_history_length = amax_history_length
    for name, value in flax_fp8_meta(amax_history_length).items():
      setattr(self, name, Fp8Meta(value))

  def _scaled_dot_general(self, compute_dtype: Any) -> Any:
    """Flax's ``fp8_scaled_dot_general`` with this op's meta."""
    return functools.partial(
        fp8_ops.fp8_scaled_dot_general,
        lhs_scale=self.input_scale[...],
        rhs_scale=self.kernel_scale[...],
        grad_scale=self.output_grad_scale[...],
        lhs_amax_history=self.input_amax_history[...],
        rhs_amax_history=self.kernel_amax_history[...],
        grad_amax_history=self.output_grad_amax_history[...],
        quantize_compute_type=compute_dtype)


def _refuse_out_sharding(out_sharding: Any) -> None:
  if out_sharding is not None:
    raise ValueError(
        "jaxmp's FP8 op: Flax's fp8_scaled_dot_general takes no "
        f"out_sharding, but the layer was called with out_sharding="
        f"{out_sharding!r}. Call the layer without it (shard the result with "
        "jax.sharding.reshard), or give the layer a policy without dot=fp8.")


class Fp8DotGeneral(_Fp8Op):
  """The ``dot_general`` of an ``nnx.Linear``/``nnx.LinearGeneral`` in FP8.

  What Flax's Linen ``Fp8DirectDotGeneralOp`` computes: the input is cast to
  the kernel's dtype (the layer's compute dtype), and both are quantized to
  E4M3 with delayed scaling, the output gradient to E5M2. The ``precision``
  the layer passes is left to Flax's op, which sets its own.
  """

  def __call__(self, lhs, rhs, dimension_numbers, precision=None,
               preferred_element_type=None, out_sharding=None):
    del precision  # fp8_scaled_dot_general chooses it (and warns if given)
    _refuse_out_sharding(out_sharding)
    lhs = jnp.asarray(lhs, rhs.dtype)
    return self._scaled_dot_general(rhs.dtype)(
        lhs, rhs, dimension_numbers,
        preferred_element_type=preferred_element_type or lhs.dtype)


class Fp8Einsum(_Fp8Op):
  """The ``einsum_op`` of an ``nnx.Einsum`` in FP8.

  What Flax's Linen ``fp8_ops.Fp8Einsum`` computes: ``jnp.einsum`` with
  Flax's ``fp8_scaled_dot_general`` as its dot-general, the input cast to
  the kernel's dtype.
  """

  def __call__(self, einsum_str, lhs, rhs, precision=None,
               preferred_element_type=None, out_sharding=None):
    _refuse_out_sharding(out_sharding)
    return jnp.einsum(
        einsum_str, lhs.astype(rhs.dtype), rhs, precision=precision,
        preferred_element_type=preferred_element_type,
        _dot_general=self._scaled_dot_general(rhs.dtype))


def _matmul_hook(module: Any) -> tuple[str, Any, type] | None:
  """``(attribute, its default, op type)`` of an NNX matmul layer, or None."""
  if isinstance(module, nnx.Einsum):
    return "einsum_op", jnp.einsum, Fp8Einsum
  if isinstance(module, nnx.Linear):
    return "dot_general", lax.dot_general, Fp8DotGeneral
  if isinstance(module, nnx.LinearGeneral):
    return "dot_general", None, Fp8DotGeneral
  return None


def is_fp8_op(module: Any) -> bool:
  """Whether ``module`` is one of jaxmp's NNX FP8 ops (not a model's layer)."""
  return isinstance(module, _Fp8Op)


def detach_fp8_ops(model: Any) -> dict[str, tuple[Any, str, Any]]:
  """Takes jaxmp's FP8 ops off the matmul layers of an NNX model.

  Each layer gets its default matmul back (the layer as built without
  FP8); the op, which holds the layer's :class:`Fp8Meta`, goes with it.

  Returns:
    ``{layer path: (layer, attribute, op)}``, for :func:`reattach_fp8_op`.
  """
  removed = {}
  for path, module in list(nnx.iter_modules(model)):
    hook = _matmul_hook(module)
    if hook is not None and isinstance(getattr(module, hook[0]), _Fp8Op):
      removed[module_path(path)] = (
          module, hook[0], getattr(module, hook[0]))
      setattr(module, hook[0], nnx.static(hook[1]))
  return removed


def reattach_fp8_op(module: Any, attribute: str, op: Any) -> None:
  """Gives a layer back an op :func:`detach_fp8_ops` took off it."""
  setattr(module, attribute, nnx.data(op))


def attach_fp8_op(module: Any, policy: Any, path: str) -> bool:
  """Gives an NNX matmul layer under an FP8 ``policy`` its FP8 op.

  Sets the ``dot_general`` of an ``nnx.Linear``/``nnx.LinearGeneral`` or the
  ``einsum_op`` of an ``nnx.Einsum`` to a new :class:`Fp8DotGeneral` or
  :class:`Fp8Einsum`. A layer that already has jaxmp's op with the same
  history length keeps it (and its meta): calling ``set_nnx_dtypes`` again
  changes nothing.

  Returns:
    Whether ``module`` has an FP8 op now.

  Raises:
    ValueError: if the layer has its own ``dot_general``/``dot_general_cls``
      /``einsum_op``, or jaxmp's op from another policy (another history
      length, or a policy without FP8 now).
  """
  hook = _matmul_hook(module)
  if hook is None:
    return False
  attribute, default, op_type = hook
  if isinstance(module, nnx.LinearGeneral) and module.dot_general_cls is not None:
    raise _own_matmul(module, path, "dot_general_cls", policy)
  current = getattr(module, attribute)
  fp8 = isinstance(policy, Fp8Policy)
  if isinstance(current, _Fp8Op):
    if fp8 and current.amax_history_length == policy.amax_history_length:
      return True
    raise ValueError(
        f"set_nnx_dtypes: the {type(module).__name__} at {path or '(root)'!r} "
        "already has jaxmp's FP8 op from an earlier set_nnx_dtypes, with an "
        f"amax history of {current.amax_history_length}, which {policy} "
        "would change. Build the model anew and call set_nnx_dtypes once "
        "with the policy you want.")
  if not fp8:
    return False
  if current is not default:
    raise _own_matmul(module, path, attribute, policy)
  setattr(module, attribute, nnx.data(op_type(policy.amax_history_length)))
  return True


def _own_matmul(module: Any, path: str, attribute: str, policy: Any) -> ValueError:
  return ValueError(
      f"{policy}: the {type(module).__name__} at {path or '(root)'!r} has its "
      f"own {attribute}, which the FP8 policy would replace. Give it its own "
      "rule with a policy without dot=fp8 (e.g. jaxmp.flax.ModulePolicy("
      f"{{'{path}': 'mixed_bfloat16'}}, default='mixed_fp8')), or drop its "
      f"{attribute}.")


def has_fp8_meta(tree: Any) -> bool:
  """Whether an NNX object (or a pytree of them) holds :class:`Fp8Meta`."""
  return bool(nnx.state(tree, Fp8Meta))
