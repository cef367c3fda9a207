"""Tests of the loss scales (update rule, pytree behaviour, validation), all_finite and select_tree.

The error messages for bad input live in the bad-input catalogue
(tests/test_bad_input.py); these tests check behaviour.
"""

import dataclasses
import math
import warnings
import zlib

import chex
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jaxmp

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = 2.0**-126
INT32_MAX = 2**31 - 1


@pytest.fixture(params=["with_jit", "without_jit"])
def variant(request):
  """chex.variants' with_jit/without_jit, for pytest functions."""
  return jax.jit if request.param == "with_jit" else (lambda fn: fn)


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
  """Runs `adjust` over `flags` (or over each of its rows) in one jitted,
  vmapped scan; returns the trajectory (or one per row)."""
  flags = np.asarray(flags)
  if flags.ndim == 1:
    return run_adjust_scan(loss_scale, flags[None])[0]

  def body(ls, finite):
    ls = ls.adjust(finite)
    return ls, (ls.loss_scale, ls.counter, ls.hysteresis_left, ls.overflows_at_min)

  run = jax.vmap(lambda f: jax.lax.scan(body, loss_scale, f)[1])
  traj = jax.device_get(jax.jit(run)(jnp.asarray(flags)))
  return [[(float(s), int(c), int(h), int(o)) for s, c, h, o in zip(*row)]
          for row in zip(*traj)]


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


OVERFLOW_RATES = (0.05, 0.3, 0.7)


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_dynamic_matches_reference_over_long_sequences(config):
  rows = []
  for overflow_rate in OVERFLOW_RATES:
    rng = np.random.default_rng(zlib.crc32(f"{config}{overflow_rate}".encode()))
    flags = rng.random(600) >= overflow_rate
    # Bursts of overflows and of clean steps, to reach both bounds.
    flags[100:140] = False
    flags[300:380] = True
    rows.append(flags)
  got = run_adjust_scan(jaxmp.DynamicLossScale(**config), np.stack(rows))
  for overflow_rate, flags, trajectory in zip(OVERFLOW_RATES, rows, got):
    assert trajectory == reference_trajectory(flags, **config), overflow_rate


# The update rule.


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


def test_int32_extremes_are_accepted_and_do_not_overflow():
  ls = jaxmp.DynamicLossScale(8.0, counter=INT32_MAX - 1, period=INT32_MAX,
                              hysteresis=INT32_MAX, overflows_at_min=INT32_MAX - 1)
  grown = ls.adjust(jnp.array(True))  # the period-th finite step: growth
  assert (float(grown.loss_scale), int(grown.counter)) == (16.0, 0)
  assert int(grown.hysteresis_left) == INT32_MAX
  spent = ls.adjust(jnp.array(False))  # budget left: used, scale kept
  assert (float(spent.loss_scale), int(spent.hysteresis_left)) == (8.0, INT32_MAX - 1)


# Scaling and unscaling.


def test_float16_loss_is_promoted_before_scaling():
  loss = jnp.float16(4.0)
  scaled = jaxmp.StaticLossScale(2.0**15).scale(loss)
  assert scaled.dtype == jnp.float32
  assert float(scaled) == 2.0**17  # inf if multiplied in float16
  bf16 = jaxmp.DynamicLossScale().scale({"l": jnp.bfloat16(1.0)})["l"]
  assert bf16.dtype == jnp.float32
  f64 = jaxmp.StaticLossScale(2.0).scale(np.float64(1.5))
  assert float(f64) == 3.0


