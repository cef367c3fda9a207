"""Falling back to a wider policy when float16 can no longer train.

:class:`PrecisionFallback` is a host-side controller: it reads a few scalars
of the loss-scaling metrics and answers which policy the run should be in.
:func:`switch_precision` moves a training state to a policy, keeping
everything else. A Flax state (a ``TrainState``, an ``nnx.Optimizer``) holds
its policy too: it is switched by ``_src/flax/train_state.py`` (above this
module in the import order), imported when the target is a Flax object, so
that ``import jaxmp`` never imports Flax and no import registers anything.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.checks import check_loss_scale
from jaxmp._src.hardware import HardwareReport, hardware_report
from jaxmp._src.loss_scale import NoOpLossScale
from jaxmp._src.loss_scaling import (
    _is_optax_state, get_loss_scale, loss_scaling_metrics, with_loss_scale)
from jaxmp._src.monitor import LossScaleMonitor
from jaxmp._src.policy import as_policy
from jaxmp._src.validation import check_number, listing

_logger = logging.getLogger("jaxmp")


class PrecisionSwitch(NamedTuple):
  """One switch of a run's policy (``PrecisionFallback.events``)."""

  step: int  # the number of updates done when it switched
  reason: str  # e.g. "3 overflow(s) at the minimum loss scale 1"
  old_policy: str  # str() of the policies
  new_policy: str


def _flax_switch(target: Any) -> Any:
  """For a Flax training state, ``of(model) -> (params, switch)``; else None."""
  if not any(cls.__module__.split(".")[0] == "flax" for cls in type(target).__mro__):
    return None
  from jaxmp._src.flax.train_state import flax_switch  # pylint: disable=g-import-not-at-top

  return flax_switch(target)


def switch_precision(target: Any, policy: Any, *, model: Any = None) -> Any:
  """Returns a training state switched to ``policy``; everything else kept.

  The params, the inner optimizer state and the counters are kept
  bit-identical; the loss scale becomes :class:`jaxmp.NoOpLossScale` when
  ``policy`` needs none. ``target`` is any pytree holding a
  :func:`jaxmp.loss_scaling` state (pass ``policy`` to its step), a
  :class:`jaxmp.flax.TrainState` (which gets the new ``policy``, ``apply_fn``
  and ``tx``) or an ``nnx.Optimizer`` with ``model=`` (switched in place, the
  model's dtypes set as by :meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`).
  A policy that stores the params in other dtypes is refused. Call it
  outside ``jit``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale())
    >>> opt_state = tx.init({"w": jnp.ones(2)})
    >>> switched = jaxmp.switch_precision(opt_state, "float32")
    >>> jaxmp.get_loss_scale(switched), switched.inner_state is opt_state.inner_state
    (NoOpLossScale(), True)
  """
  policy = as_policy(policy)
  policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
  try:  # abstractly: the target may be jax.eval_shape of a state
    current = jax.eval_shape(get_loss_scale, target)
  except ValueError as e:
    raise ValueError(
        "switch_precision needs a training state built on jaxmp.loss_scaling "
        f"(a jaxmp.flax.TrainState, an optimizer state or an nnx.Optimizer): {e}"
    ) from None
  if policy.needs_loss_scaling and isinstance(current, NoOpLossScale):
    raise ValueError(
        f"switch_precision: the new policy {policy} needs loss scaling, but the "
        "training state has no loss scale (jaxmp.NoOpLossScale). A switch goes "
        "towards wider dtypes and keeps the loss scale it finds; to train in "
        "float16 from a float32 or bfloat16 state, build a new state with "
        "jaxmp.DynamicLossScale().")
  loss_scale = None if policy.needs_loss_scaling or isinstance(
      current, NoOpLossScale) else NoOpLossScale()
  flax = _flax_switch(target)
  flax = None if flax is None else flax(model)
  if flax is None and model is not None:
    raise TypeError(
        "switch_precision: model= is for an nnx.Optimizer, whose model holds the "
        f"dtypes; a {type(target).__name__} takes no model.")
  params = flax[0] if flax is not None else jax.tree_util.tree_map(
      lambda x: None if _is_optax_state(x) else x, target, is_leaf=_is_optax_state)
  stored = jax.eval_shape(policy.params_for_storage, params)
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree_util.tree_leaves(stored)):
    if hasattr(old, "dtype") and np.dtype(old.dtype) != np.dtype(new.dtype):
      raise ValueError(
          f"switch_precision: the policy {policy} stores the params in other "
          f"dtypes than the state holds (at {jax.tree_util.keystr(path)}: "
          f"{np.dtype(old.dtype)} now, {np.dtype(new.dtype)} under the new "
          "policy). A switch keeps the params bit-identical, so the policies "
          "of a ladder share their param_dtype (float32 master params).")
  if flax is not None:
    return flax[1](policy, loss_scale)
  return target if loss_scale is None else with_loss_scale(target, loss_scale)


