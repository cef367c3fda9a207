"""Tests of migration: DeepSpeed configs, PyTorch GradScaler, jmp code.

The DeepSpeed and PyTorch rules are re-implemented here, independently and in
plain Python, from DeepSpeed's ``DynamicLossScaler.update_scale`` and from
PyTorch's documented ``GradScaler`` update; jaxmp's trajectories are compared
with them step by step over generated sequences.
"""

import json
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxmp
from jaxmp._src.codegen import deepspeed_config_to_code
from jaxmp._src.deepspeed import load_deepspeed_config
from jaxmp._src.torch_scaler import NEVER_GROW_PERIOD

BLOG_CONFIG = """\
{
  // Mixed precision: fp16 with dynamic loss scaling.
  "fp16": {
    "enabled": true,
    "loss_scale": 0,            // 0 means dynamic
    "loss_scale_window": 1000,  // grow after 1000 clean steps
    "initial_scale_power": 16,  // start at 2**16 = 65536
    "hysteresis": 2,            /* tolerate one overflow before backing off */
    "min_loss_scale": 1e-5
  },
  "optimizer": {
    "type": "AdamW",
    "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
  },
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "train_micro_batch_size_per_gpu": 8,
  "wandb": {"enabled": true, "project": "https://example.org//not-a-comment"}
}
"""


# ---------------------------------------------------------------------------
# Reading DeepSpeed configs.


def test_blog_config_with_comments():
  policy, loss_scale = jaxmp.from_deepspeed_config(BLOG_CONFIG)
  assert policy == jaxmp.get_policy("mixed_float16")
  assert isinstance(loss_scale, jaxmp.DynamicLossScale)
  assert float(loss_scale.loss_scale) == 65536.0
  assert loss_scale.period == 1000
  assert loss_scale.hysteresis == 2
  assert int(loss_scale.hysteresis_left) == 2
  assert loss_scale.min_loss_scale == 1e-5
  assert loss_scale.factor == 2.0 and loss_scale.backoff_factor == 0.5
  assert loss_scale.consecutive_hysteresis is False


def test_dict_string_and_path_give_the_same(tmp_path):
  path = tmp_path / "ds_config.json"
  path.write_text(BLOG_CONFIG)
  config = load_deepspeed_config(BLOG_CONFIG)
  assert config["wandb"]["project"] == "https://example.org//not-a-comment"
  results = [
      jaxmp.from_deepspeed_config(x)
      for x in (BLOG_CONFIG, config, path, str(path), BLOG_CONFIG.encode())
  ]
  for policy, loss_scale in results:
    assert policy == results[0][0]
    assert repr(loss_scale) == repr(results[0][1])


def test_comments_inside_strings_are_kept():
  text = '{"a": "x // y /* z */ \\" // w", /* multi\nline */ "b": 1 // end'
  assert load_deepspeed_config(text + "\n}") == {"a": 'x // y /* z */ " // w', "b": 1}


@pytest.mark.parametrize("fp16", [{"enabled": True}, {
    "enabled": True, "loss_scale": "auto", "initial_scale_power": "auto",
    "loss_scale_window": "auto", "hysteresis": "auto", "min_loss_scale": "auto",
    "consecutive_hysteresis": "auto"}])
def test_deepspeed_defaults(fp16):
  _, loss_scale = jaxmp.from_deepspeed_config({"fp16": fp16})
  assert float(loss_scale.loss_scale) == 2.0**16
  assert loss_scale.period == 1000
  assert loss_scale.hysteresis == 2
  assert loss_scale.min_loss_scale == 1.0
  assert loss_scale.consecutive_hysteresis is False