def test_unscale_returns_half_precision_leaves_in_float32():
  # As jmp's unscale (a float32 scale times the leaf) does: 2**-16 / 2**10
  # is below float16's smallest subnormal, and is kept.
  ls = jaxmp.StaticLossScale(2.0**10)
  grads = {"f32": jnp.full(3, 2.0**12), "f16": jnp.array([2.0**11, 2.0**-16], jnp.float16),
           "bf16": jnp.full(2, 3 * 2.0**10, jnp.bfloat16)}
  out = ls.unscale(grads)
  assert {k: v.dtype for k, v in out.items()} == {k: jnp.float32 for k in grads}
  chex.assert_trees_all_equal(
      out, {"f32": jnp.full(3, 4.0), "f16": jnp.array([2.0, 2.0**-26]),
            "bf16": jnp.full(2, 3.0)})


def test_complex_leaves_keep_their_imaginary_part(variant):
  ls = jaxmp.StaticLossScale(4.0)
  x = jnp.array([4 + 8j, -2 - 0.5j, 0 + 1j], jnp.complex64)
  unscaled = variant(ls.unscale)(x)
  assert unscaled.dtype == jnp.complex64
  np.testing.assert_array_equal(
      unscaled, np.array([1 + 2j, -0.5 - 0.125j, 0 + 0.25j], np.complex64))
  scaled = variant(ls.scale)({"z": x, "r": jnp.float16(3.0)})
  assert scaled["z"].dtype == jnp.complex64 and scaled["r"].dtype == jnp.float32
  np.testing.assert_array_equal(
      scaled["z"], np.array([16 + 32j, -8 - 2j, 0 + 4j], np.complex64))
  assert float(scaled["r"]) == 12.0
  # Above 2**126 the unscale runs in two products: the same for complex.
  big = jaxmp.DynamicLossScale(2.0**127)
  np.testing.assert_array_equal(
      variant(big.unscale)(jnp.array([2.0**127 * (1 + 1j)], jnp.complex64)),
      np.array([1 + 1j], np.complex64))


def test_complex_infinities_stay_infinite_not_nan(variant):
  # A complex product with (1/4 + 0j) would turn inf * 0 into nan.
  x = jnp.array([complex(np.inf, 2.0), complex(3.0, -np.inf)], jnp.complex64)
  out = np.asarray(variant(jaxmp.StaticLossScale(4.0).unscale)(x))
  np.testing.assert_array_equal(out.real, np.array([np.inf, 0.75], np.float32))
  np.testing.assert_array_equal(out.imag, np.array([0.5, -np.inf], np.float32))


def test_noop_scale_is_identity():
  ls = jaxmp.NoOpLossScale()
  tree = {"a": jnp.ones(2, jnp.float16)}
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
  assert ls.adjust(jnp.array(False)) is ls
  assert float(ls.loss_scale) == 1.0 and ls.loss_scale.dtype == jnp.float32


# Pytree behaviour: state is arrays, configuration is static.


def test_every_field_survives_a_jit_round_trip():
  ls = jaxmp.DynamicLossScale(
      512.0, 3, 10, 4.0, 0.25, backoff_factor=0.125, max_loss_scale=2.0**20,
      hysteresis=3, consecutive_hysteresis=True, hysteresis_left=2,
      overflows_at_min=5,
  )
  out = jax.jit(lambda x: x)(ls)
  assert out.config() == ls.config() == {
      "type": "DynamicLossScale", "period": 10, "factor": 4.0,
      "min_loss_scale": 0.25, "backoff_factor": 0.125,
      "max_loss_scale": 2.0**20, "hysteresis": 3, "consecutive_hysteresis": True}
  state = {"loss_scale": (512.0, jnp.float32), "counter": (3, jnp.int32),
           "hysteresis_left": (2, jnp.int32), "overflows_at_min": (5, jnp.int32)}
  for name, (value, dtype) in state.items():
    leaf = getattr(out, name)
    assert isinstance(leaf, jax.Array) and leaf.dtype == dtype, name
    assert leaf.shape == () and leaf == value, name


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


