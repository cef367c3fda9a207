"""Per-module policies for Linen and NNX models, without editing model code.

A :class:`ModulePolicy` names module classes (``nn.LayerNorm``), module names
(``"head"``) or module paths (``"Encoder_0/Dense_1"``) that run under their
own policy, while the rest of the model runs under a default policy. It is
applied to a Linen model's ``apply`` with :meth:`ModulePolicy.wrap_apply` (an
``nn.intercept_methods`` interceptor, the Linen counterpart of Haiku's
``hk.mixed_precision.set_policy``) and to an NNX model with
:meth:`ModulePolicy.set_nnx_dtypes` (which sets each module's ``dtype``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
from typing import Any, Callable, Iterable, Mapping

import jax
from flax import struct
from flax.core import meta

from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.rules import (
  check_pattern,
  check_rules,
  default_io_policy,
  is_floating_array,
  rules_need_loss_scaling,
)

# The policies of the Linen module methods now running, innermost last.
_ACTIVE = threading.local()


def _active_stack() -> list[Policy | None]:
  if not hasattr(_ACTIVE, "stack"):
    _ACTIVE.stack = []
  return _ACTIVE.stack


class _CastOnRead(struct.PyTreeNode, meta.AxisMetadata):
  """A parameter that, when a Linen module reads it, is cast to its policy.

  Reading (``unbox``) happens inside ``Module.param``; the policy is that of
  the innermost module method running, so the parameter arrives in the
  compute dtype of the module that owns it.
  """

  value: Any

  def unbox(self) -> Any:
    value = meta.unbox(self.value)
    stack = _active_stack()
    policy = stack[-1] if stack else None
    if policy is None:
      return value
    return policy.cast_to_compute(value)

  def replace_boxed(self, val: Any) -> "_CastOnRead":
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> "_CastOnRead":
    del index, params
    return self

  def remove_axis(self, index: int, params: dict[Any, Any]) -> "_CastOnRead":
    del index, params
    return self


def _box_params(params: Any) -> Any:
  def box(x):
    if isinstance(x, meta.AxisMetadata) or is_floating_array(x):
      return _CastOnRead(x)
    return x

  return jax.tree_util.tree_map(
      box, params, is_leaf=lambda x: isinstance(x, meta.AxisMetadata)
  )


def _check_key(key: Any) -> None:
  if isinstance(key, str):
    check_pattern("ModulePolicy", key)
  elif not isinstance(key, type):
    raise TypeError(
        "ModulePolicy keys must be module classes (e.g. nn.LayerNorm) or "
        "strings matching a module's name or path (e.g. 'head', "
        f"'Encoder_0/Dense_1'); got {key!r} of type {type(key).__name__}."
    )


def _key_repr(key: Any) -> str:
  if isinstance(key, type):
    return f"{key.__module__}.{key.__qualname__}"
  return repr(key)


@dataclasses.dataclass(frozen=True, init=False)
class ModulePolicy:
  """Policies for chosen modules of a Flax model; the rest use a default.

  Each rule's key is a module class (matching its instances and those of its
  subclasses) or a string, a regular expression that must match the whole of
  a module's name (``"head"``, ``"Dense_1"``) or the whole of its path
  (``"Encoder_0/Dense_1"``; NNX paths are attribute names, e.g.
  ``"blocks/0/norm"``).

  * A module that no rule matches runs under the policy of the module that
    encloses it (that called it, in Linen), and the outermost under
    ``default``. So forcing a block to float32 forces what is inside it too,
    unless a rule says otherwise. With ``default=None`` unmatched modules are
    left as they are (Haiku's semantics).
  * When more than one rule matches the same module the choice is ambiguous
    and raises ``ValueError`` (naming the module and the rules), unless
    ``first_match=True``: then rules are tried in the order given and the first
    match wins.

  **Linen** (:meth:`wrap_apply`): a module running under a policy gets its
  floating inputs cast to the compute dtype, and the parameters it reads with
  ``self.param`` arrive in the compute dtype (the float32 master copy is cast
  as it is read, so a float32 module sees the float32 values, not a bfloat16
  round trip). The outputs of a module matched by a rule, and those of the
  outermost module, are cast to that policy's output dtype; the outputs of the
  other modules stay in their compute dtype. Flax layers with ``dtype=None``
  (the default) then compute in the dtype of what they receive.

  **NNX** (:meth:`set_nnx_dtypes`): each module that has a ``dtype`` attribute
  (``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``, ``nnx.BatchNorm``,
  ``nnx.MultiHeadAttention``...) gets ``dtype`` set to its policy's compute
  dtype; NNX layers cast their inputs and parameters to ``dtype``. Parameters
  keep their dtype (the master copy); outputs are not cast, so cast the
  model's output with ``policy.default.cast_to_output``.

  Args:
    rules: a mapping (or sequence of pairs) from module classes or
      regular-expression strings to policies (anything
      :func:`jaxmp.get_policy` takes).
    default: the policy of the modules no rule covers (anything
      :func:`jaxmp.get_policy` takes), or ``None`` to leave them alone.
      Default ``"float32"``.
    first_match: resolve overlapping rules by their order instead of raising.

  Raises:
    TypeError: if a key is neither a class nor a string.
    ValueError: for an invalid regular expression, a key given twice, or a
      policy ``get_policy`` does not understand.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> import flax.linen as nn
    >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
    >>> policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"},
    ...                                  default="mixed_bfloat16")
    >>> x = jnp.ones((1, 3))
    >>> variables = model.init(jax.random.key(0), x)
    >>> apply = policy.wrap_apply(model.apply)
    >>> apply(variables, x).dtype  # the default's output dtype
    dtype('float32')
  """

  rules: tuple[tuple[Any, Policy], ...]
  default: Policy | None
  first_match: bool

  def __init__(
      self,
      rules: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = (),
      default: Any = "float32",
      *,
      first_match: bool = False,
  ):
    object.__setattr__(self, "rules", check_rules(
        "ModulePolicy", rules, _check_key, key_word="key",
        key_description="module class or name pattern", key_repr=_key_repr))
    if not isinstance(first_match, bool):
      raise TypeError(
          f"ModulePolicy: first_match must be a bool, got {first_match!r}."
      )
    object.__setattr__(
        self, "default", None if default is None else get_policy(default)
    )
    object.__setattr__(self, "first_match", first_match)

  def rule_for(self, module: Any, name: str | None, path: str) -> Policy | None:
    """Returns the policy of the rule that matches a module, or ``None``.

    Args:
      module: the module (instance).
      name: its name (a Linen module's ``name``, an NNX attribute name).
      path: its ``/``-separated path from the root module.

    Raises:
      ValueError: if several rules match and ``first_match`` is false.
    """
    match = self._match(module, name, path)
    return None if match is None else match[1]

  def _match(
      self, module: Any, name: str | None, path: str
  ) -> tuple[Any, Policy] | None:
    matches = [
        (key, policy)
        for key, policy in self.rules
        if _rule_hits(key, module, name, path)
    ]
    if not matches:
      return None
    if len(matches) > 1 and not self.first_match:
      raise ValueError(
          f"ModulePolicy: the module {type(module).__name__} at path "
          f"{path or '(root)'!r} matches several rules: "
          f"{', '.join(_key_repr(k) for k, _ in matches)}. Remove the overlap, "
          "or pass first_match=True to let the first matching rule win."
      )
    return matches[0]

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any of the policies (default included) needs loss scaling."""
    return rules_need_loss_scaling(self.rules, self.default)

  @property
  def io_policy(self) -> Policy:
    """The policy of the model's inputs and outputs: ``default``.

    Raises:
      ValueError: if there is no default.
    """
    return default_io_policy(self)

  def params_for_storage(self, params: Any) -> Any:
    """Returns the params as they are: each module casts what it reads."""
    return params

  def params_for_compute(self, params: Any) -> Any:
    """Returns the params as they are: each module casts what it reads."""
    return params

  # Linen.

  def _intercept(self, next_fun, args, kwargs, context):
    module = context.module
    scope = module.scope
    path = "/".join(scope.path) if scope is not None else ""
    stack = _active_stack()
    outermost = not stack
    own = self.rule_for(module, module.name, path)
    if own is not None:
      policy = own
    elif stack:
      policy = stack[-1]
    else:
      policy = self.default
    stack.append(policy)
    try:
      if policy is None or context.method_name == "setup":
        return next_fun(*args, **kwargs)
      args, kwargs = policy.cast_to_compute((args, kwargs))
      out = next_fun(*args, **kwargs)
    finally:
      stack.pop()
    if own is not None or outermost:
      out = policy.cast_to_output(out)
    return out

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (a Linen ``model.apply``) running under the policies.

    The returned function has the signature of ``apply_fn``
    (``(variables, *args, **kwargs)``). It wraps the floating leaves of
    ``variables["params"]`` so that each module reads its parameters in its
    own compute dtype, and runs ``apply_fn`` inside ``nn.intercept_methods``
    with an interceptor that casts the modules' inputs and outputs (see the
    class documentation). Gradients with respect to the params flow back to
    the params' own dtype. Do not make the ``params`` collection mutable in
    the wrapped call.

    Args:
      apply_fn: a function such as ``model.apply``.

    Returns:
      The wrapped function.
    """
    import flax.linen as nn  # pylint: disable=g-import-not-at-top

    @functools.wraps(apply_fn)
    def apply(variables, *args, **kwargs):
      if isinstance(variables, Mapping) and "params" in variables:
        variables = {**variables, "params": _box_params(variables["params"])}
      with nn.intercept_methods(self._intercept):
        return apply_fn(variables, *args, **kwargs)

    return apply

  # NNX.

  def set_nnx_dtypes(self, model: Any) -> dict[str, str]:
    """Sets the ``dtype`` of each module of an NNX model to its compute dtype.

    Walks the module graph (:func:`flax.nnx.iter_modules`) and, for every
    module that has a ``dtype`` attribute, sets it to the compute dtype of its
    policy (its rule's, else the enclosing module's, else ``default``). Call
    it once, outside ``jit``, after building the model; the model is changed
    in place. Parameters keep their dtype.

    Args:
      model: an ``nnx.Module``.

    Returns:
      ``{path: str(policy)}`` for each module whose ``dtype`` was set
      (``"(root)"`` for the model itself).

    Raises:
      TypeError: if ``model`` is not an ``nnx.Module``.
      ValueError: if a rule matches no module (a typo, most likely), or
        matches only modules without a ``dtype`` attribute anywhere inside
        them, or if rules overlap without ``first_match``.

    Example:
      >>> import jaxmp
      >>> from flax import nnx
      >>> class Model(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.dense = nnx.Linear(3, 4, rngs=rngs)
      ...     self.norm = nnx.LayerNorm(4, rngs=rngs)
      >>> model = Model(nnx.Rngs(0))
      >>> policy = jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"},
      ...                                  default="mixed_bfloat16")
      >>> policy.set_nnx_dtypes(model)
      {'dense': 'p=f32,c=bf16,o=f32', 'norm': 'p=f32,c=f32,o=f32'}
      >>> model.norm.dtype, model.dense.dtype
      (dtype('float32'), dtype(bfloat16))
    """
    from flax import nnx  # pylint: disable=g-import-not-at-top

    if not isinstance(model, nnx.Module):
      raise TypeError(
          "set_nnx_dtypes expects an nnx.Module; for a Linen model use "
          f"wrap_apply(model.apply). Got {type(model).__name__}."
      )
    modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]))
    effective: dict[tuple[Any, ...], Policy | None] = {}
    matched_by: dict[Any, list[tuple[Any, ...]]] = {k: [] for k, _ in self.rules}
    for path, module in modules:
      path_str = "/".join(str(p) for p in path)
      name = str(path[-1]) if path else None
      match = self._match(module, name, path_str)
      if match is not None:
        matched_by[match[0]].append(path)
        effective[path] = match[1]
      else:
        parent = next(
            (effective[path[:i]] for i in range(len(path) - 1, -1, -1)
             if path[:i] in effective),
            self.default,
        )
        effective[path] = parent
    set_paths = {}
    for path, module in modules:
      policy = effective[path]
      if policy is not None and hasattr(module, "dtype"):
        module.dtype = policy.compute_dtype
        set_paths[path] = str(policy)
    for key, paths in matched_by.items():
      if not paths:
        names = ", ".join(
            repr("/".join(str(p) for p in path)) for path, _ in modules if path
        )
        raise ValueError(
            f"ModulePolicy: the rule {_key_repr(key)} matches no module of the "
            f"model. Module paths are: {names}."
        )
      if not any(sp[: len(p)] == p for p in paths for sp in set_paths):
        raise ValueError(
            f"ModulePolicy: the rule {_key_repr(key)} matches modules without "
            "a dtype attribute (none inside them either), so it has no effect. "
            "Name the layers inside them instead (e.g. nnx.Linear)."
        )
    return {
        ("/".join(str(p) for p in path) or "(root)"): policy
        for path, policy in sorted(
            set_paths.items(), key=lambda item: [str(p) for p in item[0]]
        )
    }


def _rule_hits(key: Any, module: Any, name: str | None, path: str) -> bool:
  if isinstance(key, type):
    return isinstance(module, key)
  return (name is not None and re.fullmatch(key, name) is not None) or (
      re.fullmatch(key, path) is not None
  )
