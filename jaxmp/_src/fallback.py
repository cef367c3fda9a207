"""Falling back to a wider policy when float16 can no longer train.

:class:`PrecisionFallback` is a host-side controller. Every ``every`` steps
it reads a few scalars of the loss-scaling metrics (the overflows at the
minimum scale, which :func:`jaxmp.check_loss_scale` reads, and the skipped
steps, from which :class:`jaxmp.LossScaleMonitor` computes the overflow rate
over a window). When float16 can no longer train, it moves the run to the next
policy of a ladder such as ``("mixed_float16", "float32")`` with
:func:`switch_precision`, or raises, as the user chooses.

:func:`switch_precision` changes the policy of a training state and keeps
everything else: the params and the inner optimizer state are the same
arrays, the counters are kept, and the loss scale becomes
:class:`jaxmp.NoOpLossScale` when the new policy needs no loss scaling (it is
kept as it is when it does). It switches any pytree holding a
:func:`jaxmp.loss_scaling` state; a :class:`jaxmp.flax.TrainState` and an
``nnx.Optimizer``, which also hold the policy (or a model whose dtypes are the
policy's), are switched by ``_src/flax/switch.py``, which it imports when the
target is a Flax object.
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
from jaxmp._src.loss_scale import LossScale, NoOpLossScale
from jaxmp._src.loss_scaling import (
    get_loss_scale,
    _is_optax_state,
    loss_scaling_metrics,
    with_loss_scale,
)
from jaxmp._src.monitor import LossScaleMonitor
from jaxmp._src.policy import as_policy
from jaxmp._src.validation import check_number, listing

_logger = logging.getLogger("jaxmp")

_ON_FAILURE = ("switch", "raise")


class PrecisionSwitch(NamedTuple):
  """One switch of a run's policy, as :class:`PrecisionFallback` records it.

  ``PrecisionFallback.events`` is a list of them (a ``NamedTuple``: compare or
  read fields, ``event._asdict()`` for a log line).

  Attributes:
    step: the step at which the run switched (the number of updates done).
    reason: why, e.g. ``"3 overflow(s) at the minimum loss scale 1"``.
    old_policy: the policy before, as ``str(policy)`` writes it.
    new_policy: the policy after.

  Example:
    >>> from jaxmp._src.fallback import PrecisionSwitch
    >>> event = PrecisionSwitch(
    ...     step=120, reason="1 overflow(s) at the minimum loss scale 1",
    ...     old_policy="p=f32,c=f16,o=f32", new_policy="p=f32,c=f32,o=f32")
    >>> event.step, event._asdict()["new_policy"]
    (120, 'p=f32,c=f32,o=f32')
  """

  step: int
  reason: str
  old_policy: str
  new_policy: str


# The switch.


def _flax_switch(target: Any) -> Any:
  """``(params_of, switch)`` of a Flax training state (a TrainState, an
  nnx.Optimizer), or None.

  Flax is imported here only when ``target`` is a Flax object, so Flax is
  installed: ``import jaxmp`` never imports it, and no import registers
  anything.
  """
  if not any(cls.__module__.split(".")[0] == "flax" for cls in type(target).__mro__):
    return None
  from jaxmp._src.flax.switch import switch_of  # pylint: disable=g-import-not-at-top

  return switch_of(target)


def _params_of(target: Any, model: Any) -> Any:
  """The params a switch keeps: a Flax state's, or those of a pytree such as
  ``(params, opt_state)``, its leaves outside the optimizer state."""
  flax = _flax_switch(target)
  if flax is not None:
    return flax[0](target, model)
  if model is not None:
    raise TypeError(
        "switch_precision: model= is for an nnx.Optimizer, whose model holds "
        f"the dtypes; a {type(target).__name__} takes no model."
    )
  return jax.tree_util.tree_map(
      lambda x: None if _is_optax_state(x) else x, target, is_leaf=_is_optax_state)


def _check_storage_dtypes(params: Any, policy: Any) -> None:
  """Refuses a policy that would store the params in other dtypes."""
  stored = jax.eval_shape(policy.params_for_storage, params)
  for (path, old), new in zip(jax.tree_util.tree_leaves_with_path(params),
                              jax.tree_util.tree_leaves(stored)):
    old_dtype = getattr(old, "dtype", None)
    if old_dtype is not None and np.dtype(old_dtype) != np.dtype(new.dtype):
      raise ValueError(
          f"switch_precision: the policy {policy} stores the params in other "
          f"dtypes than the state holds (at {jax.tree_util.keystr(path)}: "
          f"{np.dtype(old_dtype)} now, {np.dtype(new.dtype)} under the new "
          "policy). A switch keeps the params bit-identical, so the policies "
          "of a ladder share their param_dtype (float32 master params)."
      )


def _current_loss_scale(target: Any) -> LossScale:
  try:
    # Abstractly, so that the target may be jax.eval_shape of a state.
    return jax.eval_shape(get_loss_scale, target)
  except ValueError as e:
    raise ValueError(
        "switch_precision needs a training state built on jaxmp.loss_scaling (a "
        "jaxmp.flax.TrainState, an optimizer state or an nnx.Optimizer): "
        f"{e}"
    ) from None


def _next_loss_scale(current: LossScale, policy: Any):
  """The loss scale to switch to, or ``None`` to keep ``current``."""
  if policy.needs_loss_scaling:
    if isinstance(current, NoOpLossScale):
      raise ValueError(
          f"switch_precision: the new policy {policy} needs loss scaling, but the "
          "training state has no loss scale (jaxmp.NoOpLossScale). A switch "
          "goes towards wider dtypes and keeps the loss scale it finds; to "
          "train in float16 from a float32 or bfloat16 state, build a new state "
          "with jaxmp.DynamicLossScale()."
      )
    return None
  if isinstance(current, NoOpLossScale):
    return None
  return NoOpLossScale()


def switch_precision(target: Any, policy: Any, *, model: Any = None) -> Any:
  """Returns a training state switched to ``policy``; everything else kept.

  The params and the inner optimizer state (moments, step counts,
  schedules) are the same arrays, bit-identical, and the loss-scaling
  counters (``skipped_steps``) are kept. The loss scale becomes
  :class:`jaxmp.NoOpLossScale` when ``policy`` needs no loss scaling
  (``float32``, ``mixed_bfloat16``); it is kept as it is when ``policy`` does
  (a :class:`jaxmp.flax.ModulePolicy` that keeps some modules in float32 and
  the rest in float16). The params stay as they are, so a policy that would
  store them in other dtypes is refused, whatever the target (the params of
  ``(params, opt_state)`` are its leaves outside the optimizer state). Call it
  outside ``jit``; a jitted step that takes the
  switched state (or, for a plain optax loop, the policy as a static
  argument) compiles once more, and then never again.

  * Any pytree holding a :func:`jaxmp.loss_scaling` state (an optimizer
    state, ``(params, opt_state)``): the same pytree with the loss scale
    replaced. The optimizer itself needs no change (its ``update`` reads the
    loss scale from the state); pass ``policy`` to the step.
  * A :class:`jaxmp.flax.TrainState`: a new state with the new ``policy`` (a static field), ``apply_fn`` wrapped by the
    new policy and ``tx`` starting from the new loss scale.
  * An ``nnx.Optimizer`` (give ``model=``): switched in place, and returned.
    Its ``opt_state`` and ``tx`` are replaced, and each module of ``model``
    that has a ``dtype`` gets the compute dtype of its policy
    (:meth:`jaxmp.flax.ModulePolicy.set_nnx_dtypes`; a :class:`jaxmp.Policy`
    acts as ``ModulePolicy({}, default=policy)``).
  * FP8 (a policy with ``dot=fp8``, see the FP8 guide): the layers the new
    policy runs without FP8 leave it, with a warning. An NNX layer loses its
    FP8 op and the :class:`jaxmp.flax.Fp8Meta` in it; a ``TrainState``
    switched to a policy without FP8 matmuls keeps its meta in ``params``,
    unused and unchanged, so the loss function keeps its variables.

  Args:
    target: the training state: any pytree holding a
      :func:`jaxmp.loss_scaling` state, a :class:`jaxmp.flax.TrainState` or
      an ``nnx.Optimizer``.
    policy: anything :func:`jaxmp.get_policy` takes, a
      :class:`jaxmp.PathPolicy` or a :class:`jaxmp.flax.ModulePolicy`.
    model: the NNX model, when ``target`` is an ``nnx.Optimizer``.

  Returns:
    The switched training state, of the kind given.

  Raises:
    ValueError: if ``target`` holds no loss-scaling state, if ``policy``
      needs loss scaling and the state has none, if ``policy`` would store
      the params in other dtypes, or if it runs FP8 matmuls and a
      ``TrainState`` has no FP8 meta.
    TypeError: if ``model`` is missing for (or given to) a target that needs
      (or takes) none.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale())
    >>> params = {"w": jnp.ones(2)}
    >>> opt_state = tx.init(params)
    >>> switched = jaxmp.switch_precision(opt_state, "float32")
    >>> jaxmp.get_loss_scale(switched)
    NoOpLossScale()
    >>> switched.inner_state is opt_state.inner_state  # the same arrays
    True
  """
  policy = as_policy(policy)
  policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
  loss_scale = _next_loss_scale(_current_loss_scale(target), policy)
  _check_storage_dtypes(_params_of(target, model), policy)
  flax = _flax_switch(target)
  if flax is not None:
    return flax[1](target, policy, loss_scale, model)
  return target if loss_scale is None else with_loss_scale(target, loss_scale)


# The controller.


def _policies_in(policy: Any) -> list[Any]:
  """The plain policies a policy is made of (its own, or its rules' and default)."""
  if hasattr(policy, "compute_dtype"):
    return [policy]
  found = [p for _, p in getattr(policy, "rules", ())]
  default = getattr(policy, "default", None)
  return found + ([default] if default is not None else [])


def _computes_in_bfloat16(policy: Any) -> bool:
  return any(np.dtype(p.compute_dtype) == np.dtype(jnp.bfloat16)
             for p in _policies_in(policy))


def _default_ladder(hardware: HardwareReport) -> tuple[str, ...]:
  if hardware.native_bfloat16:
    return ("mixed_float16", "mixed_bfloat16")
  return ("mixed_float16", "float32")


def _check_ladder(ladder: Any, hardware: HardwareReport,
                  on_failure: str) -> tuple[Any, ...]:
  owner = "PrecisionFallback"
  if isinstance(ladder, str) or not isinstance(ladder, Sequence):
    raise TypeError(
        f"{owner}: ladder must be a sequence of policies, from the first to "
        "the last resort, e.g. ('mixed_float16', 'float32'); got "
        f"{ladder!r}."
    )
  if not ladder:
    raise ValueError(
        f"{owner}: the ladder is empty. Give the policy the run starts in "
        "first, then the ones to fall back to, e.g. ('mixed_float16', "
        "'float32')."
    )
  rungs = []
  for spec in ladder:
    policy = as_policy(spec)
    policy.io_policy  # pylint: disable=pointless-statement  # raises without a default
    rungs.append(policy)
  for i, policy in enumerate(rungs):
    if policy in rungs[:i]:
      raise ValueError(
          f"{owner}: the ladder names {policy} twice (rungs {rungs.index(policy)} "
          f"and {i}). Each rung is a different policy, from the narrowest to "
          "the widest."
      )
  if on_failure == "switch" and len(rungs) < 2:
    raise ValueError(
        f"{owner}: the ladder has one rung ({rungs[0]}), so there is nothing "
        "to switch to. Add the policy to fall back to, e.g. ('mixed_float16', "
        "'float32'), or pass on_failure='raise' to stop the run as "
        "jaxmp.check_loss_scale does."
    )
  if not hardware.native_bfloat16:
    for i, policy in enumerate(rungs):
      if _computes_in_bfloat16(policy):
        raise ValueError(
            f"{owner}: rung {i} of the ladder ({policy}) computes in bfloat16, "
            f"which this hardware ({hardware.platform}: "
            f"{', '.join(hardware.device_kinds)}) does not run natively; "
            "bfloat16 would be emulated there, slower than float32. Fall back "
            "to 'float32' instead, e.g. ladder=('mixed_float16', 'float32'). "
            "Run `jaxmp doctor` to see what the hardware supports."
        )
  for i, policy in enumerate(rungs):
    if not policy.needs_loss_scaling:
      later = [p for p in rungs[i + 1:] if p.needs_loss_scaling]
      if later:
        raise ValueError(
            f"{owner}: the ladder goes from {policy}, which needs no loss "
            f"scaling, back to {later[0]}, which does. A ladder goes towards "
            "wider dtypes: put the float16 policies first."
        )
  return tuple(rungs)


class PrecisionFallback:
  """Switches a run to a wider policy when float16 can no longer train.

  A host-side controller for the training loop. Every ``every`` steps,
  :meth:`update` reads the loss-scaling metrics (a few scalars, one transfer)
  and decides whether the current policy failed:

  * **overflows at the minimum scale**: more than ``max_overflows_at_min``
    overflows found the dynamic loss scale at its floor since the run entered
    this policy (DeepSpeed's "Current loss scale already at minimum", which
    :func:`jaxmp.check_loss_scale` reports);
  * **the overflow rate**: over the last ``window`` steps, more than
    ``max_overflow_rate`` of the steps were skipped, as
    :meth:`jaxmp.LossScaleMonitor.overflow_rate` measures it (only once a
    whole window has passed under the current policy).

  Then, with ``on_failure="switch"`` (the default), it moves the run to the
  next rung of ``ladder`` with :func:`jaxmp.switch_precision` (params and
  optimizer state kept bit-identical, the loss scale replaced by
  :class:`jaxmp.NoOpLossScale`), logs the switch (``logging`` logger
  ``"jaxmp"``, level WARNING) and records it in :attr:`events`. With
  ``on_failure="raise"`` it raises :class:`jaxmp.LossScaleAtMinimumError`
  with :func:`jaxmp.check_loss_scale`'s message, as the run did before (only
  the minimum-scale condition is checked then). On the last rung there is
  nothing left to switch to: overflows at the minimum scale raise as
  ``check_loss_scale`` does, and a high overflow rate is logged once.

  The ladder goes from the policy the run starts in to the last resort.
  A rung that computes in bfloat16 is refused where ``hardware`` (default
  :func:`jaxmp.hardware_report`) says bfloat16 is not native (the CPU, NVIDIA
  GPUs before compute capability 8.0): there, fall back to float32. The
  default ladder is ``("mixed_float16", "mixed_bfloat16")`` where bfloat16 is
  native, else ``("mixed_float16", "float32")``. Each rung is a whole policy:
  to keep LayerNorm in float32 on every rung, give
  :class:`jaxmp.flax.ModulePolicy` rungs.

  Args:
    ladder: the policies, from the first to the last resort (anything
      :func:`jaxmp.get_policy` takes, :class:`jaxmp.PathPolicy`,
      :class:`jaxmp.flax.ModulePolicy`).
    every: look at the metrics every this many steps (>= 1).
    window: the number of steps over which the overflow rate is measured.
    max_overflow_rate: the largest fraction of skipped steps over a window
      that the current policy may have, in (0, 1]; ``None`` to switch only on
      overflows at the minimum scale.
    max_overflows_at_min: how many overflows at the minimum scale to
      tolerate (as in :func:`jaxmp.check_loss_scale`).
    on_failure: ``"switch"`` to move to the next rung, ``"raise"`` to raise.
    hardware: the :func:`jaxmp.hardware_report` the bfloat16 rungs are
      checked against; default :func:`jaxmp.hardware_report`.

  Raises:
    ValueError: for an empty ladder, a ladder with one rung in ``"switch"``
      mode, a rung named twice, a rung that needs loss scaling after one that
      does not, a bfloat16 rung on hardware without native bfloat16, or
      numbers out of range.
    TypeError: for arguments of the wrong kind.

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
    >>> str(policy), jaxmp.get_loss_scale(opt_state)
    ('p=f32,c=f32,o=f32', NoOpLossScale())
    >>> fallback.events[0].step, fallback.events[0].reason
    (2, '1 overflow(s) at the minimum loss scale 1')
  """

  def __init__(
      self,
      ladder: Sequence[Any] | None = None,
      *,
      every: int = 100,
      window: int = 1000,
      max_overflow_rate: float | None = 0.25,
      max_overflows_at_min: int = 0,
      on_failure: str = "switch",
      hardware: HardwareReport | None = None,
  ):
    owner = "PrecisionFallback"
    if on_failure not in _ON_FAILURE:
      raise ValueError(
          f"{owner}: on_failure must be 'switch' (fall back to the next policy "
          "of the ladder) or 'raise' (stop with jaxmp.LossScaleAtMinimumError, "
          f"as check_loss_scale does); got {on_failure!r}."
      )
    if hardware is None:
      hardware = hardware_report()
    elif not isinstance(hardware, HardwareReport):
      raise TypeError(
          f"{owner}: hardware must be what jaxmp.hardware_report() returns, "
          f"or None; got {hardware!r}."
      )
    self.every = check_number(owner, "every", every, integer=True, minimum=1)
    self.window = check_number(owner, "window", window, integer=True, minimum=1)
    if max_overflow_rate is not None:
      max_overflow_rate = check_number(
          owner, "max_overflow_rate", max_overflow_rate, minimum=0,
          exclusive_minimum=True, maximum=1,
          advice="Pass None to switch only on overflows at the minimum scale.")
    self.max_overflow_rate = max_overflow_rate
    self.max_overflows_at_min = check_number(
        owner, "max_overflows_at_min", max_overflows_at_min, integer=True,
        minimum=0)
    self.on_failure = on_failure
    self.hardware = hardware
    if ladder is None:
      ladder = _default_ladder(hardware)
    self.ladder: tuple[Any, ...] = _check_ladder(ladder, hardware, on_failure)
    self.policy: Any = self.ladder[0]
    self.rung = 0
    self.events: list[PrecisionSwitch] = []
    self.monitor = LossScaleMonitor(every=self.every, window=self.window,
                                    warn_rate=None)
    # What the current policy is measured from: the step it started at (or
    # the first look) and the overflows at the minimum scale counted then.
    self._window_start: int | None = None
    self._overflows_at_min_base = 0
    self._rate_logged = False

  @property
  def next_policy(self) -> Any:
    """The rung after the current one, or ``None`` on the last rung."""
    if self.rung + 1 < len(self.ladder):
      return self.ladder[self.rung + 1]
    return None

  @staticmethod
  def _step(target: Any, step: Any, caller: str) -> int:
    if step is None:
      step = getattr(target, "step", None)  # a TrainState's, an nnx.Optimizer's
      if step is None:
        raise TypeError(
            f"PrecisionFallback.{caller}: pass step= (the number of updates "
            "done so far) with a plain optax state or a metrics dict; "
            "a jaxmp.flax.TrainState or an nnx.Optimizer carries its own."
        )
    return check_number(f"PrecisionFallback.{caller}", "step",
                        np.asarray(jax.device_get(step)), integer=True, minimum=0)

  def check(self, target: Any, *, step: Any = None) -> str | None:
    """Says whether the current policy failed; host-side, outside ``jit``.

    Reads the metrics only when ``step`` is a multiple of ``every`` (a few
    scalars, one transfer); returns ``None`` on the other steps.

    Args:
      target: any pytree holding a :func:`jaxmp.loss_scaling` state (an
        optimizer state, a :class:`jaxmp.flax.TrainState`, an
        ``nnx.Optimizer``), or the dict of :func:`jaxmp.loss_scaling_metrics`.
      step: the number of updates done so far; read from a TrainState or an
        ``nnx.Optimizer`` when not given (one scalar more to read: pass it to
        save that).

    Returns:
      Why the policy failed (e.g. ``"2 overflow(s) at the minimum loss scale
      1"``), or ``None``.

    Raises:
      LossScaleAtMinimumError: with ``on_failure="raise"``, or on the last
        rung, when the overflows at the minimum scale exceed the limit.
    """
    step = self._step(target, step, "check")
    if step % self.every:
      return None
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
      return (f"{overflows} overflow(s) at the minimum loss scale "
              f"{record.loss_scale:g}")
    if self.on_failure == "raise" or self.max_overflow_rate is None:
      return None
    if step - self._window_start < self.window:
      return None
    rate = self.monitor.overflow_rate()
    if rate is None or rate <= self.max_overflow_rate:
      return None
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
      return None
    return reason

  def update(self, target: Any, *, step: Any = None, model: Any = None) -> Any:
    """Checks the run and switches it to the next rung if its policy failed.

    Call it after each update (it reads from the device only every
    ``every`` steps), outside ``jit``.

    Args:
      target: any pytree holding a :func:`jaxmp.loss_scaling` state (an
        optimizer state, ``(params, opt_state)``), a
        :class:`jaxmp.flax.TrainState` or an ``nnx.Optimizer`` (with
        ``model=``).
      step: the number of updates done so far; read from ``target.step``
        (a TrainState's, an ``nnx.Optimizer``'s) when not given.
      model: the NNX model, with an ``nnx.Optimizer``.

    Returns:
      For a TrainState, the (possibly switched) state; for an
      ``nnx.Optimizer``, the optimizer (switched in place, with the model);
      for any other pytree, ``(target, policy)``: pass ``policy`` to the
      step as a static argument.

    Raises:
      LossScaleAtMinimumError: as :meth:`check` does.
    """
    reason = self.check(target, step=step)
    if reason is not None:
      target = self._switch(target, self.next_policy, reason=reason, step=step,
                            model=model)
    return self._returned(target)

  def switch(self, target: Any, policy: Any, *, reason: str, step: Any = None,
             model: Any = None) -> Any:
    """Switches the run to ``policy`` now, and records the event.

    The same switch as :meth:`update`'s, for a policy of your choice: e.g.
    the :class:`jaxmp.flax.ModulePolicy` that
    ``find_overflowing_modules(...).propose_policy`` proposes, which keeps
    the modules that overflow in float32 (the loss scale stays dynamic, since
    float16 remains). A policy of the ladder becomes the current rung; any
    other is a step between the current rung and the next.

    Args:
      target: as for :meth:`update`.
      policy: the policy to switch to.
      reason: why, for the log and :attr:`events`.
      step: as for :meth:`update`.
      model: the NNX model, with an ``nnx.Optimizer``.

    Returns:
      As :meth:`update`.
    """
    return self._returned(self._switch(target, policy, reason=reason, step=step,
                                       model=model))

  def _returned(self, target: Any) -> Any:
    if _flax_switch(target) is None:  # it holds no policy: the step takes it
      return target, self.policy
    return target

  def _switch(self, target, policy, *, reason, step, model):
    if not isinstance(reason, str) or not reason:
      raise TypeError(
          "PrecisionFallback.switch: reason must be a non-empty string saying "
          f"why the run switches (it is logged and recorded); got {reason!r}."
      )
    step = self._step(target, step, "switch")
    policy = as_policy(policy)
    switched = switch_precision(target, policy, model=model)
    old = self.policy
    self.policy = policy
    if policy in self.ladder:
      self.rung = self.ladder.index(policy)
    event = PrecisionSwitch(step=step, reason=reason, old_policy=str(old),
                            new_policy=str(policy))
    self.events.append(event)
    _logger.warning("jaxmp: step %d: switching from %s to %s: %s.",
                    step, event.old_policy, event.new_policy, reason)
    # The new policy is measured from here.
    metrics = jax.device_get(loss_scaling_metrics(switched))
    self._overflows_at_min_base = int(np.asarray(metrics["overflows_at_min"]))
    self._window_start = step
    self._rate_logged = False
    if not self.monitor.records or self.monitor.records[-1].step < step:
      self.monitor.record(step, metrics)
    return switched

  # The controller's own state, for checkpoints.

  def state_dict(self) -> dict[str, Any]:
    """What a resumed run needs of the controller (JSON-ready but the policy).

    ``policy`` is the current policy object; the checkpoint functions of
    :mod:`jaxmp.flax` write it as JSON.
    """
    return {
        "ladder": [str(p) for p in self.ladder],
        "rung": self.rung,
        "policy": self.policy,
        "overflows_at_min_base": self._overflows_at_min_base,
        "events": [event._asdict() for event in self.events],
    }

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Resumes from :meth:`state_dict`; the ladder must be the same.

    Raises:
      TypeError: if ``state`` is not a dict, or a value is of the wrong kind.
      ValueError: if ``state`` lacks a key of :meth:`state_dict`'s, its rung
        is not one of the ladder's, an event is not a
        a :class:`PrecisionSwitch`'s fields, or the saved ladder differs
        from this controller's.
    """
    owner = "PrecisionFallback.load_state_dict"
    fix = ("Pass the dict that PrecisionFallback.state_dict() returned, or let "
           "jaxmp.flax.restore_checkpoint(..., fallback=controller) load it.")
    if not isinstance(state, Mapping):
      raise TypeError(f"{owner}: state must be the dict of state_dict(), got a "
                      f"{type(state).__name__}. {fix}")
    missing = [key for key in self.state_dict() if key not in state]
    if missing:
      raise ValueError(f"{owner}: the state lacks {listing(missing)}. {fix}")
    ladder = [str(p) for p in self.ladder]
    if list(state["ladder"]) != ladder:
      raise ValueError(
          "PrecisionFallback: the checkpoint was written by a controller with "
          f"the ladder {list(state['ladder'])}, but this one has {ladder}. "
          "Build the controller with the ladder of the run you resume."
      )
    rung = check_number(
        owner, "rung", state["rung"], integer=True, minimum=0,
        maximum=len(ladder) - 1,
        advice=f"It indexes the ladder of {len(ladder)} policies. {fix}")
    base = check_number(owner, "overflows_at_min_base", state["overflows_at_min_base"],
                        integer=True, minimum=0, advice=fix)
    fields = set(PrecisionSwitch._fields)
    events = state["events"]
    for event in events if isinstance(events, (list, tuple)) else [events]:
      if not isinstance(event, Mapping) or set(event) != fields:
        raise ValueError(
            f"{owner}: the event {event!r} is not a dict with the fields of a "
            f"PrecisionFallback.events entry ({', '.join(PrecisionSwitch._fields)}). {fix}")
    self.rung = rung
    self.policy = as_policy(state["policy"])
    self._overflows_at_min_base = base
    self.events = [PrecisionSwitch(**event) for event in state["events"]]
    self._window_start = None
    self._rate_logged = False

  def __repr__(self) -> str:
    return (
        f"PrecisionFallback(ladder=({', '.join(str(p) for p in self.ladder)}), "
        f"policy={self.policy}, every={self.every}, window={self.window}, "
        f"max_overflow_rate={self.max_overflow_rate}, "
        f"max_overflows_at_min={self.max_overflows_at_min}, "
        f"on_failure={self.on_failure!r}, switches={len(self.events)})"
    )
