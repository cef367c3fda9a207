"""Per-parameter policies: regular expressions on pytree paths pick a policy."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any, Iterable, Mapping, TypeVar

import jax

from jaxmp._src.policy import Policy, is_floating_array
from jaxmp._src.rules import RuleTable, RuleTablePolicy, check_pattern, rule_table

T = TypeVar("T")


def path_to_string(path: tuple[Any, ...]) -> str:
  """The ``/``-separated string of a pytree key path, without an NNX ``Variable``'s ``.value``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmp._src.path_policy import path_to_string
    >>> tree = {"params": {"Dense_0": {"kernel": jnp.ones(2)}}}
    >>> path_to_string(jax.tree_util.tree_flatten_with_path(tree)[0][0][0])
    'params/Dense_0/kernel'
  """
  path = tuple(path)
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
    path = path[:-1]
  return jax.tree_util.keystr(path, simple=True, separator="/")


@dataclasses.dataclass(frozen=True, init=False)
class PathPolicy(RuleTablePolicy):
  """Policies chosen per leaf by regular expressions on the leaf's path.

  A path is the leaf's key path joined with ``/`` (``"params/Dense_0/kernel"``
  in Linen variables, ``"Linear_0/kernel"`` in an NNX state), matched with
  :func:`re.search` (anchor with ``^``/``$`` to be precise). Only floating
  leaves are looked up and cast. Frozen and hashable (a static argument of
  ``jax.jit``, or a :class:`jaxmp.flax.TrainState`'s ``policy``, where the
  inputs and outputs use ``default``).

  Args:
    rules: a dict (or a list of pairs) from patterns to anything
      :func:`jaxmp.get_policy` takes.
    default: the policy of unmatched paths; ``None`` makes an unmatched
      floating leaf an error.
    first_match: a path several patterns match takes the first (in the order
      given) instead of raising ``ValueError``.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> policy = jaxmp.PathPolicy({"LayerNorm": "float32"}, default="mixed_bfloat16")
    >>> params = {"Dense_0": {"kernel": jnp.ones((2, 2))},
    ...           "LayerNorm_0": {"scale": jnp.ones(2)}}
    >>> policy.describe(params)
    {'Dense_0/kernel': 'p=f32,c=bf16,o=f32', 'LayerNorm_0/scale': 'p=f32,c=f32,o=f32'}
    >>> policy.cast_to_compute(params)["Dense_0"]["kernel"].dtype
    dtype(bfloat16)
  """

  table: RuleTable

  def __init__(
      self,
      rules: Mapping[str, Any] | Iterable[tuple[str, Any]],
      default: Any = "float32",
      *,
      first_match: bool = False,
  ):
    object.__setattr__(self, "table", rule_table(
        "PathPolicy", rules, default, first_match,
        check_key=functools.partial(check_pattern, "PathPolicy"),
        key_description="pattern",
        exclusive_hint=" (anchor the patterns with ^ and $)"))

  def policy_for(self, path: str) -> Policy:
    """Returns the policy of the leaf at ``path`` (a ``/``-separated string)."""
    return self.table.policy_for(
        f"the path {path!r}", lambda pattern: re.search(pattern, path) is not None)

  def _map(self, tree: Any, fn: Callable[[Policy, Any], Any],
           other: Callable[[Any], Any] = lambda x: x) -> Any:
    """``fn(policy, leaf)`` for each floating leaf of ``tree``, ``other(leaf)`` else."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(self.policy_for(path_to_string(path)), x)
        if is_floating_array(x) else other(x), tree)

  def policies(self, tree: Any) -> Any:
    """A pytree like ``tree`` with each floating leaf's :class:`Policy` (``None`` else)."""
    return self._map(tree, lambda policy, _: policy, lambda _: None)

  def describe(self, tree: Any) -> dict[str, str]:
    """Returns ``{path: str(policy)}`` for the floating leaves of ``tree``."""
    return {path_to_string(path): str(self.policy_for(path_to_string(path)))
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if is_floating_array(x)}

  def cast_to_param(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``param_dtype`` (16-bit ones warn once)."""
    return self._map(tree, Policy.cast_to_param)

  def cast_to_compute(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``compute_dtype``."""
    return self._map(tree, Policy.cast_to_compute)

  def cast_to_output(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``output_dtype``."""
    return self._map(tree, Policy.cast_to_output)

  params_for_storage = cast_to_param
  params_for_compute = cast_to_compute

  def for_autocast(self) -> tuple[Any, Any]:
    """Refused: autocast casts operations, not parameters."""
    raise ValueError(
        "PathPolicy: autocast casts the inputs of each operation, not each "
        "parameter, so per-parameter rules cannot apply under autocast. Pin "
        "modules with a jaxmp.flax.ModulePolicy (its rules become autocast "
        "scopes), or drop autocast=True to cast the params path by path.")

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (e.g. a Linen ``model.apply``) running under the policy.

    As :meth:`jaxmp.Policy.wrap_apply`, with the params cast path by path
    (paths inside the ``params`` collection: ``"Dense_0/kernel"``) and the
    inputs and outputs with ``default``. Activations are not cast between
    layers: a float32 layer after a bfloat16 one promotes (or raises under
    strict promotion); :class:`jaxmp.flax.ModulePolicy` casts each module's
    inputs too.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> import flax.linen as nn
      >>> model, x = nn.Sequential([nn.Dense(2), nn.Dense(2)]), jnp.ones((1, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> policy = jaxmp.PathPolicy({"^layers_1/": "float32"}, default="mixed_bfloat16")
      >>> apply = policy.wrap_apply(model.apply)
      >>> jaxpr = jax.make_jaxpr(apply)(variables, x)
      >>> [tuple(str(v.aval.dtype) for v in e.invars)
      ...  for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      [('bfloat16', 'bfloat16'), ('float32', 'float32')]
      >>> apply(variables, x).dtype  # the default's output dtype
      dtype('float32')
    """
    from jaxmp._src.flax.apply import apply_under_policy  # pylint: disable=g-import-not-at-top

    return apply_under_policy(self, apply_fn)

  def __str__(self) -> str:
    return f"PathPolicy({self.table})"

  __repr__ = __str__