def _check_ladder(ladder: Any, hardware: HardwareReport, on_failure: str) -> tuple[Any, ...]:
  owner = "PrecisionFallback"
  if isinstance(ladder, str) or not isinstance(ladder, Sequence):
    raise TypeError(
        f"{owner}: ladder must be a sequence of policies, from the first to "
        f"the last resort, e.g. ('mixed_float16', 'float32'); got {ladder!r}.")
  if not ladder:
    raise ValueError(
        f"{owner}: the ladder is empty. Give the policy the run starts in "
        "first, then the ones to fall back to, e.g. ('mixed_float16', 'float32').")
  rungs = [as_policy(spec) for spec in ladder]
  for i, policy in enumerate(rungs):
    policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
    if policy in rungs[:i]:
      raise ValueError(
          f"{owner}: the ladder names {policy} twice (rungs {rungs.index(policy)} "
          f"and {i}). Each rung is a different policy, from the narrowest to "
          "the widest.")
  if on_failure == "switch" and len(rungs) < 2:
    raise ValueError(
        f"{owner}: the ladder has one rung ({rungs[0]}), so there is nothing "
        "to switch to. Add the policy to fall back to, e.g. ('mixed_float16', "
        "'float32'), or pass on_failure='raise' to stop the run as "
        "jaxmp.check_loss_scale does.")
  for i, policy in enumerate(rungs):
    parts = [policy] if hasattr(policy, "compute_dtype") else [
        p for p in (*(p for _, p in policy.rules), policy.default) if p is not None]
    if not hardware.native_bfloat16 and any(
        np.dtype(p.compute_dtype) == np.dtype(jnp.bfloat16) for p in parts):
      raise ValueError(
          f"{owner}: rung {i} of the ladder ({policy}) computes in bfloat16, "
          f"which this hardware ({hardware.platform}: "
          f"{', '.join(hardware.device_kinds)}) does not run natively; "
          "bfloat16 would be emulated there, slower than float32. Fall back "
          "to 'float32' instead, e.g. ladder=('mixed_float16', 'float32'). "
          "Run `jaxmp doctor` to see what the hardware supports.")
    later = [p for p in rungs[i + 1:] if p.needs_loss_scaling]
    if not policy.needs_loss_scaling and later:
      raise ValueError(
          f"{owner}: the ladder goes from {policy}, which needs no loss "
          f"scaling, back to {later[0]}, which does. A ladder goes towards "
          "wider dtypes: put the float16 policies first.")
  return tuple(rungs)


