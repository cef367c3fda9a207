"""The precision audit: the dtypes the matmuls and convolutions of a function run in.

:func:`precision_report` traces a function (nothing runs) and evaluates its
jaxpr with ``jaxpr.evaluate`` on facts about where each value's bits come
from, following the primitive kinds of ``autocast_rules``; it reports each
``dot_general`` and ``conv_general_dilated``, inner programs included, with
the cause of a float32 input. :func:`warn_on_first_trace` runs it once per
trace for ``TrainState.value_and_grad(audit=True)``. The guide page
``docs/diagnostics.md`` says what each cause means, and its fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.autocast_rules import KIND, signature, trace
from jaxmp._src.policy import parse_dtype
from jaxmp._src.validation import caller_stacklevel, listing

DIRECTIONS = ("forward", "backward", "recompute")
# The share of the forward matmul/conv FLOPs that must run in a half-precision
# compute dtype; below it the Flax helpers warn (when they can name a cause).
MIN_SHARE_IN_COMPUTE_DTYPE = 0.5
# The name JAX gives the recomputed part of a ``jax.checkpoint`` backward pass.
_REMAT_SCOPE = "rematted_computation"
# The audit's trace runs each Linen module that has a ``dtype`` attribute in a
# name scope ``jaxmp_declares_<dtype name or None>``: a module's own dtype wins
# over the dtype of what it receives.
_DECLARES = "jaxmp_declares_"


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _is_narrow(dtype: Any) -> bool:
  """float16, bfloat16 and the float8 types."""
  return _is_float(dtype) and np.dtype(dtype).itemsize <= 2


def _is_wide(dtype: Any) -> bool:
  return _is_float(dtype) and np.dtype(dtype).itemsize >= 4


class PrecisionWarning(UserWarning):
  """A half-precision policy that does not take effect: the matmuls run in float32.

  :meth:`jaxmp.flax.TrainState.value_and_grad` with ``audit=True`` raises it
  at trace time (once per compilation), naming the cause and the layers.

  Example:
    >>> import warnings, jaxmp
    >>> with warnings.catch_warnings():  # fail instead of warning, e.g. in CI
    ...   warnings.simplefilter("error", jaxmp.PrecisionWarning)
  """


@dataclasses.dataclass(frozen=True)
class PrecisionOp:
  """One matmul (``dot_general``) or convolution of a :class:`PrecisionReport`.

  Attributes:
    primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
    direction: ``"forward"``, ``"backward"`` (the ops of a gradient) or
      ``"recompute"`` (forward ops a ``jax.checkpoint`` runs again).
    lhs_dtype: the left input's dtype (a layer's activations); ``rhs_dtype``
      the right one's (its kernel), ``out_dtype`` the output's.
    lhs_shape: the left input's shape; ``rhs_shape``, ``out_shape`` likewise.
    flops: two per multiply-add, times ``repeats``, per call of the function.
    repeats: the product of the lengths of the ``scan`` loops around it and
      of the devices of a ``shard_map``/``pmap``; a ``while`` body counts once.
    module: the module path of the name stack (``"ResNet/Conv_0"``), or ``""``.
    operands: per input, the path of the argument it is read from (through
      casts, reshapes and slices), e.g. ``"params/Dense_0/kernel"``, or ``""``.
    source: the line that created it, as JAX names lines
      (``"file.py:12:4 (function)"``), else the line of the ``jit`` or loop
      around it; for a Flax layer, its line in Flax.
    cause: why a float32 (or float64) input is wide, where the trace shows
      it: ``"recast"``, ``"closure"``, ``"created"`` or ``"mixed"``; else ``""``.
    captured: for ``"closure"``, the captured array's type (``"float32[8,4]"``);
      for ``"created"``, the operation that began the value, and its line.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> op, = jaxmp.precision_report(jnp.dot, jnp.ones((4, 3)), jnp.ones((3, 2))).ops
    >>> op.primitive, op.inputs, op.flops
    ('dot_general', ('float32', 'float32'), 48)
  """

  primitive: str
  direction: str
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  flops: int
  repeats: int
  module: str
  operands: tuple[str, str]
  source: str
  cause: str
  captured: str

  @property
  def inputs(self) -> tuple[str, str]:
    """The names of the two input dtypes, e.g. ``("float16", "float16")``."""
    return (self.lhs_dtype.name, self.rhs_dtype.name)

  def runs_in(self, dtype: Any) -> bool:
    """Whether both inputs have the floating dtype ``dtype`` (a dtype or name)."""
    dtype = parse_dtype(dtype)
    return self.lhs_dtype == dtype and self.rhs_dtype == dtype

  @property
  def where(self) -> str:
    """The module path, else the argument of its weights, else the source line."""
    return self.module or self.operands[1] or self.operands[0] or self.source


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """The matmuls and convolutions of a traced function, with their dtypes.

  Returned by :func:`jaxmp.precision_report`; ``str(report)`` is a table.
  ``direction`` is ``None`` (all ops) or one of ``"forward"``,
  ``"backward"``, ``"recompute"``; ``dtype`` a floating dtype or a name such
  as ``"bf16"``. Both raise ``ValueError`` if unknown.

  Attributes:
    ops: a :class:`PrecisionOp` per op, in trace order.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> def loss(w, x):
    ...   return jnp.sum(x.astype(jnp.float16) @ w.astype(jnp.float16))
    >>> w, x = jnp.ones((3, 2)), jnp.ones((4, 3))
    >>> report = jaxmp.precision_report(jax.grad(loss), w, x)
    >>> report.flops_by_dtype()
    {('float16', 'float16'): 96}
    >>> [op.direction for op in report.ops]
    ['forward', 'backward']
    >>> report.flops_share("f16"), report.ops_outside("f16")
    (1.0, ())
  """

  ops: tuple[PrecisionOp, ...]

  def _select(self, direction: str | None) -> tuple[PrecisionOp, ...]:
    if direction is not None and direction not in DIRECTIONS:
      raise ValueError(
          f"PrecisionReport: direction must be None or one of "
          f"{', '.join(map(repr, DIRECTIONS))}; got {direction!r}.")
    return tuple(op for op in self.ops if direction in (None, op.direction))

  def flops(self, direction: str | None = None) -> int:
    """The FLOPs per call of the ops (of one ``direction``)."""
    return sum(op.flops for op in self._select(direction))

  def flops_by_dtype(self, direction: str | None = None) -> dict[tuple[str, str], int]:
    """``{(lhs dtype name, rhs dtype name): FLOPs}``, largest first."""
    totals: dict[tuple[str, str], int] = {}
    for op in self._select(direction):
      totals[op.inputs] = totals.get(op.inputs, 0) + op.flops
    return dict(sorted(totals.items(), key=lambda item: (-item[1], item[0])))

  def flops_share(self, dtype: Any, direction: str | None = None) -> float:
    """The fraction of the FLOPs whose two inputs are in ``dtype``.

    Raises:
      ValueError: also if the selected ops have no FLOPs.
    """
    ops = self._select(direction)
    total = sum(op.flops for op in ops)
    if total == 0:
      raise ValueError(
          "PrecisionReport.flops_share: the function has no matmul or "
          "convolution" + (f" in the {direction} pass" if direction else "")
          + ", so there is no share to compute. Check report.ops first.")
    return sum(op.flops for op in ops if op.runs_in(dtype)) / total

  def ops_outside(self, dtype: Any, direction: str | None = None) -> tuple[PrecisionOp, ...]:
    """The ops whose inputs are not both in ``dtype``."""
    parse_dtype(dtype)
    return tuple(op for op in self._select(direction) if not op.runs_in(dtype))

  def __str__(self) -> str:
    total = self.flops()
    passes = ", ".join(f"{d} {self.flops(d):,}" for d in DIRECTIONS if self._select(d))
    head = (f"jaxmp precision report: {len(self.ops)} matmul/conv ops, {total:,} "
            "FLOPs per call" + (f" ({passes})" if passes else ""))
    if not self.ops:
      return head + "; nothing to report."
    lines = [head, "FLOPs by input dtypes:"] + [
        f"  {lhs} x {rhs:<10} {100.0 * flops / (total or 1):6.1f}%  {flops:,}"
        for (lhs, rhs), flops in self.flops_by_dtype().items()]
    shape = lambda s: "[" + ",".join(map(str, s)) + "]"  # pylint: disable=unnecessary-lambda-assignment
    rows = [("pass", "op", "inputs", "output", "shapes", "FLOPs", "where", "cause",
             "source")] + [(
                 op.direction, "dot" if op.primitive == "dot_general" else "conv",
                 " x ".join(op.inputs), op.out_dtype.name,
                 f"{shape(op.lhs_shape)} x {shape(op.rhs_shape)} -> {shape(op.out_shape)}"
                 + (f" (x{op.repeats})" if op.repeats > 1 else ""), f"{op.flops:,}",
                 op.module or op.operands[1] or op.operands[0] or "-",
                 op.cause or "-", op.source or "-") for op in self.ops]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("Ops:")
    lines += ["  " + "  ".join(c.rjust(w) if i == 5 else c.ljust(w) for i, (c, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows]
    return "\n".join(lines)


# -- Tracing -------------------------------------------------------------------


def _argument_names(fn: Callable[..., Any], args: tuple, kwargs: dict) -> list[str]:
  """A name per positional argument, from ``fn``'s signature when it binds."""
  names = [f"args[{i}]" for i in range(len(args))]
  try:
    bound = inspect.signature(fn).bind(*args, **kwargs)
  except (TypeError, ValueError):
    return names
  position = 0
  for name, value in bound.arguments.items():
    kind = bound.signature.parameters[name].kind
    if kind is inspect.Parameter.VAR_POSITIONAL:
      names[position:position + len(value)] = [f"{name}[{i}]" for i in range(len(value))]
      position += len(value)
    elif kind in (inspect.Parameter.POSITIONAL_ONLY,
                  inspect.Parameter.POSITIONAL_OR_KEYWORD) and position < len(args):
      names[position] = name
      position += 1
  return names


