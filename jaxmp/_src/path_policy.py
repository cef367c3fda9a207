"""Per-parameter policies: regular expressions on pytree paths pick a policy.

A :class:`PathPolicy` maps regular expressions on the paths of a pytree's
leaves (``"params/Dense_0/kernel"``) to :class:`jaxmp.Policy` objects and has
the same ``cast_to_param``/``cast_to_compute``/``cast_to_output`` methods as a
policy, applied leaf by leaf.
"""

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
  """Returns the ``/``-separated string of a pytree key path.

  ``jax.tree_util.keystr(path, simple=True, separator="/")``, except that a
  trailing ``.value`` attribute (the array inside an NNX ``Variable``) is left
  out, so that an NNX state's ``kernel`` leaf is ``"Linear_0/kernel"`` as in
  Linen.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmp._src.path_policy import path_to_string
    >>> tree = {"params": {"Dense_0": {"kernel": jnp.ones(2)}}}
    >>> path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][0]
    >>> path_to_string(path)
    'params/Dense_0/kernel'
  """
  path = tuple(path)
  if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and (
      path[-1].name == "value"
  ):
    path = path[:-1]
  return jax.tree_util.keystr(path, simple=True, separator="/")


_check_pattern = functools.partial(check_pattern, "PathPolicy")


