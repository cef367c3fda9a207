"""Which modules overflow, and a policy that keeps just those in float32.

:func:`find_overflowing_modules` runs a forward pass once and records, for
each module call, whether its floating inputs and outputs are finite (Linen
through ``nn.intercept_methods``, NNX by wrapping the ``__call__`` of the
model's module classes while it runs). :meth:`OverflowReport.propose_policy`
turns the finding into a :class:`jaxmp.flax.ModulePolicy`.
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
from jaxmp._src.flax.fp8 import FP8_META, Fp8Op
from jaxmp._src.flax.module_policy import ModulePolicy, set_model_policy
from jaxmp._src.loss_scale import all_finite
from jaxmp._src.policy import Policy, as_policy, is_floating_array
from jaxmp._src.rules import module_path


class ModuleCall(NamedTuple):
  """One module call of :func:`find_overflowing_modules`: its path (``""``:
  the model), method, whether its floating inputs and outputs were finite,
  and the index of the call it was made from (``-1``: none)."""

  path: str
  method: str
  inputs_finite: bool
  outputs_finite: bool
  parent: int


@dataclasses.dataclass(frozen=True)
class OverflowReport:
  """Where a model's forward pass first produces inf or nan.

  Attributes:
    modules: the paths of the modules whose inputs are finite and outputs are
      not, and inside which no module already did that (``""``: the model's
      own operations); empty when the forward pass is finite.
    calls: every :class:`ModuleCall`, in the order they ran.
    inputs_finite: whether the model's inputs (after the policy's casts) were.
    gradient_modules: the modules with non-finite gradients, when ``grads``
      were given.
  """

  modules: tuple[str, ...]
  calls: tuple[ModuleCall, ...]
  inputs_finite: bool
  gradient_modules: tuple[str, ...] = ()
  # The report of the same forward pass under another policy.
  _recheck: Callable[[Any], OverflowReport] | None = dataclasses.field(
      default=None, compare=False, repr=False)

  def propose_policy(self, policy: Any, *, dtype: Any = jnp.float32) -> Any:
    """The policy that runs :attr:`modules` in ``dtype`` and the rest as now.

    ``ModulePolicy({path: promoted, ...}, default=policy,
    override_dtype=True)``, ``promoted`` computing in ``dtype`` (a
    :class:`jaxmp.flax.ModulePolicy`'s rules follow the new ones, with
    ``first_match=True``); ``promoted`` alone when the model itself
    overflows. It is checked on the report's batch: the modules that then
    overflow (fed a promoted module's output) are promoted too, until it runs
    finite; raises if it cannot.

    Example:
      >>> import jax, jax.numpy as jnp, jaxmp, jaxmp.flax
      >>> import flax.linen as nn
      >>> model = nn.Sequential([nn.Dense(2, kernel_init=nn.initializers.constant(1e4))])
      >>> x = jnp.full((1, 3), 100.0)
      >>> apply = jaxmp.get_policy("mixed_float16").wrap_apply(model.apply)
      >>> report = jaxmp.flax.find_overflowing_modules(
      ...     apply, model.init(jax.random.key(0), x), x)
      >>> report.modules, report.propose_policy("mixed_float16").rules[0][0]
      (('layers_0',), 'layers_0')
    """
    policy = as_policy(policy)
    if not isinstance(policy, (ModulePolicy, Policy)):
      raise TypeError(
          "propose_policy: module promotion needs a jaxmp.Policy or a "
          f"jaxmp.flax.ModulePolicy to start from; got {policy}. A PathPolicy "
          "chooses dtypes per parameter, not per module.")
    if not self.inputs_finite:
      raise ValueError(
          "propose_policy: the model's inputs already hold inf or nan (after "
          "the policy's casts), so no module is to blame: look for bad data "
          "(jaxmp.nonfinite_paths(batch)), or inputs beyond float16's range (65504).")
    if not self.modules:
      raise ValueError(
          "propose_policy: every module's outputs are finite in this forward "
          "pass, so the inf or nan comes from the loss or the backward pass, "
          "which promoting modules does not fix. Fall back to a wider policy "
          "(jaxmp.PrecisionFallback moves to the next rung), or compute the "
          "loss in float32.")
    promoted = Policy(policy.io_policy.param_dtype, dtype, dtype)
    paths = list(self.modules)
    while True:
      if "" in paths:
        proposal = promoted
      elif isinstance(policy, ModulePolicy):
        rules = [(re.escape(p), promoted) for p in paths]
        proposal = ModulePolicy(
            rules + [(k, p) for k, p in policy.rules if k not in dict(rules)],
            default=policy.default, first_match=True, override_dtype=True)
      else:
        proposal = ModulePolicy([(re.escape(p), promoted) for p in paths],
                                default=policy, override_dtype=True)
      found = () if self._recheck is None else self._recheck(proposal).modules
      if not found:
        return proposal
      if "" in paths or set(found) <= set(paths):
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
    found = ("inf or nan first produced by " + ", ".join(
        repr(p) if p else "the model itself" for p in self.modules) if self.modules
             else "no module produces inf or nan in the forward pass")
    if self.gradient_modules:
      found += "; non-finite gradients in " + ", ".join(map(repr, self.gradient_modules))
    return found


def _floating_finite(tree: Any) -> jax.Array:
  return all_finite([x for x in jax.tree_util.tree_leaves(tree) if is_floating_array(x)])


class _Recorder:
  """Collects the module calls while a forward pass is traced."""

  def __init__(self):
    self.calls: list[tuple[str, str, int]] = []  # (path, method, parent)
    self.flags: list[tuple[jax.Array, jax.Array]] = []
    self.stack: list[tuple[int, str]] = []  # (call index, module path)

  def run(self, path: str, method: str, call: Callable[[], Any], args: Any) -> Any:
    if self.stack and self.stack[-1][1] == path:
      return call()  # the same module again (super(), another method, a copy)
    index = len(self.calls)
    self.calls.append((path, method, self.stack[-1][0] if self.stack else -1))
    inputs = _floating_finite(args)
    self.flags.append((inputs, inputs))
    self.stack.append((index, path))
    try:
      out = call()
    finally:
      self.stack.pop()
    self.flags[index] = (inputs, _floating_finite(out))
    return out

  def report(self, flags: Any, grads: Any, recheck: Callable[[Any], Any]) -> OverflowReport:
    calls = tuple(ModuleCall(path, method, bool(i), bool(o), parent) for (
        path, method, parent), (i, o) in zip(self.calls, jax.device_get(flags)))
    sources = [c.inputs_finite and not c.outputs_finite for c in calls]
    inside = [False] * len(calls)  # a module inside produced them, however deep
    for index in range(len(calls) - 1, -1, -1):  # children come after parents
      if calls[index].parent >= 0 and (sources[index] or inside[index]):
        inside[calls[index].parent] = True
    modules = tuple(dict.fromkeys(
        c.path for c, s, i in zip(calls, sources, inside) if s and not i))
    roots = [c for c in calls if c.parent == -1]
    return OverflowReport(
        modules=modules, calls=calls, inputs_finite=all(c.inputs_finite for c in roots),
        gradient_modules=_gradient_modules(grads), _recheck=recheck)


def _gradient_modules(grads: Any) -> tuple[str, ...]:
  """The module paths of the non-finite leaves of ``grads``."""
  if grads is None:
    return ()
  if isinstance(grads, Mapping) and set(grads) == {"params"}:
    grads = grads["params"]  # Linen variables
  bad, modules = set(nonfinite_paths(grads)), []
  for path, _ in jax.tree_util.tree_leaves_with_path(grads):
    if jax.tree_util.keystr(path) in bad:
      names = [str(next((getattr(k, a) for a in ("key", "name", "idx") if hasattr(k, a)), k))
               for k in path]
      if isinstance(path[-1], jax.tree_util.GetAttrKey) and names[-1] == "value":
        names = names[:-1]  # an NNX Variable's value
      modules.append("/".join(names[:-1]))  # without the parameter's own name
  return tuple(dict.fromkeys(modules))


def _traced(forward: Callable[..., Any], args: Any, kwargs: Any, *state: Any) -> Any:
  """``jax.jit(forward)(*state, args, kwargs)`` with only the array leaves traced."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  is_array = [isinstance(x, (jax.Array, np.ndarray)) for x in leaves]

  def run(*state_and_arrays):
    arrays = iter(state_and_arrays[len(state):])
    call_args, call_kwargs = jax.tree_util.tree_unflatten(
        treedef, [next(arrays) if a else x for x, a in zip(leaves, is_array)])
    return forward(*state_and_arrays[:len(state)], call_args, call_kwargs)

  return jax.jit(run)(*state, *[x for x, a in zip(leaves, is_array) if a])


def _linen(apply_fn: Callable[..., Any], args: Any, kwargs: Any, grads: Any) -> OverflowReport:
  import flax  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from flax.linen import fp8_ops  # pylint: disable=g-import-not-at-top

  recorder = _Recorder()

  def intercept(next_fun, call_args, call_kwargs, context):
    # An FP8 op is part of the layer that holds it: the layer is reported.
    if context.method_name == "setup" or isinstance(context.module, fp8_ops.Fp8DotGeneralBase):
      return next_fun(*call_args, **call_kwargs)
    scope = context.module.scope
    return recorder.run("/".join(scope.path) if scope is not None else "",
                        context.method_name, lambda: next_fun(*call_args, **call_kwargs),
                        (call_args, call_kwargs))

  def forward(call_args, call_kwargs):
    with nn.intercept_methods(intercept):
      apply_fn(*call_args, **call_kwargs)
    return recorder.flags

  try:
    flags = _traced(forward, args, kwargs)
  except flax.errors.ScopeCollectionNotFound as e:
    if FP8_META not in str(e):
      raise
    raise ValueError(
        "find_overflowing_modules: the model runs FP8 matmuls, whose meta "
        f"(the {FP8_META!r} collection) is not in the variables given. Pass "
        "it with the params, as a TrainState holds them: "
        "find_overflowing_modules(state.apply_fn, state.params, x).") from None
  bare = apply_fn.apply_fn if isinstance(apply_fn, WrappedApply) else apply_fn
  return recorder.report(flags, grads, lambda policy: _linen(
      policy.wrap_apply(bare), args, kwargs, None))


@contextlib.contextmanager
def _watching_nnx_calls(model: Any, recorder: _Recorder) -> Iterator[None]:
  """Wraps ``__call__`` of the model's module classes while the block runs."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  paths = {id(m): module_path(path) for path, m in nnx.iter_modules(model)
           if not isinstance(m, Fp8Op)}  # an FP8 op is part of its layer
  classes = list(dict.fromkeys(type(m) for _, m in nnx.iter_modules(model)))
  originals = {cls: (cls.__call__, "__call__" in vars(cls)) for cls in classes}

  def wrap(original):
    def watched(self, *args, **kwargs):
      if id(self) not in paths:
        return original(self, *args, **kwargs)
      return recorder.run(paths[id(self)], "__call__",
                          lambda: original(self, *args, **kwargs), (args, kwargs))
    return watched

  try:
    for cls in classes:
      cls.__call__ = wrap(originals[cls][0])
    yield
  finally:
    for cls, (original, own) in originals.items():
      if own:
        cls.__call__ = original
      else:
        delattr(cls, "__call__")


def _nnx(model: Any, args: Any, kwargs: Any, grads: Any) -> OverflowReport:
  from flax import nnx  # pylint: disable=g-import-not-at-top

  recorder = _Recorder()
  graphdef, state = nnx.split(model)

  def forward(state, call_args, call_kwargs):
    copy = nnx.merge(graphdef, state)  # the model itself is left untouched
    with _watching_nnx_calls(copy, recorder):
      copy(*call_args, **call_kwargs)
    return recorder.flags

  def recheck(policy):  # on a copy of the model as it was, switched
    copy = nnx.merge(graphdef, state)
    set_model_policy(copy, policy, switching=True)
    return _nnx(copy, args, kwargs, None)

  return recorder.report(_traced(forward, args, kwargs, state), grads, recheck)


def find_overflowing_modules(model: Any, *args, grads: Any = None,
                             **kwargs) -> OverflowReport:
  """Runs the forward pass once and finds the modules that produce inf or nan.

  Host-side, with the batch that overflowed; nothing of the model changes.
  ``model`` is a Linen apply function (``state.apply_fn``) called as
  ``model(variables, *args, **kwargs)``, or an NNX module whose dtypes are
  set (its classes' ``__call__`` is wrapped meanwhile: run no NNX code in
  another thread). ``grads`` of the failing step are mapped to
  :attr:`OverflowReport.gradient_modules`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp, jaxmp.flax
    >>> import flax.linen as nn
    >>> class Model(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     x = nn.Dense(4, name="body")(x)
    ...     return nn.Dense(2, name="head", kernel_init=nn.initializers.constant(1e4))(x)
    >>> x = jnp.ones((1, 3))
    >>> apply = jaxmp.get_policy("mixed_float16").wrap_apply(Model().apply)
    >>> jaxmp.flax.find_overflowing_modules(
    ...     apply, Model().init(jax.random.key(0), x), x * 100).modules
    ('head',)
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  if isinstance(model, nnx.Module):
    return _nnx(model, args, kwargs, grads)
  if isinstance(model, nn.Module):
    raise TypeError(
        "find_overflowing_modules: pass the apply function, not the Linen "
        "module: state.apply_fn, or policy.wrap_apply(model.apply), with the "
        "variables as the first argument.")
  if not callable(model):
    raise TypeError(
        "find_overflowing_modules: model must be a Linen apply function "
        "(state.apply_fn, or policy.wrap_apply(model.apply)) called with the "
        f"variables first, or an NNX module; got {type(model).__name__}.")
  return _linen(model, args, kwargs, grads)
