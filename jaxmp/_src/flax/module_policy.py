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
  WrappedApply,
  cast_apply_output,
  note_declared_dtype,
  warn_declared_dtypes,
)
from jaxmp._src.flax.fp8 import fp8_dot_general_cls, uses_fp8
from jaxmp._src.flax.fp8_nnx import attach_fp8_op
from jaxmp._src.policy import Policy, is_floating_array
from jaxmp._src.rules import (
  RuleTable,
  RuleTablePolicy,
  check_pattern,
  module_path,
  rule_table,
)

class _Call:
  """What one wrapped Linen call keeps: made per call and handed to its
  interceptor and its parameters, so nothing outlives the call or is shared
  between threads."""

  def __init__(self):
    # The policies of the module methods now running, innermost last.
    self.policies: list[Policy | None] = []
    # The copies of modules made to run with the policy's fields, by id:
    # (copy, the method it runs, what turns Flax's call names back on).
    self.clones: dict[int, tuple[Any, str, contextlib.ExitStack]] = {}
    # The modules whose declared dtype defeats their policy, by path.
    self.defeated: dict[str, str] = {}


class _CastOnRead(struct.PyTreeNode, meta.AxisMetadata):
  """A parameter that, when a Linen module reads it, is cast to its policy.

  Reading (``unbox``) happens inside ``Module.param``; the policy is that of
  the innermost module method running, so the parameter arrives in the
  compute dtype of the module that owns it.
  """

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


def _box_params(params: Any, call: _Call) -> Any:
  boxed = lambda x: isinstance(x, meta.AxisMetadata)
  return jax.tree_util.tree_map(
      lambda x: _CastOnRead(x, call) if boxed(x) or is_floating_array(x) else x,
      params, is_leaf=boxed)


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


def _has_dtype_field(cls: type) -> bool:
  """Whether a (Linen, dataclass) module class declares a ``dtype`` field."""
  return "dtype" in getattr(cls, "__dataclass_fields__", {})