def _tag_declared_dtype(next_fun, args, kwargs, context):
  """A Linen interceptor: runs a module with a ``dtype`` in a scope naming it."""
  module = context.module
  if "dtype" not in getattr(type(module), "__dataclass_fields__", {}):
    return next_fun(*args, **kwargs)
  try:
    name = "None" if module.dtype is None else np.dtype(module.dtype).name
  except TypeError:  # a dtype attribute of another kind
    return next_fun(*args, **kwargs)
  with jax.named_scope(_DECLARES + name):
    return next_fun(*args, **kwargs)


def _audit(fn: Callable[..., Any], args: tuple, kwargs: dict, names: list[str]
           ) -> PrecisionReport:
  linen = sys.modules.get("flax.linen")
  with (linen.intercept_methods(_tag_declared_dtype) if linen
        else contextlib.nullcontext()):
    closed, _, dynamic = trace(lambda tree: fn(*tree[0], **tree[1]), (args, kwargs))
  paths = []  # of the arguments, e.g. params/w: the leaves of (args, kwargs)
  for path, _ in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
    head = names[path[1].idx] if path[0].idx == 0 else path[1].key
    tail = jax.tree_util.keystr(tuple(path[2:]), simple=True, separator="/")
    paths.append("/".join(p for p in (str(head), tail) if p))
  jaxpr, ops = closed.jaxpr, []
  ins = [_Facts(narrow=_is_narrow(v.aval.dtype), path=p) for v, p in
         zip(jaxpr.invars, (p for p, d in zip(paths, dynamic) if d))]
  _walk(jaxpr, [_constant(v) for v in jaxpr.constvars], ins,
        jaxprs.new_name_stack(), 1, ops, "")
  return PrecisionReport(tuple(ops))


