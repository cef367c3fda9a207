"""Tests of reading DeepSpeed configs: ``jaxmp.from_deepspeed_config``.

DeepSpeed's behaviour comes from ``tests/data/deepspeed.json``, recorded from
the real DeepSpeed by ``tests/data/make_oracle_fixtures.py``: its config keys
and defaults, what it accepts and refuses, and its ``DynamicLossScaler`` step
by step. Its rule is also re-implemented here (checked against the recording),
to compare generated sequences with jaxmp's growth timing.
"""

import json
import pathlib
import re
import warnings

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from jaxmp._src.deepspeed import (
  BF16_KEYS, DEEPSPEED_FP16_DEFAULTS, FP16_KEYS, load_deepspeed_config)
from models import BLOG_CONFIG, recorder, trajectories

DATA = pathlib.Path(__file__).resolve().parent / "data"
FIXTURE = json.loads((DATA / "deepspeed.json").read_text(encoding="utf-8"))
FIELDS = ("loss_scale", "hysteresis_left", "overflows_at_min")


def _same_reading(config, expected):
  policy, loss_scale = jaxmp.from_deepspeed_config(config)
  assert policy == expected[0] and repr(loss_scale) == repr(expected[1])


# Reading configs (most precision blocks: against DeepSpeed's probes below).
def test_dict_string_bytes_bom_and_path_give_the_same(tmp_path):
  config = load_deepspeed_config(BLOG_CONFIG)  # comments inside strings are kept
  assert config["wandb"] == {"project": "https://example.org//not-a-comment",
                             "note": 'x /* y */ " // w,}', "tags": [1, 2], "d": ",]"}
  path, bom_path = tmp_path / "ds_config.json", tmp_path / "ds_config_bom.json"
  path.write_text(BLOG_CONFIG)
  bom_path.write_text(BLOG_CONFIG, encoding="utf-8-sig")
  expected = (jaxmp.get_policy("mixed_float16"), jaxmp.DynamicLossScale(
      2.0**16, period=1000, hysteresis=2, min_loss_scale=1e-5))
  for form in (config, BLOG_CONFIG, path, str(path), BLOG_CONFIG.encode(), bom_path,
               "\ufeff" + BLOG_CONFIG, ("\ufeff" + BLOG_CONFIG).encode(),
               "\ufeff" + json.dumps(config)):  # one line with a BOM: JSON, not a path
    _same_reading(form, expected)
  _same_reading({"bf16": {"enabled": False}}, (jaxmp.get_policy("float32"),
                                               jaxmp.NoOpLossScale()))


@pytest.mark.parametrize("config, warning", [
    ({"fp16": {"enabled": "auto"}},
     r'"auto" read as .*Trainer\'s defaults: fp16\.enabled as false'),
    ({"fp_16": {"enabled": True}}, r"the key 'fp_16' is not read .*Did you mean 'fp16'"),
    ({"FP16": {"enabled": True}}, r"the key 'FP16' is not read .*Did you mean 'fp16'"),
    ({"bf_16": {"enabled": True}}, r"the key 'bf_16' is not read .*Did you mean 'bf16'"),
    ({"bfloat_16": {"enabled": True}}, r"the key 'bfloat_16' .*Did you mean 'bfloat16'"),
    # Other keys are not read either, and do not warn (`jaxmp convert` notes them).
    ({"zero_optimization": {}, "fp32_allreduce": True, "train_batch_size": 8,
      "steps_per_print": 10}, None),
])
def test_a_precision_block_that_is_not_read_warns(config, warning):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    policy, _ = jaxmp.from_deepspeed_config(config)
  assert policy == jaxmp.get_policy("float32")
  messages = [str(w.message) for w in caught]
  assert messages == [] if warning is None else (
      len(messages) == 1 and re.search(warning, messages[0])), messages