def test_static_bf16_float32():
  policy, loss_scale = jaxmp.from_deepspeed_config(
      {"fp16": {"enabled": True, "loss_scale": 128}})
  assert policy == jaxmp.get_policy("mixed_float16")
  assert isinstance(loss_scale, jaxmp.StaticLossScale)
  assert float(loss_scale.loss_scale) == 128.0
  for key in ("bf16", "bfloat16"):
    policy, loss_scale = jaxmp.from_deepspeed_config({key: {"enabled": True}})
    assert policy == jaxmp.get_policy("mixed_bfloat16")
    assert isinstance(loss_scale, jaxmp.NoOpLossScale)
  for config in ({}, {"fp16": {"enabled": False}}, {"bf16": {"enabled": False}}):
    policy, loss_scale = jaxmp.from_deepspeed_config(config)
    assert policy == jaxmp.get_policy("float32")
    assert isinstance(loss_scale, jaxmp.NoOpLossScale)


def test_consecutive_hysteresis_is_read():
  _, loss_scale = jaxmp.from_deepspeed_config(
      {"fp16": {"enabled": True, "consecutive_hysteresis": True, "hysteresis": 4}})
  assert loss_scale.consecutive_hysteresis is True
  assert loss_scale.hysteresis == 4


def test_enabled_auto_warns():
  with pytest.warns(UserWarning, match='fp16.enabled is "auto"'):
    policy, _ = jaxmp.from_deepspeed_config({"fp16": {"enabled": "auto"}})
  assert policy == jaxmp.get_policy("float32")


@pytest.mark.parametrize("config, match", [
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both enabled"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis must be >= 1"),
    ({"fp16": {"enabled": True, "min_loss_scale": 2**20}}, "above the initial"),
    ({"fp16": {"enabled": True, "loss_scale": -1}}, "loss_scale must be 0"),
    ({"fp16": {"enabled": True, "min_loss_scale": 0}}, "min_loss_scale must be > 0"),
    ({"fp16": {"enabled": True, "loss_scale_window": 0}}, "positive integer"),
    ({"fp16": {"enabled": True, "loss_scale_window": 10.5}}, "must be an integer"),
    ({"fp16": {"enabled": True, "loss_scale_window": "1000"}}, "must be an integer"),
    ({"fp16": {"enabled": True, "hysteresis": True}}, "must be an integer"),
    ({"fp16": {"enabled": True, "initial_scale_power": 200}}, r"\[-126, 127\]"),
    ({"fp16": {"enabled": True, "loss_scale": float("inf")}}, "finite"),
    ({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}, "true or false"),
    ({"fp16": {"enabled": "yes"}}, "true or false"),
    ({"fp16": True}, "must be an object"),
    ("[1, 2]", "JSON object"),
    ('{"fp16": {"enabled": tru}}', "not valid JSON"),
    ('{"fp16": /* open', "unterminated"),
    ("no/such/ds_config.json", "no such file"),
])
def test_bad_configs_raise_value_error(config, match):
  with pytest.raises(ValueError, match=match):
    jaxmp.from_deepspeed_config(config)


def test_bad_config_type():
  with pytest.raises(TypeError, match="a dict, a JSON string or a path"):
    jaxmp.from_deepspeed_config(42)


# ---------------------------------------------------------------------------
# DeepSpeed's rule, re-implemented from `DynamicLossScaler.update_scale`.


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


def test_deepspeed_reference_grows_one_step_later():
  # DeepSpeed: growth on the (window+1)-th clean step, then every window.
  ref = DeepSpeedScaler(8.0, 3, 1.0, 1, False)
  scales = []
  for overflow in [False] * 7 + [True] + [False] * 4:
    ref.update(overflow)
    scales.append(ref.scale)
  assert scales == [8, 8, 8, 16, 16, 16, 32, 16, 16, 16, 16, 32]
  # And the raising condition: at the minimum with no hysteresis left.
  ref = DeepSpeedScaler(2.0, 1000, 1.0, 2, False)
  for overflow in [True, True, True, True]:
    ref.update(overflow)
  assert (ref.scale, ref.left, ref.raises) == (1.0, 1, 2)


def test_jaxmp_grows_on_the_window_th_step_deepspeed_one_later():
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


