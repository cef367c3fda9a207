"""Records the PyTorch and DeepSpeed behaviour that the migration tests compare with.

The tests of ``jaxmp.from_torch_grad_scaler`` and ``jaxmp.from_deepspeed_config``
compare jaxmp with the real libraries. So that ``make test`` needs neither
(PyTorch alone is several GB), what the libraries do is recorded here, once,
into two JSON files next to this script:

* ``torch_grad_scaler.json``: ``GradScaler``'s defaults, the scale and growth
  tracker after each step of PyTorch's update kernel
  (``torch._amp_update_scale_``, what ``GradScaler.update`` runs) for a set
  of configurations and overflow sequences, and one run of a real
  ``torch.amp.GradScaler`` driven through ``scale``/``step``/``update``;
* ``deepspeed.json``: the keys and defaults of DeepSpeed's ``fp16``/``bf16``
  config models, its gradient-clipping default, what ``DeepSpeedConfig``
  makes of a list of probe configs (accepted with which values, or refused),
  and the scale, hysteresis and "already at minimum" errors of DeepSpeed's
  ``DynamicLossScaler`` step by step.

The inputs (configurations and overflow sequences) are fixed in this script
and written into the files with the results and the versions used, so the
tests read everything from the files. Regenerate them after upgrading the
oracles, with the ``oracle`` extra installed (PyTorch's CPU wheel is enough;
DeepSpeed runs on the CPU with ``DS_BUILD_OPS=0``)::

    pip install -e ".[oracle]"
    python tests/data/make_oracle_fixtures.py                # both files
    python tests/data/make_oracle_fixtures.py --only torch   # one of them

When torch (or deepspeed) is importable, the tests also rerun these recorders
and check that the library still gives what the file holds.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import pathlib
import platform
import socket
import sys
import tempfile
from typing import Any

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent
TORCH_FIXTURE = DATA / "torch_grad_scaler.json"
DEEPSPEED_FIXTURE = DATA / "deepspeed.json"


def overflow_sequences(seed: int, count: int, steps: int) -> list[str]:
  """Overflow flags as strings of 0/1, with rates from rare to almost always."""
  rng = np.random.default_rng(seed)
  rates = np.linspace(0.02, 0.95, count)
  flags = rng.random((count, steps)) < rates[:, None]
  return ["".join("1" if f else "0" for f in row) for row in flags]


# ---------------------------------------------------------------------------
# PyTorch.

TORCH_CONFIGS = [
    dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
    dict(init_scale=1126.4, growth_factor=1.1, backoff_factor=0.1, growth_interval=1),
    dict(init_scale=3.0, growth_factor=1.0001, backoff_factor=1 / 3, growth_interval=2),
    dict(init_scale=7.5e30, growth_factor=10.0, backoff_factor=0.9, growth_interval=1),
    dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=0),
    dict(init_scale=1e-3, growth_factor=1.5, backoff_factor=0.25, growth_interval=7),
    dict(init_scale=65536.0, growth_factor=3.0, backoff_factor=0.9, growth_interval=-1),
    dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000),
]
TORCH_SEQUENCES = dict(count=6, steps=60)
# Runs that the tests and the docs quote, by name.
TORCH_EXAMPLES = {
    "backoff by 0.1, rounded once": (
        dict(init_scale=1126.4, growth_factor=2.0, backoff_factor=0.1, growth_interval=2000),
        "1"),
    "growth by 1.1, rounded once": (
        dict(init_scale=3.0, growth_factor=1.1, backoff_factor=0.5, growth_interval=1),
        "0"),
    "the migration guide's example": (
        dict(init_scale=1126.4, growth_factor=1.1, backoff_factor=0.1, growth_interval=2),
        "10000"),
}
GRAD_SCALER_RUN = dict(
    config=dict(init_scale=8.0, growth_factor=1.5, backoff_factor=0.25, growth_interval=2),
    overflows="0010001100" "0100000101",
)


def torch_update_kernel(config: dict[str, Any], overflows: str) -> dict[str, list]:
  """Scale and growth tracker after each step of ``torch._amp_update_scale_``."""
  import torch  # pylint: disable=g-import-not-at-top

  scale = torch.full((1,), config["init_scale"], dtype=torch.float32)
  tracker = torch.zeros((1,), dtype=torch.int32)
  scales, trackers = [], []
  for flag in overflows:
    found_inf = torch.full((1,), float(flag == "1"), dtype=torch.float32)
    torch._amp_update_scale_(  # pylint: disable=protected-access
        scale, tracker, found_inf, config["growth_factor"],
        config["backoff_factor"], config["growth_interval"])
    scales.append(float(scale.item()))
    trackers.append(int(tracker.item()))
  return {"scales": scales, "growth_trackers": trackers}


def torch_grad_scaler_object(config: dict[str, Any], overflows: str) -> dict[str, list]:
  """``torch.amp.GradScaler`` on the CPU, through its public step and update."""
  import torch  # pylint: disable=g-import-not-at-top

  param = torch.nn.Parameter(torch.ones(2))
  optimizer = torch.optim.SGD([param], lr=0.0)
  scaler = torch.amp.GradScaler("cpu", **config)
  scales, trackers = [], []
  for flag in overflows:
    optimizer.zero_grad()
    loss = (param * (float("inf") if flag == "1" else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    scales.append(float(scaler.get_scale()))
    trackers.append(int(scaler.state_dict()["_growth_tracker"]))
  return {"scales": scales, "growth_trackers": trackers}


def torch_fixture() -> dict[str, Any]:
  import torch  # pylint: disable=g-import-not-at-top

  signature = inspect.signature(torch.amp.GradScaler.__init__)
  defaults = {
      name: signature.parameters[name].default
      for name in ("init_scale", "growth_factor", "backoff_factor",
                   "growth_interval", "enabled")
  }
  runs = []
  for i, config in enumerate(TORCH_CONFIGS):
    for overflows in overflow_sequences(i, **TORCH_SEQUENCES):
      runs.append({"config": config, "overflows": overflows,
                   **torch_update_kernel(config, overflows)})
  run = GRAD_SCALER_RUN
  return {
      "versions": _versions(torch=torch.__version__),
      "grad_scaler_defaults": defaults,
      "examples": {
          name: {"config": config, "overflows": overflows,
                 **torch_update_kernel(config, overflows)}
          for name, (config, overflows) in TORCH_EXAMPLES.items()},
      "update_kernel_runs": runs,
      "grad_scaler_object_run": {
          **run, **torch_grad_scaler_object(run["config"], run["overflows"])},
  }


# ---------------------------------------------------------------------------
# DeepSpeed.

# (initial_scale_power, loss_scale_window, min_loss_scale, hysteresis,
#  consecutive_hysteresis) of DynamicLossScaler runs.
DEEPSPEED_SCALERS = [
    (3, 3, 1.0, 1, False),
    (16, 1000, 1.0, 2, False),
    (2, 1000, 1.0, 2, False),
    (4, 2, 1.0, 2, True),
    (-2, 1, 2.0**-3, 1, False),
    (-2, 5, 1e-5, 3, False),
    (0, 3, 0.25, 4, True),
    (10, 8, 3.0, 2, False),
    (20, 1, 0.1, 1, True),
    (5, 2, 1.0, 3, True),
    (1, 1000, 1.0, 1, False),
    (12, 5, 1.0, 4, False),
]
DEEPSPEED_SEQUENCES = dict(count=4, steps=80)
# Runs that the tests and the docs quote, by name.
DEEPSPEED_EXAMPLES = {
    "growth one step after the window": ((3, 3, 1.0, 1, False), "000000010000"),
    "raises at the minimum": ((1, 1000, 1.0, 2, False), "1111"),
    "raises after the budget and two halvings": ((2, 1000, 1.0, 2, False), "101101"),
}

# Probe configs for DeepSpeedConfig: (id, config dict or JSON text). Every
# config carries the batch size that DeepSpeedConfig needs; jaxmp ignores it.
_BATCH = {"train_micro_batch_size_per_gpu": 1}
_BATCH_TEXT = '"train_micro_batch_size_per_gpu": 1'
DEEPSPEED_PROBES: list[tuple[str, Any]] = [
    ("fp16 defaults", {**_BATCH, "fp16": {"enabled": True}}),
    ("fp16 every loss-scale key", {**_BATCH, "fp16": {
        "enabled": True, "loss_scale": 0, "initial_scale_power": 12,
        "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True,
        "min_loss_scale": 2}}),
    ("fp16 auto values", {**_BATCH, "fp16": {
        "enabled": True, "loss_scale": "auto", "initial_scale_power": "auto",
        "loss_scale_window": "auto", "hysteresis": "auto",
        "consecutive_hysteresis": "auto", "min_loss_scale": "auto"}}),
    ("fp16 static scale", {**_BATCH, "fp16": {"enabled": True, "loss_scale": 128}}),
    ("fp16 enabled auto", {**_BATCH, "fp16": {"enabled": "auto"}}),
    ("fp16 disabled", {**_BATCH, "fp16": {"enabled": False, "initial_scale_power": 8}}),
    ("fp16 known keys jaxmp does not map", {**_BATCH, "fp16": {
        "enabled": True, "auto_cast": False}}),
    ("bf16", {**_BATCH, "bf16": {"enabled": True}}),
    ("bfloat16, the older name", {**_BATCH, "bfloat16": {"enabled": True}}),
    ("bf16 wins over bfloat16", {**_BATCH, "bf16": {"enabled": False},
                                 "bfloat16": {"enabled": True}}),
    ("bf16 known keys jaxmp does not map", {**_BATCH, "bf16": {
        "enabled": True, "immediate_grad_update": False, "check_grad_overflow": True}}),
    ("no precision block", dict(_BATCH)),
    ("fp16 and bf16 both enabled", {**_BATCH, "fp16": {"enabled": True},
                                    "bf16": {"enabled": True}}),
    ("fp16 misspelt key", {**_BATCH, "fp16": {"enabled": True, "initial_scale_pwr": 12}}),
    ("fp16 misspelt key while disabled", {**_BATCH, "fp16": {
        "enabled": False, "loss_scael": 0}}),
    ("bf16 misspelt enabled", {**_BATCH, "bf16": {"enabeld": True}}),
    ("fp16 not an object", {**_BATCH, "fp16": True}),
    ("fp16 negative loss_scale", {**_BATCH, "fp16": {"enabled": True, "loss_scale": -1}}),
    ("fp16 loss_scale_window 0", {**_BATCH, "fp16": {"enabled": True, "loss_scale_window": 0}}),
    ("fp16 min_loss_scale 0", {**_BATCH, "fp16": {"enabled": True, "min_loss_scale": 0}}),
    ("fp16 fractional initial_scale_power", {**_BATCH, "fp16": {
        "enabled": True, "initial_scale_power": 12.5}}),
    ("fp16 fractional min_loss_scale", {**_BATCH, "fp16": {
        "enabled": True, "min_loss_scale": 0.25}}),
    ("fp16 hysteresis 0", {**_BATCH, "fp16": {"enabled": True, "hysteresis": 0}}),
    ("fp16 hysteresis true", {**_BATCH, "fp16": {"enabled": True, "hysteresis": True}}),
    ("fp16 quoted number", {**_BATCH, "fp16": {"enabled": True, "initial_scale_power": "12"}}),
    ("fp16 enabled yes", {**_BATCH, "fp16": {"enabled": "yes"}}),
    ("fp16 initial_scale_power 200", {**_BATCH, "fp16": {
        "enabled": True, "initial_scale_power": 200}}),
    ("text: duplicate fp16 block",
     "{" + _BATCH_TEXT + ', "fp16": {"enabled": true}, "fp16": {"enabled": false}}'),
    ("text: duplicate key inside fp16",
     "{" + _BATCH_TEXT + ', "fp16": {"enabled": true, "enabled": false}}'),
    ("text: comments and trailing commas",
     "{\n  // fp16 on\n  " + _BATCH_TEXT + ',\n  "fp16": {"enabled": true, '
     '/* dynamic */ "loss_scale": 0,},\n}'),
    ("text: byte-order mark", "\ufeff{" + _BATCH_TEXT + ', "bf16": {"enabled": true}}'),
    ("text: NaN loss_scale", "{" + _BATCH_TEXT + ', "fp16": {"enabled": true, "loss_scale": NaN}}'),
]


def _init_deepspeed():
  """Imports deepspeed and sets up its one-process group (gloo, on loopback)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
    os.environ.setdefault(key, value)
  import deepspeed  # pylint: disable=g-import-not-at-top
  import deepspeed.comm  # pylint: disable=g-import-not-at-top

  if not deepspeed.comm.is_initialized():
    deepspeed.init_distributed(dist_backend="gloo")
  return deepspeed