def _check_override_dtype(value: Any) -> bool | tuple[type, ...]:
  """``override_dtype`` as ``True``, ``False`` or a tuple of module classes."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  classes = (value,) if isinstance(value, type) else value
  if not (isinstance(classes, (tuple, list)) and classes
          and all(isinstance(c, type) for c in classes)):
    raise TypeError(
        "ModulePolicy: override_dtype must be True (every module that has a "
        "dtype attribute), False, or a tuple of module classes such as "
        f"(nn.Dense, nn.Conv); got {value!r}."
    )
  for cls in classes:
    if not _has_dtype_field(cls):
      raise ValueError(
          f"ModulePolicy: override_dtype names {_key_repr(cls)}, which has no "
          "dtype attribute, so there is nothing to override. Name the Linen "
          "layers that take dtype= (e.g. nn.Dense, nn.Conv, or your model class "
          "if it declares dtype); for NNX models, set_nnx_dtypes sets every "
          "layer's dtype without it."
      )
  return tuple(classes)


def _module_subject(module: Any, path: str) -> str:
  return f"the module {type(module).__name__} at path {path or '(root)'!r}"


@dataclasses.dataclass(frozen=True, init=False)
class ModulePolicy(RuleTablePolicy):
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
  other modules stay in their compute dtype, and what the wrapped ``apply``
  returns is cast to ``default``'s output dtype. Flax layers with
  ``dtype=None`` (the default) then compute in the dtype of what they
  receive.

  **A model's own** ``dtype``: a layer built with ``dtype=jnp.float32`` (as
  most published Flax models do: ``dtype: Any = jnp.float32`` passed to every
  layer) computes in float32 whatever it receives. ``override_dtype=True``
  makes the policy win: a module that has a ``dtype`` attribute runs with its
  policy's compute dtype (``param_dtype`` is left alone, so the master params
  stay as they are stored). A tuple of classes limits the override to their
  instances. A module whose declared ``dtype`` is not overridden and is not
  its policy's compute dtype is reported, once per trace, with a
  :class:`jaxmp.PrecisionWarning`; a rule of that dtype keeps it silently. ``ModulePolicy({}, default="mixed_float16",
  override_dtype=True)`` is then "mixed_float16 for the whole model".
  Linen modules are frozen, so such a module runs as a copy with the
  policy's fields (``module.clone``), bound to the module's variables and
  RNGs; the model's own modules are never changed. With
  ``capture_intermediates``, the call of such a copy is recorded too.

  **FP8**: a rule's policy, or the default, may be an FP8 policy (``dot=fp8``)
  (``"mixed_fp8"``). Each ``nn.Dense`` and ``nn.DenseGeneral`` running under
  it then calls Flax's ``fp8_ops.Fp8DirectDotGeneralOp`` (its
  ``dot_general_cls`` in the copy that runs), whose scales and amax histories
  live in the collection ``"_overwrite_with_gradient"``; wrap ``model.init``
  too (``policy.wrap_apply(model.init)``, which injects the ops but casts
  nothing) to create them. Other modules run in the base compute dtype. A
  Dense layer with its own ``dot_general`` is refused, and so is an
  ``nn.Einsum``, which takes no ``dot_general_cls`` in Linen: give it a rule
  with a policy without FP8, or use ``nn.DenseGeneral``. NNX models get
  their FP8 ops from :meth:`set_nnx_dtypes`.

  **NNX** (:meth:`set_nnx_dtypes`): each module that has a ``dtype`` attribute
  (``nnx.Linear``, ``nnx.Conv``, ``nnx.LayerNorm``, ``nnx.BatchNorm``,
  ``nnx.MultiHeadAttention``...) gets ``dtype`` set to its policy's compute
  dtype, whatever ``dtype`` it was built with (``override_dtype`` only
  concerns Linen); NNX layers cast their inputs and parameters to ``dtype``.
  Parameters keep their dtype (the master copy); outputs are not cast, so
  cast the model's output with ``policy.default.cast_to_output``. Under an
  FP8 policy each ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum``
  also gets an FP8 op whose meta is :class:`jaxmp.flax.Fp8Meta` variables.

  Args:
    rules: a mapping (or sequence of pairs) from module classes or
      regular-expression strings to policies (anything
      :func:`jaxmp.get_policy` takes).
    default: the policy of the modules no rule covers (anything
      :func:`jaxmp.get_policy` takes), or ``None`` to leave them alone.
      Default ``"float32"``.
    first_match: resolve overlapping rules by their order instead of raising.
    override_dtype: Linen only: ``True`` to run every module that has a
      ``dtype`` with its policy's compute dtype, a tuple of module classes
      to do so for their instances only, ``False`` (the
      default) to leave the modules' ``dtype`` as declared.

  Raises:
    TypeError: if a key is neither a class nor a string, or
      ``override_dtype`` is neither a bool nor module classes.
    ValueError: for an invalid regular expression, a key given twice, a
      policy ``get_policy`` does not understand, or an ``override_dtype``
      class without a ``dtype`` attribute.

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

  table: RuleTable
  override_dtype: bool | tuple[type, ...]
  tag_scopes: bool

  def __init__(
      self,
      rules: Mapping[Any, Any] | Iterable[tuple[Any, Any]] = (),
      default: Any = "float32",
      *,
      first_match: bool = False,
      override_dtype: bool | type | tuple[type, ...] = False,
  ):
    object.__setattr__(self, "table", rule_table(
        "ModulePolicy", rules, default, first_match, check_key=_check_key,
        key_description="module class or name pattern", key_repr=_key_repr,
        exclusive_hint=" (a class and a name that cover the same module overlap)"))
    object.__setattr__(self, "override_dtype", _check_override_dtype(override_dtype))
    # Set by for_autocast: matched modules run inside a named scope per policy.
    object.__setattr__(self, "tag_scopes", False)

  def _match(
      self, module: Any, name: str | None, path: str
  ) -> tuple[Any, Policy] | None:
    return self.table.match(
        _module_subject(module, path),
        lambda key: _rule_hits(key, module, name, path),
    )

  def _overrides_dtype(self, module: Any) -> bool:
    if self.override_dtype is False:
      return False
    if self.override_dtype is not True and not isinstance(module, self.override_dtype):
      return False
    return _has_dtype_field(type(module))

  def params_for_storage(self, params: Any) -> Any:
    """Returns the params as they are: each module casts what it reads."""
    return params

  def params_for_compute(self, params: Any) -> Any:
    """Returns the params as they are: each module casts what it reads."""
    return params

  def __str__(self) -> str:
    override = self.override_dtype
    if isinstance(override, tuple):
      override = "(" + "".join(_key_repr(c) + ", " for c in override).rstrip() + ")"
    return f"ModulePolicy({self.table}, override_dtype={override})"

  __repr__ = __str__

  # Linen.

  def _scope_tags(self) -> dict[Policy, str]:
    """A name-scope tag for each distinct policy of the rules."""
    tags: dict[Policy, str] = {}
    for _, policy in self.table.rules:
      tags.setdefault(policy, f"jaxmp_policy_{len(tags)}")
    return tags

  def for_autocast(self) -> tuple[ModulePolicy, dict[str, Policy]]:
    """``(policy, scope_policies)`` for :func:`jaxmp.autocast`.

    The returned copy runs each module a rule matches inside a
    ``jax.named_scope`` that names its policy, and ``scope_policies`` maps
    those scopes to the policies, so a module pinned to float32 stays in
    float32 under autocast while the rest follows ``default``.
    """
    tagged = copy.copy(self)
    object.__setattr__(tagged, "tag_scopes", True)
    scopes = {re.escape(tag): policy for policy, tag in self._scope_tags().items()}
    return tagged, scopes

  def _fields(self, module: Any, policy: Policy | None) -> dict[str, Any]:
    """The fields ``module`` runs with under ``policy``, where they differ."""
    if policy is None:
      return {}
    fields = {}
    if self._overrides_dtype(module) and module.dtype != policy.compute_dtype:
      fields["dtype"] = policy.compute_dtype
    fp8_cls = fp8_dot_general_cls(module, policy)
    if fp8_cls is not None:
      fields["dot_general_cls"] = fp8_cls
    return fields

  def _intercept(self, call, next_fun, args, kwargs, context):
    module = context.module
    copy_of = call.clones.get(id(module))
    if copy_of is not None:  # a copy made below: it has the policy's fields
      if context.method_name == copy_of[1]:
        copy_of[2].close()  # its call has begun: name calls again
      return next_fun(*args, **kwargs)
    scope = module.scope
    path = "/".join(scope.path) if scope is not None else ""
    stack = call.policies
    outermost = not stack
    own = (self._match(module, module.name, path) or (None, None))[1]
    policy = own if own is not None else stack[-1] if stack else self.default
    setup = context.method_name == "setup"
    fields = {} if setup else self._fields(module, policy)
    run = (_method_of_copy(call, module, context.method_name, fields)
           if fields else None) or next_fun
    stack.append(policy)
    try:
      # In model.init nothing is cast: the params are created in their
      # param_dtype as the inputs arrive, and only the variables are kept.
      if policy is None or setup or module.is_initializing():
        return run(*args, **kwargs)
      # A policy that the module's declared dtype defeats; autocast casts
      # each op instead.
      if not (self._overrides_dtype(module) or self.tag_scopes):
        note_declared_dtype(call.defeated, module, path, [policy.compute_dtype])
      args, kwargs = policy.cast_to_compute((args, kwargs))
      if own is not None and self.tag_scopes:
        with jax.named_scope(self._scope_tags()[own]):
          out = run(*args, **kwargs)
      else:
        out = run(*args, **kwargs)
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
    with an interceptor that casts the modules' inputs and outputs (and, with
    ``override_dtype`` or FP8, runs them with the policy's fields; see the
    class documentation).
    What ``apply_fn`` returns is cast to ``default``'s output dtype; with
    ``mutable=[...]``, where it returns ``(output, updated_collections)``,
    only the output is cast, and the updated collections (``batch_stats``)
    keep their dtype. Gradients with respect to the params flow back to the
    params' own dtype. Do not make the ``params`` collection mutable in the
    wrapped call.

    Args:
      apply_fn: a function such as ``model.apply``.

    Returns:
      The wrapped function.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp
      >>> import flax.linen as nn
      >>> model = nn.Dense(2, dtype=jnp.float32)  # a declared float32 layer
      >>> x = jnp.ones((1, 3))
      >>> variables = model.init(jax.random.key(0), x)
      >>> def dot_dtypes(policy):
      ...   jaxpr = jax.make_jaxpr(policy.wrap_apply(model.apply))(variables, x)
      ...   return [tuple(str(v.aval.dtype) for v in e.invars)
      ...           for e in jaxpr.eqns if e.primitive.name == "dot_general"]
      >>> dot_dtypes(jaxmp.flax.ModulePolicy({}, default="mixed_float16"))
      [('float32', 'float32')]
      >>> dot_dtypes(jaxmp.flax.ModulePolicy({}, default="mixed_float16",
      ...                                    override_dtype=True))
      [('float16', 'float16')]
    """
    return WrappedApply(_apply_under_modules, self, apply_fn)

  # NNX.

  def set_nnx_dtypes(self, model: Any) -> dict[str, str]:
    """Sets the ``dtype`` of each module of an NNX model to its compute dtype.

    Walks the module graph (:func:`flax.nnx.iter_modules`) and, for every
    module that has a ``dtype`` attribute, sets it to the compute dtype of its
    policy (its rule's, else the enclosing module's, else ``default``). Call
    it once, outside ``jit``, after building the model; the model is changed
    in place. A module built with ``dtype=jnp.float32`` is overridden like
    any other (NNX layers read ``self.dtype`` when they run). Parameters keep
    their dtype (``param_dtype`` is not touched).

    Under an FP8 policy (``dot=fp8``, ``"mixed_fp8"``), each
    ``nnx.Linear`` and ``nnx.LinearGeneral`` it covers gets an FP8 op as its
    ``dot_general``, and each ``nnx.Einsum`` as its ``einsum_op``: an
    ``nnx.Module`` calling Flax's ``fp8_ops.fp8_scaled_dot_general``, whose
    scales and amax histories are :class:`jaxmp.flax.Fp8Meta` variables of
    the model (named and initialised as in Flax's Linen ops). Train it with
    ``jaxmp.scaled_value_and_grad(..., value_and_grad=nnx.value_and_grad)``,
    which updates the meta, and guard the meta with :func:`jaxmp.keep_on_skip`
    (see the FP8 guide). A second call
    with the same policy keeps the ops and their meta.

    Args:
      model: an ``nnx.Module``.

    Returns:
      ``{path: str(policy)}`` for each module whose ``dtype`` was set
      (``"(root)"`` for the model itself).

    Raises:
      TypeError: if ``model`` is not an ``nnx.Module``.
      ValueError: if a rule matches no module (a typo, most likely), or
        matches only modules without a ``dtype`` attribute anywhere inside
        them, or if rules overlap without ``first_match``; under an FP8
        policy, for a matmul layer with its own ``dot_general``
        (``dot_general_cls``, ``einsum_op``), or one that has FP8 ops from an
        earlier call with another policy.

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
      (<class 'jax.numpy.float32'>, <class 'jax.numpy.bfloat16'>)
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
      path_str = module_path(path)
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
      if policy is not None:  # under an FP8 policy, a matmul layer's FP8 op
        attach_fp8_op(module, policy, module_path(path))
    for key, paths in matched_by.items():
      if not paths:
        names = ", ".join(
            repr(module_path(path)) for path, _ in modules if path
        )
        raise ValueError(
            f"ModulePolicy: the rule {_key_repr(key)} matches no module of the "
            f"model. Module paths are: {names}. Check the rule for a typo."
        )
      if not any(sp[: len(p)] == p for p in paths for sp in set_paths):
        raise ValueError(
            f"ModulePolicy: the rule {_key_repr(key)} matches modules without "
            "a dtype attribute (none inside them either), so it has no effect. "
            "Name the layers inside them instead (e.g. nnx.Linear)."
        )
    return {
        (module_path(path) or "(root)"): policy
        for path, policy in sorted(
            set_paths.items(), key=lambda item: [str(p) for p in item[0]]
        )
    }


def _apply_under_modules(policy: ModulePolicy, apply_fn: Callable[..., Any],
                         variables: Any, *args, **kwargs) -> Any:
  """``apply_fn(variables, *args, **kwargs)`` under the module policy."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  call = _Call()  # per call: under jit, once per trace
  if isinstance(variables, Mapping) and "params" in variables:
    variables = {**variables, "params": _box_params(variables["params"], call)}
  with nn.intercept_methods(functools.partial(policy._intercept, call)):  # pylint: disable=protected-access
    result = apply_fn(variables, *args, **kwargs)
  warn_declared_dtypes(call.defeated, "ModulePolicy", stacklevel=3)
  if policy.default is None:
    return result
  return cast_apply_output(policy.default, result, kwargs)


