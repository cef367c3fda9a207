"""The precision audit: the dtypes the matmuls and convolutions of a function
run in, from its jaxpr evaluated (``jaxpr.evaluate``) on facts about where
each value's bits come from, by the primitive kinds of ``autocast_rules``."""

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
from jaxmp._src.autocast_rules import KIND, is_float, signature, trace
from jaxmp._src.policy import parse_dtype
from jaxmp._src.validation import PrecisionWarning, caller_stacklevel, listing

DIRECTIONS = ("forward", "backward", "recompute")
# Below this share of the FLOPs in a 16-bit compute dtype, the Flax helpers
# warn (when they can name a cause).
MIN_SHARE_IN_COMPUTE_DTYPE = 0.5
_REMAT_SCOPE = "rematted_computation"  # JAX's name for what a checkpoint recomputes
# The audit runs each Linen module with a dtype attribute in a scope
# jaxmp_declares_<dtype or None>: a module's own dtype wins over its inputs'.
_DECLARES = "jaxmp_declares_"


def _is_narrow(dtype: Any) -> bool:
  """float16, bfloat16 and the float8 types."""
  return is_float(dtype) and np.dtype(dtype).itemsize <= 2


def _is_wide(dtype: Any) -> bool:
  return is_float(dtype) and np.dtype(dtype).itemsize >= 4


