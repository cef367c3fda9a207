"""The precision audit: the dtypes the matmuls and convolutions of a function run in.

:func:`precision_report` traces a function with :func:`jax.make_jaxpr` (it
runs nothing) and lists each ``dot_general`` and ``conv_general_dilated`` of
the trace, inner jaxprs included (``jit``, ``scan``, ``while``, ``cond``,
``remat``, ``custom_jvp``/``custom_vjp``, ``shard_map`` ...), with its input
and output dtypes, shapes, FLOPs, pass (forward or backward), module path and
source line.

The audit is an abstract evaluation of the jaxpr (:func:`jaxprs.evaluate`)
whose values are facts about where each value's bits come from. With
``audit=True``, :meth:`jaxmp.flax.TrainState.value_and_grad` runs it once per
trace, through :func:`warn_on_first_trace`, and warns with a
:class:`PrecisionWarning` when a half-precision policy ends up computing most
of its matmul FLOPs in float32. What each cause means, and its fix, is on the
guide page ``docs/diagnostics.md``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import warnings
from typing import Any, Callable, Iterable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.policy import parse_dtype
from jaxmp._src.validation import PrecisionWarning, caller_stacklevel, listing

DOT = "dot_general"
CONV = "conv_general_dilated"
DIRECTIONS = ("forward", "backward", "recompute")

# The share of the forward matmul/conv FLOPs that must run in a half-precision
# compute dtype; below it the Flax helpers warn (when they can name a cause).
MIN_SHARE_IN_COMPUTE_DTYPE = 0.5

# Primitives that only move or reshape their first operand: what an operand
# is made of is what that operand is made of.
_MOVES = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "rev", "gather", "reduce_precision", "copy",
    "copy_p", "sharding_constraint", "mesh_cast", "reshard", "pvary",
})
# Primitives whose outputs are their inputs, one for one.
_PASS_THROUGH = frozenset({"optimization_barrier", "device_put"})
# The name JAX gives the recomputed part of a ``jax.checkpoint`` backward pass.
_REMAT_SCOPE = "rematted_computation"
# The audit's trace runs each Linen module that has a ``dtype`` attribute inside
# a name scope ``jaxmp_declares_<dtype name or None>``: a module's own dtype
# wins over the dtype of what it receives.
_DECLARES = "jaxmp_declares_"


def _is_float(dtype: Any) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _is_narrow_float(dtype: Any) -> bool:
  """float16, bfloat16 and the float8 types."""
  return _is_float(dtype) and np.dtype(dtype).itemsize <= 2


def _is_wide_float(dtype: Any) -> bool:
  """float32 and float64."""
  return _is_float(dtype) and np.dtype(dtype).itemsize >= 4


@dataclasses.dataclass(frozen=True)
class PrecisionOp:
  """One matmul (``dot_general``) or convolution of a :class:`PrecisionReport`.

  Attributes:
    primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
    direction: ``"forward"``; ``"backward"`` for the ops of a gradient (JAX
      marks them as transposed); ``"recompute"`` for the forward ops that a
      ``jax.checkpoint`` recomputes in the backward pass.
    lhs_dtype: the dtype of the left input (the activations of a layer).
    rhs_dtype: the dtype of the right input (the kernel of a layer).
    out_dtype: the dtype of the output.
    lhs_shape: the shape of the left input.
    rhs_shape: the shape of the right input.
    out_shape: the shape of the output.
    flops: the floating-point operations of the op per call of the function:
      two per multiply-add, times ``repeats``.
    repeats: how many times the op runs per call: the product of the lengths
      of the ``scan`` loops around it (and of the devices of a
      ``shard_map``/``pmap``, whose shapes are per device). The body of a
      ``while`` loop counts once; every branch of a ``cond`` counts.
    module: the module path from the trace's name stack, e.g.
      ``"ResNet/Conv_0"`` for Linen; ``""`` where there is none (NNX and
      plain JAX functions: see ``operands``).
    operands: for each input, the path of the argument of the function it is
      read from (through casts, reshapes and slices), e.g.
      ``"params/Dense_0/kernel"``; ``""`` for a computed value.
    source: the line that created the op, as JAX names it in its own
      messages (the innermost frame outside JAX), ``"file.py:12:4
      (function)"``; for a Flax layer, the layer's line in Flax.
    cause: for an op with a float32 (or float64) input, why it is wide, when
      the trace shows it: ``"recast"``, ``"closure"``, ``"created"`` or
      ``"mixed"`` (the precision audit guide, ``docs/diagnostics.md``, says
      what each means); ``""`` otherwise.
    captured: for ``cause == "closure"``, the type of the captured array,
      e.g. ``"float32[8,4]"``; for ``"created"``, the operation that began
      the float32 value and its line, e.g. ``"random_bits at vae.py:12:8
      (reparameterize)"``.

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
    """The module path, else the argument the op reads, else the source line."""
    return self.module or _param_of(self.operands) or self.source


