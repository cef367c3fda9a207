"""A host-side recorder of loss-scaling metrics: history, overflow rate, plots."""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmp._src.checks import REMEDIES, metrics_on_host
from jaxmp._src.validation import caller_stacklevel, check_number


class MonitorRecord(NamedTuple):
  """One sample of the loss-scaling metrics, on the host."""

  step: int
  loss_scale: float
  skipped_steps: int
  last_finite: bool
  overflows_at_min: int


class LossScaleMonitor:
  """Records loss-scaling metrics every ``every`` steps and summarises them.

  Call :meth:`update` with the step count (``state.step``) and the optimizer
  state (or the dict of :func:`jaxmp.loss_scaling_metrics`) after every
  update; it reads from the device only when ``step`` is a multiple of
  ``every``. ``skipped_steps`` is cumulative, so sampling loses no skip. A
  stacked state (``pmap`` replicas, ``vmap``) is recorded by its worst member
  in each field.

  Args:
    every: record every this many steps (an integer >= 1).
    window: the steps over which :meth:`overflow_rate` is measured.
    warn_rate: warn once (``RuntimeWarning``) when a full window skipped at
      least this fraction of its steps (in (0, 1]); ``None`` never warns.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4))
    >>> params = jnp.ones(2)
    >>> state = tx.init(params)
    >>> monitor = jaxmp.LossScaleMonitor(every=2, window=4, warn_rate=0.5)
    >>> for step, g in enumerate([jnp.inf, 1.0, 1.0, 1.0], start=1):
    ...   _, state = tx.update(jnp.full(2, g), state, params)
    ...   _ = monitor.update(step, state)
    >>> monitor.history["step"], monitor.history["skipped_steps"]
    ([2, 4], [1, 1])
    >>> monitor.overflow_rate(), monitor.steps_since_last_skip()
    (0.25, 2)
  """

  def __init__(self, every: int = 100, window: int = 1000,
               warn_rate: float | None = 0.1):
    owner = "LossScaleMonitor"
    self.every = check_number(owner, "every", every, integer=True, minimum=1,
                              advice="100 reads the metrics every 100 steps.")
    self.window = check_number(owner, "window", window, integer=True, minimum=1,
                               advice="1000 measures the overflow rate over the "
                               "last 1000 steps.")
    self.warn_rate = None if warn_rate is None else check_number(
        owner, "warn_rate", warn_rate, minimum=0, exclusive_minimum=True,
        maximum=1, advice="0.1 warns when a tenth of the steps are skipped; "
        "None never warns.")
    self.records: list[MonitorRecord] = []
    self.warned = False

  def update(self, step: Any, x: Any) -> bool:
    """Records ``x`` when ``step`` (an int or a scalar array) is a multiple of ``every``.

    Returns whether a record was taken.
    """
    step = _host_step(step)
    if step % self.every:
      return False
    self.record(step, x)
    return True

  def record(self, step: Any, x: Any) -> MonitorRecord:
    """Records ``x`` at ``step`` now, whatever ``every`` says; steps must increase."""
    step = _host_step(step)
    if self.records and step <= self.records[-1].step:
      raise ValueError(
          f"LossScaleMonitor: step {step} is not after the last recorded step "
          f"{self.records[-1].step}; steps must increase.")
    values = metrics_on_host(x, MonitorRecord._fields[1:], "LossScaleMonitor")
    record = MonitorRecord(  # the worst member of a stacked state
        step=step,
        loss_scale=float(np.min(values["loss_scale"])),
        skipped_steps=int(np.max(values["skipped_steps"])),
        last_finite=bool(np.all(values["last_finite"])),
        overflows_at_min=int(np.max(values["overflows_at_min"])),
    )
    self.records.append(record)
    rate = self.overflow_rate()
    if not (self.warned or self.warn_rate is None or step < self.window
            or rate is None or rate < self.warn_rate):
      self.warned = True
      warnings.warn(
          f"jaxmp: {rate:.0%} of the last {self.window} steps were skipped for "
          f"inf/nan gradients (loss scale now {record.loss_scale:g}): float16's "
          f"range is too narrow for this run. {REMEDIES}",
          RuntimeWarning, stacklevel=caller_stacklevel())
    return record

  @property
  def history(self) -> dict[str, list[Any]]:
    """The records as a dict of lists, one per field of a record (``step``, ``loss_scale`` ...)."""
    return {f: [getattr(r, f) for r in self.records] for f in MonitorRecord._fields}

  def overflow_rate(self, window: int | None = None) -> float | None:
    """The fraction of steps skipped over the last ``window`` (default: the monitor's) steps.

    Measured from the latest record (or step 0) at least ``window`` steps
    before the last one; ``None`` before the first record.
    """
    window = self.window if window is None else window
    if not self.records:
      return None
    last = self.records[-1]
    base = max((r for r in self.records[:-1] if r.step <= last.step - window),
               key=lambda r: r.step, default=None)
    base_step, base_skipped = (0, 0) if base is None else (base.step, base.skipped_steps)
    return (last.skipped_steps - base_skipped) / (last.step - base_step) if (
        last.step > base_step) else None

  def steps_since_last_skip(self) -> int | None:
    """Steps since the last skipped step (a lower bound, short by less than ``every``).

    ``None`` if no step was skipped.
    """
    if not self.records or self.records[-1].skipped_steps == 0:
      return None
    last = self.records[-1]
    return last.step - next(r.step for r in self.records
                            if r.skipped_steps == last.skipped_steps)

  def summary(self) -> str:
    """A one-line summary of the latest record, for logs."""
    if not self.records:
      return "no loss-scaling metrics recorded yet"
    last, rate, since = self.records[-1], self.overflow_rate(), self.steps_since_last_skip()
    return (
        f"step {last.step}: loss scale {last.loss_scale:g}, "
        f"{last.skipped_steps} skipped step(s), overflow rate "
        f"{'n/a' if rate is None else f'{rate:.1%}'} over {self.window} steps, "
        f"{'no skip yet' if since is None else f'{since} steps since the last skip'}")

  def plot(self, path: str | os.PathLike[str]) -> str:
    """Writes a PNG of the loss scale and the skipped steps to ``path``; returns it.

    Needs matplotlib (``pip install 'jaxmp[examples]'``); no display.
    """
    if not self.records:
      raise ValueError(
          "LossScaleMonitor.plot: nothing recorded yet. Call "
          "monitor.update(step, opt_state) after the updates first.")
    try:
      from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
      from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
          "LossScaleMonitor.plot needs matplotlib: pip install 'jaxmp[examples]'") from e
    history = self.history
    steps = np.asarray(history["step"])
    figure = Figure(figsize=(8, 5), constrained_layout=True)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.step(steps, np.maximum(history["loss_scale"], np.finfo(np.float32).tiny),
             where="post", color="tab:blue")
    top.set(ylabel="loss scale", title="Loss scaling")
    top.set_yscale("log", base=2)
    bottom.bar(steps, np.diff(history["skipped_steps"], prepend=0),
               width=-0.9 * np.maximum(np.diff(steps, prepend=0), 1),
               align="edge", color="tab:red")
    bottom.set(ylabel="skipped steps\nper interval", xlabel="step")
    for axes in (top, bottom):
      axes.grid(True, alpha=0.3)
    figure.savefig(os.fspath(path), format="png", dpi=100)
    return os.fspath(path)

  def __repr__(self) -> str:
    return (f"LossScaleMonitor(every={self.every}, window={self.window}, "
            f"warn_rate={self.warn_rate}, records={len(self.records)})")


def _host_step(step: Any) -> int:
  """``step`` as a Python int; a stacked step must agree across members."""
  if isinstance(step, (jax.Array, np.ndarray)):
    step = np.asarray(jax.device_get(step))
    if step.ndim and step.size and np.all(step == step.flat[0]):
      step = step.flat[0]  # a pmap-replicated step count
  return check_number("LossScaleMonitor", "step", step, integer=True, minimum=0,
                      advice="Pass the number of updates done so far, e.g. state.step.")