class PrecisionFallback:
  """Moves a run down a ``ladder`` of policies when float16 can no longer train.

  Host-side, every ``every`` steps, it reads the loss-scaling metrics (one
  transfer): the current policy failed when more than
  ``max_overflows_at_min`` overflows found the scale at its floor since the
  run entered it, or more than ``max_overflow_rate`` (``None``: never) of
  the steps of a whole ``window`` under it were skipped. :meth:`check` then
  returns the next rung; :meth:`update` switches the run to it
  (:func:`jaxmp.switch_precision`), logs and records it in :attr:`events`.
  ``on_failure="raise"``, or overflows at the floor on the last rung, raise
  as :func:`jaxmp.check_loss_scale` does. The default ladder ends in
  ``"mixed_bfloat16"`` where ``hardware`` runs bfloat16 natively, else in
  ``"float32"``; a bfloat16 rung is refused elsewhere.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> fallback = jaxmp.PrecisionFallback(("mixed_float16", "float32"), every=1)
    >>> tx = jaxmp.loss_scaling(
    ...     optax.sgd(0.1), jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
    >>> params = {"w": jnp.ones(2)}
    >>> opt_state, policy = tx.init(params), fallback.policy
    >>> for step in range(1, 4):  # every step overflows
    ...   _, opt_state = tx.update({"w": jnp.full(2, jnp.inf)}, opt_state, params)
    ...   opt_state, policy = fallback.update(opt_state, step=step)
    >>> str(policy), fallback.events[0].step, fallback.events[0].reason
    ('p=f32,c=f32,o=f32', 2, '1 overflow(s) at the minimum loss scale 1')
  """

  def __init__(self, ladder: Sequence[Any] | None = None, *, every: int = 100,
               window: int = 1000, max_overflow_rate: float | None = 0.25,
               max_overflows_at_min: int = 0, on_failure: str = "switch",
               hardware: HardwareReport | None = None):
    owner = "PrecisionFallback"
    if on_failure not in ("switch", "raise"):
      raise ValueError(
          f"{owner}: on_failure must be 'switch' (fall back to the next policy "
          "of the ladder) or 'raise' (stop with jaxmp.LossScaleAtMinimumError, "
          f"as check_loss_scale does); got {on_failure!r}.")
    if hardware is None:
      hardware = hardware_report()
    elif not isinstance(hardware, HardwareReport):
      raise TypeError(f"{owner}: hardware must be what jaxmp.hardware_report() "
                      f"returns, or None; got {hardware!r}.")
    self.every = check_number(owner, "every", every, integer=True, minimum=1)
    self.window = check_number(owner, "window", window, integer=True, minimum=1)
    self.max_overflow_rate = None if max_overflow_rate is None else check_number(
        owner, "max_overflow_rate", max_overflow_rate, minimum=0,
        exclusive_minimum=True, maximum=1,
        advice="Pass None to switch only on overflows at the minimum scale.")
    self.max_overflows_at_min = check_number(
        owner, "max_overflows_at_min", max_overflows_at_min, integer=True, minimum=0)
    self.on_failure, self.hardware = on_failure, hardware
    if ladder is None:
      ladder = (("mixed_float16", "mixed_bfloat16") if hardware.native_bfloat16
                else ("mixed_float16", "float32"))
    self.ladder: tuple[Any, ...] = _check_ladder(ladder, hardware, on_failure)
    self.policy: Any = self.ladder[0]
    self.rung = 0
    self.events: list[PrecisionSwitch] = []
    self.monitor = LossScaleMonitor(every=self.every, window=self.window, warn_rate=None)
    # The current policy is measured from _window_start (its first step, or
    # the first look) and the overflows at the floor counted then.
    self._window_start: int | None = None
    self._overflows_at_min_base = 0
    self._rate_logged = False

  @property
  def next_policy(self) -> Any:
    """The rung after the current one, or ``None`` on the last rung."""
    return self.ladder[self.rung + 1] if self.rung + 1 < len(self.ladder) else None

  @staticmethod
  def _step(target: Any, step: Any, caller: str) -> int:
    if step is None:
      step = getattr(target, "step", None)  # a TrainState's, an nnx.Optimizer's
      if step is None:
        raise TypeError(
            f"PrecisionFallback.{caller}: pass step= (the number of updates "
            "done so far) with a plain optax state or a metrics dict; a "
            "jaxmp.flax.TrainState or an nnx.Optimizer carries its own.")
    return check_number(f"PrecisionFallback.{caller}", "step",
                        np.asarray(jax.device_get(step)), integer=True, minimum=0)

  def _failure(self, target: Any, step: Any) -> tuple[int, str | None]:
    """``(step, why the current policy failed or None)``."""
    step = self._step(target, step, "check")
    if step % self.every:
      return step, None
    if self.monitor.records and self.monitor.records[-1].step == step:
      record = self.monitor.records[-1]
    else:
      record = self.monitor.record(step, target)
    if self._window_start is None:
      self._window_start = step
    overflows = record.overflows_at_min - self._overflows_at_min_base
    if overflows > self.max_overflows_at_min:
      if self.on_failure == "raise" or self.next_policy is None:
        check_loss_scale(target, max_overflows_at_min=self._overflows_at_min_base
                         + self.max_overflows_at_min)
      return step, (f"{overflows} overflow(s) at the minimum loss scale "
                    f"{record.loss_scale:g}")
    if (self.on_failure == "raise" or self.max_overflow_rate is None
        or step - self._window_start < self.window):
      return step, None
    rate = self.monitor.overflow_rate()
    if rate is None or rate <= self.max_overflow_rate:
      return step, None
    reason = (f"{rate:.0%} of the last {self.window} steps were skipped "
              f"(loss scale {record.loss_scale:g})")
    if self.next_policy is None:
      if not self._rate_logged:
        self._rate_logged = True
        _logger.warning(
            "jaxmp: step %d: %s under %s, the last policy of the fallback "
            "ladder; nothing left to switch to. Look for bad data "
            "(jaxmp.nonfinite_paths(batch)) or lower the learning rate.",
            step, reason, self.policy)
      return step, None
    return step, reason

  def check(self, target: Any, *, step: Any = None) -> Any:
    """Returns the policy to switch to, or ``None``; host-side, outside ``jit``.

    Reads the metrics when ``step`` (the updates done; a TrainState's or an
    ``nnx.Optimizer``'s when not given) is a multiple of ``every``.
    ``target`` is any pytree holding a :func:`jaxmp.loss_scaling` state, or
    the dict of :func:`jaxmp.loss_scaling_metrics`.
    """
    return None if self._failure(target, step)[1] is None else self.next_policy

  def update(self, target: Any, *, step: Any = None, model: Any = None) -> Any:
    """Checks the run and switches it to the next rung if its policy failed.

    Call it after each update, outside ``jit``. Returns a TrainState or an
    ``nnx.Optimizer`` (give ``model=``) switched; for any other pytree,
    ``(target, policy)``: pass ``policy`` to the step as a static argument.
    """
    step, reason = self._failure(target, step)
    if reason is not None:
      target = self._switch(target, self.next_policy, reason, step, model)
    return self._returned(target)

  def switch(self, target: Any, policy: Any, *, reason: str, step: Any = None,
             model: Any = None) -> Any:
    """Switches the run to ``policy`` now (e.g. a proposed
    :class:`jaxmp.flax.ModulePolicy`), records ``reason``; returns as
    :meth:`update` does. A policy of the ladder becomes the current rung."""
    if not isinstance(reason, str) or not reason:
      raise TypeError(
          "PrecisionFallback.switch: reason must be a non-empty string saying "
          f"why the run switches (it is logged and recorded); got {reason!r}.")
    return self._returned(self._switch(
        target, as_policy(policy), reason, self._step(target, step, "switch"), model))

  def _returned(self, target: Any) -> Any:
    # A Flax state holds its policy; for another pytree, the step takes it.
    return target if _flax_switch(target) is not None else (target, self.policy)

  def _switch(self, target, policy, reason, step, model):
    switched = switch_precision(target, policy, model=model)
    event = PrecisionSwitch(step, reason, str(self.policy), str(policy))
    self.policy = policy
    if policy in self.ladder:
      self.rung = self.ladder.index(policy)
    self.events.append(event)
    _logger.warning("jaxmp: step %d: switching from %s to %s: %s.",
                    step, event.old_policy, event.new_policy, reason)
    # The new policy is measured from here.
    metrics = jax.device_get(loss_scaling_metrics(switched))
    self._overflows_at_min_base = int(np.asarray(metrics["overflows_at_min"]))
    self._window_start, self._rate_logged = step, False
    if not self.monitor.records or self.monitor.records[-1].step < step:
      self.monitor.record(step, metrics)
    return switched

  def state_dict(self) -> dict[str, Any]:
    """What a resumed run needs of the controller (JSON-ready but ``policy``)."""
    return {"ladder": [str(p) for p in self.ladder], "rung": self.rung,
            "policy": self.policy, "overflows_at_min_base": self._overflows_at_min_base,
            "events": [event._asdict() for event in self.events]}

  def _same_ladder(self, saved: Any, owner: str) -> None:
    ladder = [str(p) for p in self.ladder]
    if list(saved) != ladder:
      raise ValueError(
          f"{owner}: the checkpoint was written under a PrecisionFallback with "
          f"the ladder {list(saved)}, but the given one has {ladder}. Build the "
          "controller with the ladder of the run you resume.")

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Resumes from :meth:`state_dict`; the ladder must be the same."""
    owner = "PrecisionFallback.load_state_dict"
    fix = ("Pass the dict that PrecisionFallback.state_dict() returned, or let "
           "jaxmp.flax.restore_checkpoint(..., fallback=controller) load it.")
    if not isinstance(state, Mapping):
      raise TypeError(f"{owner}: state must be the dict of state_dict(), got a "
                      f"{type(state).__name__}. {fix}")
    missing = [key for key in self.state_dict() if key not in state]
    if missing:
      raise ValueError(f"{owner}: the state lacks {listing(missing)}. {fix}")
    self._same_ladder(state["ladder"], owner)
    rung = check_number(owner, "rung", state["rung"], integer=True, minimum=0,
                        maximum=len(self.ladder) - 1,
                        advice=f"It indexes the ladder of {len(self.ladder)} policies. {fix}")
    base = check_number(owner, "overflows_at_min_base", state["overflows_at_min_base"],
                        integer=True, minimum=0, advice=fix)
    events = state["events"]
    for event in events if isinstance(events, (list, tuple)) else [events]:
      if not isinstance(event, Mapping) or set(event) != set(PrecisionSwitch._fields):
        raise ValueError(
            f"{owner}: the event {event!r} is not a dict with the fields of a "
            f"PrecisionFallback.events entry ({', '.join(PrecisionSwitch._fields)}). {fix}")
    self.rung, self.policy = rung, as_policy(state["policy"])
    self._overflows_at_min_base = base
    self.events = [PrecisionSwitch(**event) for event in events]
    self._window_start, self._rate_logged = None, False

  def __repr__(self) -> str:
    return (
        f"PrecisionFallback(ladder=({', '.join(str(p) for p in self.ladder)}), "
        f"policy={self.policy}, every={self.every}, window={self.window}, "
        f"max_overflow_rate={self.max_overflow_rate}, "
        f"max_overflows_at_min={self.max_overflows_at_min}, "
        f"on_failure={self.on_failure!r}, switches={len(self.events)})")