def _compare_with_deepspeed(fp16, seed, jaxmp_timing):
  if fp16["min_loss_scale"] > 2.0**fp16["initial_scale_power"]:
    fp16 = {**fp16, "min_loss_scale": 2.0**fp16["initial_scale_power"]}
  _, loss_scale = jaxmp.from_deepspeed_config({"fp16": {"enabled": True, **fp16}})
  overflows = _sequences(seed, batch=16, steps=80)
  scales, lefts, at_min = _trajectories(loss_scale, overflows)
  for b, sequence in enumerate(overflows):
    ref = DeepSpeedScaler(2.0**fp16["initial_scale_power"], fp16["loss_scale_window"],
                          fp16["min_loss_scale"], fp16["hysteresis"],
                          fp16["consecutive_hysteresis"], jaxmp_timing=jaxmp_timing)
    for t, overflow in enumerate(sequence):
      ref.update(bool(overflow))
      state = (scales[b, t], lefts[b, t], at_min[b, t])
      expected = (np.float32(ref.scale), ref.left, ref.raises)
      assert state == expected, (b, t, sequence[: t + 1].astype(int).tolist())
    if not jaxmp_timing:
      return


@settings(derandomize=True, max_examples=15, deadline=None)
@given(fp16=deepspeed_configs, seed=st.integers(0, 2**16))
def test_deepspeed_hysteresis_minimum_and_raising_match_exactly(fp16, seed):
  """jaxmp == DeepSpeed's rule (with jaxmp's growth timing), step for step.

  The scale, the hysteresis budget and the count of the overflows on which
  DeepSpeed raises "Current loss scale already at minimum" all agree.
  """
  _compare_with_deepspeed(fp16, seed, jaxmp_timing=True)


@settings(derandomize=True, max_examples=10, deadline=None)
@given(fp16=deepspeed_configs, seed=st.integers(0, 2**16))
def test_deepspeed_exact_while_nothing_grows(fp16, seed):
  """Without growth (a window longer than the run) the rules are identical."""
  fp16 = {**fp16, "loss_scale_window": 1000}
  _compare_with_deepspeed(fp16, seed, jaxmp_timing=False)


def test_check_loss_scale_raises_where_deepspeed_raises():
  config = {"fp16": {"enabled": True, "initial_scale_power": 2, "hysteresis": 2,
                     "min_loss_scale": 1}}
  _, ls = jaxmp.from_deepspeed_config(config)
  ref = DeepSpeedScaler(4.0, 1000, 1, 2, False)
  sequence = [True, False, True, True, False, True, True, True]
  for step, overflow in enumerate(sequence):
    ref.update(overflow)
    ls = ls.adjust(jnp.array(not overflow))
    if ref.raises:
      with pytest.raises(jaxmp.LossScaleAtMinimumError, match="already at minimum"):
        jaxmp.check_loss_scale(ls)
      break
    jaxmp.check_loss_scale(ls)
  # 4 (budget used), clean, 4 -> 2, 2 -> 1, clean, then the overflow at 1 raises.
  assert step == 5


def test_no_maximum_in_deepspeed_jaxmp_stops_at_float32_max():
  _, ls = jaxmp.from_deepspeed_config(
      {"fp16": {"enabled": True, "initial_scale_power": 126, "loss_scale_window": 1}})
  for _ in range(3):
    ls = ls.adjust(jnp.array(True))
  assert float(ls.loss_scale) == 2.0**127


# ---------------------------------------------------------------------------
# PyTorch GradScaler.


def torch_reference(overflows, init_scale, growth_factor, backoff_factor,
                    growth_interval):
  """PyTorch's documented GradScaler update, with a float32 scale.

  The float32 scale is multiplied by the (double) factor in double precision
  and stored back as float32; a growth to inf is refused; the growth tracker
  resets on overflow and on growth. Yields the scale after each step.
  """
  scale = np.float32(init_scale)
  tracker = 0
  for overflow in overflows:
    if overflow:
      scale = np.float32(float(scale) * backoff_factor)
      tracker = 0
    else:
      tracker += 1
      if tracker == growth_interval:
        grown = np.float32(float(scale) * growth_factor)
        if np.isfinite(grown):
          scale = grown
        tracker = 0
    yield scale