def deepspeed_scaler(scaler_config: tuple, overflows: str) -> dict[str, Any]:
  """DeepSpeed's DynamicLossScaler, step by step.

  ``raises`` marks with 1 the steps on which DeepSpeed raises "Current loss
  scale already at minimum": each step is first tried on a copy that raises
  there, then taken on a scaler that does not, so the run goes on.
  """
  _init_deepspeed()
  from deepspeed.runtime.fp16 import loss_scaler  # pylint: disable=g-import-not-at-top

  power, window, min_scale, hysteresis, consecutive = scaler_config
  args = {
      loss_scaler.INITIAL_LOSS_SCALE: 2.0**power,
      loss_scaler.SCALE_WINDOW: window,
      loss_scaler.MIN_LOSS_SCALE: min_scale,
      loss_scaler.DELAYED_SHIFT: hysteresis,
      loss_scaler.CONSECUTIVE_HYSTERESIS: consecutive,
  }
  scaler = loss_scaler.DynamicLossScaler(**args, raise_error_at_min_scale=False)
  scales, hysteresis_left, raises = [], [], []
  for flag in overflows:
    trial = copy.deepcopy(scaler)
    trial.raise_error_at_min_scale = True
    try:
      trial.update_scale(flag == "1")
      raised = "0"
    except Exception as e:  # pylint: disable=broad-except
      if "already at minimum" not in str(e):
        raise
      raised = "1"
    scaler.update_scale(flag == "1")
    scales.append(float(scaler.cur_scale))
    hysteresis_left.append(int(scaler.cur_hysteresis))
    raises.append(raised)
  return {"scales": scales, "hysteresis_left": hysteresis_left,
          "raises": "".join(raises)}