def test_pytree_children_and_static_fields_follow_the_dataclass_fields():
  ls = jaxmp.DynamicLossScale(8.0, 1, 4, hysteresis=3, overflows_at_min=2)
  paths = [jax.tree_util.keystr(p, simple=True, separator="/")
           for p, _ in jax.tree_util.tree_leaves_with_path(ls)]
  state = [f.name for f in dataclasses.fields(ls) if f.name not in ls.config()]
  assert paths == state == ["loss_scale", "counter", "hysteresis_left",
                            "overflows_at_min"]
  assert [int(x) for x in jax.tree_util.tree_leaves(ls)] == [8, 1, 3, 2]
  # Every other field is static: part of the tree structure.
  assert set(ls.config()) | set(state) == {"type"} | {
      f.name for f in dataclasses.fields(ls)}
  other = jaxmp.DynamicLossScale(8.0, 1, 5, hysteresis=3)
  assert jax.tree_util.tree_structure(ls) != jax.tree_util.tree_structure(other)
  assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      jaxmp.StaticLossScale(2.0))] == [".loss_scale"]
  assert jax.tree_util.tree_leaves(jaxmp.NoOpLossScale()) == []


def test_jitted_adjust_does_not_retrace():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(ls, finite):
    return ls.adjust(finite)

  ls = jaxmp.DynamicLossScale(period=2)  # NumPy state on the first call
  for finite in [True, False, True, True]:
    ls = step(ls, jnp.asarray(finite))  # JAX arrays afterwards
  assert float(ls.loss_scale) == 2.0**15
  # jmp's idiom: weakly typed and float16 arrays, stored as float32 state.
  ls = step(jaxmp.DynamicLossScale(jnp.asarray(2.0**15), jnp.asarray(0), period=2),
            jnp.array(True))
  ls = step(jaxmp.DynamicLossScale(jnp.float16(2.0**15), period=2), jnp.array(True))
  assert float(ls.loss_scale) == 2.0**15 and int(ls.counter) == 1


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


# Any leaves: tree_map, eval_shape, Equinox. Validation never runs on unflatten.

ARBITRARY_LEAVES = {
    "bool mask": lambda x: True,
    "None": lambda x: None,
    "object()": lambda x: object(),
    "ShapeDtypeStruct": lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
    "string": lambda x: "not an array",
}
LOSS_SCALES = {
    "NoOp": jaxmp.NoOpLossScale,
    "Static": lambda: jaxmp.StaticLossScale(8.0),
    "Dynamic": lambda: jaxmp.DynamicLossScale(
        16.0, 3, 5, hysteresis=2, consecutive_hysteresis=True),
    "in an optimizer state": lambda: jaxmp.loss_scaling(
        optax.adam(0.1), jaxmp.DynamicLossScale(hysteresis=2)).init({"w": jnp.ones(2)}),
}


@pytest.mark.parametrize("leaf", ARBITRARY_LEAVES, ids=list(ARBITRARY_LEAVES))
@pytest.mark.parametrize("make", LOSS_SCALES, ids=list(LOSS_SCALES))
def test_tree_map_to_arbitrary_leaves_and_back(make, leaf):
  tree = LOSS_SCALES[make]()
  mapped = jax.tree_util.tree_map(ARBITRARY_LEAVES[leaf], tree)
  is_leaf = lambda x: x is None
  assert (jax.tree_util.tree_structure(mapped, is_leaf=is_leaf)
          == jax.tree_util.tree_structure(tree, is_leaf=is_leaf))
  leaves = jax.tree_util.tree_leaves(mapped, is_leaf=is_leaf)
  want = [ARBITRARY_LEAVES[leaf](x) for x in jax.tree_util.tree_leaves(tree)]
  assert [type(x) for x in leaves] == [type(x) for x in want]
  # And back: the original state, every field and the configuration kept.
  back = jax.tree_util.tree_map(lambda _, x: x, mapped, tree, is_leaf=is_leaf)
  chex.assert_trees_all_equal(back, tree)
  loss_scale = lambda t: t.loss_scale if isinstance(t, tuple) else t
  assert loss_scale(back) == loss_scale(tree)
  assert loss_scale(mapped).config() == loss_scale(tree).config()