# -- Walking the jaxpr ------------------------------------------------------


class _Facts(NamedTuple):
  """What the audit knows of a value: where its bits come from."""

  # A 16-bit argument or captured array, or an argument cast to 16 bits (as
  # a policy casts params and inputs); not a 16-bit result computed in
  # float32 and cast down, as LayerNorm's.
  narrow: bool = False
  recast: str = ""  # a wide cast of a narrow value: the narrow dtype
  from_recast: bool = False  # a wide value computed from a recast one
  captured: str = ""  # computed from a captured floating array: its type
  path: str = ""  # the argument it is read from (through moves and casts)
  upcast: bool = False  # a 16-bit value cast up
  literal: bool = False  # a literal of the program (here or in an outer one)
  # Made from no floating value but literals (random bits, iota, a fill):
  # the operation that began it, and its line.
  made: str = ""
  created: str = ""  # a wide value computed from a made one that met a 16-bit one


_NOTHING = _Facts()
_LITERAL = _Facts(literal=True)


def _merge(facts: list[_Facts], out_dtype: Any) -> _Facts:
  """The facts of a computed value: the recasts and constants it derives from."""
  if _is_narrow(out_dtype):
    return _NOTHING
  return _Facts(from_recast=any(f.recast or f.from_recast for f in facts),
                captured=next((f.captured for f in facts if f.captured), ""),
                created=_created(facts))


