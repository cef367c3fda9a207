"""Tests of reading DeepSpeed configs: ``jaxmp.from_deepspeed_config``.

DeepSpeed's behaviour comes from ``tests/data/deepspeed.json``, recorded from
the real DeepSpeed by ``tests/data/make_oracle_fixtures.py`` (its versions are
in the file): its config keys and defaults, what it accepts and refuses, and
its ``DynamicLossScaler`` step by step. DeepSpeed's rule is also
re-implemented here in plain Python (checked against the recording), so that
generated sequences can be compared with jaxmp's growth timing.
"""

import importlib.util
import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from jaxmp._src.deepspeed import (
  BF16_KEYS,
  DEEPSPEED_FP16_DEFAULTS,
  FP16_KEYS,
  load_deepspeed_config,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"
FIXTURE = json.loads((DATA / "deepspeed.json").read_text(encoding="utf-8"))

BLOG_CONFIG = """\
{
  // Mixed precision: fp16 with dynamic loss scaling.
  "fp16": {
    "enabled": true,
    "loss_scale": 0,            // 0 means dynamic
    "loss_scale_window": 1000,  // grow after 1000 clean steps
    "initial_scale_power": 16,  // start at 2**16 = 65536
    "hysteresis": 2,            /* tolerate one overflow before backing off */
    "min_loss_scale": 1e-5,
  },
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
  },
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "wandb": {"project": "https://example.org//not-a-comment", /* multi
            line */ "note": "x /* y */ \\" // w,}", "tags": [1, 2,], "d": ",]"},
}
"""


# ---------------------------------------------------------------------------
# Reading DeepSpeed configs.


def test_dict_string_bytes_bom_and_path_give_the_same(tmp_path):
  config = load_deepspeed_config(BLOG_CONFIG)  # comments inside strings are kept
  assert config["wandb"] == {"project": "https://example.org//not-a-comment",
                             "note": 'x /* y */ " // w,}', "tags": [1, 2], "d": ",]"}
  path = tmp_path / "ds_config.json"
  path.write_text(BLOG_CONFIG)
  bom_path = tmp_path / "ds_config_bom.json"
  bom_path.write_text(BLOG_CONFIG, encoding="utf-8-sig")
  expected = jaxmp.from_deepspeed_config(config)
  for form in (BLOG_CONFIG, path, str(path), BLOG_CONFIG.encode(), "\ufeff" + BLOG_CONFIG,
               ("\ufeff" + BLOG_CONFIG).encode(), bom_path,
               "\ufeff" + json.dumps(config)):  # one line with a BOM: JSON, not a path
    policy, loss_scale = jaxmp.from_deepspeed_config(form)
    assert policy == expected[0] and repr(loss_scale) == repr(expected[1])


ALL_AUTO = dict.fromkeys(DEEPSPEED_FP16_DEFAULTS, "auto")


@pytest.mark.parametrize("config, preset, loss_scale", [
    (BLOG_CONFIG, "mixed_float16",
     jaxmp.DynamicLossScale(2.0**16, period=1000, hysteresis=2, min_loss_scale=1e-5)),
    # DeepSpeed's defaults, where absent or "auto".
    ({"fp16": {"enabled": True}}, "mixed_float16",
     jaxmp.DynamicLossScale(2.0**16, period=1000, hysteresis=2, min_loss_scale=1.0)),
    ({"fp16": {**ALL_AUTO, "enabled": True}}, "mixed_float16",
     jaxmp.DynamicLossScale(2.0**16, period=1000, hysteresis=2, min_loss_scale=1.0)),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": True, "hysteresis": 4}},
     "mixed_float16", jaxmp.DynamicLossScale(2.0**16, period=1000, hysteresis=4,
                                             consecutive_hysteresis=True)),
    ({"fp16": {"enabled": True, "loss_scale": 128}}, "mixed_float16",
     jaxmp.StaticLossScale(128.0)),
    ({"bf16": {"enabled": True}}, "mixed_bfloat16", jaxmp.NoOpLossScale()),
    ({"bfloat16": {"enabled": True}}, "mixed_bfloat16", jaxmp.NoOpLossScale()),
    ({}, "float32", jaxmp.NoOpLossScale()),
    ({"fp16": {"enabled": False}}, "float32", jaxmp.NoOpLossScale()),
    ({"bf16": {"enabled": False}}, "float32", jaxmp.NoOpLossScale()),
])
def test_the_precision_blocks_give_the_policy_and_loss_scale(config, preset, loss_scale):
  policy, ours = jaxmp.from_deepspeed_config(config)
  assert policy == jaxmp.get_policy(preset)
  assert repr(ours) == repr(loss_scale)