@pytest.mark.parametrize("make", ["NoOp", "Static", "Dynamic"])
def test_eval_shape_of_a_step(make):
  # State leaves are float32 (the scale) and int32 (counters), kept by a step.
  ls = LOSS_SCALES[make]()
  shapes = jax.eval_shape(lambda ls: ls.adjust(jnp.array(True)), ls)
  assert type(shapes) is type(ls) and shapes.config() == ls.config()
  dtypes = [np.dtype(np.float32)] + [np.dtype(np.int32)] * 3
  assert [(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(shapes)] == [
      ((), x.dtype) for x in jax.tree_util.tree_leaves(ls)] == [
          ((), d) for d in dtypes[:len(jax.tree_util.tree_leaves(ls))]]
  assert jnp.asarray(ls.loss_scale).dtype == jnp.float32


def test_equinox_partition_combine_and_filter_jit():
  eqx = pytest.importorskip("equinox")
  ls = jaxmp.DynamicLossScale(8.0, period=2, hysteresis=2, consecutive_hysteresis=True)
  dynamic, static = eqx.partition(ls, eqx.is_array)
  assert jax.tree_util.tree_leaves(static) == []
  assert eqx.combine(dynamic, static) == ls

  @eqx.filter_jit
  @chex.assert_max_traces(n=1)
  def step(ls, grads):
    return ls.adjust(jaxmp.all_finite(grads))

  got = []
  for grads in [jnp.ones(2), jnp.array([1.0, jnp.inf]), jnp.array([jnp.nan, 1.0]),
                jnp.ones(2), jnp.ones(2)]:
    ls = step(ls, grads)
    got.append((float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)))
  assert got == [(8.0, 1, 2), (8.0, 0, 1), (4.0, 0, 1), (4.0, 1, 2), (8.0, 0, 2)]


def test_adjust_never_reads_the_state_back_to_the_host():
  # Validation is for the values a user gives; adjust builds the next state
  # by the rule, without checking (and so without reading) it.
  ls = jax.device_put(jaxmp.DynamicLossScale(4.0, period=2, hysteresis=2))
  with jax.transfer_guard_device_to_host("disallow"):
    for finite in [False, False, True, True]:
      ls = ls.adjust(jnp.array(finite))
  assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == (4.0, 0, 2)


# Construction: values given as arrays, traced values, dataclasses.replace.


def test_values_given_as_arrays_are_validated_and_stored_as_state():
  ls = jaxmp.DynamicLossScale(
      jnp.float32(2**15), np.int64(3), np.int32(10), jnp.float32(3.0),
      np.ones([], np.float32), backoff_factor=jnp.asarray(0.25),
      max_loss_scale=np.float64(2.0**20), hysteresis=jnp.int32(4),
      consecutive_hysteresis=np.bool_(True), hysteresis_left=np.uint8(2),
      overflows_at_min=jnp.asarray(7))
  assert ls.config() == {
      "type": "DynamicLossScale", "period": 10, "factor": 3.0,
      "min_loss_scale": 1.0, "backoff_factor": 0.25, "max_loss_scale": 2.0**20,
      "hysteresis": 4, "consecutive_hysteresis": True}
  assert all(type(v) in (int, float, bool, str) for v in ls.config().values())
  state = [(x.dtype, x.shape, x.item()) for x in jax.tree_util.tree_leaves(ls)]
  assert state == [(np.float32, (), 2.0**15), (np.int32, (), 3), (np.int32, (), 2),
                   (np.int32, (), 7)]
  # A float32 JAX array is kept as it is, on its device.
  scale = jnp.float32(4.0)
  assert jaxmp.StaticLossScale(scale).loss_scale is scale
  # jmp's README scale (float16) and a bfloat16 one are stored as float32.
  ls = jaxmp.DynamicLossScale(jmp.half_dtype()(2**15))
  assert ls.loss_scale.dtype == np.float32 and float(ls.loss_scale) == 2.0**15
  assert jaxmp.StaticLossScale(jnp.bfloat16(4.0)).loss_scale.dtype == np.float32
  # The range ends: the smallest normal float32 and the largest one.
  assert float(jaxmp.StaticLossScale(F32_TINY).loss_scale) == F32_TINY
  ls = jaxmp.DynamicLossScale(F32_TINY, min_loss_scale=0.0)
  assert float(ls.adjust(jnp.array(False)).loss_scale) == F32_TINY
  assert float(jaxmp.DynamicLossScale(F32_MAX).loss_scale) == F32_MAX
  assert jaxmp.DynamicLossScale(max_loss_scale=math.inf).max_loss_scale == F32_MAX