def _created(facts: list[_Facts], narrow: bool = False) -> str:
  """The origin of a made value that widened a 16-bit one (or of one that
  did so before) among an operation's inputs; ``narrow``: a 16-bit input
  meets them directly (a mixed matmul)."""
  made = next((f.made for f in facts if f.made), "")
  return next((f.created for f in facts if f.created), "") or (
      made if narrow or any(f.upcast for f in facts) else "")


def _origin(eqn: Any, ins: list[_Facts], stack: Any, line: str) -> str:
  """What makes ``eqn``'s outputs, if they are made of no floating value but
  literals and made ones (``_Facts.made``); ``""`` otherwise."""
  made = []
  for atom, facts in zip(eqn.invars, ins):
    if facts.made:
      made.append(facts)
    elif _is_float(atom.aval.dtype) and not facts.literal:
      return ""
  if made:  # random bits before a constant they are scaled by
    return min(made, key=lambda f: f.literal).made
  if "transpose" in jaxprs.name_parts(stack)[1]:
    return ""  # the zeros and ones of autodiff are not the model's
  return f"{eqn.primitive.name} at {line}"


def _join(alternatives: list[_Facts]) -> _Facts:
  """The facts of a value that is one of several (the branches of a cond)."""
  one = lambda values: values.pop() if len(values) == 1 else ""  # pylint: disable=unnecessary-lambda-assignment
  return _Facts(
      narrow=all(f.narrow for f in alternatives),
      recast=one({f.recast for f in alternatives}),
      from_recast=any(f.from_recast for f in alternatives),
      captured=next((f.captured for f in alternatives if f.captured), ""),
      path=one({f.path for f in alternatives}),
      upcast=all(f.upcast for f in alternatives),
      made=one({f.made for f in alternatives}),
      created=next((f.created for f in alternatives if f.created), ""))


def _constant(var: Any) -> _Facts:
  # Only a floating array can make a matmul run in float32: a captured PRNG
  # key (a dropout key), integer or boolean array never does.
  aval = var.aval
  return _Facts(narrow=_is_narrow(aval.dtype), captured=(
      f"{aval.dtype}[{','.join(map(str, aval.shape))}]" if _is_float(aval.dtype) else ""))


def _dot_flops(eqn: Any) -> int:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval.shape
  return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lhs_contract)


def _conv_flops(eqn: Any) -> int:
  # rhs_spec is (out feature dim, in feature dim, *spatial dims) of the
  # kernel; each output element sums over its in-features and window.
  spec = eqn.params["dimension_numbers"].rhs_spec
  rhs = eqn.invars[1].aval.shape
  return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(rhs[d] for d in spec[1:])