def deepspeed_verdict(config: Any) -> dict[str, Any]:
  """What ``DeepSpeedConfig`` makes of a config dict or JSON text."""
  _init_deepspeed()
  from deepspeed.runtime.config import DeepSpeedConfig  # pylint: disable=g-import-not-at-top

  path = None
  try:
    if isinstance(config, str):
      with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False,
                                       encoding="utf-8") as f:
        f.write(config)
        path = f.name
    parsed = DeepSpeedConfig(path or copy.deepcopy(config))
  except Exception as e:  # pylint: disable=broad-except
    message = " ".join(str(e).split())
    return {"accepted": False, "error": f"{type(e).__name__}: {message}"[:300]}
  finally:
    if path:
      os.unlink(path)
  fp16 = parsed.float16_config
  return {
      "accepted": True,
      "fp16_enabled": fp16.enabled,
      "bf16_enabled": parsed.bfloat16_config.enabled,
      "loss_scale": fp16.loss_scale,
      "dynamic_loss_scale_args": fp16.dynamic_loss_scale_args(),
  }


def deepspeed_fixture() -> dict[str, Any]:
  deepspeed = _init_deepspeed()
  import pydantic  # pylint: disable=g-import-not-at-top
  from deepspeed.runtime import precision_config  # pylint: disable=g-import-not-at-top
  from deepspeed.runtime.config import DeepSpeedConfig  # pylint: disable=g-import-not-at-top

  def fields(model) -> dict[str, Any]:
    return {name: field.default for name, field in model.model_fields.items()}

  def run(scaler_config: tuple, overflows: str) -> dict[str, Any]:
    power, window, min_scale, hysteresis, consecutive = scaler_config
    return {
        "config": {"initial_scale_power": power, "loss_scale_window": window,
                   "min_loss_scale": min_scale, "hysteresis": hysteresis,
                   "consecutive_hysteresis": consecutive},
        "overflows": overflows,
        **deepspeed_scaler(scaler_config, overflows),
    }

  runs = [run(scaler_config, overflows)
          for i, scaler_config in enumerate(DEEPSPEED_SCALERS)
          for overflows in overflow_sequences(100 + i, **DEEPSPEED_SEQUENCES)]
  return {
      "versions": _versions(deepspeed=deepspeed.__version__,
                            pydantic=pydantic.__version__),
      "fp16_keys": fields(precision_config.DeepSpeedFP16Config),
      "bf16_keys": fields(precision_config.DeepSpeedBF16Config),
      "extra_keys": precision_config.DeepSpeedFP16Config.model_config["extra"],
      "gradient_clipping_default": DeepSpeedConfig(dict(_BATCH)).gradient_clipping,
      "probes": [{"id": name, "config": config, **deepspeed_verdict(config)}
                 for name, config in DEEPSPEED_PROBES],
      "examples": {name: run(*example) for name, example in DEEPSPEED_EXAMPLES.items()},
      "scaler_runs": runs,
  }


