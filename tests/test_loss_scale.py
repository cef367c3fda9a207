"""Tests of the loss scales (update rule, pytree behaviour, validation), all_finite and select_tree."""

import dataclasses
import math
import warnings
import zlib

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import jaxmp

F32_MAX = float(np.finfo(np.float32).max)


def reference_trajectory(flags, *, loss_scale=2.0**15, period=2000, factor=2.0,
                         min_loss_scale=1.0, backoff_factor=None,
                         max_loss_scale=None, hysteresis=1,
                         consecutive_hysteresis=False):
  """The contract's update rule in plain Python, one step at a time.

  Products are formed in float64 and rounded once to float32.
  """
  backoff = 1.0 / factor if backoff_factor is None else backoff_factor
  maximum = np.float32(F32_MAX if max_loss_scale is None else max_loss_scale)
  minimum = np.float32(min_loss_scale)
  scale, counter, left, overflows = np.float32(loss_scale), 0, hysteresis, 0
  out = []
  for finite in flags:
    if finite:
      counter += 1
      if consecutive_hysteresis:
        left = hysteresis
      if counter == period:
        counter = 0
        left = hysteresis
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          grown = np.float32(float(scale) * factor)
        if math.isfinite(grown) and grown <= maximum:
          scale = grown
    else:
      counter = 0
      if left > 1:
        left -= 1
      else:
        if scale <= minimum:
          overflows += 1
        scale = max(np.float32(float(scale) * backoff), minimum)
    out.append((float(scale), counter, left, overflows))
  return out


def run_adjust_scan(loss_scale, flags):
  """Runs `adjust` over `flags` in one jitted scan; returns the trajectory."""

  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter, ls.hysteresis_left, ls.overflows_at_min)

  _, traj = jax.jit(lambda ls, f: jax.lax.scan(body, ls, f))(
      loss_scale, jnp.asarray(flags)
  )
  traj = jax.device_get(traj)
  return [
      (float(s), int(c), int(h), int(o)) for s, c, h, o in zip(*traj)
  ]


CONFIGS = [
    dict(),
    dict(period=1),
    dict(period=3, hysteresis=2),
    dict(period=4, hysteresis=3, consecutive_hysteresis=True),
    dict(period=2, loss_scale=8.0, min_loss_scale=2.0),
    dict(period=2, loss_scale=2.0**10, max_loss_scale=2.0**12),
    dict(period=3, factor=3.0, backoff_factor=0.25, loss_scale=100.0),
    dict(period=2, factor=1.1, backoff_factor=0.1, loss_scale=1000.0,
         min_loss_scale=1e-3, max_loss_scale=1e6),
    dict(period=5, loss_scale=1.0, min_loss_scale=1.0, hysteresis=2),
    dict(period=1, loss_scale=2.0**120, max_loss_scale=None),
    dict(period=7, hysteresis=4, consecutive_hysteresis=False, loss_scale=2.0**16,
         min_loss_scale=2.0**10),
]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
@pytest.mark.parametrize("overflow_rate", [0.05, 0.3, 0.7])
def test_dynamic_matches_reference_over_long_sequences(config, overflow_rate):
  rng = np.random.default_rng(zlib.crc32(f"{config}{overflow_rate}".encode()))
  flags = rng.random(600) >= overflow_rate
  # Bursts of overflows and of clean steps, to reach both bounds.
  flags[100:140] = False
  flags[300:380] = True
  got = run_adjust_scan(jaxmp.DynamicLossScale(**config), flags)
  want = reference_trajectory(flags, **config)
  assert got == want


class AdjustVariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_short_sequence_both_ways(self):
    config = dict(period=3, hysteresis=2, loss_scale=64.0, min_loss_scale=4.0)
    flags = [True, True, True, False, False, False, True, False, False,
             False, False, False, True, True, True, True, True, True]
    adjust = self.variant(lambda ls, f: ls.adjust(f))
    ls = jaxmp.DynamicLossScale(**config)
    got = []
    for finite in flags:
      ls = adjust(ls, jnp.asarray(finite))
      got.append((float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left),
                  int(ls.overflows_at_min)))
    assert got == reference_trajectory(flags, **config)
    # Spelled out: two clean steps, growth on the third...
    assert got[2] == (128.0, 0, 2, 0)
    # ...the first overflow uses the hysteresis budget, the second backs off.
    assert got[3][0] == 128.0 and got[4][0] == 64.0


