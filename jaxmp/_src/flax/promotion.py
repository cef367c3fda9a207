"""Which modules overflow, and a policy that keeps just those in float32.

:func:`find_overflowing_modules` runs a model's forward pass once, under its
policy, and records for every module call whether its floating inputs and
outputs are finite: the modules whose inputs are finite and whose outputs are
not (and inside which no module already did that) are where the inf or nan
is produced. Linen models are watched with ``nn.intercept_methods``; NNX
models by wrapping the ``__call__`` of their module classes for the duration
of the call. Given the gradients of the failing step, it also maps
:func:`jaxmp.nonfinite_paths` to module paths.

:meth:`OverflowReport.propose_policy` turns the finding into a
:class:`jaxmp.flax.ModulePolicy` that runs those modules in float32 and the
rest under the current policy; :func:`jaxmp.switch_precision` (or
:meth:`jaxmp.PrecisionFallback.switch`) applies it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.diagnostics import nonfinite_paths
from jaxmp._src.flax.apply import WrappedApply
from jaxmp._src.flax.fp8 import FP8_META
from jaxmp._src.flax.fp8_nnx import is_fp8_op
from jaxmp._src.flax.module_policy import ModulePolicy
from jaxmp._src.flax.switch import set_model_policy
from jaxmp._src.loss_scale import all_finite
from jaxmp._src.policy import Policy, as_policy, is_floating_array
from jaxmp._src.rules import module_path

_ROOT = ""


class ModuleCall(NamedTuple):
  """One call of a module method during :func:`find_overflowing_modules`.

  Attributes:
    path: the module's ``/``-separated path (``""`` for the model itself),
      as :class:`jaxmp.flax.ModulePolicy` matches it.
    method: the method called (``"__call__"``).
    inputs_finite: whether its floating inputs held no inf or nan.
    outputs_finite: whether its floating outputs held none.
    parent: the index of the call it was made from, or ``-1``.
  """

  path: str
  method: str
  inputs_finite: bool
  outputs_finite: bool
  parent: int


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """Where a model's forward pass first produces inf or nan.

  Attributes:
    modules: the paths of the modules that produce non-finite values: their
      inputs are finite, their outputs are not, and no module called inside
      them already produced them; in the order they ran. ``""`` is the model
      itself (an operation in its own body). Empty when the forward pass is
      finite (the overflow is then in the loss or the backward pass).
    calls: every module call, in the order they ran (:class:`ModuleCall`).
    inputs_finite: whether the model's inputs (after the policy's casts)
      were finite; when not, the data itself holds inf or nan.
    gradient_modules: the paths of the modules with non-finite gradients,
      from :func:`jaxmp.nonfinite_paths` of the gradients given (empty when
      none were). An overflow in the forward pass makes the gradients of
      every module before it non-finite too, so this is the wider list.

  Example:
    >>> from jaxmp._src.flax.promotion import OverflowReport
    >>> report = OverflowReport(modules=("head",), calls=(),
    ...                          inputs_finite=True)
    >>> print(report)
    inf or nan first produced by 'head'
    >>> print(report.propose_policy("mixed_float16"))
    ModulePolicy({'head': p=f32,c=f32,o=f32}, default=p=f32,c=f16,o=f32, first_match=False, override_dtype=True)
  """

  modules: tuple[str, ...]
  calls: tuple[ModuleCall, ...]
  inputs_finite: bool
  gradient_modules: tuple[str, ...] = ()
  # The report of the same forward pass under another policy (None for a
  # report not made by find_overflowing_modules).
  _recheck: Callable[[Any], OverflowReport] | None = dataclasses.field(
      default=None, compare=False, repr=False)

  def propose_policy(self, policy: Any, *, dtype: Any = jnp.float32) -> Any:
    """The policy that runs :attr:`modules` in ``dtype`` and the rest as now.

    The proposal is checked on the batch the report was made from: the
    forward pass runs again under it, and the modules that then produce inf
    or nan (a float16 module fed a promoted module's float32 output beyond
    65504) are promoted too, until it runs finite.

    For a :class:`jaxmp.Policy`, ``ModulePolicy({path: promoted, ...},
    default=policy, override_dtype=True)``, where ``promoted`` computes and
    outputs in ``dtype`` and keeps ``policy``'s ``param_dtype``; each path is
    matched exactly. For a :class:`jaxmp.flax.ModulePolicy`, its rules with
    the new ones put first (they win where they overlap:
    ``first_match=True``) and its default kept. ``override_dtype=True``
    makes the rules win over a module's own ``dtype=`` (a layer built with
    ``dtype=jnp.float16`` would otherwise stay in float16 and overflow
    again); every other Linen module with a ``dtype`` then computes in its
    policy's compute dtype too. When the model itself produces the non-finite
    values (``""`` in :attr:`modules`), the whole model is promoted: the
    plain ``promoted`` policy. The loss scale stays dynamic as long as the
    rest computes in float16.

    Args:
      policy: the current policy (anything :func:`jaxmp.get_policy` takes, or
        a :class:`jaxmp.flax.ModulePolicy`).
      dtype: the dtype of the promoted modules; default float32.

    Returns:
      A :class:`jaxmp.flax.ModulePolicy` (or, for the whole model, a
      :class:`jaxmp.Policy`).

    Raises:
      ValueError: when no module produced non-finite values (fall back to a
        wider policy instead: the overflow is in the loss or the backward
        pass), the inputs themselves are not finite (bad data), or the
        forward pass still produces them with every module it names promoted.
      TypeError: for a :class:`jaxmp.PathPolicy`, which rules over params
        rather than modules.
    """
    policy = as_policy(policy)
    if isinstance(policy, ModulePolicy):
      base = policy
      io = policy.io_policy
    elif isinstance(policy, Policy):
      base, io = None, policy
    else:
      raise TypeError(
          "propose_policy: module promotion needs a jaxmp.Policy or a "
          f"jaxmp.flax.ModulePolicy to start from; got {policy}. A PathPolicy "
          "chooses dtypes per parameter, not per module."
      )
    if not self.inputs_finite:
      raise ValueError(
          "propose_policy: the model's inputs already hold inf or nan (after "
          "the policy's casts), so no module is to blame: look for bad data "
          "(jaxmp.nonfinite_paths(batch)), or inputs beyond float16's range "
          "(65504)."
      )
    if not self.modules:
      raise ValueError(
          "propose_policy: every module's outputs are finite in this forward "
          "pass, so the inf or nan comes from the loss or the backward pass, "
          "which promoting modules does not fix. Fall back to a wider policy "
          "(jaxmp.PrecisionFallback moves to the next rung), or compute the "
          "loss in float32."
      )
    promoted = Policy(io.param_dtype, dtype, dtype)
    paths = list(self.modules)
    while True:
      proposal = _promote(paths, policy, base, promoted)
      found = () if self._recheck is None else self._recheck(proposal).modules
      if not found:
        return proposal
      if _ROOT in paths or set(found) <= set(paths):
        raise ValueError(
            f"propose_policy: under {proposal}, which promotes "
            f"{', '.join(repr(p) if p else 'the whole model' for p in paths)} "
            f"to {np.dtype(dtype).name}, the forward pass on the report's batch "
            f"still produces inf or nan in {', '.join(map(repr, found))}: "
            "promoting modules does not fix it. Fall back to a wider policy "
            "(jaxmp.PrecisionFallback moves to the next rung), or look for "
            "values beyond float32's range.")
      paths += [path for path in found if path not in paths]

  def __str__(self) -> str:
    if not self.inputs_finite:
      return "the model's inputs hold inf or nan"
    if not self.modules:
      found = "no module produces inf or nan in the forward pass"
    else:
      found = "inf or nan first produced by " + ", ".join(
          repr(path) if path else "the model itself" for path in self.modules)
    if self.gradient_modules:
      found += "; non-finite gradients in " + ", ".join(
          repr(path) for path in self.gradient_modules)
    return found


def _promote(paths: list[str], policy: Any, base: ModulePolicy | None,
             promoted: Policy) -> Any:
  """``policy`` with the modules at ``paths`` promoted (see propose_policy)."""
  if _ROOT in paths:
    return promoted
  new_rules = [(re.escape(path), promoted) for path in paths]
  if base is None:
    return ModulePolicy(new_rules, default=policy, override_dtype=True)
  keys = {key for key, _ in new_rules}
  old_rules = [(key, p) for key, p in base.rules if key not in keys]
  return ModulePolicy(new_rules + old_rules, default=base.default,
                      first_match=True, override_dtype=True)


def _floating_finite(tree: Any) -> jax.Array:
  leaves = [x for x in jax.tree_util.tree_leaves(tree) if is_floating_array(x)]
  return all_finite(leaves)


class _Recorder:
  """Collects the module calls while a forward pass is traced."""

  def __init__(self):
    self.calls: list[list[Any]] = []  # [path, method, parent]
    self.flags: list[tuple[jax.Array, jax.Array]] = []
    self.stack: list[tuple[int, str]] = []  # (call index, module path)

  def run(self, path: str, method: str, call: Callable[[], Any], args: Any) -> Any:
    if self.stack and self.stack[-1][1] == path:
      # The same module, through a super() call or another of its methods,
      # or the copy of it that a ModulePolicy runs.
      return call()
    index = len(self.calls)
    parent = self.stack[-1][0] if self.stack else -1
    self.calls.append([path, method, parent])
    inputs = _floating_finite(args)
    self.flags.append((inputs, inputs))
    self.stack.append((index, path))
    try:
      out = call()
    finally:
      self.stack.pop()
    self.flags[index] = (inputs, _floating_finite(out))
    return out

  def report(self, flags: Any, grads: Any,
             recheck: Callable[[Any], OverflowReport]) -> OverflowReport:
    flags = jax.device_get(flags)
    calls = tuple(
        ModuleCall(path, method, bool(np.asarray(i)), bool(np.asarray(o)), parent)
        for (path, method, parent), (i, o) in zip(self.calls, flags))
    sources = [c.inputs_finite and not c.outputs_finite for c in calls]
    # A call inside which a module produced the values is no source, however
    # deep inside: children come after their parents.
    produced_inside = [False] * len(calls)
    for index in range(len(calls) - 1, -1, -1):
      parent = calls[index].parent
      if parent >= 0 and (sources[index] or produced_inside[index]):
        produced_inside[parent] = True
    sources = [s and not inside for s, inside in zip(sources, produced_inside)]
    modules = []
    for call, source in zip(calls, sources):
      if source and call.path not in modules:
        modules.append(call.path)
    roots = [c for c in calls if c.parent == -1]
    inputs_finite = all(c.inputs_finite for c in roots) if roots else True
    return OverflowReport(
        modules=tuple(modules), calls=calls, inputs_finite=inputs_finite,
        gradient_modules=_gradient_modules(grads), _recheck=recheck)


def _key_name(key: Any) -> str:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return str(getattr(key, attribute))
  return str(key)


def _gradient_modules(grads: Any) -> tuple[str, ...]:
  """The module paths of the non-finite leaves of ``grads``."""
  if grads is None:
    return ()
  if isinstance(grads, Mapping) and set(grads) == {"params"}:
    grads = grads["params"]  # Linen variables: the params collection
  bad = set(nonfinite_paths(grads))
  modules = []
  for path, _ in jax.tree_util.tree_leaves_with_path(grads):
    if jax.tree_util.keystr(path) not in bad:
      continue
    names = [_key_name(key) for key in path]
    if isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
      names = names[:-1]  # an NNX Variable's value
    module = "/".join(names[:-1])  # without the parameter's own name
    if module not in modules:
      modules.append(module)
  return tuple(modules)


def _split_arrays(tree: Any) -> tuple[list[Any], Callable[[list[Any]], Any]]:
  """The array leaves of ``tree`` and how to put them back among the others."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]
  arrays = [x for x, a in zip(leaves, is_array) if a]

  def rebuild(new_arrays):
    it = iter(new_arrays)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if a else x for x, a in zip(leaves, is_array)])

  return arrays, rebuild