torch_configs = st.fixed_dictionaries({
    "init_scale": st.sampled_from([65536.0, 1.0, 3.0, 1e-3, 1126.4, 7.5e30]),
    "growth_factor": st.sampled_from([2.0, 1.1, 1.5, 3.0, 10.0, 1.0001]),
    "backoff_factor": st.sampled_from([0.5, 0.1, 0.25, 0.9, 1 / 3]),
    "growth_interval": st.sampled_from([-1, 0, 1, 2, 3, 7]),
})


def _compare_with_torch(config, overflows, reference):
  loss_scale = jaxmp.from_torch_grad_scaler(**config)
  scales = _trajectories(loss_scale, overflows)[0]
  tiny = np.finfo(np.float32).tiny
  for b, sequence in enumerate(overflows):
    for t, expected in enumerate(reference(sequence, **config)):
      if expected < tiny:  # the CPU flushes float32 subnormals to zero
        break
      assert scales[b, t] == expected, (b, t, config, sequence[: t + 1].astype(int).tolist())


@settings(derandomize=True, max_examples=15, deadline=None)
@given(config=torch_configs, seed=st.integers(0, 2**16))
def test_torch_trajectory_matches_reference(config, seed):
  _compare_with_torch(config, _sequences(seed, batch=16, steps=80), torch_reference)


def test_torch_reference_factor_rounding_matters():
  # 1126.4 * 0.1 in double precision, stored as float32, differs from the
  # float32 product; jaxmp follows PyTorch.
  scale = next(torch_reference([True], 1126.4, 2.0, 0.1, 2000))
  assert scale == np.float32(112.64) != np.float32(1126.4) * np.float32(0.1)
  ls = jaxmp.from_torch_grad_scaler(init_scale=1126.4, backoff_factor=0.1)
  assert np.float32(ls.adjust(jnp.array(False)).loss_scale) == scale
  # And growth by 1.1 from 3.0.
  ls = jaxmp.from_torch_grad_scaler(init_scale=3.0, growth_factor=1.1, growth_interval=1)
  assert np.float32(ls.adjust(jnp.array(True)).loss_scale) == np.float32(3.3)


def test_torch_real_grad_scaler_update():
  torch = pytest.importorskip("torch")

  def real(sequence, init_scale, growth_factor, backoff_factor, growth_interval):
    scale = torch.full((1,), init_scale, dtype=torch.float32)
    tracker = torch.zeros((1,), dtype=torch.int32)
    for overflow in sequence:
      found_inf = torch.full((1,), float(overflow), dtype=torch.float32)
      torch._amp_update_scale_(scale, tracker, found_inf, growth_factor,
                               backoff_factor, growth_interval)
      yield np.float32(scale.item())

  configs = [
      dict(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
      dict(init_scale=1126.4, growth_factor=1.1, backoff_factor=0.1, growth_interval=1),
      dict(init_scale=3.0, growth_factor=1.0001, backoff_factor=1 / 3, growth_interval=2),
      dict(init_scale=7.5e30, growth_factor=10.0, backoff_factor=0.9, growth_interval=1),
      dict(init_scale=1.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=0),
  ]
  for i, config in enumerate(configs):
    _compare_with_torch(config, _sequences(i, batch=6, steps=50), real)


def test_torch_scaler_against_the_python_object():
  torch = pytest.importorskip("torch")
  # GradScaler on the CPU, driven through its public step/update.
  param = torch.nn.Parameter(torch.ones(2))
  opt = torch.optim.SGD([param], lr=0.0)
  scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=1.5,
                                backoff_factor=0.25, growth_interval=2)
  ls = jaxmp.from_torch_grad_scaler(init_scale=8.0, growth_factor=1.5,
                                    backoff_factor=0.25, growth_interval=2)
  for overflow in [False, False, True, False, False, False, True, True, False, False]:
    opt.zero_grad()
    loss = (param * (float("inf") if overflow else 1.0)).sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    ls = ls.adjust(jnp.array(not overflow))
    assert np.float32(ls.loss_scale) == np.float32(scaler.get_scale())