@dataclasses.dataclass(frozen=True)
class PrecisionReport:
  """The matmuls and convolutions of a traced function, with their dtypes.

  Returned by :func:`jaxmp.precision_report`. ``str(report)`` is a table:
  the share of the FLOPs in each pair of input dtypes, then one line per op.

  Attributes:
    ops: a tuple of :class:`PrecisionOp` (one per op: its dtypes, shapes, FLOPs and
      where it runs), in trace order.

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
    if direction is None:
      return self.ops
    if direction not in DIRECTIONS:
      raise ValueError(
          f"PrecisionReport: direction must be None or one of "
          f"{', '.join(map(repr, DIRECTIONS))}; got {direction!r}."
      )
    return tuple(op for op in self.ops if op.direction == direction)

  def flops(self, direction: str | None = None) -> int:
    """The FLOPs of all ops (of one ``direction`` if given) per call.

    Args:
      direction: ``None`` for all ops, or ``"forward"``, ``"backward"``,
        ``"recompute"``.

    Raises:
      ValueError: for another ``direction``.
    """
    return sum(op.flops for op in self._select(direction))

  def flops_by_dtype(self, direction: str | None = None) -> dict[tuple[str, str], int]:
    """The FLOPs per pair of input dtypes, largest first.

    Args:
      direction: ``None`` for all ops, or ``"forward"``, ``"backward"``,
        ``"recompute"``.

    Returns:
      ``{(lhs dtype name, rhs dtype name): flops}``, e.g.
      ``{("float16", "float16"): 96}``.

    Raises:
      ValueError: for another ``direction``.
    """
    totals: dict[tuple[str, str], int] = {}
    for op in self._select(direction):
      totals[op.inputs] = totals.get(op.inputs, 0) + op.flops
    return dict(sorted(totals.items(), key=lambda item: (-item[1], item[0])))

  def flops_share(self, dtype: Any, direction: str | None = None) -> float:
    """The fraction of the FLOPs whose two inputs are in ``dtype``.

    Args:
      dtype: a floating dtype or a name such as ``"float16"`` or ``"bf16"``.
      direction: ``None`` for all ops, or ``"forward"``, ``"backward"``,
        ``"recompute"``.

    Returns:
      A number between 0 and 1.

    Raises:
      ValueError: if the selected ops have no FLOPs (the function has no
        matmul or convolution), or for an unknown dtype or direction.
    """
    ops = self._select(direction)
    total = sum(op.flops for op in ops)
    if total == 0:
      raise ValueError(
          "PrecisionReport.flops_share: the function has no matmul or "
          "convolution" + (f" in the {direction} pass" if direction else "")
          + ", so there is no share to compute. Check report.ops first."
      )
    return sum(op.flops for op in ops if op.runs_in(dtype)) / total

  def ops_outside(
      self, dtype: Any, direction: str | None = None
  ) -> tuple[PrecisionOp, ...]:
    """The ops whose inputs are not both in ``dtype``.

    Args:
      dtype: a floating dtype or a name such as ``"float16"`` or ``"bf16"``.
      direction: ``None`` for all ops, or ``"forward"``, ``"backward"``,
        ``"recompute"``.

    Raises:
      ValueError: for an unknown dtype or direction.
    """
    parse_dtype(dtype)
    return tuple(op for op in self._select(direction) if not op.runs_in(dtype))

  def __str__(self) -> str:
    total = self.flops()
    passes = ", ".join(
        f"{d} {_count(self.flops(d))}" for d in DIRECTIONS if self._select(d))
    lines = [
        f"jaxmp precision report: {len(self.ops)} matmul/conv ops, "
        f"{_count(total)} FLOPs per call" + (f" ({passes})" if passes else "")
    ]
    if not self.ops:
      return lines[0] + "; nothing to report."
    lines.append("FLOPs by input dtypes:")
    for (lhs, rhs), flops in self.flops_by_dtype().items():
      share = 100.0 * flops / total if total else 0.0
      lines.append(f"  {lhs} x {rhs:<10} {share:6.1f}%  {_count(flops)}")
    rows = [("pass", "op", "inputs", "output", "shapes", "FLOPs", "where",
             "cause", "source")]
    for op in self.ops:
      shapes = (f"{_shape(op.lhs_shape)} x {_shape(op.rhs_shape)} -> "
                f"{_shape(op.out_shape)}")
      if op.repeats > 1:
        shapes += f" (x{op.repeats})"
      rows.append((
          op.direction, "dot" if op.primitive == DOT else "conv",
          " x ".join(op.inputs), op.out_dtype.name, shapes, _count(op.flops),
          op.module or _param_of(op.operands) or "-", op.cause or "-",
          op.source or "-",
      ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("Ops:")
    for row in rows:
      cells = [cell.rjust(w) if i == 5 else cell.ljust(w)
               for i, (cell, w) in enumerate(zip(row, widths))]
      lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def _count(n: int) -> str:
  return f"{n:,}"


def _shape(shape: tuple[int, ...]) -> str:
  return "[" + ",".join(map(str, shape)) + "]"


def _param_of(operands: tuple[str, str]) -> str:
  """The argument path an op reads its weights from: the right input first."""
  return operands[1] or operands[0]


# ---------------------------------------------------------------------------
# Tracing.


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


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
      for i in range(len(value)):
        names[position + i] = f"{name}[{i}]"
      position += len(value)
    elif kind in (inspect.Parameter.POSITIONAL_ONLY,
                  inspect.Parameter.POSITIONAL_OR_KEYWORD) and position < len(args):
      names[position] = name
      position += 1
  return names


def _key_value(key: Any) -> Any:
  for attribute in ("idx", "key", "name"):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  return key


def _leaf_paths(tree: Any, names: list[str]) -> list[tuple[str, Any]]:
  """``(path, leaf)`` for each leaf of ``tree``, paths such as ``params/w``.

  ``tree`` is ``(args, kwargs)``, or a pytree with the same first two levels
  (``0``: the positional arguments by position, ``1``: the keyword arguments
  by name), as NNX's ``nnx.split((args, kwargs))`` gives.
  """
  out = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    head = ""
    if len(path) >= 2:
      group, which = _key_value(path[0]), _key_value(path[1])
      head = names[which] if group == 0 and which < len(names) else str(which)
    tail = jax.tree_util.keystr(tuple(path[2:]), simple=True, separator="/")
    out.append(("/".join(p for p in (head, tail) if p), leaf))
  return out


def _trace(
    call: Callable[[Any], Any], tree: Any, names: list[str]
) -> tuple[Any, list[str]]:
  """The jaxpr of ``call(tree)`` and the argument path of each of its inputs.

  The array leaves of ``tree`` (concrete, abstract or tracers) become inputs
  of the jaxpr; its other leaves (Python numbers, strings, flags) stay
  static, as they would be under ``jax.jit`` with ``static_argnames``.
  Nothing runs.
  """
  leaves = _leaf_paths(tree, names)
  treedef = jax.tree_util.tree_structure(tree)
  dynamic = [i for i, (_, leaf) in enumerate(leaves) if _is_array(leaf)]

  def flat_fn(*arrays):
    values = [leaf for _, leaf in leaves]
    for i, array in zip(dynamic, arrays):
      values[i] = array
    return call(jax.tree_util.tree_unflatten(treedef, values))

  linen = sys.modules.get("flax.linen")
  with (linen.intercept_methods(_tag_declared_dtype) if linen
        else contextlib.nullcontext()):
    closed = jax.make_jaxpr(flat_fn)(*(leaves[i][1] for i in dynamic))
  return closed, [leaves[i][0] for i in dynamic]


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


def _call_with(fn: Callable[..., Any]) -> Callable[[Any], Any]:
  """``fn`` as a function of the pair ``(args, kwargs)``."""
  return lambda tree: fn(*tree[0], **tree[1])


# ---------------------------------------------------------------------------
# Walking the jaxpr.


class _Facts(NamedTuple):
  """What the audit knows of a value: where its bits come from."""

  # A 16-bit argument or captured array, or an argument cast to 16 bits (as a
  # policy casts params and inputs); not a 16-bit result computed in float32
  # and cast down, as LayerNorm's.
  narrow_origin: bool = False
  recast: str = ""  # a wide cast of a narrow_origin value: the narrow dtype
  computed_from_recast: bool = False  # a wide value computed from a recast one
  captured: str = ""  # derived from a captured array: its type, e.g. float32[8]
  path: str = ""  # the argument it is read from (through moves and casts)
  upcast: bool = False  # a 16-bit value cast up to float32
  literal: bool = False  # a literal of the program (here or in an outer one)
  # Made in the forward pass from no floating value but literals (random
  # bits, iota, a fill): the operation that began it and its line.
  made: str = ""
  # A wide value computed from a made float32 value that met a 16-bit one:
  # what ``made`` says of that value.
  created: str = ""


_NOTHING = _Facts()
_LITERAL = _Facts(literal=True)


def _merge(facts: list[_Facts], out_dtype: Any) -> _Facts:
  """The facts of a computed value: the recasts and constants it derives from."""
  if _is_narrow_float(out_dtype):
    return _NOTHING
  return _Facts(
      computed_from_recast=any(f.recast or f.computed_from_recast for f in facts),
      captured=next((f.captured for f in facts if f.captured), ""),
      created=_created(facts))


def _created(facts: list[_Facts], narrow: bool = False) -> str:
  """The origin of a made float32 value that widened a 16-bit one (or of
  one that did so before), among the inputs ``facts`` of an operation;
  ``narrow``: a 16-bit input meets them directly (a mixed matmul)."""
  made = next((f.made for f in facts if f.made), "")
  return next((f.created for f in facts if f.created), "") or (
      made if narrow or any(f.upcast for f in facts) else "")


def _origin(eqn: Any, ins: list[_Facts], stack: Any, line: str) -> str:
  """What makes ``eqn``'s outputs, if they are made of no floating value but
  literals and made ones (see ``_Facts.made``); ``""`` otherwise."""
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
  paths = {f.path for f in alternatives}
  recasts = {f.recast for f in alternatives}
  made = {f.made for f in alternatives}
  return _Facts(
      narrow_origin=all(f.narrow_origin for f in alternatives),
      recast=recasts.pop() if len(recasts) == 1 else "",
      computed_from_recast=any(f.computed_from_recast for f in alternatives),
      captured=next((f.captured for f in alternatives if f.captured), ""),
      path=paths.pop() if len(paths) == 1 else "",
      upcast=all(f.upcast for f in alternatives),
      made=made.pop() if len(made) == 1 else "",
      created=next((f.created for f in alternatives if f.created), ""),
  )


def _aval_str(aval: Any) -> str:
  return f"{aval.dtype}[{','.join(map(str, aval.shape))}]"


def _constant_facts(var: Any) -> _Facts:
  # Only a floating array can make a matmul run in float32: a captured PRNG
  # key (a dropout key), integer or boolean array never does.
  dtype = var.aval.dtype
  return _Facts(narrow_origin=_is_narrow_float(dtype),
                captured=_aval_str(var.aval) if _is_float(dtype) else "")


def _dot_flops(eqn: Any) -> int:
  (lhs_contract, _), _ = eqn.params["dimension_numbers"]
  lhs_shape = eqn.invars[0].aval.shape
  out_shape = eqn.outvars[0].aval.shape
  return 2 * math.prod(out_shape) * math.prod(lhs_shape[d] for d in lhs_contract)


def _conv_flops(eqn: Any) -> int:
  # rhs_spec is (out feature dim, in feature dim, *spatial dims) of the kernel;
  # each output element sums over the kernel's in-features and window.
  rhs_spec = eqn.params["dimension_numbers"].rhs_spec
  rhs_shape = eqn.invars[1].aval.shape
  out_shape = eqn.outvars[0].aval.shape
  window = math.prod(rhs_shape[d] for d in rhs_spec[2:])
  return 2 * math.prod(out_shape) * rhs_shape[rhs_spec[1]] * window


def _repeats(eqn: Any) -> int:
  """How many times an eqn's inner jaxpr runs per run of the eqn."""
  name = eqn.primitive.name
  if name == "scan":
    return int(eqn.params["length"])
  if name == "shard_map":
    mesh = eqn.params["mesh"]
    axes = eqn.params.get("manual_axes") or eqn.params.get("newly_manual_axes") or ()
    return math.prod(dict(mesh.shape)[a] for a in axes)
  if name == "xla_pmap":
    return int(eqn.params["axis_size"])
  return 1