_FLOPS = {"dot_general": _dot_flops, "conv_general_dilated": _conv_flops}


def _repeats(eqn: Any) -> int:
  """How many times an equation's programs run per run of the equation."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    return int(p["length"])
  if eqn.primitive.name == "shard_map":
    axes = p.get("manual_axes") or p.get("newly_manual_axes") or ()
    return math.prod(dict(p["mesh"].shape)[a] for a in axes)
  return int(p["axis_size"]) if eqn.primitive.name == "xla_pmap" else 1


def _walk(jaxpr: Any, consts: list[_Facts], ins: list[_Facts], stack: Any,
          repeats: int, ops: list[PrecisionOp], line: str) -> list[_Facts]:
  """The facts of ``jaxpr``'s outputs; appends its matmuls and convs to
  ``ops``. ``line``: the source line of the equation around ``jaxpr``."""

  def rule(eqn, ins, stack):
    name, kind = eqn.primitive.name, KIND.get(eqn.primitive.name)
    here = jaxprs.source_line(eqn) or line  # a jit's inside may have none
    if kind == "matmul" and name in _FLOPS:
      ops.append(_record(eqn, ins, stack, repeats, here))
    subs = jaxprs.inner_jaxprs(eqn.params)
    if subs:
      return _enter(eqn, subs, ins, stack, repeats * _repeats(eqn), ops, here)
    if kind == "as_is" and len(eqn.invars) == len(eqn.outvars):
      return ins
    if kind == "cast":
      outs = [_convert(ins[0], eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype)]
    elif kind in ("move", "follow") and eqn.invars:
      outs = [ins[0]] * len(eqn.outvars)
    else:
      outs = [_merge(ins, v.aval.dtype) for v in eqn.outvars]
    made = _origin(eqn, ins, stack, here)
    literal = all(f.literal for f in ins)
    return [f._replace(made=made, literal=literal)
            if made and not _is_narrow(v.aval.dtype) else f
            for f, v in zip(outs, eqn.outvars)]

  return jaxprs.evaluate(jaxpr, consts, ins, rule, literal=lambda _: _LITERAL,
                         name_stack=stack)


def _enter(eqn, subs, ins, stack, repeats, ops, line) -> list[_Facts]:
  """The facts of the outputs of an equation that holds programs (``subs``):
  each is walked; the outputs of those that give the equation's are joined."""
  results = []
  for sub in subs:
    # Inner inputs are the equation's last inputs, one for one (a cond's
    # first input is the branch index; a while body's follow its condition's).
    offset = len(eqn.invars) - len(sub.invars)
    args = [ins[offset + i] if offset >= 0
            and eqn.invars[offset + i].aval.dtype == var.aval.dtype else _NOTHING
            for i, var in enumerate(sub.invars)]
    outs = _walk(sub, [_constant(v) for v in sub.constvars], args, stack,
                 repeats, ops, line)
    if len(outs) == len(eqn.outvars):
      results.append(outs)
  if results:
    return [_join(list(column)) for column in zip(*results)]
  return [_merge(ins, v.aval.dtype) for v in eqn.outvars]


def _convert(facts: _Facts, source: Any, target: Any) -> _Facts:
  if _is_narrow(target):
    return _Facts(narrow=bool(facts.path or facts.narrow), path=facts.path)
  if _is_wide(target) and _is_narrow(source):
    recast = np.dtype(source).name if facts.narrow else ""
    return _Facts(recast=recast, path=facts.path, upcast=True)
  if _is_wide(target) and _is_wide(source):
    return facts
  return _merge([facts], target)