# ---------------------------------------------------------------------------
# Writing.


def _versions(**libraries: str) -> dict[str, str]:
  return {"python": platform.python_version(), "numpy": np.__version__,
          **{name: str(version) for name, version in libraries.items()}}


def dumps(value: Any, indent: int = 0) -> str:
  """JSON with one line per list of scalars, so the files stay readable."""
  pad, inner = " " * indent, " " * (indent + 1)
  if isinstance(value, dict) and value:
    items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + pad + "}"
  if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
    items = [inner + dumps(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"
  if isinstance(value, float) and not math.isfinite(value):
    raise ValueError(f"not a JSON number: {value}")
  return json.dumps(value, ensure_ascii=True)


def write(path: pathlib.Path, fixture: dict[str, Any]) -> None:
  fixture = {"generated_by": "tests/data/make_oracle_fixtures.py", **fixture}
  path.write_text(dumps(fixture) + "\n", encoding="utf-8")
  print(f"wrote {path} ({path.stat().st_size} bytes)")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", choices=("torch", "deepspeed"))
  args = parser.parse_args(argv)
  if args.only in (None, "torch"):
    write(TORCH_FIXTURE, torch_fixture())
  if args.only in (None, "deepspeed"):
    write(DEEPSPEED_FIXTURE, deepspeed_fixture())
  return 0


if __name__ == "__main__":
  sys.exit(main())
