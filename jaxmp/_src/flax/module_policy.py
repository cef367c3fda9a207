"""Per-module policies for Linen and NNX models, without editing model code.

Linen: :meth:`ModulePolicy.wrap_apply`, an ``nn.intercept_methods``
interceptor (Haiku's ``set_policy`` for Linen). NNX:
:meth:`ModulePolicy.set_nnx_dtypes`, which sets each module's ``dtype``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import re
from typing import Any, Callable, Iterable, Mapping

import jax
import numpy as np
from flax import struct
from flax.core import meta

from jaxmp._src.flax.apply import (
    WrappedApply, cast_apply_output, note_declared_dtype, warn_declared_dtypes)
from jaxmp._src.flax.fp8 import fp8_dot_general_cls, nnx_fp8_op
from jaxmp._src.policy import Fp8Policy, Policy, is_floating_array
from jaxmp._src.rules import RuleTable, RuleTablePolicy, check_pattern, module_path, rule_table


class _Call:
  """What one wrapped Linen call keeps (made per call: nothing outlives it)."""

  def __init__(self):
    self.policies: list[Policy | None] = []  # of the methods running, innermost last
    # The copies run with the policy's fields, by id: (copy, method, the
    # context that turns Flax's call names back on).
    self.clones: dict[int, tuple[Any, str, contextlib.ExitStack]] = {}
    self.defeated: dict[str, Any] = {}  # modules whose own dtype wins, by path


class _CastOnRead(struct.PyTreeNode, meta.AxisMetadata):
  """A parameter cast to the policy of the innermost running module as
  ``Module.param`` reads (unboxes) it: each module reads its own compute dtype."""

  value: Any
  call: _Call = struct.field(pytree_node=False)

  def unbox(self) -> Any:
    stack, value = self.call.policies, meta.unbox(self.value)
    return stack[-1].cast_to_compute(value) if stack and stack[-1] else value

  def replace_boxed(self, val: Any) -> "_CastOnRead":
    return self.replace(value=val)

  def add_axis(self, index: int, params: dict[Any, Any]) -> "_CastOnRead":
    del index, params
    return self

  remove_axis = add_axis


def _check_key(key: Any) -> None:
  if isinstance(key, str):
    check_pattern("ModulePolicy", key)
  elif not isinstance(key, type):
    raise TypeError(
        "ModulePolicy keys must be module classes (e.g. nn.LayerNorm) or "
        "strings matching a module's name or path (e.g. 'head', "
        f"'Encoder_0/Dense_1'); got {key!r} of type {type(key).__name__}.")


def _key_repr(key: Any) -> str:
  return f"{key.__module__}.{key.__qualname__}" if isinstance(key, type) else repr(key)


def _has_dtype_field(cls: type) -> bool:
  return "dtype" in getattr(cls, "__dataclass_fields__", {})


def _check_override_dtype(value: Any) -> bool | tuple[type, ...]:
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  classes = (value,) if isinstance(value, type) else value
  if not (isinstance(classes, (tuple, list)) and classes
          and all(isinstance(c, type) for c in classes)):
    raise TypeError(
        "ModulePolicy: override_dtype must be True (every module that has a "
        "dtype attribute), False, or a tuple of module classes such as "
        f"(nn.Dense, nn.Conv); got {value!r}.")
  for cls in classes:
    if not _has_dtype_field(cls):
      raise ValueError(
          f"ModulePolicy: override_dtype names {_key_repr(cls)}, which has no "
          "dtype attribute, so there is nothing to override. Name the Linen "
          "layers that take dtype= (e.g. nn.Dense, nn.Conv, or your model class "
          "if it declares dtype); for NNX models, set_nnx_dtypes sets every "
          "layer's dtype without it.")
  return tuple(classes)


def _rule_hits(key: Any, module: Any, name: str | None, path: str) -> bool:
  if isinstance(key, type):
    return isinstance(module, key)
  return (name is not None and re.fullmatch(key, name) is not None) or (
      re.fullmatch(key, path) is not None)


@dataclasses.dataclass(frozen=True, init=False)
class ModulePolicy(RuleTablePolicy):
  """Policies for chosen modules of a Flax model; the rest use a default.

  A rule's key is a module class (subclasses match) or a regular expression
  matching the whole of a module's name (``"head"``) or path
  (``"Encoder_0/Dense_1"``). A module no rule matches runs under the policy
  of the module enclosing it, the outermost under ``default`` (``None``: left
  as it is). Overlapping rules raise unless ``first_match=True``.

  Linen (:meth:`wrap_apply`, or a ``TrainState``'s ``policy=``): each module
  gets its inputs and the params it reads in its compute dtype. A module's
  own ``dtype=`` wins unless ``override_dtype`` (``True``, or a tuple of
  classes) makes the policy set it, and is then reported with a
  :class:`jaxmp.PrecisionWarning`; a rule of that dtype keeps it silently.
  Under an FP8 policy each ``nn.Dense``/``nn.DenseGeneral`` runs with Flax's
  FP8 op. A module that needs other fields runs as a copy bound to its
  variables. NNX: :meth:`set_nnx_dtypes`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp, jaxmp.flax
    >>> import flax.linen as nn
    >>> model = nn.Sequential([nn.Dense(4), nn.LayerNorm(), nn.Dense(2)])
    >>> policy = jaxmp.flax.ModulePolicy({nn.LayerNorm: "float32"},
    ...                                  default="mixed_bfloat16")
    >>> x = jnp.ones((1, 3))
    >>> policy.wrap_apply(model.apply)(model.init(jax.random.key(0), x), x).dtype
    dtype('float32')
  """

  table: RuleTable
  override_dtype: bool | tuple[type, ...]
  tag_scopes: bool  # set by for_autocast: a named scope per matched policy

  def __init__(self, rules: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = (),
               default: Any = "float32", *, first_match: bool = False,
               override_dtype: bool | type | tuple[type, ...] = False):
    object.__setattr__(self, "table", rule_table(
        "ModulePolicy", rules, default, first_match, check_key=_check_key,
        key_description="module class or name pattern", key_repr=_key_repr,
        exclusive_hint=" (a class and a name that cover the same module overlap)"))
    object.__setattr__(self, "override_dtype", _check_override_dtype(override_dtype))
    object.__setattr__(self, "tag_scopes", False)

  def _match(self, module: Any, name: str | None, path: str) -> tuple[Any, Policy] | None:
    return self.table.match(
        f"the module {type(module).__name__} at path {path or '(root)'!r}",
        lambda key: _rule_hits(key, module, name, path))

  def _overrides_dtype(self, module: Any) -> bool:
    if self.override_dtype is False or (self.override_dtype is not True and not
                                        isinstance(module, self.override_dtype)):
      return False
    return _has_dtype_field(type(module))

  def params_for_storage(self, params: Any) -> Any:
    """Returns the params as they are: each module casts what it reads."""
    return params

  params_for_compute = params_for_storage

  def __str__(self) -> str:
    override = self.override_dtype
    if isinstance(override, tuple):
      override = "(" + "".join(_key_repr(c) + ", " for c in override).rstrip() + ")"
    return f"ModulePolicy({self.table}, override_dtype={override})"

  __repr__ = __str__

  def _scope_tags(self) -> dict[Policy, str]:
    tags: dict[Policy, str] = {}
    for _, policy in self.table.rules:
      tags.setdefault(policy, f"jaxmp_policy_{len(tags)}")
    return tags

  def for_autocast(self) -> tuple[ModulePolicy, dict[str, Policy]]:
    """``(policy, scope_policies)`` for :func:`jaxmp.autocast`: the copy runs
    each matched module in a ``jax.named_scope`` that ``scope_policies`` maps
    to its policy."""
    tagged = copy.copy(self)
    object.__setattr__(tagged, "tag_scopes", True)
    return tagged, {re.escape(tag): p for p, tag in self._scope_tags().items()}

  # Linen.

  def _intercept(self, call, next_fun, args, kwargs, context):
    module = context.module
    copy_of = call.clones.get(id(module))
    if copy_of is not None:  # a copy made below: it has the policy's fields
      if context.method_name == copy_of[1]:
        copy_of[2].close()  # its call has begun: name calls again
      return next_fun(*args, **kwargs)
    path = "/".join(module.scope.path) if module.scope is not None else ""
    stack = call.policies
    outermost = not stack
    own = (self._match(module, module.name, path) or (None, None))[1]
    policy = own if own is not None else stack[-1] if stack else self.default
    setup = context.method_name == "setup"
    fields = {}
    if policy is not None and not setup:
      if self._overrides_dtype(module) and module.dtype != policy.compute_dtype:
        fields["dtype"] = policy.compute_dtype
      fp8_cls = fp8_dot_general_cls(module, policy, path)
      if fp8_cls is not None:
        fields["dot_general_cls"] = fp8_cls
    run = (_method_of_copy(call, module, context.method_name, fields)
           if fields else None) or next_fun
    stack.append(policy)
    try:
      # In init nothing is cast: params are created in their param_dtype.
      if policy is None or setup or module.is_initializing():
        return run(*args, **kwargs)
      if not (self._overrides_dtype(module) or self.tag_scopes):
        note_declared_dtype(call.defeated, module, path, [policy.compute_dtype])
      args, kwargs = policy.cast_to_compute((args, kwargs))
      with (jax.named_scope(self._scope_tags()[own]) if own is not None and
            self.tag_scopes else contextlib.nullcontext()):
        out = run(*args, **kwargs)
    finally:
      stack.pop()
    return policy.cast_to_output(out) if own is not None or outermost else out

  def wrap_apply(self, apply_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Returns ``apply_fn`` (a Linen ``model.apply``) running under the policies.

    Its output is cast to ``default``'s output dtype (with ``mutable=...``,
    not the collections). Under FP8, wrap ``model.init`` too: it creates the
    FP8 meta.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp, jaxmp.flax
      >>> import flax.linen as nn
      >>> model = nn.Dense(2, dtype=jnp.float32)  # a declared float32 layer
      >>> x = jnp.ones((1, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> policy = jaxmp.flax.ModulePolicy({}, default="mixed_float16",
      ...                                  override_dtype=True)
      >>> jaxmp.precision_report(policy.wrap_apply(model.apply), variables, x).ops[0].inputs
      ('float16', 'float16')
    """
    return WrappedApply(_apply_under_modules, self, apply_fn)

  # NNX.

  def set_nnx_dtypes(self, model: Any) -> dict[str, str]:
    """Sets the ``dtype`` of each module of an NNX model to its compute dtype.

    Every module with a ``dtype`` attribute gets its policy's compute dtype,
    whatever it was built with (``param_dtype`` is left alone); under an FP8
    policy each ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` also
    gets an FP8 op whose meta is :class:`jaxmp.flax.Fp8Meta`. Call it once,
    outside ``jit``: the model is changed in place (not at all when it
    raises), and ``{path: str(policy)}`` of the modules set is returned.

    Example:
      >>> import jaxmp, jaxmp.flax
      >>> from flax import nnx
      >>> class Model(nnx.Module):
      ...   def __init__(self, rngs):
      ...     self.dense = nnx.Linear(3, 4, rngs=rngs)
      ...     self.norm = nnx.LayerNorm(4, rngs=rngs)
      >>> jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"},
      ...                         default="mixed_bfloat16").set_nnx_dtypes(Model(nnx.Rngs(0)))
      {'dense': 'p=f32,c=bf16,o=f32', 'norm': 'p=f32,c=f32,o=f32'}
    """
    return set_model_policy(model, self)[0]


def set_model_policy(model: Any, policy: Any, switching: bool = False
                     ) -> tuple[dict[str, str], list[str]]:
  """``set_nnx_dtypes`` of ``policy`` (a :class:`jaxmp.Policy` acts as
  ``ModulePolicy({}, default=policy)``), checked whole before the model is
  changed; returns its report and, when ``switching``, the paths of the
  layers whose FP8 op (and meta) came off."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if not isinstance(model, nnx.Module):
    raise TypeError("set_nnx_dtypes expects an nnx.Module; for a Linen model use "
                    f"wrap_apply(model.apply). Got {type(model).__name__}.")
  if not isinstance(policy, ModulePolicy):
    if not isinstance(policy, Policy):
      raise TypeError(
          "switch_precision: an NNX model takes a jaxmp.Policy or a "
          "jaxmp.flax.ModulePolicy, which set the modules' dtype; got "
          f"{type(policy).__name__} {policy}. A PathPolicy casts a params "
          "tree, which an NNX model does not take.")
    policy = ModulePolicy({}, default=policy)
  modules = sorted(nnx.iter_modules(model), key=lambda item: len(item[0]))
  effective: dict[tuple[Any, ...], Policy | None] = {}
  matched: dict[Any, list[tuple[Any, ...]]] = {key: [] for key, _ in policy.rules}
  for path, module in modules:
    match = policy._match(module, str(path[-1]) if path else None, module_path(path))  # pylint: disable=protected-access
    if match is not None:
      matched[match[0]].append(path)
    effective[path] = match[1] if match is not None else next(
        (effective[path[:i]] for i in range(len(path) - 1, -1, -1)
         if path[:i] in effective), policy.default)
  dtyped = [p for p, m in modules if effective[p] is not None and hasattr(m, "dtype")]
  for key, paths in matched.items():
    if not paths:
      raise ValueError(
          f"ModulePolicy: the rule {_key_repr(key)} matches no module of the "
          f"model. Module paths are: {', '.join(repr(module_path(p)) for p, _ in modules if p)}."
          " Check the rule for a typo.")
    if not any(d[:len(p)] == p for p in paths for d in dtyped):
      raise ValueError(
          f"ModulePolicy: the rule {_key_repr(key)} matches modules without "
          "a dtype attribute (none inside them either), so it has no effect. "
          "Name the layers inside them instead (e.g. nnx.Linear).")
  ops = [(module, nnx_fp8_op(module, effective[path], module_path(path), switching))
         for path, module in modules if effective[path] is not None or switching]
  # Checked: now change the model.
  by_path = dict(modules)
  for path in dtyped:
    by_path[path].dtype = effective[path].compute_dtype
  dropped = []
  for module, op in ops:
    if op is not None:
      setattr(module, op[0], op[1])
      dropped += [op[2]] if op[2] is not None else []
  report = {module_path(p) or "(root)": str(effective[p])
            for p in sorted(dtyped, key=lambda p: [str(x) for x in p])}
  return report, dropped


def _apply_under_modules(policy: ModulePolicy, apply_fn: Callable[..., Any],
                         variables: Any, *args, **kwargs) -> Any:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  call = _Call()  # per call: under jit, once per trace
  if isinstance(variables, Mapping) and "params" in variables:
    boxed = lambda x: isinstance(x, meta.AxisMetadata)
    variables = {**variables, "params": jax.tree_util.tree_map(
        lambda x: _CastOnRead(x, call) if boxed(x) or is_floating_array(x) else x,
        variables["params"], is_leaf=boxed)}
  with nn.intercept_methods(functools.partial(policy._intercept, call)):  # pylint: disable=protected-access
    result = apply_fn(variables, *args, **kwargs)
  warn_declared_dtypes(call.defeated, "ModulePolicy", stacklevel=3)
  if policy.default is None:
    return result
  return cast_apply_output(policy.default, result, kwargs)


def _method_of_copy(call: _Call, module: Any, method_name: str,
                    fields: dict[str, Any]) -> Callable[..., Any] | None:
  """``module``'s method on a copy with ``fields`` (None for a function given
  to ``apply(method=...)``). The copy is bound to the module's scope (its
  variables and RNGs) and its call is not named again by Flax."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  clone = module.clone(parent=module.scope.rewound(), **fields)
  method = getattr(clone, method_name, None)
  if method is None:
    return None

  def run(*args, **kwargs):
    with contextlib.ExitStack() as unnamed:
      unnamed.enter_context(nn.override_named_call(False))
      call.clones[id(clone)] = (clone, method_name, unnamed)
      return method(*args, **kwargs)

  return run


def runs_fp8(policy: Any) -> bool:
  """Whether ``policy`` is a :class:`ModulePolicy` with an FP8 default or rule."""
  return isinstance(policy, ModulePolicy) and any(
      isinstance(p, Fp8Policy) for p in (policy.default, *(p for _, p in policy.rules)))