def test_integer_arrays_for_scales_are_converted_with_jmp_warning():
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    ls = jaxmp.DynamicLossScale(jnp.asarray(4, jnp.int32),
                                min_loss_scale=np.float32(1.0))
  assert ls.loss_scale.dtype == np.float32 and float(ls.loss_scale) == 4.0
  with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
    ls = jaxmp.DynamicLossScale(8.0, min_loss_scale=jnp.asarray(2, jnp.int32))
  assert ls.min_loss_scale == 2.0
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    assert float(jaxmp.StaticLossScale(np.int16(8)).loss_scale) == 8.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxmp.DynamicLossScale(16, min_loss_scale=2)  # Python ints: no warning


def test_traced_state_values_are_accepted_and_converted():
  @jax.jit
  def build(scale, counter):
    ls = jaxmp.DynamicLossScale(scale, counter, period=8)
    return ls, jaxmp.StaticLossScale(scale)

  ls, static = build(jnp.float16(64.0), jnp.int8(3))
  assert (ls.loss_scale.dtype, ls.counter.dtype) == (jnp.float32, jnp.int32)
  assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == (64.0, 3, 1)
  assert static.loss_scale.dtype == jnp.float32 and float(static.loss_scale) == 64.0


def test_replace_validates_concrete_values_and_takes_traced_ones():
  ls = jaxmp.DynamicLossScale(8.0, period=4)
  doubled = jax.jit(lambda ls: dataclasses.replace(ls, loss_scale=ls.loss_scale * 2))(ls)
  assert float(doubled.loss_scale) == 16.0 and doubled.config() == ls.config()
  moved = jax.jit(lambda ls, c: dataclasses.replace(ls, counter=c))(ls, jnp.int32(3))
  assert int(moved.counter) == 3
  assert dataclasses.replace(ls, period=10).config()["period"] == 10
  assert int(dataclasses.replace(ls, period=10).counter) == 0


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(loss_scale=float("nan")), ValueError),
        (dict(loss_scale=jnp.float32(jnp.inf)), ValueError),
        (dict(loss_scale=1e-40, min_loss_scale=0.0), ValueError),
        (dict(loss_scale=jnp.float32(2.0), min_loss_scale=4.0), ValueError),
        (dict(counter=jnp.int32(5), period=5), ValueError),
        (dict(counter=2**32 + 5), ValueError),
        (dict(hysteresis=2, hysteresis_left=jnp.int32(3)), ValueError),
        (dict(overflows_at_min=np.int32(-1)), ValueError),
        (dict(loss_scale="1024"), TypeError),
        (dict(loss_scale=None), TypeError),
        (dict(period=0), ValueError),
        (dict(hysteresis=2**32 + 1), ValueError),
        (dict(factor=1.0), ValueError),
    ],
)
def test_invalid_dynamic_configuration_raises(kwargs, error):
  # At construction, outside jit (the catalogue checks the messages)...
  with pytest.raises(error):
    jaxmp.DynamicLossScale(**kwargs)
  # ...and only there: rebuilding a loss scale from leaves checks nothing.
  ls = jaxmp.DynamicLossScale()
  state = {k: v for k, v in kwargs.items() if k in
           ("loss_scale", "counter", "hysteresis_left", "overflows_at_min")}
  leaves = [state.get(name, getattr(ls, name)) for name in
            ("loss_scale", "counter", "hysteresis_left", "overflows_at_min")]
  rebuilt = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(ls), leaves)
  assert [rebuilt.loss_scale, rebuilt.counter, rebuilt.hysteresis_left,
          rebuilt.overflows_at_min] == leaves