@pytest.mark.parametrize("config, warning", [
    ({"fp16": {"enabled": "auto"}}, r'"auto" read as .*Trainer\'s defaults: fp16\.enabled as false'),
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


# ---------------------------------------------------------------------------
# What DeepSpeed accepts and refuses, from the recording.

# Where jaxmp and DeepSpeed differ on purpose (docs/migration-deepspeed.md):
# configs DeepSpeed accepts that jaxmp refuses, and the other way round.
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
  assert set(FP16_KEYS) == set(FIXTURE["fp16_keys"])
  assert set(BF16_KEYS) == set(FIXTURE["bf16_keys"])
  recorded = {k: FIXTURE["fp16_keys"][k] for k in DEEPSPEED_FP16_DEFAULTS}
  assert DEEPSPEED_FP16_DEFAULTS == recorded


def _jaxmp_verdict(config):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)  # enabled: "auto"
    try:
      return jaxmp.from_deepspeed_config(config)
    except ValueError:
      return None


def _same_as_deepspeed(probe, policy, loss_scale):
  if probe["bf16_enabled"]:
    return policy == jaxmp.get_policy("mixed_bfloat16") and isinstance(
        loss_scale, jaxmp.NoOpLossScale)
  if not probe["fp16_enabled"]:
    return policy == jaxmp.get_policy("float32") and isinstance(
        loss_scale, jaxmp.NoOpLossScale)
  if policy != jaxmp.get_policy("mixed_float16"):
    return False
  if probe["loss_scale"] > 0:
    return isinstance(loss_scale, jaxmp.StaticLossScale) and float(
        loss_scale.loss_scale) == probe["loss_scale"]
  args = probe["dynamic_loss_scale_args"]
  return isinstance(loss_scale, jaxmp.DynamicLossScale) and (
      float(loss_scale.loss_scale), loss_scale.period, loss_scale.hysteresis,
      loss_scale.consecutive_hysteresis, loss_scale.min_loss_scale,
  ) == (args["init_scale"], args["scale_window"], args["delayed_shift"],
        args["consecutive_hysteresis"], args["min_scale"])


def test_jaxmp_accepts_and_refuses_what_deepspeed_does():
  """Every probe: refused by both, or read by both to the same values.

  The exceptions are the documented differences above, and those must still
  be differences (a new recording that closes one fails here).
  """
  refuses, accepts = set(), set()
  for probe in FIXTURE["probes"]:
    ours = _jaxmp_verdict(probe["config"])
    if not probe["accepted"]:
      if ours is not None:
        accepts.add(probe["id"])
    elif ours is None:
      refuses.add(probe["id"])
    else:
      assert _same_as_deepspeed(probe, *ours), probe["id"]
  assert refuses == set(JAXMP_REFUSES)
  assert accepts == set(JAXMP_ACCEPTS)


# ---------------------------------------------------------------------------
# DeepSpeed's scaler: recorded, and re-implemented from `update_scale`.


class DeepSpeedScaler:
  """DeepSpeed's dynamic loss scaler, in plain Python (float64 scale).

  Instead of raising "Current loss scale already at minimum", it counts the
  steps on which DeepSpeed would raise (``raises``) and goes on as DeepSpeed
  does with ``raise_error_at_min_scale=False``. With ``jaxmp_timing`` the
  growth test counts one step fewer (growth on the window-th clean step,
  jaxmp's contract); everything else stays DeepSpeed's.
  """

  def __init__(self, init_scale, window, min_scale, hysteresis, consecutive,
               jaxmp_timing=False):
    self.scale = float(init_scale)
    self.window = window
    self.min_scale = min_scale
    self.hysteresis = hysteresis
    self.left = hysteresis
    self.consecutive = consecutive
    self.iteration = 0
    self.last_overflow = -1
    self.raises = 0
    self.offset = 0 if jaxmp_timing else 1

  def update(self, overflow):
    if overflow:
      if self.hysteresis == 1 or self.left == 1:
        if self.scale == self.min_scale:
          self.raises += 1
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


def _reference(config, jaxmp_timing=False):
  return DeepSpeedScaler(2.0**config["initial_scale_power"], config["loss_scale_window"],
                         config["min_loss_scale"], config["hysteresis"],
                         config["consecutive_hysteresis"], jaxmp_timing=jaxmp_timing)


def test_the_reference_is_deepspeed_s_recorded_scaler():
  for run in FIXTURE["scaler_runs"]:
    ref = _reference(run["config"])
    raises = 0
    for t, flag in enumerate(run["overflows"]):
      ref.update(flag == "1")
      raises += run["raises"][t] == "1"
      state = (ref.scale, ref.left, ref.raises)
      assert state == (run["scales"][t], run["hysteresis_left"][t], raises), (
          run["config"], t)


def test_the_documented_differences_from_deepspeed_s_scaler():
  # jaxmp grows on the window-th clean step, DeepSpeed one step later.
  _, ls = jaxmp.from_deepspeed_config(
      {"fp16": {"enabled": True, "initial_scale_power": 3, "loss_scale_window": 3,
                "hysteresis": 1}})
  ref = DeepSpeedScaler(8.0, 3, 1.0, 1, False)
  jaxmp_scales, ds_scales = [], []
  for overflow in [True] + [False] * 4:
    ls = ls.adjust(jnp.array(not overflow))
    ref.update(overflow)
    jaxmp_scales.append(float(ls.loss_scale))
    ds_scales.append(ref.scale)
  assert jaxmp_scales == [4, 4, 4, 8, 8]
  assert ds_scales == [4, 4, 4, 4, 8]
  # DeepSpeed has no maximum; jaxmp stops at the largest float32 power of 2.
  _, ls = jaxmp.from_deepspeed_config(
      {"fp16": {"enabled": True, "initial_scale_power": 126, "loss_scale_window": 1}})
  for _ in range(3):
    ls = ls.adjust(jnp.array(True))
  assert float(ls.loss_scale) == 2.0**127


@jax.jit
def _run_trajectories(loss_scale, finite_flags):
  """Per-step (scale, hysteresis left, overflows at min) for flags[batch, steps].

  The static configuration is part of the pytree structure, so jit compiles
  once per configuration.
  """

  def step(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.hysteresis_left, ls.overflows_at_min)

  return jax.vmap(lambda flags: jax.lax.scan(step, loss_scale, flags)[1])(finite_flags)


def _trajectories(loss_scale, overflows):
  out = _run_trajectories(loss_scale, jnp.asarray(~overflows))
  return [np.asarray(x) for x in out]


def _flags(strings):
  return np.array([[c == "1" for c in s] for s in strings])


def _loss_scale(config):
  _, loss_scale = jaxmp.from_deepspeed_config({"fp16": {"enabled": True, **config}})
  return loss_scale


def test_jaxmp_is_recorded_deepspeed_until_the_first_growth():
  """Step for step equal to DeepSpeed's scaler, up to jaxmp's first growth.

  From there the documented timing differs (see the reference above), and
  the recording spans whole runs for windows longer than the run.
  """
  runs = {}
  for run in FIXTURE["scaler_runs"]:
    runs.setdefault(json.dumps(run["config"]), []).append(run)
  compared = 0
  for group in runs.values():
    config = group[0]["config"]
    scales, lefts, at_min = _trajectories(
        _loss_scale(config), _flags([run["overflows"] for run in group]))
    for b, run in enumerate(group):
      raises = 0
      previous = 2.0**config["initial_scale_power"]
      for t in range(len(run["overflows"])):
        if scales[b, t] > previous:
          break
        previous = scales[b, t]
        raises += run["raises"][t] == "1"
        expected = (np.float32(run["scales"][t]), run["hysteresis_left"][t], raises)
        assert (scales[b, t], lefts[b, t], at_min[b, t]) == expected, (config, b, t)
        compared += 1
  assert compared > 1500


def _sequences(seed, batch, steps):
  """Overflow flags[batch, steps]: rates from rare to almost always."""
  rng = np.random.default_rng(seed)
  rates = np.linspace(0.02, 0.95, batch)
  return rng.random((batch, steps)) < rates[:, None]


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
  """jaxmp == DeepSpeed's rule (with jaxmp's growth timing), step for step.

  The scale, the hysteresis budget and the count of the overflows on which
  DeepSpeed raises "Current loss scale already at minimum" all agree (with a
  window of 1000, nothing grows, and the timing plays no part).
  """
  if fp16["min_loss_scale"] > 2.0**fp16["initial_scale_power"]:
    fp16 = {**fp16, "min_loss_scale": 2.0**fp16["initial_scale_power"]}
  overflows = _sequences(seed, batch=16, steps=80)
  scales, lefts, at_min = _trajectories(_loss_scale(fp16), overflows)
  for b, sequence in enumerate(overflows):
    ref = _reference(fp16, jaxmp_timing=True)
    for t, overflow in enumerate(sequence):
      ref.update(bool(overflow))
      state = (scales[b, t], lefts[b, t], at_min[b, t])
      expected = (np.float32(ref.scale), ref.left, ref.raises)
      assert state == expected, (b, t, sequence[: t + 1].astype(int).tolist())


def test_check_loss_scale_raises_where_deepspeed_raises():
  # 4 (budget used), clean, 4 -> 2, 2 -> 1, clean, then the overflow at 1
  # raises in DeepSpeed; check_loss_scale raises there, and not before.
  for name in ("raises after the budget and two halvings", "raises at the minimum"):
    run = FIXTURE["examples"][name]
    ls = _loss_scale(run["config"])
    for flag, raises in zip(run["overflows"], run["raises"]):
      ls = ls.adjust(jnp.array(flag == "0"))
      if raises == "1":
        break
      jaxmp.check_loss_scale(ls)
    with pytest.raises(jaxmp.LossScaleAtMinimumError, match="already at minimum"):
      jaxmp.check_loss_scale(ls)
  assert FIXTURE["examples"]["raises after the budget and two halvings"]["raises"] == "000001"


# ---------------------------------------------------------------------------
# Live: the recording still holds, where deepspeed is installed.


def _recorder():
  spec = importlib.util.spec_from_file_location(
      "make_oracle_fixtures", DATA / "make_oracle_fixtures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_live_deepspeed_still_gives_the_recording():
  deepspeed = pytest.importorskip("deepspeed")
  recorder = _recorder()
  for run in FIXTURE["scaler_runs"][::7]:
    config = tuple(run["config"][k] for k in (
        "initial_scale_power", "loss_scale_window", "min_loss_scale", "hysteresis",
        "consecutive_hysteresis"))
    live = recorder.deepspeed_scaler(config, run["overflows"])
    assert live == {k: run[k] for k in live}, (deepspeed.__version__, run["config"])
  for probe in FIXTURE["probes"]:
    live = recorder.deepspeed_verdict(probe["config"])
    assert live["accepted"] == probe["accepted"], probe["id"]


# ---------------------------------------------------------------------------
# The Hugging Face Trainer's arguments fill in "auto", as the Trainer does
# (its DeepSpeed integration); `jaxmp convert` is tested in test_cli.py.

HF_BF16 = DATA / "ds_config_zero2_bf16.json"  # "auto" everywhere
HF_ARGS = DATA / "hf_training_args.json"  # TrainingArguments.to_json_string()


def test_a_trainer_flag_that_is_not_read_warns_by_name():
  with pytest.warns(UserWarning, match=r"--output_dir, --do_train not read"):
    policy, _ = jaxmp.from_deepspeed_config(
        {}, training_args=["--output_dir", "out", "--bf16", "--do_train"])
  assert policy == jaxmp.get_policy("mixed_bfloat16")


BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True}}


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
    policy, loss_scale = jaxmp.from_deepspeed_config(config, training_args=training_args)
  expected = jaxmp.from_deepspeed_config(same_as)
  assert policy == expected[0] and repr(loss_scale) == repr(expected[1])