def _walk(jaxpr: Any, consts: list[_Facts], ins: list[_Facts], name_stack: Any,
          repeats: int, ops: list[PrecisionOp], line: str = "") -> list[_Facts]:
  """The facts of ``jaxpr``'s outputs; appends its matmuls and convs to ``ops``.
  ``line``: the source line of the equation that holds ``jaxpr``."""

  def rule(eqn, ins, stack):
    name = eqn.primitive.name
    here = jaxprs.source_line(eqn) or line  # a jit's inside has no user line
    if name in (DOT, CONV):
      ops.append(_record(eqn, ins, stack, repeats))
    subs = jaxprs.inner_jaxprs(eqn.params)
    if subs:
      return _walk_inner(eqn, subs, ins, stack, repeats * _repeats(eqn), ops, here)
    if name == "convert_element_type":
      outs = [_convert(ins[0], eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype)]
    elif name in _MOVES and eqn.invars:
      outs = [ins[0]] * len(eqn.outvars)
    elif name in _PASS_THROUGH and len(eqn.invars) == len(eqn.outvars):
      return ins
    else:
      outs = [_merge(ins, v.aval.dtype) for v in eqn.outvars]
    made = _origin(eqn, ins, stack, here)
    constant = all(f.literal for f in ins)
    return [f._replace(made=made, literal=constant)
            if made and not _is_narrow_float(v.aval.dtype) else f
            for f, v in zip(outs, eqn.outvars)]

  return jaxprs.evaluate(jaxpr, consts, ins, rule, literal=lambda _: _LITERAL,
                         name_stack=name_stack)