# What DeepSpeed accepts and refuses, from the recording. Where jaxmp differs on
# purpose (docs/migration-deepspeed.md): what it refuses, and what it accepts.
JAXMP_REFUSES = {
    "fp16 hysteresis 0": "a hysteresis of 0 makes no sense",
    "fp16 hysteresis true": "a bool where a number belongs",
    "fp16 quoted number": "a quoted number: JSON types are read as written",
    "fp16 enabled yes": "a string where a bool belongs",
    "fp16 initial_scale_power 200": "2**200 is beyond float32",
}
JAXMP_ACCEPTS = {
    "fp16 fractional min_loss_scale": "DeepSpeed 0.19 types min_loss_scale as "
    "an integer; the scaler itself works with any positive floor",
}


def test_jaxmp_knows_the_recorded_deepspeed_s_fp16_and_bf16_keys_and_defaults():
  assert FIXTURE["generated_by"] == "tests/data/make_oracle_fixtures.py"
  assert set(FIXTURE["versions"]) >= {"deepspeed", "pydantic", "python", "numpy"}
  assert len(FIXTURE["probes"]) >= 30 and len(FIXTURE["scaler_runs"]) >= 40
  assert FIXTURE["extra_keys"] == "forbid"  # DeepSpeed refuses other keys
  assert FIXTURE["gradient_clipping_default"] == 1.0  # test_cli.py: what convert prints
  assert set(FP16_KEYS) == set(FIXTURE["fp16_keys"])
  assert set(BF16_KEYS) == set(FIXTURE["bf16_keys"])
  assert DEEPSPEED_FP16_DEFAULTS == {k: FIXTURE["fp16_keys"][k] for k in DEEPSPEED_FP16_DEFAULTS}


def _deepspeed_reading(probe):
  """What DeepSpeed read from a probe, as jaxmp's (policy, loss scale)."""
  if probe["bf16_enabled"] or not probe["fp16_enabled"]:
    preset = "mixed_bfloat16" if probe["bf16_enabled"] else "float32"
    return jaxmp.get_policy(preset), jaxmp.NoOpLossScale()
  if probe["loss_scale"] > 0:
    return jaxmp.get_policy("mixed_float16"), jaxmp.StaticLossScale(probe["loss_scale"])
  args = probe["dynamic_loss_scale_args"]
  return jaxmp.get_policy("mixed_float16"), jaxmp.DynamicLossScale(
      float(args["init_scale"]), period=args["scale_window"], hysteresis=args["delayed_shift"],
      consecutive_hysteresis=args["consecutive_hysteresis"], min_loss_scale=args["min_scale"])


def test_jaxmp_accepts_and_refuses_what_deepspeed_does():
  """Every probe: refused by both, or read by both to the same values, except
  the documented differences above, which must still be differences."""
  differs = {}
  for probe in FIXTURE["probes"]:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)  # enabled: "auto"
      try:
        ours = jaxmp.from_deepspeed_config(probe["config"])
      except ValueError:
        ours = None
    if (ours is not None) != probe["accepted"]:
      differs[probe["id"]] = probe["accepted"]
    elif ours is not None:
      assert repr(ours) == repr(_deepspeed_reading(probe)), probe["id"]
  assert differs == {**dict.fromkeys(JAXMP_REFUSES, True), **dict.fromkeys(JAXMP_ACCEPTS, False)}


# DeepSpeed's scaler: recorded, and re-implemented from `update_scale`.
class DeepSpeedScaler:
  """DeepSpeed's dynamic loss scaler in plain Python (float64 scale). It counts the steps on which
  DeepSpeed raises "already at minimum" (``raises``) and goes on; with ``jaxmp_timing`` it grows on
  the window-th clean step (jaxmp's contract), one step before DeepSpeed."""

  def __init__(self, config, jaxmp_timing=False):
    self.scale = 2.0**config["initial_scale_power"]
    self.window, self.min_scale = config["loss_scale_window"], config["min_loss_scale"]
    self.hysteresis = self.left = config["hysteresis"]
    self.consecutive = config["consecutive_hysteresis"]
    self.iteration, self.last_overflow, self.raises = 0, -1, 0
    self.offset = 0 if jaxmp_timing else 1

  def update(self, overflow):
    if overflow:
      if self.hysteresis == 1 or self.left == 1:
        self.raises += self.scale == self.min_scale
        self.scale = max(self.scale / 2.0, self.min_scale)
      else:
        self.left -= 1
      self.last_overflow = self.iteration
    else:
      if self.consecutive:
        self.left = self.hysteresis
      clean = self.iteration - self.last_overflow - self.offset
      if clean > 0 and clean % self.window == 0:
        if not self.consecutive:
          self.left = self.hysteresis
        self.scale *= 2.0
    self.iteration += 1
    return self.scale, self.left, self.raises