def _linen(apply_fn: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any], grads: Any) -> OverflowReport:
  import flax  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top

  recorder = _Recorder()

  def intercept(next_fun, call_args, call_kwargs, context):
    if context.method_name == "setup" or isinstance(
        context.module, fp8_ops.Fp8DotGeneralBase):
      # An FP8 op is part of the layer that holds it: the layer is reported.
      return next_fun(*call_args, **call_kwargs)
    scope = context.module.scope
    path = "/".join(scope.path) if scope is not None else _ROOT
    return recorder.run(path, context.method_name,
                        lambda: next_fun(*call_args, **call_kwargs),
                        (call_args, call_kwargs))

  arrays, rebuild = _split_arrays((args, kwargs))

  def forward(arrays):
    call_args, call_kwargs = rebuild(arrays)
    with nn.intercept_methods(intercept):
      apply_fn(*call_args, **call_kwargs)
    return recorder.flags

  try:
    flags = jax.jit(forward)(arrays)
  except flax.errors.ScopeCollectionNotFound as e:
    if FP8_META not in str(e):
      raise
    raise ValueError(
        "find_overflowing_modules: the model runs FP8 matmuls, whose meta "
        f"(the {FP8_META!r} collection) is not in the variables given. Pass "
        "it with the params, as a TrainState holds them: "
        "find_overflowing_modules(state.apply_fn, state.params, x)."
    ) from None
  # The model's own apply, to run under a proposed policy instead.
  bare = apply_fn.apply_fn if isinstance(apply_fn, WrappedApply) else apply_fn
  return recorder.report(flags, grads, lambda policy: _linen(
      policy.wrap_apply(bare), args, kwargs, None))