def _convert(facts: _Facts, source: Any, target: Any) -> _Facts:
  if _is_narrow_float(target):
    return _Facts(narrow_origin=bool(facts.path or facts.narrow_origin),
                  path=facts.path)
  if _is_wide_float(target) and _is_narrow_float(source):
    recast = np.dtype(source).name if facts.narrow_origin else ""
    return _Facts(recast=recast, path=facts.path, upcast=True)
  if _is_wide_float(target) and _is_wide_float(source):
    return facts
  return _merge([facts], target)


def _walk_inner(eqn, subs, ins, stack, repeats, ops, line) -> list[_Facts]:
  results = []
  for sub in subs:
    # Inner inputs are the eqn's last inputs, one for one (a cond's first
    # input is the branch index; a while body's inputs follow the cond's).
    offset = len(eqn.invars) - len(sub.invars)
    args = [
        ins[offset + i] if offset >= 0
        and eqn.invars[offset + i].aval.dtype == var.aval.dtype else _NOTHING
        for i, var in enumerate(sub.invars)]
    outs = _walk(sub, [_constant_facts(v) for v in sub.constvars], args, stack,
                 repeats, ops, line)
    if len(outs) == len(eqn.outvars):
      results.append(outs)
  if results:
    return [_join(list(column)) for column in zip(*results)]
  return [_merge(ins, v.aval.dtype) for v in eqn.outvars]