def _loss_scale(config):
  return jaxmp.from_deepspeed_config({"fp16": {"enabled": True, **config}})[1]


def _recorded(run):
  """DeepSpeed's (scale, hysteresis left, raises so far) after each step of a run."""
  return [(scale, left, run["raises"][: t + 1].count("1"))
          for t, (scale, left) in enumerate(zip(run["scales"], run["hysteresis_left"]))]


def _f32(state):
  return (np.float32(state[0]), *state[1:])


def _steps(loss_scale, overflows):
  """jaxmp's (scale, hysteresis left, overflows at min), ``[sequence][step]``."""
  return [list(zip(*rows)) for rows in zip(*trajectories(loss_scale, overflows, *FIELDS))]


def test_jaxmp_is_recorded_deepspeed_until_the_first_growth():
  """Step for step equal to DeepSpeed's scaler, up to jaxmp's first growth
  (from there the documented timing differs); the reference, for whole runs."""
  runs = {}
  for run in FIXTURE["scaler_runs"]:
    runs.setdefault(json.dumps(run["config"]), []).append(run)
  compared = 0
  for group in runs.values():
    config = group[0]["config"]
    ours = _steps(_loss_scale(config), [r["overflows"] for r in group])
    for b, run in enumerate(group):
      ref = DeepSpeedScaler(config)
      assert [ref.update(flag == "1") for flag in run["overflows"]] == _recorded(run), config
      previous = 2.0**config["initial_scale_power"]
      for t, (state, recorded) in enumerate(zip(ours[b], _recorded(run))):
        if state[0] > previous:
          break
        previous = state[0]
        assert state == _f32(recorded), (config, b, t)
        compared += 1
  assert compared > 1500


def test_jaxmp_grows_one_step_before_deepspeed_and_has_a_maximum():
  run = FIXTURE["examples"]["growth one step after the window"]
  (scales,) = trajectories(_loss_scale(run["config"]), [run["overflows"]], "loss_scale")
  assert run["scales"] == [8, 8, 8, 16, 16, 16, 32, 16, 16, 16, 16, 32]
  assert scales[0].tolist() == [8, 8, 16, 16, 16, 32, 32, 16, 16, 16, 32, 32]
  # DeepSpeed has no maximum; jaxmp stops at the largest float32 power of 2.
  ls = _loss_scale({"initial_scale_power": 126, "loss_scale_window": 1})
  assert trajectories(ls, ["000"], "loss_scale")[0][0].tolist() == [2.0**127] * 3


deepspeed_configs = st.fixed_dictionaries({
    "initial_scale_power": st.integers(-4, 20),
    "loss_scale_window": st.sampled_from([1, 2, 3, 5, 8, 1000]),
    "hysteresis": st.integers(1, 4),
    "consecutive_hysteresis": st.booleans(),
    "min_loss_scale": st.sampled_from([1e-5, 2.0**-3, 0.25, 1, 3, 0.1]),
})


@settings(derandomize=True, max_examples=15, deadline=None)
@given(fp16=deepspeed_configs, seed=st.integers(0, 2**16))
def test_deepspeed_hysteresis_minimum_and_raising_match_exactly(fp16, seed):
  """jaxmp == DeepSpeed's rule (with jaxmp's growth timing), step for step:
  the scale, the hysteresis budget and the count of the overflows on which
  DeepSpeed raises "Current loss scale already at minimum"."""
  fp16["min_loss_scale"] = min(fp16["min_loss_scale"], 2.0**fp16["initial_scale_power"])
  overflows = recorder().overflow_sequences(seed, 16, 80)
  ours = _steps(_loss_scale(fp16), overflows)
  for b, sequence in enumerate(overflows):
    ref = DeepSpeedScaler(fp16, jaxmp_timing=True)
    for t, flag in enumerate(sequence):
      assert ours[b][t] == _f32(ref.update(flag == "1")), (b, sequence[: t + 1])