@contextlib.contextmanager
def _watching_nnx_calls(model: Any, recorder: _Recorder) -> Iterator[None]:
  """Wraps ``__call__`` of the model's module classes while the block runs."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  # An FP8 op is part of the layer that holds it: the layer is reported.
  paths = {id(m): module_path(path)
           for path, m in nnx.iter_modules(model) if not is_fp8_op(m)}
  classes = list(dict.fromkeys(type(m) for _, m in nnx.iter_modules(model)))
  originals = {cls: cls.__call__ for cls in classes}  # before any is wrapped
  own = {cls: "__call__" in vars(cls) for cls in classes}

  def wrap(original):
    def watched(self, *args, **kwargs):
      if id(self) not in paths:
        return original(self, *args, **kwargs)
      return recorder.run(paths[id(self)], "__call__",
                          lambda: original(self, *args, **kwargs), (args, kwargs))
    return watched

  try:
    for cls in classes:
      cls.__call__ = wrap(originals[cls])
    yield
  finally:
    for cls in classes:
      if own[cls]:
        cls.__call__ = originals[cls]
      else:
        delattr(cls, "__call__")


def _nnx(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
         grads: Any) -> OverflowReport:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  recorder = _Recorder()
  graphdef, state = nnx.split(model)
  arrays, rebuild = _split_arrays((args, kwargs))

  def forward(state, arrays):
    copy = nnx.merge(graphdef, state)  # the model itself is left untouched
    call_args, call_kwargs = rebuild(arrays)
    with _watching_nnx_calls(copy, recorder):
      copy(*call_args, **call_kwargs)
    return recorder.flags

  def recheck(policy):  # on a copy of the model as it was, switched
    copy = nnx.merge(graphdef, state)
    set_model_policy(copy, policy)
    return _nnx(copy, args, kwargs, None)

  return recorder.report(jax.jit(forward)(state, arrays), grads, recheck)


def find_overflowing_modules(model: Any, *args, grads: Any = None,
                             **kwargs) -> OverflowReport:
  """Runs the forward pass once and finds the modules that produce inf or nan.

  Host-side diagnostics for a failing step: call it outside ``jit`` with the
  batch that overflowed, under the policy the run trains in. The forward pass
  is traced and run once (jitted, as the train step is); nothing of the
  model or the state is changed. A module *produces* non-finite values when
  its floating inputs are finite and its outputs are not, and no module
  called inside it already did. Thread-safety: while an NNX model runs here,
  the ``__call__`` of its module classes is wrapped.

  Args:
    model: for Linen, the apply function the step uses (``state.apply_fn`` of
      a :class:`jaxmp.flax.TrainState`, or ``policy.wrap_apply(model.apply)``),
      called as ``model(*args, **kwargs)``, so ``args`` starts with the
      variables (``{"params": params}``). For NNX, the model (an
      ``nnx.Module``), called as ``model(*args, **kwargs)``; set its dtypes
      first (:meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`).
    *args: the arguments of the call (the batch's inputs).
    grads: optional: the gradients of the failing step; their non-finite
      leaves (:func:`jaxmp.nonfinite_paths`) are mapped to module paths in
      :attr:`OverflowReport.gradient_modules`.
    **kwargs: keyword arguments of the call; the arrays among ``args`` and
      ``kwargs`` are traced, the other values are fixed.

  Returns:
    An :class:`OverflowReport`.

  Raises:
    TypeError: if ``model`` is neither callable nor an NNX module.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp, jaxmp.flax
    >>> import flax.linen as nn
    >>> class Model(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.Dense(4, name="body")(x)
    ...     return nn.Dense(2, name="head", kernel_init=nn.initializers.constant(1e4))(x)
    >>> x = jnp.ones((1, 3))
    >>> variables = Model().init(jax.random.key(0), x)
    >>> apply = jaxmp.get_policy("mixed_float16").wrap_apply(Model().apply)
    >>> report = jaxmp.flax.find_overflowing_modules(apply, variables, x * 100)
    >>> report.modules
    ('head',)
    >>> report.propose_policy("mixed_float16").rules[0][0]
    'head'
  """
  try:
    from flax import nnx  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    nnx = None
  if nnx is not None and isinstance(model, nnx.Module):
    return _nnx(model, args, kwargs, grads)
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if isinstance(model, nn.Module):
    raise TypeError(
        "find_overflowing_modules: pass the apply function, not the Linen "
        "module: state.apply_fn, or policy.wrap_apply(model.apply), with the "
        "variables as the first argument."
    )
  if not callable(model):
    raise TypeError(
        "find_overflowing_modules: model must be a Linen apply function "
        "(state.apply_fn, or policy.wrap_apply(model.apply)) called with the "
        "variables first, or an NNX module; got "
        f"{type(model).__name__}."
    )
  return _linen(model, args, kwargs, grads)