@dataclasses.dataclass(frozen=True)
class PrecisionOp:
  """One matmul (``dot_general``) or convolution of a :class:`PrecisionReport`.

  Its fields: ``primitive``; ``direction`` (``"forward"``, ``"backward"``, or
  ``"recompute"`` under ``jax.checkpoint``); the dtypes and shapes of the
  left input (activations), the right one (a kernel) and the output;
  ``flops`` (two per multiply-add, times ``repeats``: the lengths of the
  ``scan`` loops and the devices of a ``shard_map`` around it); ``module``,
  its Linen path; ``operands``, the argument each input is read from
  (``"params/Dense_0/kernel"``) or ``""``; ``source``, its line as JAX names
  lines, or that of the ``jit`` around it; ``cause`` of a float32 input,
  ``"recast"``, ``"closure"``, ``"created"``, ``"mixed"`` or ``""``
  (``docs/diagnostics.md``); ``captured``, the captured array's type for a
  closure, or the operation and line that began a created value.

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

  ``ops`` holds a :class:`PrecisionOp` per op, in trace order; ``str(report)``
  is a table. In the methods, ``direction`` is ``None`` (all ops),
  ``"forward"``, ``"backward"`` or ``"recompute"``, and ``dtype`` a floating
  dtype or a name such as ``"bf16"``; others raise ``ValueError``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> def loss(w, x):
    ...   return jnp.sum(x.astype(jnp.float16) @ w.astype(jnp.float16))
    >>> report = jaxmp.precision_report(jax.grad(loss), jnp.ones((3, 2)), jnp.ones((4, 3)))
    >>> report.flops_by_dtype(), [op.direction for op in report.ops]
    ({('float16', 'float16'): 96}, ['forward', 'backward'])
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
    """The share of the FLOPs with both inputs in ``dtype`` (none: ``ValueError``)."""
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
    return "\n".join([head, "FLOPs by input dtypes:"] + [
        f"  {lhs} x {rhs:<10} {100.0 * flops / (total or 1):6.1f}%  {flops:,}"
        for (lhs, rhs), flops in self.flops_by_dtype().items()] + ["Ops:"] + [
            "  " + "  ".join(c.rjust(w) if i == 5 else c.ljust(w) for i, (c, w) in
                             enumerate(zip(row, widths))).rstrip() for row in rows])


def _tag_declared_dtype(next_fun, args, kwargs, context):
  """A Linen interceptor: runs a module with a ``dtype`` in a scope naming it."""
  module, name = context.module, ""
  if "dtype" in getattr(type(module), "__dataclass_fields__", {}):
    with contextlib.suppress(TypeError):  # a dtype attribute of another kind
      name = "None" if module.dtype is None else np.dtype(module.dtype).name
  with jax.named_scope(_DECLARES + name) if name else contextlib.nullcontext():
    return next_fun(*args, **kwargs)


def _audit(fn: Callable[..., Any], args: tuple, kwargs: dict,
           names_from: Callable[..., Any]) -> PrecisionReport:
  """The report of ``fn(*args, **kwargs)``; ``names_from``'s signature names
  the positional arguments, when they bind."""
  names = [f"args[{i}]" for i in range(len(args))]
  with contextlib.suppress(TypeError, ValueError):
    parameters = inspect.signature(names_from).parameters
    bound = inspect.signature(names_from).bind(*args, **kwargs).arguments
    names = []
    for name, value in bound.items():
      kind = parameters[name].kind
      names += ([f"{name}[{i}]" for i in range(len(value))] if kind == kind.VAR_POSITIONAL
                else [name] if kind < kind.VAR_POSITIONAL else [])
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


class _Facts(NamedTuple):
  """What the audit knows of a value: where its bits come from."""

  # A 16-bit argument or captured array, or an argument cast to 16 bits (as a
  # policy casts them); not a 16-bit result of float32 math (LayerNorm's).
  narrow: bool = False
  recast: str = ""  # a wide cast of a narrow value: the narrow dtype
  from_recast: bool = False  # a wide value computed from a recast one
  captured: str = ""  # computed from a captured floating array: its type
  path: str = ""  # the argument it is read from (through moves and casts)
  upcast: bool = False  # a 16-bit value cast up
  literal: bool = False  # a literal of the program (here or in an outer one)
  made: str = ""  # made of no floating value but literals: what began it, where
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
  """The origin of a made value among ``facts`` that widened a 16-bit one,
  before or here (``narrow``: a 16-bit input meets them, a mixed matmul)."""
  made = next((f.made for f in facts if f.made), "")
  return next((f.created for f in facts if f.created), "") or (
      made if narrow or any(f.upcast for f in facts) else "")


def _origin(eqn: Any, ins: list[_Facts], stack: Any, line: str) -> str:
  """What makes ``eqn``'s outputs, if they are made of no floating value but
  literals and made ones (``_Facts.made``); ``""`` otherwise."""
  if any(is_float(a.aval.dtype) and not (f.made or f.literal)
         for a, f in zip(eqn.invars, ins)):
    return ""
  made = [f for f in ins if f.made]  # random bits before the constant that scales them
  if made:
    return min(made, key=lambda f: f.literal).made
  # The zeros and ones of autodiff are not the model's.
  return "" if "transpose" in jaxprs.name_parts(stack)[1] else f"{eqn.primitive.name} at {line}"


def _constant(var: Any) -> _Facts:
  # Only a floating array can make a matmul run in float32: a captured PRNG
  # key (a dropout key), integer or boolean array never does.
  aval = var.aval
  return _Facts(narrow=_is_narrow(aval.dtype), captured=(
      f"{aval.dtype}[{','.join(map(str, aval.shape))}]" if is_float(aval.dtype) else ""))


def _repeats(eqn: Any) -> int:
  """How many times an equation's programs run per run of the equation."""
  p = eqn.params
  if eqn.primitive.name == "scan":
    return int(p["length"])
  if eqn.primitive.name == "shard_map":
    axes = p.get("manual_axes") or p.get("newly_manual_axes") or ()
    return math.prod(dict(p["mesh"].shape)[a] for a in axes)
  return int(p["axis_size"]) if eqn.primitive.name == "xla_pmap" else 1