def test_check_loss_scale_raises_where_deepspeed_raises():
  for name in ("raises after the budget and two halvings", "raises at the minimum"):
    run = FIXTURE["examples"][name]
    ls = _loss_scale(run["config"])
    for flag, raises in zip(run["overflows"], run["raises"]):
      ls = ls.adjust(jnp.array(flag == "0"))
      if raises == "1":
        break
      jaxmp.check_loss_scale(ls)  # not before DeepSpeed raises
    with pytest.raises(jaxmp.LossScaleAtMinimumError, match="already at minimum"):
      jaxmp.check_loss_scale(ls)
  assert FIXTURE["examples"]["raises after the budget and two halvings"]["raises"] == "000001"


def test_live_deepspeed_still_gives_the_recording():
  deepspeed = pytest.importorskip("deepspeed")
  for run in FIXTURE["scaler_runs"][::7]:
    live = recorder().deepspeed_scaler(tuple(run["config"].values()), run["overflows"])
    assert live == {k: run[k] for k in live}, (deepspeed.__version__, run["config"])
  for probe in FIXTURE["probes"]:
    live = recorder().deepspeed_verdict(probe["config"])
    assert live["accepted"] == probe["accepted"], probe["id"]


# The Hugging Face Trainer's arguments fill in "auto", as the Trainer does
# (its DeepSpeed integration); `jaxmp convert` is tested in test_cli.py.
HF_BF16 = DATA / "ds_config_zero2_bf16.json"  # "auto" everywhere
HF_ARGS = DATA / "hf_training_args.json"  # TrainingArguments.to_json_string()
BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True}}


def test_a_trainer_flag_that_is_not_read_warns_by_name():
  with pytest.warns(UserWarning, match=r"--output_dir, --do_train not read"):
    policy, _ = jaxmp.from_deepspeed_config(
        {}, training_args=["--output_dir", "out", "--bf16", "--do_train"])
  assert policy == jaxmp.get_policy("mixed_bfloat16")


# The command line and the dict are read by one parser: the same arguments
# give the same result (and the same refusal: see the bad-input catalogue).
@pytest.mark.parametrize("config, training_args, same_as", [
    # Every form of the Trainer's arguments resolves a config of "auto"s.
    (HF_BF16, json.loads(HF_ARGS.read_text(encoding="utf-8")), BF16),
    (HF_BF16, HF_ARGS.read_text(encoding="utf-8"), BF16),
    (HF_BF16, HF_ARGS, BF16),
    (HF_BF16, ["--bf16", "--learning_rate", "2e-4", "--max_grad_norm=1.0"], BF16),
    ({}, ["--bf16"], BF16),  # the Trainer adds the block
    ({}, {"fp16": True}, FP16),
    ({"fp16": {"enabled": "auto"}}, ["--fp16_full_eval"], FP16),
    ({"fp16": {"enabled": "auto"}}, {"fp16_full_eval": True}, FP16),
    ({"bf16": {"enabled": "auto"}}, ["--bf16-full-eval", "true"], BF16),
    ({"bf16": {"enabled": "auto"}}, {"bf16_full_eval": True}, BF16),
    # The config's loss scale is kept.
    ({"fp16": {"enabled": "auto", "initial_scale_power": 8, "hysteresis": 3}},
     {"fp16": True, "gradient_accumulation_steps": 4},
     {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 3}}),
    (HF_BF16, {}, {}),  # the Trainer's default: neither fp16 nor bf16
    # Values that agree with the Trainer's are accepted as they are.
    ({**BF16, "gradient_clipping": 1.0, "gradient_accumulation_steps": 4}, HF_ARGS, BF16),
])
def test_the_trainer_s_arguments_fill_in_the_config(config, training_args, same_as):
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # every "auto" is resolved: no warning
    reading = jaxmp.from_deepspeed_config(config, training_args=training_args)
  _same_reading(same_as, reading)