def test_from_torch_grad_scaler_options():
  ls = jaxmp.from_torch_grad_scaler()
  assert float(ls.loss_scale) == 65536.0
  assert (ls.period, ls.factor, ls.backoff_factor, ls.min_loss_scale) == (2000, 2.0, 0.5, 0.0)
  assert isinstance(jaxmp.from_torch_grad_scaler(enabled=False), jaxmp.NoOpLossScale)
  for interval in (0, -5):
    assert jaxmp.from_torch_grad_scaler(growth_interval=interval).period == NEVER_GROW_PERIOD
  # Never growing keeps the pytree intact through jit.
  ls = jaxmp.from_torch_grad_scaler(init_scale=4.0, growth_interval=0)
  ls = jax.jit(lambda s: s.adjust(jnp.array(True)))(ls)
  assert float(ls.loss_scale) == 4.0 and int(ls.counter) == 1


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(init_scale="cuda"), TypeError, "device"),
    (dict(init_scale=0.0), ValueError, "init_scale"),
    (dict(init_scale=float("inf")), ValueError, "init_scale"),
    (dict(growth_factor=1.0), ValueError, "growth_factor"),
    (dict(backoff_factor=1.0), ValueError, "backoff_factor"),
    (dict(growth_interval=2.5), TypeError, "growth_interval"),
    (dict(enabled="yes"), TypeError, "enabled"),
])
def test_from_torch_grad_scaler_errors(kwargs, error, match):
  with pytest.raises(error, match=match):
    jaxmp.from_torch_grad_scaler(**kwargs)


def test_torch_positional_device_is_explained():
  with pytest.raises(TypeError, match="device name"):
    jaxmp.from_torch_grad_scaler("cuda", 2.0**16)


# ---------------------------------------------------------------------------
# Generated code.


def _run_code(code):
  namespace = {}
  exec(compile(code, "<generated>", "exec"), namespace)  # pylint: disable=exec-used
  return namespace


def test_generated_code_builds_the_same_objects():
  code, left_out = deepspeed_config_to_code(BLOG_CONFIG)
  namespace = _run_code(code)
  policy, loss_scale = jaxmp.from_deepspeed_config(BLOG_CONFIG)
  assert namespace["policy"] == policy
  assert repr(namespace["loss_scale"]) == repr(loss_scale)
  assert "optax.clip_by_global_norm(1.0)" in code
  assert "optax.adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-08, weight_decay=0.01)" in code
  assert [key for key, _ in left_out] == [
      "zero_optimization", "zero_optimization.offload_optimizer",
      "train_micro_batch_size_per_gpu", "wandb"]
  # The optimizer really trains and skips an overflowing step.
  tx = namespace["tx"]
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  updates, state = tx.update({"w": jnp.array([jnp.inf, 1.0, 1.0])}, state, params)
  assert int(jaxmp.loss_scaling_metrics(state)["skipped_steps"]) == 1
  assert jnp.all(optax.apply_updates(params, updates)["w"] == 1.0)