def test_hysteresis_as_deepspeed_consecutive():
  flags = [False, True, False, False]
  plain = reference_trajectory(flags, loss_scale=16.0, hysteresis=2, period=100)
  refill = reference_trajectory(flags, loss_scale=16.0, hysteresis=2, period=100,
                                consecutive_hysteresis=True)
  # Without consecutive hysteresis the budget is not refilled by a clean step.
  assert [s for s, *_ in plain] == [16.0, 16.0, 8.0, 4.0]
  assert [s for s, *_ in refill] == [16.0, 16.0, 16.0, 8.0]
  for kwargs, want in [({}, plain), ({"consecutive_hysteresis": True}, refill)]:
    ls = jaxmp.DynamicLossScale(16.0, period=100, hysteresis=2, **kwargs)
    assert run_adjust_scan(ls, flags) == want


def test_jmp_positional_signature_and_behaviour():
  ours = jaxmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 5, 2, 1.0)
  theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 5, 2,
                                jnp.float32(1.0))
  rng = np.random.default_rng(0)
  for finite in rng.random(80) > 0.2:
    finite = jnp.asarray(finite)
    ours, theirs = ours.adjust(finite), theirs.adjust(finite)
    assert float(ours.loss_scale) == float(theirs.loss_scale)
    assert int(ours.counter) == int(theirs.counter)
  assert (ours.period, ours.factor, ours.min_loss_scale) == (5, 2.0, 1.0)
  # Same scale/unscale results as jmp.
  grads = {"w": jnp.array([3.0, -1.5]), "h": jnp.ones(2, jnp.float16)}
  chex.assert_trees_all_equal(ours.unscale(grads), theirs.unscale(grads))
  assert float(ours.scale(jnp.float32(3.0))) == float(theirs.scale(jnp.float32(3.0)))


def test_every_field_survives_a_jit_round_trip():
  ls = jaxmp.DynamicLossScale(
      512.0, 3, 10, 4.0, 0.25, backoff_factor=0.125, max_loss_scale=2.0**20,
      hysteresis=3, consecutive_hysteresis=True, hysteresis_left=2,
      overflows_at_min=5,
  )
  out = jax.jit(lambda x: x)(ls)
  for field in dataclasses.fields(ls):
    assert np.asarray(getattr(out, field.name)) == np.asarray(getattr(ls, field.name)), field.name
    assert type(getattr(out, field.name)) is not None


def test_min_loss_scale_survives_jit_where_jmp_loses_it():
  # jmp 0.0.4 drops min_loss_scale in tree_unflatten, so the floor becomes 1.0
  # under jit; here the floor stays 256.
  ls = jaxmp.DynamicLossScale(1024.0, min_loss_scale=256.0)
  step = jax.jit(lambda ls: ls.adjust(jnp.array(False)))
  for _ in range(5):
    ls = step(ls)
  assert float(ls.loss_scale) == 256.0
  assert ls.min_loss_scale == 256.0
  assert int(ls.overflows_at_min) == 3


@pytest.mark.parametrize(
    "make", [jaxmp.NoOpLossScale, lambda: jaxmp.StaticLossScale(8.0),
             lambda: jaxmp.DynamicLossScale(hysteresis=2)],
)
def test_state_leaves_have_explicit_dtypes(make):
  ls = make()
  for leaf in jax.tree_util.tree_leaves(ls):
    assert leaf.dtype in (np.dtype(np.float32), np.dtype(np.int32)), leaf
  assert jnp.asarray(ls.loss_scale).dtype == jnp.float32
  jitted = jax.jit(lambda x: x.adjust(jnp.array(True)))(ls)
  for before, after in zip(jax.tree_util.tree_leaves(ls), jax.tree_util.tree_leaves(jitted)):
    assert before.dtype == after.dtype and before.shape == after.shape == ()


def test_jitted_adjust_does_not_retrace():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(ls, finite):
    return ls.adjust(finite)

  ls = jaxmp.DynamicLossScale(period=2)  # NumPy state on the first call
  for finite in [True, False, True, True]:
    ls = step(ls, jnp.asarray(finite))  # JAX arrays afterwards
  assert float(ls.loss_scale) == 2.0**15