def _record(eqn, ins, stack, repeats, line) -> PrecisionOp:
  (lhs, rhs), out = eqn.invars[:2], eqn.outvars[0]
  scopes, transforms = jaxprs.name_parts(stack)
  # Whether the innermost Linen module with a dtype declares a wide one
  # (None outside Linen: unknown).
  declared = [s[len(_DECLARES):] for s in scopes if s.startswith(_DECLARES)]
  declares_wide = declared[-1] in ("float32", "float64") if declared else None
  scopes = [s for s in scopes if not s.startswith(_DECLARES)]
  direction = "forward"
  if "transpose" in transforms:
    direction = "recompute" if _REMAT_SCOPE in scopes else "backward"
  operands, dtypes = ins[:2], (lhs.aval.dtype, rhs.aval.dtype)
  wide = [f for f, dtype in zip(operands, dtypes) if _is_wide(dtype)]
  narrow = any(_is_narrow(dtype) for dtype in dtypes)
  cause, captured = "", ""
  if wide:
    recast = any(f.recast for f in wide)
    from_recast = any(f.from_recast for f in wide)
    captured = next((f.captured for f in wide if f.captured), "")
    created = _created(wide, narrow)
    # In a module that declares float32: an input cast back up, or computed
    # from one (attention scores), unless the other is a float32 argument
    # read as it is (a param a rule keeps in float32).
    if declares_wide and (recast or from_recast and not any(
        f.path and not f.recast for f in wide)):
      cause, captured = "recast", ""  # the module's own dtype, first
    elif captured:
      cause = "closure"
    elif created:
      cause, captured = "created", created
    elif recast and declares_wide is None:
      cause = "recast"
    elif recast or narrow:
      # A module without a float32 dtype that promotes its 16-bit params to
      # a float32 input, or an op of a 16-bit and a float32 input.
      cause = "mixed"
    elif from_recast and not declares_wide:
      # The gradients of such an op (a float32 batch met 16-bit params, or
      # a cast back up outside Linen): their inputs are computed from it.
      cause = "recast" if declares_wide is None else "mixed"
  return PrecisionOp(
      primitive=eqn.primitive.name, direction=direction,
      lhs_dtype=np.dtype(lhs.aval.dtype), rhs_dtype=np.dtype(rhs.aval.dtype),
      out_dtype=np.dtype(out.aval.dtype), lhs_shape=tuple(lhs.aval.shape),
      rhs_shape=tuple(rhs.aval.shape), out_shape=tuple(out.aval.shape),
      flops=_FLOPS[eqn.primitive.name](eqn) * repeats, repeats=repeats,
      module="/".join(s for s in scopes if s != _REMAT_SCOPE),
      operands=(operands[0].path, operands[1].path), source=line, cause=cause,
      captured=captured)


def precision_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PrecisionReport:
  """Traces ``fn(*args, **kwargs)`` and reports the dtypes of its matmuls and convs.

  Nothing runs: ``fn`` is traced with :func:`jax.make_jaxpr` on the array
  arguments (which may be :class:`jax.ShapeDtypeStruct`); the others are
  static. Every ``dot_general`` and ``conv_general_dilated`` is reported,
  those inside ``jit``, ``scan``, ``while``, ``cond``, ``remat``, custom
  derivatives and ``shard_map`` included, and those of the backward pass
  (``direction="backward"``) if ``fn`` computes gradients.

  Args:
    fn: the function, e.g. a loss, ``jax.grad(loss_fn)`` or a training step.
    *args: its positional arguments.
    **kwargs: its keyword arguments.

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> def loss(params, x):
    ...   params, x = jaxmp.get_policy("mixed_float16").cast_to_compute((params, x))
    ...   return jnp.sum(x @ params["w"])
    >>> params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    >>> op, = jaxmp.precision_report(loss, params, x).ops
    >>> op.inputs, op.out_dtype, op.flops, op.operands
    (('float16', 'float16'), dtype('float16'), 48, ('x', 'params/w'))
  """
  if not callable(fn):
    raise TypeError(
        f"precision_report expects a function as its first argument, got "
        f"{type(fn).__name__}. Pass the function, then its arguments: "
        "jaxmp.precision_report(loss_fn, params, batch).")
  return _audit(fn, args, kwargs, _argument_names(fn, args, kwargs))