def _walk(jaxpr, consts, ins, stack, repeats, ops, line) -> list[_Facts]:
  """The facts of ``jaxpr``'s outputs; appends its matmuls and convs to
  ``ops``. ``line``: the source line of the equation around ``jaxpr``."""

  def rule(eqn, ins, stack):
    kind, outvars = KIND.get(eqn.primitive.name), eqn.outvars
    here = jaxprs.source_line(eqn) or line  # a jit's inside may have none
    if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
      ops.append(_record(eqn, ins, stack, repeats, here))
    if jaxprs.inner_jaxprs(eqn.params):
      results = []
      for sub in jaxprs.inner_jaxprs(eqn.params):
        # Its inputs are the equation's last, one for one (a cond's first is
        # the branch index; a while body's follow its condition's).
        start = len(eqn.invars) - len(sub.invars)
        args = [ins[start + i] if start >= 0 and eqn.invars[start + i].aval.dtype
                == var.aval.dtype else _NOTHING for i, var in enumerate(sub.invars)]
        outs = _walk(sub, [_constant(v) for v in sub.constvars], args, stack,
                     repeats * _repeats(eqn), ops, here)
        if len(outs) == len(outvars):
          results.append(outs)
      # An output one of several programs give (a cond's branches) is what
      # they agree on, else as if computed from them.
      return [column[0] if results and len(set(column)) == 1 else
              _merge(list(column), v.aval.dtype)
              for v, column in zip(outvars, zip(*results) if results else [ins] * len(outvars))]
    if kind == "as_is" and len(eqn.invars) == len(outvars):
      return ins
    if kind == "cast":
      outs = [_convert(ins[0], eqn.invars[0].aval.dtype, outvars[0].aval.dtype)]
    elif kind in ("move", "follow") and eqn.invars:
      outs = [ins[0]] * len(outvars)
    else:
      outs = [_merge(ins, v.aval.dtype) for v in outvars]
    made = _origin(eqn, ins, stack, here)
    literal = all(f.literal for f in ins)
    return [f._replace(made=made, literal=literal)
            if made and not _is_narrow(v.aval.dtype) else f for f, v in zip(outs, outvars)]

  return jaxprs.evaluate(jaxpr, consts, ins, rule, literal=lambda _: _LITERAL,
                         name_stack=stack)


def _convert(facts: _Facts, source: Any, target: Any) -> _Facts:
  if _is_narrow(target):
    return _Facts(narrow=bool(facts.path or facts.narrow), path=facts.path)
  if _is_wide(target) and _is_narrow(source):
    recast = np.dtype(source).name if facts.narrow else ""
    return _Facts(recast=recast, path=facts.path, upcast=True)
  if _is_wide(target) and _is_wide(source):
    return facts
  return _merge([facts], target)


def _flops(eqn: Any) -> int:
  """Two per multiply-add: per output element, over the contracted dimensions
  (a convolution's kernel spec is (out feature, in feature, *window))."""
  out, (lhs, rhs) = eqn.outvars[0].aval.shape, (v.aval.shape for v in eqn.invars[:2])
  if eqn.primitive.name == "dot_general":
    (contract, _), _ = eqn.params["dimension_numbers"]
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract)
  spec = eqn.params["dimension_numbers"].rhs_spec
  return 2 * math.prod(out) * math.prod(rhs[d] for d in spec[1:])


def _record(eqn, ins, stack, repeats, line) -> PrecisionOp:
  (lhs, rhs), out = (v.aval for v in eqn.invars[:2]), eqn.outvars[0].aval
  scopes, transforms = jaxprs.name_parts(stack)
  # Whether the innermost Linen module with a dtype declares a wide one
  # (None outside Linen: unknown).
  declared = [s[len(_DECLARES):] for s in scopes if s.startswith(_DECLARES)]
  declares_wide = declared[-1] in ("float32", "float64") if declared else None
  wide = [f for f, aval in zip(ins, (lhs, rhs)) if _is_wide(aval.dtype)]
  narrow = _is_narrow(lhs.dtype) or _is_narrow(rhs.dtype)
  recast, from_recast = any(f.recast for f in wide), any(f.from_recast for f in wide)
  closure = next((f.captured for f in wide if f.captured), "")
  cause, captured = next(((cause, captured) for hit, cause, captured in (
      # A module that declares float32, first: an input cast back up, or
      # computed from one (attention scores), unless the other is a float32
      # argument read as it is (a param a rule keeps in float32).
      (declares_wide and (recast or from_recast and not any(
          f.path and not f.recast for f in wide)), "recast", ""),
      (closure, "closure", closure),
      (_created(wide, narrow), "created", _created(wide, narrow)),
      (recast and declares_wide is None, "recast", ""),
      # A module without a float32 dtype that promotes its 16-bit params to
      # a float32 input, or an op of a 16-bit and a float32 input.
      (recast or narrow, "mixed", ""),
      # The gradients of such an op: computed from its recast values.
      (from_recast and not declares_wide,
       "recast" if declares_wide is None else "mixed", ""),
  ) if wide and hit), ("", ""))
  scopes = [s for s in scopes if not s.startswith(_DECLARES)]
  return PrecisionOp(
      primitive=eqn.primitive.name,
      direction="forward" if "transpose" not in transforms else
      "recompute" if _REMAT_SCOPE in scopes else "backward",
      lhs_dtype=np.dtype(lhs.dtype), rhs_dtype=np.dtype(rhs.dtype),
      out_dtype=np.dtype(out.dtype), lhs_shape=tuple(lhs.shape),
      rhs_shape=tuple(rhs.shape), out_shape=tuple(out.shape),
      flops=_flops(eqn) * repeats, repeats=repeats,
      module="/".join(s for s in scopes if s != _REMAT_SCOPE),
      operands=(ins[0].path, ins[1].path), source=line, cause=cause, captured=captured)