def _method_of_copy(call: _Call, module: Any, method_name: str,
                    fields: dict[str, Any]) -> Callable[..., Any] | None:
  """``module``'s method on a copy with ``fields``, or ``None``.

  The copy is bound to a scope with the module's path (its variables and RNG
  streams) and its own reservations of names, so that its setup does not
  clash with the module's. Flax has named the module's call already: the
  copy's call is not named again, so the name stack reads as without it.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  clone = module.clone(parent=module.scope.rewound(), **fields)
  method = getattr(clone, method_name, None)
  if method is None:  # a function given to apply(method=...): run as it is
    return None

  def run(*args, **kwargs):
    with contextlib.ExitStack() as unnamed:
      unnamed.enter_context(nn.override_named_call(False))
      call.clones[id(clone)] = (clone, method_name, unnamed)
      return method(*args, **kwargs)

  return run


def _rule_hits(key: Any, module: Any, name: str | None, path: str) -> bool:
  if isinstance(key, type):
    return isinstance(module, key)
  return (name is not None and re.fullmatch(key, name) is not None) or (
      re.fullmatch(key, path) is not None
  )


def runs_fp8(policy: Any) -> bool:
  """Whether ``policy`` is a :class:`ModulePolicy` whose default or a rule is FP8."""
  return isinstance(policy, ModulePolicy) and uses_fp8(
      [policy.default, *(p for _, p in policy.rules)])
