"""Per-parameter policies: regular expressions on pytree paths pick a policy.

A :class:`PathPolicy` maps regular expressions on the paths of a pytree's
leaves (``"params/Dense_0/kernel"``) to :class:`jaxmp.Policy` objects and has
the same ``cast_to_param``/``cast_to_compute``/``cast_to_output`` methods as a
policy, applied leaf by leaf.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any, Iterable, Mapping, TypeVar

import jax

from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.rules import (
    check_pattern,
    check_rules,
    default_io_policy,
    is_floating_array,
    rules_need_loss_scaling,
)

T = TypeVar("T")


def path_to_string(path: Iterable[Any]) -> str:
  """Returns the ``/``-separated string of a pytree key path.

  Dict keys, sequence indices and attribute names become the parts of the
  string. A trailing ``.value`` attribute (the array inside an NNX
  ``Variable``) is left out, so that an NNX state's ``kernel`` leaf is
  ``"Linear_0/kernel"`` as in Linen.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxmp._src.path_policy import path_to_string
    >>> tree = {"params": {"Dense_0": {"kernel": jnp.ones(2)}}}
    >>> path, _ = jax.tree_util.tree_flatten_with_path(tree)[0][0]
    >>> path_to_string(path)
    'params/Dense_0/kernel'
  """
  keys = list(path)
  if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and (
      keys[-1].name == "value"
  ):
    keys = keys[:-1]
  parts = []
  for key in keys:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.FlattenedIndexKey):
      parts.append(str(key.key))
    else:
      parts.append(str(key))
  return "/".join(parts)


def _check_pattern(pattern: Any) -> None:
  if not isinstance(pattern, str):
    raise TypeError(
        f"PathPolicy patterns must be regular-expression strings, got "
        f"{pattern!r} of type {type(pattern).__name__}."
    )
  check_pattern("PathPolicy", pattern)


@dataclasses.dataclass(frozen=True, init=False)
class PathPolicy:
  """Policies chosen per leaf by regular expressions on the leaf's path.

  A leaf's path is its pytree key path joined with ``/``, e.g.
  ``"params/Dense_0/kernel"`` for Linen variables or ``"Linear_0/kernel"``
  for an NNX state (see :func:`path_to_string`). Each pattern is matched with
  :func:`re.search`, so ``"LayerNorm"`` matches any path that contains it;
  anchor it (``"^params/head/"``, ``"bias$"``) to be precise.

  * **Unmatched paths** get ``default`` (``float32`` unless you say
    otherwise). With ``default=None`` an unmatched floating leaf raises
    ``ValueError``, listing its path and the patterns.
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
    TypeError: if a pattern is not a string.

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

  rules: tuple[tuple[str, Policy], ...]
  default: Policy | None
  first_match: bool

  def __init__(
      self,
      rules: Mapping[str, Any] | Iterable[tuple[str, Any]],
      default: Any = "float32",
      *,
      first_match: bool = False,
  ):
    object.__setattr__(self, "rules", check_rules(
        "PathPolicy", rules, _check_pattern, key_word="pattern",
        key_description="pattern"))
    object.__setattr__(
        self, "default", None if default is None else get_policy(default)
    )
    if not isinstance(first_match, bool):
      raise TypeError(f"PathPolicy: first_match must be a bool, got {first_match!r}.")
    object.__setattr__(self, "first_match", first_match)

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
      ValueError: PathPolicy: the path 'params/head/bias' matches several patterns: 'bias$', 'head'. Make the patterns exclusive (anchor them with ^ and $), or pass first_match=True to let the first matching rule win.
    """
    matches = [(p, pol) for p, pol in self.rules if re.search(p, path)]
    if not matches:
      if self.default is None:
        raise ValueError(
            f"PathPolicy: no pattern matches the path {path!r} and there is no "
            f"default policy. Patterns: {', '.join(repr(p) for p, _ in self.rules)}"
            ". Add a pattern for it or pass default=... (e.g. 'float32')."
        )
      return self.default
    if len(matches) > 1 and not self.first_match:
      raise ValueError(
          f"PathPolicy: the path {path!r} matches several patterns: "
          f"{', '.join(repr(p) for p, _ in matches)}. Make the patterns "
          "exclusive (anchor them with ^ and $), or pass first_match=True to "
          "let the first matching rule win."
      )
    return matches[0][1]

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
      >>> policy = jaxmp.PathPolicy({"^head/": "float32"}, default="bf16")
      >>> policy.describe({"head": {"w": jnp.ones(1)}, "body": {"w": jnp.ones(1)}})
      {'body/w': 'p=bf16,c=bf16,o=bf16', 'head/w': 'p=f32,c=f32,o=f32'}
    """
    described = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      if is_floating_array(x):
        name = path_to_string(path)
        described[name] = str(self.policy_for(name))
    return described

  def _cast(self, tree: T, field: str) -> T:
    def one(path, x):
      if not is_floating_array(x):
        return x
      policy = self.policy_for(path_to_string(path))
      return x.astype(getattr(policy, field))

    return jax.tree_util.tree_map_with_path(one, tree)

  def cast_to_param(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``param_dtype``."""
    return self._cast(tree, "param_dtype")

  def cast_to_compute(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``compute_dtype``."""
    return self._cast(tree, "compute_dtype")

  def cast_to_output(self, tree: T) -> T:
    """Casts each floating leaf to its policy's ``output_dtype``."""
    return self._cast(tree, "output_dtype")

  @property
  def io_policy(self) -> Policy:
    """The policy of a model's inputs and outputs: ``default``.

    Raises:
      ValueError: if there is no default.
    """
    return default_io_policy(self)

  def params_for_storage(self, params: Any) -> Any:
    """Casts each param to its policy's ``param_dtype``."""
    return self.cast_to_param(params)

  def params_for_compute(self, params: Any) -> Any:
    """Casts each param to its policy's ``compute_dtype``."""
    return self.cast_to_compute(params)

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` unchanged; the casts are made around the call."""
    return apply_fn

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any of the policies (default included) needs loss scaling."""
    return rules_need_loss_scaling(self.rules, self.default)

  def __str__(self) -> str:
    rules = ", ".join(f"{p!r}: {pol}" for p, pol in self.rules)
    return f"PathPolicy({{{rules}}}, default={self.default})"