def test_lower_and_compile_with_a_loss_scale_argument():
  # jmp's DynamicLossScale cannot be passed to jax.jit(f).lower(...).
  compiled = jax.jit(lambda ls: ls.adjust(jnp.array(True))).lower(
      jaxmp.DynamicLossScale()).compile()
  assert float(compiled(jaxmp.DynamicLossScale()).loss_scale) == 2.0**15


def test_static_scale_value_is_state_not_structure():
  a, b = jaxmp.StaticLossScale(2.0), jaxmp.StaticLossScale(1024.0)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def scaled(ls, x):
    return ls.scale(x)

  assert float(scaled(a, jnp.float32(3.0))) == 6.0
  assert float(scaled(b, jnp.float32(3.0))) == 3072.0


def test_float16_loss_is_promoted_before_scaling():
  loss = jnp.float16(4.0)
  scaled = jaxmp.StaticLossScale(2.0**15).scale(loss)
  assert scaled.dtype == jnp.float32
  assert float(scaled) == 2.0**17  # inf if multiplied in float16
  bf16 = jaxmp.DynamicLossScale().scale({"l": jnp.bfloat16(1.0)})["l"]
  assert bf16.dtype == jnp.float32
  f64 = jaxmp.StaticLossScale(2.0).scale(np.float64(1.5))
  assert float(f64) == 3.0


def test_unscale_keeps_each_leaf_dtype():
  ls = jaxmp.StaticLossScale(2.0**10)
  grads = {"f32": jnp.full(3, 2.0**12), "f16": jnp.full(2, 2.0**11, jnp.float16),
           "bf16": jnp.full(2, 3 * 2.0**10, jnp.bfloat16)}
  out = ls.unscale(grads)
  assert {k: v.dtype for k, v in out.items()} == {k: v.dtype for k, v in grads.items()}
  chex.assert_trees_all_equal(
      out, {"f32": jnp.full(3, 4.0), "f16": jnp.full(2, 2.0, jnp.float16),
            "bf16": jnp.full(2, 3.0, jnp.bfloat16)})


def test_noop_scale_is_identity():
  ls = jaxmp.NoOpLossScale()
  tree = {"a": jnp.ones(2, jnp.float16)}
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
  assert ls.adjust(jnp.array(False)) is ls
  assert float(ls.loss_scale) == 1.0 and ls.loss_scale.dtype == jnp.float32


def test_scale_never_becomes_inf():
  ls = jaxmp.DynamicLossScale(2.0**126, period=1)
  traj = run_adjust_scan(ls, [True] * 10)
  assert all(math.isfinite(s) for s, *_ in traj)
  assert traj[-1][0] == 2.0**127  # 2**128 would be inf: growth refused
  capped = run_adjust_scan(jaxmp.DynamicLossScale(2.0**10, period=1,
                                                  max_loss_scale=2.0**12), [True] * 5)
  assert [s for s, *_ in capped] == [2.0**11, 2.0**12, 2.0**12, 2.0**12, 2.0**12]