def _record(eqn, ins, stack, repeats) -> PrecisionOp:
  lhs, rhs = eqn.invars[:2]
  out = eqn.outvars[0]
  scopes, transforms = jaxprs.name_parts(stack)
  # Whether the innermost Linen module with a dtype declares a wide one
  # (None outside Linen: unknown).
  declared = [s[len(_DECLARES):] for s in scopes if s.startswith(_DECLARES)]
  declares_wide = declared[-1] in ("float32", "float64") if declared else None
  scopes = [s for s in scopes if not s.startswith(_DECLARES)]
  if "transpose" in transforms:
    direction = "recompute" if _REMAT_SCOPE in scopes else "backward"
  else:
    direction = "forward"
  module = "/".join(s for s in scopes if s != _REMAT_SCOPE)
  flops = _dot_flops(eqn) if eqn.primitive.name == DOT else _conv_flops(eqn)
  operands = ins[:2]
  dtypes = (lhs.aval.dtype, rhs.aval.dtype)
  wide = [f for f, dtype in zip(operands, dtypes) if _is_wide_float(dtype)]
  cause, captured = "", ""
  if wide:
    recast = any(f.recast for f in wide)
    captured = next((f.captured for f in wide if f.captured), "")
    # In a module that declares float32: an input cast back up, or computed
    # from one (attention scores), unless the other is a float32 argument
    # read as it is (a param a rule keeps in float32).
    declared_recast = recast or (
        any(f.computed_from_recast for f in wide)
        and not any(f.path and not f.recast for f in wide))
    created = _created(wide, any(_is_narrow_float(dtype) for dtype in dtypes))
    if declares_wide and declared_recast:  # the module's own dtype, first
      cause, captured = "recast", ""
    elif captured:
      cause = "closure"
    elif created:
      cause, captured = "created", created
    elif recast and declares_wide is None:
      cause = "recast"
    elif recast or any(_is_narrow_float(dtype) for dtype in dtypes):
      # A module without a float32 dtype that promotes its 16-bit params
      # to a float32 input, or an op of a 16-bit and a float32 input.
      cause = "mixed"
  return PrecisionOp(
      primitive=eqn.primitive.name, direction=direction,
      lhs_dtype=np.dtype(lhs.aval.dtype), rhs_dtype=np.dtype(rhs.aval.dtype),
      out_dtype=np.dtype(out.aval.dtype), lhs_shape=tuple(lhs.aval.shape),
      rhs_shape=tuple(rhs.aval.shape), out_shape=tuple(out.aval.shape),
      flops=flops * repeats, repeats=repeats, module=module,
      operands=(operands[0].path, operands[1].path),
      source=jaxprs.source_line(eqn), cause=cause, captured=captured)