# Equality and hashing.


def test_equality_compares_type_configuration_and_state():
  ls = jaxmp.DynamicLossScale(8.0, period=4)
  assert ls == jaxmp.DynamicLossScale(jnp.float32(8.0), jnp.int32(0), 4)
  assert ls == jax.tree_util.tree_map(lambda x: x, ls)
  assert ls == jax.jit(lambda x: x)(ls)  # NumPy state against JAX arrays
  assert ls != ls.adjust(jnp.array(True))  # other state
  assert ls != jaxmp.DynamicLossScale(8.0, period=5)  # other configuration
  assert ls != jaxmp.StaticLossScale(8.0) and ls != 8.0  # other types
  assert jaxmp.StaticLossScale(2.0) == jaxmp.StaticLossScale(jnp.float32(2.0))
  assert jaxmp.StaticLossScale(2.0) != jaxmp.StaticLossScale(4.0)
  assert jaxmp.NoOpLossScale() == jaxmp.NoOpLossScale()
  nan = jax.tree_util.tree_map(lambda x: np.float32(np.nan), jaxmp.StaticLossScale(2.0))
  assert nan == jax.tree_util.tree_map(lambda x: np.float32(np.nan), nan)
  # pmap-stacked state compares as a whole.
  stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
  assert stacked == jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
  assert stacked != ls


def test_hash_is_that_of_the_configuration():
  ls = jaxmp.DynamicLossScale(8.0, period=4)
  assert hash(ls) == hash(ls.adjust(jnp.array(False)))
  assert hash(ls) != hash(jaxmp.DynamicLossScale(8.0, period=5))
  assert len({jaxmp.NoOpLossScale(), jaxmp.NoOpLossScale()}) == 1
  assert {ls: "found"}[jaxmp.DynamicLossScale(jnp.float32(8.0), period=4)] == "found"


# all_finite and select_tree.


def _old_per_leaf_all_finite(tree):
  """The check as jaxmp first wrote it: ``jnp.all(jnp.isfinite(x))`` per leaf."""
  leaves = jax.tree_util.tree_leaves(tree)
  return bool(not leaves or all(bool(jnp.all(jnp.isfinite(x))) for x in leaves))


def _mixed_tree():
  """Leaves grouped by the check in every way: a group of two, lone leaves of
  other shapes and dtypes (float16, complex), a scalar, a Python float, an
  empty leaf, integer and bool leaves."""
  return {"pair": [jnp.ones((40, 50)), jnp.full((40, 50), 2.0)],
          "lone": jnp.ones(1000), "half": jnp.ones(40, jnp.bfloat16),
          "f16": jnp.ones(40, jnp.float16), "z": jnp.ones(40, jnp.complex64),
          "scalar": jnp.float32(3.0), "python": 0.5, "empty": jnp.zeros((0, 3)),
          "steps": jnp.arange(40), "mask": jnp.ones(40, jnp.bool_)}