def precision_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> PrecisionReport:
  """Traces ``fn(*args, **kwargs)`` and reports the dtypes of its matmuls and convs.

  Nothing runs: ``fn`` (a loss, ``jax.grad(loss_fn)``, a training step) is
  traced on the array arguments, which may be :class:`jax.ShapeDtypeStruct`;
  the others are static. Every ``dot_general`` and ``conv_general_dilated``
  is reported, inner programs (``jit``, ``scan``, ``cond``, ``shard_map``
  ...) and the backward pass included. Raises ``TypeError`` if ``fn`` is not
  callable.

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
  return _audit(fn, args, kwargs, fn)


def _warning_text(report: PrecisionReport, compute_dtype: Any) -> str | None:
  """The :class:`PrecisionWarning`'s text if ``compute_dtype`` is 16-bit,
  less than :data:`MIN_SHARE_IN_COMPUTE_DTYPE` of the FLOPs run in it and
  the trace shows a cause for some of the others; else ``None``."""
  dtype = np.dtype(compute_dtype)
  if dtype not in (np.dtype(jnp.float16), np.dtype(jnp.bfloat16)):
    return None
  ops = [op for op in report.ops if is_float(op.lhs_dtype) and is_float(op.rhs_dtype)]
  # FP8 matmuls (an FP8 policy, Flax's fp8_ops) are narrower still: they
  # count with those in the compute dtype.
  outside = [op for op in ops if not op.runs_in(dtype) and not (
      op.lhs_dtype.itemsize == 1 and op.rhs_dtype.itemsize == 1)]
  total = sum(op.flops for op in ops)
  inside = total - sum(op.flops for op in outside)
  if total == 0 or inside >= MIN_SHARE_IN_COMPUTE_DTYPE * total or not any(
      op.cause for op in outside):
    return None
  elsewhere = ", ".join(
      f"{100 * flops / total:.0f}% in {' x '.join(dict.fromkeys(pair))}"
      for pair, flops in PrecisionReport(tuple(outside)).flops_by_dtype().items())
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


def warn_on_first_trace(grad_fn: Callable[..., Any], audited_fn: Callable[..., Any], *,
                        compute_dtype: Any, names_from: Callable[..., Any] | None = None
                        ) -> Callable[..., Any]:
  """``grad_fn``, which on each new argument signature (each compilation) also
  audits ``audited_fn`` (the forward loss; ``names_from`` names its arguments)
  and warns when a 16-bit ``compute_dtype`` does not take effect."""
  seen: set[Any] = set()

  @functools.wraps(grad_fn)
  def checked(*args, **kwargs):
    out = grad_fn(*args, **kwargs)
    key = signature((args, kwargs))
    if key is None or key not in seen:
      seen.add(key)
      with warnings.catch_warnings():  # grad_fn's trace gave them already
        warnings.simplefilter("ignore", PrecisionWarning)
        report = _audit(audited_fn, args, kwargs, names_from or audited_fn)
      text = _warning_text(report, compute_dtype)
      if text is not None:
        warnings.warn(text, PrecisionWarning, stacklevel=caller_stacklevel())
    return out

  return checked