def test_overflows_at_min_counts_only_overflows_at_the_floor():
  ls = jaxmp.DynamicLossScale(4.0, period=100, min_loss_scale=1.0, hysteresis=2)
  flags = [False] * 7
  traj = run_adjust_scan(ls, flags)
  # budget used, 2.0, 1.0, then three overflows at the floor
  assert [s for s, *_ in traj] == [4.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  assert [o for *_, o in traj] == [0, 0, 0, 1, 2, 3, 4]


def test_factor_products_are_rounded_once():
  # 1.1 and 0.1 are not float32 numbers: the product is formed as in float64.
  ls = jaxmp.DynamicLossScale(3.0, period=1, factor=1.1, backoff_factor=0.1,
                              min_loss_scale=0.0)
  flags = [True] * 30 + [False] * 30
  got = [s for s, *_ in run_adjust_scan(ls, flags)]
  want = [s for s, *_ in reference_trajectory(flags, loss_scale=3.0, period=1, factor=1.1,
                                              backoff_factor=0.1, min_loss_scale=0.0)]
  assert got == want


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(loss_scale=0.0), "positive and finite"),
        (dict(loss_scale=-1.0), "positive and finite"),
        (dict(loss_scale=float("inf")), "positive and finite"),
        (dict(loss_scale=float("nan")), "positive and finite"),
        (dict(period=0), "period must be an integer between 1"),
        (dict(factor=1.0), "factor must be a finite number > 1"),
        (dict(factor=0.5), "factor must be a finite number > 1"),
        (dict(backoff_factor=1.0), "strictly between 0 and 1"),
        (dict(backoff_factor=0.0), "strictly between 0 and 1"),
        (dict(loss_scale=2.0, min_loss_scale=4.0), "min_loss_scale .* is above"),
        (dict(hysteresis=0), "hysteresis must be an integer >= 1"),
        (dict(min_loss_scale=-1.0), "min_loss_scale must be finite and >= 0"),
        (dict(loss_scale=2.0**20, max_loss_scale=2.0**10), "above max_loss_scale"),
        (dict(counter=5, period=5), "counter must lie in"),
        (dict(hysteresis=2, hysteresis_left=3), "hysteresis_left must lie in"),
    ],
)
def test_invalid_dynamic_configuration_raises(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jaxmp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(period=2.5), "period must be an integer"),
        (dict(period="2000"), "period must be an integer"),
        (dict(loss_scale=jnp.float16(1024.0)), "must be a scalar float32 array"),
        (dict(loss_scale=np.float16(1024.0)), "too small"),
        (dict(loss_scale=np.ones(2, np.float32)), "must be a scalar"),
        (dict(counter=jnp.float32(0.0)), "must be a scalar int32 array"),
        (dict(consecutive_hysteresis="yes"), "must be a bool"),
        (dict(hysteresis=True), "hysteresis must be an integer"),
    ],
)
def test_ill_typed_dynamic_configuration_raises(kwargs, match):
  with pytest.raises(TypeError, match=match):
    jaxmp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("value", [0.0, -2.0, float("inf"), float("nan")])
def test_invalid_static_scale_raises(value):
  with pytest.raises(ValueError, match="positive and finite"):
    jaxmp.StaticLossScale(value)


def test_adjust_needs_a_scalar_bool():
  with pytest.raises(TypeError, match="scalar boolean"):
    jaxmp.DynamicLossScale().adjust(jnp.array([True, False]))
  with pytest.raises(TypeError, match="scalar boolean"):
    jaxmp.StaticLossScale(2.0).adjust(jnp.float32(1.0))


# all_finite and select_tree.


class AllFiniteTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_detects_inf_minus_inf_and_nan_anywhere(self):
    all_finite = self.variant(jaxmp.all_finite)
    tree = {"a": jnp.ones((3, 2)), "b": [jnp.zeros(4, jnp.float16), jnp.arange(3)]}
    assert bool(all_finite(tree))
    for bad in [jnp.inf, -jnp.inf, jnp.nan]:
      for path in ["a", "b"]:
        broken = {"a": tree["a"], "b": list(tree["b"])}
        if path == "a":
          broken["a"] = broken["a"].at[2, 1].set(bad)
        else:
          broken["b"][0] = broken["b"][0].at[3].set(bad)
        result = all_finite(broken)
        assert result.shape == () and result.dtype == jnp.bool_
        assert not bool(result)

  @chex.variants(with_jit=True, without_jit=True)
  def test_empty_tree_is_finite(self):
    assert bool(self.variant(jaxmp.all_finite)({}))

  @chex.variants(with_jit=True, without_jit=True)
  def test_float16_overflow_is_seen(self):
    x = jnp.array([300.0], jnp.float16)
    assert not bool(self.variant(lambda x: jaxmp.all_finite(x * x * x))(x))


class SelectTreeTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_selects_whole_trees(self):
    a = {"w": jnp.ones(2), "n": jnp.array(3)}
    b = {"w": jnp.zeros(2), "n": jnp.array(7)}
    select = self.variant(jaxmp.select_tree)
    chex.assert_trees_all_equal(select(jnp.array(True), a, b), a)
    chex.assert_trees_all_equal(select(jnp.array(False), a, b), b)

  def test_non_scalar_predicate_is_refused(self):
    with pytest.raises(TypeError, match="scalar boolean predicate"):
      jaxmp.select_tree(jnp.array([True, False]), jnp.ones(2), jnp.zeros(2))
    with pytest.raises(TypeError, match="scalar boolean predicate"):
      jaxmp.select_tree(np.float32(1.0), jnp.ones(2), jnp.zeros(2))

  def test_mismatched_structures_are_refused(self):
    with pytest.raises(ValueError, match="same structure"):
      jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(1)}, {"b": jnp.ones(1)})
