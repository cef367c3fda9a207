"""A host-side recorder of loss-scaling metrics: history, overflow rate, plots.

:class:`LossScaleMonitor` reads :func:`jaxmp.loss_scaling_metrics` every
``every`` steps (one small device-to-host transfer each time, none in
between), keeps the history, gives the overflow rate over a window and the
steps since the last skip, warns once when the overflow rate stays high, and
draws the scale and the skips into a PNG (with matplotlib, from the
``examples`` extra).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxmp._src.checks import metrics_on_host
from jaxmp._src.validation import check_number


class MonitorRecord(NamedTuple):
  """One sample of the loss-scaling metrics, on the host."""

  step: int
  loss_scale: float
  skipped_steps: int
  last_finite: bool
  overflows_at_min: int


class LossScaleMonitor:
  """Records loss-scaling metrics every ``every`` steps and summarises them.

  Feed it the optimizer state (or the dict of
  :func:`jaxmp.loss_scaling_metrics`) after every update with
  :meth:`update`; it reads from the device only when ``step`` is a multiple
  of ``every``. Because ``skipped_steps`` is cumulative, sampling loses no
  skip: the overflow rate over a window is exact at the sampled steps.

  ``step`` is the number of updates done so far (``state.step`` of a Flax
  ``TrainState`` after ``apply_gradients``); the history implicitly starts at
  step 0 with no skip.

  A stacked state (``pmap`` replicas, or several runs under ``vmap``) is
  recorded by its worst member in each field: the smallest loss scale, the
  most skipped steps and overflows at the minimum, and ``last_finite`` false
  if any member's last step was skipped.

  Args:
    every: record every this many steps (an integer >= 1).
    window: the number of steps over which :meth:`overflow_rate` is measured
      (an integer >= 1).
    warn_rate: warn once (``RuntimeWarning``) when, over a full window, at
      least this fraction of the steps was skipped (a number in (0, 1]).
      ``None`` never warns.

  Raises:
    TypeError: if an argument is not a number (or not an integer).
    ValueError: if it lies outside its range.

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
    every = check_number("LossScaleMonitor", "every", every, integer=True,
                         minimum=1, advice="100 reads the metrics every 100 steps.")
    window = check_number("LossScaleMonitor", "window", window, integer=True,
                          minimum=1, advice="1000 measures the overflow rate "
                          "over the last 1000 steps.")
    if warn_rate is not None:
      warn_rate = check_number(
          "LossScaleMonitor", "warn_rate", warn_rate, minimum=0,
          exclusive_minimum=True, maximum=1,
          advice="0.1 warns when a tenth of the steps are skipped; None never "
          "warns.")
    self.every = every
    self.window = window
    self.warn_rate = warn_rate
    self.records: list[MonitorRecord] = []
    self.warned = False

  # Recording.

  def update(self, step: Any, x: Any) -> bool:
    """Records ``x`` when ``step`` is a multiple of ``every``.

    Args:
      step: the number of updates done so far (an int or a scalar array; an
        array is read from the device; a stacked one must hold one value).
      x: an optimizer state holding a :func:`jaxmp.loss_scaling` state, or the
        dict returned by :func:`jaxmp.loss_scaling_metrics`.

    Returns:
      Whether a record was taken.
    """
    step = _host_step(step)
    if step % self.every:
      return False
    self.record(step, x)
    return True

  def record(self, step: Any, x: Any) -> MonitorRecord:
    """Records ``x`` at ``step`` now, whatever ``every`` says; returns the record.

    Raises:
      ValueError: if ``step`` is not after the last recorded step, or ``x``
        holds no loss-scaling state (or is a metrics dict that lacks one).
      TypeError: if ``step`` is not an integer.
    """
    step = _host_step(step)
    if self.records and step <= self.records[-1].step:
      raise ValueError(
          f"LossScaleMonitor: step {step} is not after the last recorded step "
          f"{self.records[-1].step}; steps must increase."
      )
    values = metrics_on_host(x, MonitorRecord._fields[1:], "LossScaleMonitor")
    # A stacked state (pmap replicas, vmapped runs) is recorded by its worst
    # member in each field.
    record = MonitorRecord(
        step=step,
        loss_scale=float(np.min(values["loss_scale"])),
        skipped_steps=int(np.max(values["skipped_steps"])),
        last_finite=bool(np.all(values["last_finite"])),
        overflows_at_min=int(np.max(values["overflows_at_min"])),
    )
    self.records.append(record)
    self._maybe_warn()
    return record

  # Summaries.

  @property
  def history(self) -> dict[str, list[Any]]:
    """The records as a dict of lists, one per field (``step``, ``loss_scale``,
    ``skipped_steps``, ``last_finite``, ``overflows_at_min``)."""
    return {
        field: [getattr(r, field) for r in self.records]
        for field in MonitorRecord._fields
    }

  def overflow_rate(self, window: int | None = None) -> float | None:
    """The fraction of steps skipped over the last ``window`` steps.

    Measured between the last record and the latest record (or step 0) that
    lies at least ``window`` steps before it; shorter when the history is.

    Args:
      window: defaults to the monitor's ``window``.

    Returns:
      The rate, or ``None`` before the first record at a step > 0.
    """
    window = self.window if window is None else window
    if not self.records:
      return None
    last = self.records[-1]
    base_step, base_skipped = 0, 0
    for r in self.records[:-1]:
      if r.step <= last.step - window:
        base_step, base_skipped = r.step, r.skipped_steps
    if last.step <= base_step:
      return None
    return (last.skipped_steps - base_skipped) / (last.step - base_step)

  def steps_since_last_skip(self) -> int | None:
    """Steps since the last skipped step; ``None`` if no step was skipped.

    Exact when the last skip fell on a recorded step (always with
    ``every=1``); otherwise a lower bound, short by less than ``every``.
    """
    if not self.records or self.records[-1].skipped_steps == 0:
      return None
    last = self.records[-1]
    first_seen = next(
        r for r in self.records if r.skipped_steps == last.skipped_steps
    )
    return last.step - first_seen.step

  def summary(self) -> str:
    """A one-line summary of the latest record, for logs."""
    if not self.records:
      return "no loss-scaling metrics recorded yet"
    last = self.records[-1]
    rate = self.overflow_rate()
    since = self.steps_since_last_skip()
    return (
        f"step {last.step}: loss scale {last.loss_scale:g}, "
        f"{last.skipped_steps} skipped step(s), overflow rate "
        f"{'n/a' if rate is None else f'{rate:.1%}'} over {self.window} steps, "
        f"{'no skip yet' if since is None else f'{since} steps since the last skip'}"
    )

  def _maybe_warn(self) -> None:
    if self.warned or self.warn_rate is None:
      return
    last = self.records[-1]
    rate = self.overflow_rate()
    if last.step < self.window or rate is None or rate < self.warn_rate:
      return
    self.warned = True
    warnings.warn(
        f"jaxmp: {rate:.0%} of the last {self.window} steps were skipped for "
        f"inf/nan gradients (loss scale now {last.loss_scale:g}). float16's "
        "range is too narrow for this run: use the mixed_bfloat16 policy with "
        "jaxmp.NoOpLossScale() where the hardware runs bfloat16 "
        "(jaxmp.auto_policy(); `jaxmp doctor`), or start from a lower initial "
        "loss scale, lower the learning rate, or clip gradients.",
        RuntimeWarning,
        stacklevel=4,
    )

  # Plotting.

  def plot(self, path: str | os.PathLike[str]) -> str:
    """Writes a PNG of the loss scale and the skipped steps over the steps.

    Uses matplotlib's Agg renderer (no display needed); matplotlib comes with
    the ``examples`` extra (``pip install 'jaxmp[examples]'``).

    Args:
      path: where to write the PNG.

    Returns:
      The path written, as a string.

    Raises:
      ImportError: if matplotlib is not installed.
      ValueError: if nothing was recorded yet.
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
          "LossScaleMonitor.plot needs matplotlib: pip install 'jaxmp[examples]'"
      ) from e
    history = self.history
    steps = np.asarray(history["step"])
    skipped = np.asarray(history["skipped_steps"])
    per_interval = np.diff(skipped, prepend=0)
    widths = np.diff(steps, prepend=0)

    figure = Figure(figsize=(8, 5), constrained_layout=True)
    FigureCanvasAgg(figure)
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.step(steps, np.maximum(history["loss_scale"], np.finfo(np.float32).tiny),
             where="post", color="tab:blue")
    top.set_yscale("log", base=2)
    top.set_ylabel("loss scale")
    top.set_title("Loss scaling")
    top.grid(True, alpha=0.3)
    bottom.bar(steps, per_interval, width=-0.9 * np.maximum(widths, 1),
               align="edge", color="tab:red")
    bottom.set_ylabel("skipped steps\nper interval")
    bottom.set_xlabel("step")
    bottom.grid(True, alpha=0.3)
    path = os.fspath(path)
    figure.savefig(path, format="png", dpi=100)
    return path

  def __repr__(self) -> str:
    return (
        f"LossScaleMonitor(every={self.every}, window={self.window}, "
        f"warn_rate={self.warn_rate}, records={len(self.records)})"
    )


def _host_step(step: Any) -> int:
  """``step`` as a Python int; a stacked step must agree across members."""
  if isinstance(step, (jax.Array, np.ndarray)):
    step = np.asarray(jax.device_get(step))
    if step.ndim and step.size and np.all(step == step.flat[0]):
      step = step.flat[0]  # a pmap-replicated step count
  return check_number("LossScaleMonitor", "step", step, integer=True, minimum=0,
                      advice="Pass the number of updates done so far, e.g. "
                      "state.step.")