@dataclasses.dataclass(frozen=True, init=False)
class PathPolicy(RuleTablePolicy):
  """Policies chosen per leaf by regular expressions on the leaf's path.

  A leaf's path is its pytree key path joined with ``/``
  (``jax.tree_util.keystr(path, simple=True, separator="/")``), e.g.
  ``"params/Dense_0/kernel"`` for Linen variables or ``"Linear_0/kernel"``
  for an NNX state (an NNX ``Variable``'s trailing ``.value`` is not part of
  the path). Each pattern is matched with :func:`re.search`, so
  ``"LayerNorm"`` matches any path that contains it; anchor it
  (``"^params/head/"``, ``"bias$"``) to be precise.

  * **Unmatched paths** get ``default`` (``float32`` unless you say
    otherwise). With ``default=None`` an unmatched floating leaf raises
    ``ValueError``, naming its path and the rules.
  * **Overlapping patterns**: when more than one pattern matches the same path
    the choice is ambiguous and raises ``ValueError`` naming the path and the
    patterns, unless ``first_match=True``, in which case the rules are tried in
    the order given and the first match wins (give them as a dict or a list of
    pairs, in priority order).

  Only floating array leaves are cast (and looked up); integer, boolean and
  non-array leaves are returned unchanged, as with :class:`jaxmp.Policy`.

  A ``PathPolicy`` is frozen and hashable, so it can be a static argument of
  ``jax.jit`` or the ``policy`` of a :class:`jaxmp.flax.TrainState`, where the
  params are cast path by path and the inputs and outputs use ``default``.

  Args:
    rules: a mapping (or a sequence of ``(pattern, policy)`` pairs) from
      regular expressions to policies; a policy is anything
      :func:`jaxmp.get_policy` takes (``"float32"``, ``"mixed_bfloat16"``,
      ``"p=f32,c=bf16,o=f32"``, a :class:`jaxmp.Policy`).
    default: the policy of paths no pattern matches, or ``None`` to make an
      unmatched floating leaf an error.
    first_match: resolve overlaps by the order of ``rules`` instead of raising.

  Raises:
    ValueError: for an invalid regular expression, a pattern given twice, or a
      policy ``get_policy`` does not understand.
    TypeError: if a pattern is not a string, or ``rules`` is not a mapping or
      a sequence of pairs.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> policy = jaxmp.PathPolicy({"LayerNorm": "float32"},
    ...                           default="mixed_bfloat16")
    >>> params = {"Dense_0": {"kernel": jnp.ones((2, 2))},
    ...           "LayerNorm_0": {"scale": jnp.ones(2)}}
    >>> compute = policy.cast_to_compute(params)
    >>> compute["Dense_0"]["kernel"].dtype, compute["LayerNorm_0"]["scale"].dtype
    (dtype(bfloat16), dtype('float32'))
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
        "PathPolicy", rules, default, first_match, check_key=_check_pattern,
        key_description="pattern",
        exclusive_hint=" (anchor the patterns with ^ and $)"))

  def policy_for(self, path: str) -> Policy:
    """Returns the policy of the leaf at ``path`` (a ``/``-separated string).

    Raises:
      ValueError: if several patterns match and ``first_match`` is false, or
        if none matches and there is no default.

    Example:
      >>> import jaxmp
      >>> policy = jaxmp.PathPolicy({"bias$": "float32", "head": "bf16"},
      ...                           default="mixed_float16")
      >>> str(policy.policy_for("params/Dense_0/kernel"))
      'p=f32,c=f16,o=f32'
      >>> policy.policy_for("params/head/bias")
      Traceback (most recent call last):
      ...
      ValueError: PathPolicy: the path 'params/head/bias' matches several rules: 'bias$', 'head'. Make the rules exclusive (anchor the patterns with ^ and $), or pass first_match=True to let the first matching rule (in the order given) win.
    """
    return self.table.policy_for(
        f"the path {path!r}", lambda pattern: re.search(pattern, path) is not None
    )

  def policies(self, tree: Any) -> Any:
    """Returns a pytree like ``tree`` with each floating leaf's :class:`Policy`.

    Other leaves become ``None``.
    """

    def one(path, x):
      if not is_floating_array(x):
        return None
      return self.policy_for(path_to_string(path))

    return jax.tree_util.tree_map_with_path(one, tree)

  def describe(self, tree: Any) -> dict[str, str]:
    """Returns ``{path: str(policy)}`` for the floating leaves of ``tree``.

    Example:
      >>> import jax.numpy as jnp, jaxmp
      >>> policy = jaxmp.PathPolicy({"^head/": "float32"}, default="mixed_float16")
      >>> policy.describe({"head": {"w": jnp.ones(1)}, "body": {"w": jnp.ones(1)}})
      {'body/w': 'p=f32,c=f16,o=f32', 'head/w': 'p=f32,c=f32,o=f32'}
    """
    described = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if is_floating_array(x):
        name = path_to_string(path)
        described[name] = str(self.policy_for(name))
    return described

  def _cast(self, tree: T, cast: Callable[[Policy, Any], Any]) -> T:
    def one(path, x):
      if not is_floating_array(x):
        return x
      return cast(self.policy_for(path_to_string(path)), x)

    return jax.tree_util.tree_map_with_path(one, tree)

  def cast_to_param(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``param_dtype``.

    A 16-bit ``param_dtype`` warns once per policy, as
    :meth:`jaxmp.Policy.cast_to_param` does.
    """
    return self._cast(tree, Policy.cast_to_param)

  def cast_to_compute(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``compute_dtype``."""
    return self._cast(tree, Policy.cast_to_compute)

  def cast_to_output(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``output_dtype``."""
    return self._cast(tree, Policy.cast_to_output)

  def params_for_storage(self, params: Any) -> Any:
    """Casts each param to its policy's ``param_dtype``."""
    return self.cast_to_param(params)

  def params_for_compute(self, params: Any) -> Any:
    """Casts each param to its policy's ``compute_dtype``."""
    return self.cast_to_compute(params)

  def for_autocast(self) -> tuple[Any, Any]:
    """Refused: autocast casts operations, not parameters.

    Raises:
      ValueError: always; the message names the alternatives.
    """
    raise ValueError(
        "PathPolicy: autocast casts the inputs of each operation, not each "
        "parameter, so per-parameter rules cannot apply under autocast. Pin "
        "modules with a jaxmp.flax.ModulePolicy (its rules become autocast "
        "scopes), or drop autocast=True to cast the params path by path."
    )

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (e.g. a Linen ``model.apply``) running under the policy.

    As :meth:`jaxmp.Policy.wrap_apply`, with ``variables["params"]`` cast path
    by path (the paths are those inside the ``params`` collection,
    ``"Dense_0/kernel"``, as in :meth:`jaxmp.flax.TrainState.value_and_grad`)
    and the inputs and outputs cast with ``default``.

    Only the params are cast per path, not the activations between layers:
    where a layer's params and its inputs differ in dtype (a float32 layer
    after a bfloat16 one, as below), the model's own promotion decides. Flax
    layers promote the two to the wider dtype; under strict dtype promotion
    (``jax_numpy_dtype_promotion="strict"``) they raise. To run a layer in
    float32 under strict promotion, use :class:`jaxmp.flax.ModulePolicy`,
    which casts each module's inputs too.

    Args:
      apply_fn: a function of ``(variables, *args, **kwargs)``.

    Returns:
      The wrapped function.

    Raises:
      ValueError: if there is no default.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> import flax.linen as nn
      >>> model = nn.Sequential([nn.Dense(2), nn.Dense(2)])
      >>> x = jnp.ones((1, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> policy = jaxmp.PathPolicy({"^layers_1/": "float32"}, default="mixed_bfloat16")
      >>> jaxpr = jax.make_jaxpr(policy.wrap_apply(model.apply))(variables, x)
      >>> [tuple(str(v.aval.dtype) for v in e.invars)
      ...  for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      [('bfloat16', 'bfloat16'), ('float32', 'float32')]
    """
    from jaxmp._src.flax.apply import apply_under_policy  # pylint: disable=g-import-not-at-top

    return apply_under_policy(self, apply_fn)

  def __str__(self) -> str:
    return f"PathPolicy({self.table})"

  __repr__ = __str__