def _audit(call: Callable[[Any], Any], tree: Any, names: list[str]
           ) -> PrecisionReport:
  closed, paths = _trace(call, tree, names)
  jaxpr, ops = closed.jaxpr, []
  args = [_Facts(narrow_origin=_is_narrow_float(var.aval.dtype), path=path)
          for var, path in zip(jaxpr.invars, paths)]
  _walk(jaxpr, [_constant_facts(v) for v in jaxpr.constvars], args,
        jaxprs.new_name_stack(), 1, ops)
  return PrecisionReport(tuple(ops))


def precision_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PrecisionReport:
  """Traces ``fn(*args, **kwargs)`` and reports the dtypes of its matmuls and convs.

  Nothing runs: ``fn`` is traced with :func:`jax.make_jaxpr`, on the shapes
  and dtypes of the array arguments (which may be :class:`jax.ShapeDtypeStruct`).
  Other arguments (Python numbers, flags, strings) are passed as they are, as
  static arguments. Every ``dot_general`` and ``conv_general_dilated`` of the
  trace is reported, those inside ``jit``, ``scan``, ``while``, ``cond``,
  ``remat``, ``custom_jvp``/``custom_vjp`` and ``shard_map`` included; if
  ``fn`` computes gradients, the ops of the backward pass are reported too,
  with ``direction="backward"``.

  Args:
    fn: the function, e.g. a loss function, ``jax.grad(loss_fn)`` or a whole
      (jitted) training step.
    *args: its positional arguments (arrays, pytrees, or abstract
      :class:`jax.ShapeDtypeStruct` values).
    **kwargs: its keyword arguments.

  Returns:
    A :class:`jaxmp.PrecisionReport`.

  Raises:
    TypeError: if ``fn`` is not callable.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> def loss(params, x):
    ...   params, x = jaxmp.get_policy("mixed_float16").cast_to_compute((params, x))
    ...   return jnp.sum(x @ params["w"])
    >>> params, x = {"w": jnp.ones((3, 2))}, jnp.ones((4, 3))
    >>> report = jaxmp.precision_report(loss, params, x)
    >>> op, = report.ops
    >>> op.inputs, op.out_dtype, op.flops, op.operands
    (('float16', 'float16'), dtype('float16'), 48, ('x', 'params/w'))
    >>> report.flops_share("float16")
    1.0
  """
  if not callable(fn):
    raise TypeError(
        f"precision_report expects a function as its first argument, got "
        f"{type(fn).__name__}. Pass the function, then its arguments: "
        "jaxmp.precision_report(loss_fn, params, batch)."
    )
  names = _argument_names(fn, args, kwargs)
  return _audit(_call_with(fn), (args, kwargs), names)


# ---------------------------------------------------------------------------
# The trace-time check of the Flax helpers.