@pytest.mark.parametrize("optimizer, expected", [
    ({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.1}}, "optax.adamw("),
    ({"type": "Adam", "params": {"lr": 0.001, "weight_decay": 0.1, "adam_w_mode": False}},
     "optax.add_decayed_weights(0.1), optax.adam("),
    ({"type": "Adam", "params": {"lr": 0.001}}, "optax.adam(learning_rate)"),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, "optax.sgd(learning_rate, momentum=0.9)"),
    ({"type": "Lamb", "params": {"lr": 0.01}}, "optax.lamb("),
    ({"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99]}}, "optax.lion(learning_rate, b1=0.9, b2=0.99"),
    ({"type": "OneBitAdam", "params": {"lr": "auto"}}, "optax.adamw(learning_rate)"),
])
def test_generated_optimizers_run(optimizer, expected):
  config = {"bf16": {"enabled": True}, "optimizer": optimizer,
            "gradient_clipping": "auto", "gradient_accumulation_steps": 2}
  code, left_out = deepspeed_config_to_code(config)
  assert expected in code
  assert "optax.MultiSteps(tx, every_k_schedule=2)" in code
  tx = _run_code(code)["tx"]
  params = jnp.ones(2)
  state = tx.init(params)
  tx.update(jnp.ones(2), state, params)
  assert ("optimizer" in [k for k, _ in left_out]) == (optimizer["type"] == "OneBitAdam")


def test_generated_code_float32_and_static():
  code, _ = deepspeed_config_to_code({})
  assert 'get_policy("float32")' in code and "NoOpLossScale()" in code
  code, _ = deepspeed_config_to_code({"fp16": {"enabled": True, "loss_scale": 1024}})
  assert "jaxmp.StaticLossScale(1024.0)" in code
  _run_code(code)


# ---------------------------------------------------------------------------
# `import jaxmp as jmp`.


JMP_NAMES = ["Policy", "get_policy", "DynamicLossScale", "StaticLossScale",
             "NoOpLossScale", "all_finite", "select_tree", "half_dtype",
             "cast_to_full", "cast_to_half"]


def test_jmp_public_names_exist():
  jmp = pytest.importorskip("jmp")
  for name in JMP_NAMES:
    assert hasattr(jaxmp, name), name
  assert {n for n in dir(jmp) if not n.startswith("_")} <= set(dir(jaxmp))


def _jmp_style_training(jmp):
  """jmp's README idioms, written against the module passed in."""
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  params = {"w": jnp.full((3,), 0.5), "step": jnp.zeros((), jnp.int32)}
  half = jmp.cast_to_half(params)
  full = jmp.cast_to_full(half)
  loss_scale = jmp.DynamicLossScale(jnp.float32(2**15), period=2)
  static = jmp.StaticLossScale(jnp.float32(2**4))
  out = []
  for g in [1.0, jnp.inf, 1.0, 1.0]:
    grads = loss_scale.scale({"w": jnp.full((3,), g, jnp.float32)})
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    new = jmp.select_tree(finite, {"w": params["w"] - 0.1}, {"w": params["w"]})
    out.append((float(loss_scale.loss_scale), bool(finite), new["w"].tolist()))
  return (
      policy.compute_dtype == jnp.float16,
      policy.cast_to_compute(params)["w"].dtype, half["w"].dtype, half["step"].dtype,
      full["w"].dtype, jmp.half_dtype() == jnp.float16, jmp.half_dtype()(2.0).dtype,
      float(static.scale(jnp.float32(2.0))), float(jmp.NoOpLossScale().scale(3.0)),
      out,
  )


def test_jmp_idioms_give_the_same_results():
  jmp = pytest.importorskip("jmp")
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    expected = _jmp_style_training(jmp)
  assert _jmp_style_training(jaxmp) == expected


def test_half_dtype_is_callable_like_jmp():
  # A core fix: jmp.half_dtype() returns the JAX scalar type, which README code
  # calls (`jmp.half_dtype()(2 ** 15)`); it also still equals the NumPy dtype.
  assert jaxmp.half_dtype() is jnp.float16
  assert jaxmp.half_dtype()(2.0).dtype == np.dtype("float16")
  assert jaxmp.get_policy("half").compute_dtype == np.dtype("float16")
  assert jaxmp.cast_to_half(jnp.ones(2)).dtype == np.dtype("float16")


def test_jmp_readme_float16_initial_scale_gets_a_clear_error():
  # jmp's README builds the scale as `jmp.DynamicLossScale(jmp.half_dtype()(2 ** 15))`;
  # jaxmp keeps scales in float32 and says how to write it.
  with pytest.raises(TypeError, match="float32"):
    jaxmp.DynamicLossScale(jaxmp.half_dtype()(2**15))


def test_json_dump_round_trip_of_defaults():
  # The defaults table mirrors DeepSpeed's documented fp16 block.
  from jaxmp._src.deepspeed import DEEPSPEED_FP16_DEFAULTS  # pylint: disable=g-import-not-at-top
  assert json.loads(json.dumps(DEEPSPEED_FP16_DEFAULTS)) == {
      "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
      "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1}
  assert math.isclose(2.0**DEEPSPEED_FP16_DEFAULTS["initial_scale_power"], 65536.0)