def test_all_finite_decides_as_the_per_leaf_check_on_every_kind_of_leaf(variant):
  all_finite = variant(jaxmp.all_finite)
  tree = _mixed_tree()
  result = all_finite(tree)
  assert result.shape == () and result.dtype == jnp.bool_
  assert bool(result) and _old_per_leaf_all_finite(tree)
  float_paths = [("pair", 0), ("pair", 1), ("lone",), ("half",), ("f16",), ("scalar",)]
  bad_values = (jnp.inf, -jnp.inf, jnp.nan)
  for path in float_paths + [("z",)]:
    for bad in bad_values + ((complex(0, np.inf), complex(np.nan, 1)) if path == ("z",) else ()):
      broken = jax.tree_util.tree_map(lambda x: x, tree)
      if path[0] == "pair":
        broken["pair"] = list(tree["pair"])
        broken["pair"][path[1]] = broken["pair"][path[1]].at[7, 9].set(bad)
      elif path[0] == "scalar":
        broken["scalar"] = jnp.float32(bad)
      else:
        broken[path[0]] = broken[path[0]].at[17].set(bad)
      assert not bool(all_finite(broken)) and not _old_per_leaf_all_finite(broken), path
  assert not bool(all_finite({**tree, "python": float("nan")}))
  integers = {"steps": jnp.arange(40), "max": jnp.array([2**31 - 1]),
              "mask": jnp.zeros(3, jnp.bool_)}
  assert bool(all_finite(integers)) and _old_per_leaf_all_finite(integers)
  assert bool(all_finite({})) and bool(jaxmp.all_finite(None))  # empty trees
  # A float16 overflow inside the checked computation.
  assert not bool(variant(lambda x: jaxmp.all_finite(x * x * x))(
      jnp.array([300.0], jnp.float16)))


def test_all_finite_under_vmap_decides_per_example():
  batch = {"w": jnp.ones((3, 40, 50)).at[1, 2, 3].set(jnp.nan),
           "b": jnp.ones((3, 50)).at[2, 0].set(jnp.inf), "s": jnp.ones(3)}
  flags = jax.jit(jax.vmap(jaxmp.all_finite))(batch)
  assert flags.tolist() == [True, False, False]


def test_all_finite_of_many_leaves_of_one_shape_reduces_them_in_bounded_groups():
  # One variadic reduce of 1000 leaves compiled in minutes on XLA:CPU; the
  # check reduces at most 64 leaves at a time (here 64 and a lone 65th).
  leaves = [jnp.full(40, float(i)) for i in range(65)]
  all_finite = jax.jit(jaxmp.all_finite)
  assert bool(all_finite(leaves))
  for i in (0, 63, 64):
    broken = list(leaves)
    broken[i] = broken[i].at[5].set(jnp.nan)
    assert not bool(all_finite(broken)), i
  jaxpr = jax.make_jaxpr(jaxmp.all_finite)(leaves).jaxpr
  operands = [len(eqn.invars) for eqn in jaxpr.eqns if eqn.primitive.name == "reduce"]
  assert max(operands) == 2 * 64  # 64 leaves and their 64 initial values


def test_select_tree_selects_whole_trees(variant):
  a = {"w": jnp.ones(2), "n": jnp.array(3), "h": jnp.ones(2, jnp.bfloat16)}
  b = {"w": jnp.zeros(2), "n": jnp.array(7), "h": jnp.zeros(2, jnp.bfloat16)}
  select = variant(jaxmp.select_tree)
  chex.assert_trees_all_equal(select(jnp.array(True), a, b), a)
  chex.assert_trees_all_equal(select(jnp.array(False), a, b), b)
  assert jaxmp.select_tree(jnp.array(True), None, None) is None


def test_select_tree_is_jmps():
  a = {"w": jnp.ones(2), "n": jnp.array(3), "h": jnp.full(2, 1.5, jnp.float16)}
  b = {"w": jnp.zeros(2), "n": jnp.array(7), "h": jnp.full(2, -2.0, jnp.float16)}
  for pred in [jnp.bool_(True), jnp.bool_(False)]:
    ours, theirs = jaxmp.select_tree(pred, a, b), jmp.select_tree(pred, a, b)
    chex.assert_trees_all_equal(ours, theirs, strict=True)