def _names(ops: Iterable[PrecisionOp]) -> str:
  return listing(dict.fromkeys(op.where for op in ops))


def _warning_text(report: PrecisionReport, compute_dtype: Any) -> str | None:
  """The text of the :class:`PrecisionWarning` for ``report``, or ``None``.

  ``None`` unless ``compute_dtype`` is float16 or bfloat16, fewer than
  :data:`MIN_SHARE_IN_COMPUTE_DTYPE` of the floating matmul/conv FLOPs have
  both inputs in it, and some of the others have a cause the trace shows.
  """
  dtype = np.dtype(compute_dtype)
  if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
    return None
  ops = [op for op in report.ops
         if _is_float(op.lhs_dtype) and _is_float(op.rhs_dtype)]
  total = sum(op.flops for op in ops)
  # FP8 matmuls (an FP8 policy, Flax's fp8_ops) are narrower still: they
  # count with those in the compute dtype.
  inside_ops = [op for op in ops if op.runs_in(dtype) or (
      np.dtype(op.lhs_dtype).itemsize == 1 and np.dtype(op.rhs_dtype).itemsize == 1)]
  inside = sum(op.flops for op in inside_ops)
  if total == 0 or inside >= MIN_SHARE_IN_COMPUTE_DTYPE * total:
    return None
  outside = [op for op in ops if op not in inside_ops]
  if not any(op.cause for op in outside):
    return None
  by_pair: dict[str, int] = {}
  for op in outside:
    key = " x ".join(op.inputs) if op.lhs_dtype != op.rhs_dtype else op.lhs_dtype.name
    by_pair[key] = by_pair.get(key, 0) + op.flops
  elsewhere = ", ".join(
      f"{100 * flops / total:.0f}% in {key}"
      for key, flops in sorted(by_pair.items(), key=lambda item: -item[1]))
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
          + (f" ({captured})" if captured else "") + f", in {_names(hit)}")
  lines.append(
      "The diagnostics guide (docs/diagnostics.md, 'The causes') says "
      "what each cause means and how to fix it; "
      "jaxmp.precision_report(loss_fn, state.params, *batch) lists every op.")
  return "\n".join(lines)


def _signature(args: tuple, kwargs: dict) -> Any:
  """What a new trace of a function depends on: structure, shapes, statics."""
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  key = []
  for leaf in leaves:
    if _is_array(leaf):
      key.append((tuple(leaf.shape), str(leaf.dtype),
                  bool(getattr(leaf, "weak_type", False))))
    else:
      try:
        hash(leaf)
        key.append(leaf)
      except TypeError:
        key.append(id(leaf))
  return treedef, tuple(key)


def warn_on_first_trace(
    grad_fn: Callable[..., Any],
    audited_fn: Callable[..., Any],
    *,
    compute_dtype: Any,
    names_from: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
  """Returns ``grad_fn`` that, once per new argument signature, audits ``audited_fn``.

  On the first call with given shapes, dtypes and static values (under
  ``jit``: once per compilation), after calling ``grad_fn``, it traces
  ``audited_fn`` (the forward loss, not its gradient) on the same arguments
  with :func:`jax.make_jaxpr` and warns with a :class:`PrecisionWarning`
  when a half-precision compute dtype does not take effect. It runs nothing
  on the device and transfers nothing. ``TrainState.value_and_grad(...,
  audit=True)`` is its one caller.

  Args:
    grad_fn: the function to return, wrapped.
    audited_fn: the function whose matmuls are audited, called with the same
      arguments as ``grad_fn``.
    compute_dtype: the policy's compute dtype.
    names_from: the function whose signature names the arguments (default
      ``audited_fn``).
  """
  seen: set[Any] = set()

  @functools.wraps(grad_fn)
  def checked(*args, **kwargs):
    out = grad_fn(*args, **kwargs)
    key = _signature(args, kwargs)
    if key not in seen:
      seen.add(key)
      names = _argument_names(names_from or audited_fn, args, kwargs)
      with warnings.catch_warnings():  # grad_fn's trace gave them already
        warnings.simplefilter("ignore", PrecisionWarning)
        report = _audit(_call_with(audited_fn), (args, kwargs), names)
      text = _warning_text(report, compute_dtype)
      if text is not None:
        warnings.warn(text, PrecisionWarning, stacklevel=caller_stacklevel())
    return out

  return checked