# -- The trace-time check of the Flax helpers --------------------------------


def _warning_text(report: PrecisionReport, compute_dtype: Any) -> str | None:
  """The text of the :class:`PrecisionWarning` for ``report``, or ``None``:
  ``None`` unless ``compute_dtype`` is float16 or bfloat16, fewer than
  :data:`MIN_SHARE_IN_COMPUTE_DTYPE` of the floating matmul/conv FLOPs run
  in it, and some of the others have a cause the trace shows."""
  dtype = np.dtype(compute_dtype)
  if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
    return None
  ops = [op for op in report.ops if _is_float(op.lhs_dtype) and _is_float(op.rhs_dtype)]
  # FP8 matmuls (an FP8 policy, Flax's fp8_ops) are narrower still: they
  # count with those in the compute dtype.
  outside = [op for op in ops if not op.runs_in(dtype) and not (
      op.lhs_dtype.itemsize == 1 and op.rhs_dtype.itemsize == 1)]
  total = sum(op.flops for op in ops)
  inside = total - sum(op.flops for op in outside)
  if total == 0 or inside >= MIN_SHARE_IN_COMPUTE_DTYPE * total or not any(
      op.cause for op in outside):
    return None
  by_pair: dict[str, int] = {}
  for op in outside:
    key = " x ".join(op.inputs) if op.lhs_dtype != op.rhs_dtype else op.lhs_dtype.name
    by_pair[key] = by_pair.get(key, 0) + op.flops
  elsewhere = ", ".join(f"{100 * flops / total:.0f}% in {key}" for key, flops in
                        sorted(by_pair.items(), key=lambda item: -item[1]))
  lines = [
      f"TrainState.value_and_grad(audit=True): the policy computes in "
      f"{dtype.name}, but only {100 * inside / total:.0f}% of the matmul and "
      f"convolution FLOPs of the loss function run in it ({elsewhere}):"]
  for cause in ("closure", "recast", "created", "mixed", ""):
    hit = [op for op in outside if op.cause == cause]
    if hit:
      captured = ", ".join(dict.fromkeys(op.captured for op in hit if op.captured))
      lines.append(
          f"  - {100 * sum(op.flops for op in hit) / total:.0f}% of the FLOPs: "
          + (f"cause {cause!r}" if cause else "no cause the trace shows")
          + (f" ({captured})" if captured else "")
          + f", in {listing(dict.fromkeys(op.where for op in hit))}")
  lines.append(
      "The diagnostics guide (docs/diagnostics.md, 'The causes') says "
      "what each cause means and how to fix it; "
      "jaxmp.precision_report(loss_fn, state.params, *batch) lists every op.")
  return "\n".join(lines)


def warn_on_first_trace(
    grad_fn: Callable[..., Any],
    audited_fn: Callable[..., Any],
    *,
    compute_dtype: Any,
    names_from: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
  """Returns ``grad_fn`` that, once per new argument signature, audits ``audited_fn``.

  After calling ``grad_fn`` with new shapes, dtypes or static values (under
  ``jit``: once per compilation), it traces ``audited_fn`` (the forward
  loss) on the same arguments and warns with a :class:`PrecisionWarning`
  when a half-precision ``compute_dtype`` does not take effect; nothing runs
  on the device. ``names_from`` (default ``audited_fn``) names the arguments.
  """
  seen: set[Any] = set()

  @functools.wraps(grad_fn)
  def checked(*args, **kwargs):
    out = grad_fn(*args, **kwargs)
    key = signature((args, kwargs))
    if key is None or key not in seen:
      seen.add(key)
      names = _argument_names(names_from or audited_fn, args, kwargs)
      with warnings.catch_warnings():  # grad_fn's trace gave them already
        warnings.simplefilter("ignore", PrecisionWarning)
        report = _audit(audited_fn, args, kwargs, names)
      text = _warning_text(report, compute_dtype)
      if text is not None:
        warnings.warn(text, PrecisionWarning, stacklevel=caller_stacklevel())
    return out

  return checked
