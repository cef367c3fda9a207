"""Tests of the loss scales (update rule, pytree behaviour, validation), all_finite
and select_tree. The messages for bad input: the catalogue, test_bad_input.py."""

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
from models import finite as per_leaf  # NumPy's isfinite on each leaf

F32_MAX, F32_TINY, INT32_MAX = float(np.finfo(np.float32).max), 2.0**-126, 2**31 - 1
STATE_FIELDS = ("loss_scale", "counter", "hysteresis_left", "overflows_at_min")
leaves = jax.tree_util.tree_leaves


@pytest.fixture(params=["with_jit", "without_jit"])
def variant(request):
  """chex.variants' with_jit/without_jit, for pytest functions."""
  return jax.jit if request.param == "with_jit" else (lambda fn: fn)


def reference_trajectory(flags, *, loss_scale=2.0**15, period=2000, factor=2.0,
                         min_loss_scale=1.0, backoff_factor=None, max_loss_scale=None,
                         hysteresis=1, consecutive_hysteresis=False):
  """The contract's update rule in plain Python, one step at a time; products
  are formed in float64 and rounded once to float32."""
  backoff = 1.0 / factor if backoff_factor is None else backoff_factor
  maximum, minimum = np.float32(max_loss_scale or F32_MAX), np.float32(min_loss_scale)
  scale, counter, left, overflows = np.float32(loss_scale), 0, hysteresis, 0
  out = []
  for finite in flags:
    if finite:
      counter += 1
      left = hysteresis if consecutive_hysteresis else left
      if counter == period:
        counter, left = 0, hysteresis
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          grown = np.float32(float(scale) * factor)
        scale = grown if math.isfinite(grown) and grown <= maximum else scale
    elif left > 1:
      counter, left = 0, left - 1
    else:
      overflows += bool(scale <= minimum)
      counter, scale = 0, max(np.float32(float(scale) * backoff), minimum)
    out.append((float(scale), counter, left, overflows))
  return out


CONFIGS = [
    dict(), dict(period=1), dict(period=3, hysteresis=2),
    dict(period=4, hysteresis=3, consecutive_hysteresis=True),
    dict(period=2, loss_scale=8.0, min_loss_scale=2.0),
    dict(period=2, loss_scale=2.0**10, max_loss_scale=2.0**12),
    dict(period=3, factor=3.0, backoff_factor=0.25, loss_scale=100.0),
    dict(period=2, factor=1.1, backoff_factor=0.1, loss_scale=1000.0, min_loss_scale=1e-3,
         max_loss_scale=1e6),
    dict(period=5, loss_scale=1.0, min_loss_scale=1.0, hysteresis=2),
    dict(period=1, loss_scale=2.0**120, max_loss_scale=None),
    dict(period=7, hysteresis=4, consecutive_hysteresis=False, loss_scale=2.0**16,
         min_loss_scale=2.0**10)]


@pytest.mark.parametrize("config", CONFIGS, ids=[str(c) for c in CONFIGS])
def test_dynamic_matches_reference_over_long_sequences(config):
  rows = []
  for overflow_rate in (0.05, 0.3, 0.7):
    flags = np.random.default_rng(zlib.crc32(f"{config}{overflow_rate}".encode())).random(600)
    rows.append(flags >= overflow_rate)
    rows[-1][100:140], rows[-1][300:380] = False, True  # bursts, to reach both bounds
  run = jax.jit(jax.vmap(lambda f: jax.lax.scan(  # every row in one jitted, vmapped scan
      lambda ls, finite: (ls.adjust(finite),) * 2, jaxmp.DynamicLossScale(**config), f)[1]))
  trajectories = np.stack(leaves(jax.device_get(run(jnp.asarray(np.stack(rows))))), axis=-1)
  for flags, trajectory in zip(rows, trajectories):
    assert [(float(s), int(c), int(h), int(o)) for s, c, h, o in trajectory] == (
        reference_trajectory(flags, **config))


def test_jmp_positional_signature_and_behaviour():
  ours = jaxmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 5, 2, 1.0)
  theirs = jmp.DynamicLossScale(jnp.float32(2.0**15), jnp.int32(0), 5, 2, jnp.float32(1.0))
  state = lambda ls: (float(ls.loss_scale), int(ls.counter))
  for finite in np.random.default_rng(0).random(80) > 0.2:
    ours, theirs = ours.adjust(jnp.asarray(finite)), theirs.adjust(jnp.asarray(finite))
    assert state(ours) == state(theirs)
  assert (ours.period, ours.factor, ours.min_loss_scale) == (5, 2.0, 1.0)
  grads = {"w": jnp.array([3.0, -1.5]), "h": jnp.ones(2, jnp.float16)}  # scale/unscale too
  chex.assert_trees_all_equal(ours.unscale(grads), theirs.unscale(grads))
  assert float(ours.scale(jnp.float32(3.0))) == float(theirs.scale(jnp.float32(3.0)))


def test_scale_and_unscale_compute_in_float32(variant):
  # A float16 loss times 2**15 would be inf in float16; unscale returns half-precision leaves in
  # float32, as jmp's does: 2**-16 / 2**10 is below float16's smallest subnormal, and is kept.
  static = jaxmp.StaticLossScale(2.0**15)
  scaled = variant(static.scale)({"f16": jnp.float16(4.0), "bf16": jnp.bfloat16(1.0),
                                  "f64": np.float64(1.5)})
  chex.assert_trees_all_equal(scaled, {"f16": jnp.float32(2.0**17), "bf16": jnp.float32(2.0**15),
                                       "f64": jnp.float32(1.5 * 2.0**15)}, strict=True)
  grads = {"f32": jnp.full(3, 2.0**12), "f16": jnp.array([2.0**11, 2.0**-16], jnp.float16),
           "bf16": jnp.full(2, 3 * 2.0**10, jnp.bfloat16)}
  chex.assert_trees_all_equal(
      variant(jaxmp.StaticLossScale(2.0**10).unscale)(grads),
      {"f32": jnp.full(3, 4.0), "f16": jnp.array([2.0, 2.0**-26]), "bf16": jnp.full(2, 3.0)},
      strict=True)
  ls = jaxmp.NoOpLossScale()  # the identity
  assert ls.scale(grads) is grads and ls.unscale(grads) is grads
  assert ls.adjust(jnp.array(False)) is ls
  assert float(ls.loss_scale) == 1.0 and ls.loss_scale.dtype == jnp.float32


def test_complex_leaves_keep_their_imaginary_part(variant):
  ls = jaxmp.StaticLossScale(4.0)
  x = jnp.array([4 + 8j, -2 - 0.5j, 0 + 1j], jnp.complex64)
  chex.assert_trees_all_equal(
      (variant(ls.unscale)(x), variant(ls.scale)({"z": x, "r": jnp.float16(3.0)})),
      (jnp.array([1 + 2j, -0.5 - 0.125j, 0 + 0.25j], jnp.complex64),
       {"z": jnp.array([16 + 32j, -8 - 2j, 0 + 4j], jnp.complex64), "r": jnp.float32(12.0)}),
      strict=True)
  # Above 2**126 the unscale runs in two products: the same for complex.
  big = jaxmp.DynamicLossScale(2.0**127)
  np.testing.assert_array_equal(
      variant(big.unscale)(jnp.array([2.0**127 * (1 + 1j)], jnp.complex64)),
      np.array([1 + 1j], np.complex64))
  # A complex product with (1/4 + 0j) would turn inf * 0 into nan.
  out = np.asarray(variant(ls.unscale)(
      jnp.array([complex(np.inf, 2.0), complex(3.0, -np.inf)], jnp.complex64)))
  np.testing.assert_array_equal(out.real, np.array([np.inf, 0.75], np.float32))
  np.testing.assert_array_equal(out.imag, np.array([0.5, -np.inf], np.float32))


def test_every_field_survives_a_jit_round_trip():
  """The state fields are the pytree's children; the others are static (structure)."""
  ls = jaxmp.DynamicLossScale(
      512.0, 3, 10, 4.0, 0.25, backoff_factor=0.125, max_loss_scale=2.0**20,
      hysteresis=3, consecutive_hysteresis=True, hysteresis_left=2, overflows_at_min=5)
  out = jax.jit(lambda x: x)(ls)
  assert out.config() == ls.config() == {
      "type": "DynamicLossScale", "period": 10, "factor": 4.0,
      "min_loss_scale": 0.25, "backoff_factor": 0.125,
      "max_loss_scale": 2.0**20, "hysteresis": 3, "consecutive_hysteresis": True}
  assert all(isinstance(getattr(out, name), jax.Array) for name in STATE_FIELDS)
  assert [(x.dtype, x.shape, x.item()) for x in leaves(out)] == [
      (jnp.float32, (), 512.0), (jnp.int32, (), 3), (jnp.int32, (), 2), (jnp.int32, (), 5)]
  paths = [jax.tree_util.keystr(p, simple=True, separator="/")
           for p, _ in jax.tree_util.tree_leaves_with_path(ls)]
  state = [f.name for f in dataclasses.fields(ls) if f.name not in ls.config()]
  assert paths == state == list(STATE_FIELDS)
  assert set(ls.config()) | set(state) == {"type"} | {f.name for f in dataclasses.fields(ls)}
  assert jax.tree_util.tree_structure(ls) != jax.tree_util.tree_structure(
      dataclasses.replace(ls, period=11))
  assert [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
      jaxmp.StaticLossScale(2.0))] == [".loss_scale"]
  assert leaves(jaxmp.NoOpLossScale()) == []


def test_min_loss_scale_survives_jit_where_jmp_loses_it():
  # jmp 0.0.4 drops min_loss_scale in tree_unflatten, so the floor becomes 1.0
  # under jit; here the floor stays 256.
  ls = jaxmp.DynamicLossScale(1024.0, min_loss_scale=256.0)
  step = jax.jit(lambda ls: ls.adjust(jnp.array(False)))
  for _ in range(5):
    ls = step(ls)
  assert (float(ls.loss_scale), ls.min_loss_scale, int(ls.overflows_at_min)) == (256.0, 256.0, 3)


def test_jitted_adjust_does_not_retrace():
  # Nor does adjust read its state back to the host: validation is for the
  # values a user gives; adjust builds the next state by the rule.
  ls = jax.device_put(jaxmp.DynamicLossScale(4.0, period=2, hysteresis=2))
  with jax.transfer_guard_device_to_host("disallow"):
    for finite in [False, False, True, True]:
      ls = ls.adjust(jnp.array(finite))
  assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == (4.0, 0, 2)
  step = jax.jit(chex.assert_max_traces(lambda ls, finite: ls.adjust(finite), n=1))
  ls = jaxmp.DynamicLossScale(period=2)  # NumPy state on the first call
  for finite in [True, False, True, True]:
    ls = step(ls, jnp.asarray(finite))  # JAX arrays afterwards
  assert float(ls.loss_scale) == 2.0**15
  # jmp's idiom: weakly typed and float16 arrays, stored as float32 state.
  ls = step(jaxmp.DynamicLossScale(jnp.asarray(2.0**15), jnp.asarray(0), period=2),
            jnp.array(True))
  ls = step(jaxmp.DynamicLossScale(jnp.float16(2.0**15), period=2), jnp.array(True))
  assert float(ls.loss_scale) == 2.0**15 and int(ls.counter) == 1
  # And jax.jit(f).lower(...) takes a loss scale (jmp's cannot be passed).
  compiled = jax.jit(lambda ls: ls.adjust(jnp.array(True))).lower(
      jaxmp.DynamicLossScale()).compile()
  assert float(compiled(jaxmp.DynamicLossScale()).loss_scale) == 2.0**15


def test_static_scale_value_is_state_not_structure():
  a, b = jaxmp.StaticLossScale(2.0), jaxmp.StaticLossScale(1024.0)
  assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
  scaled = jax.jit(chex.assert_max_traces(lambda ls, x: ls.scale(x), n=1))
  assert (float(scaled(a, jnp.float32(3.0))), float(scaled(b, jnp.float32(3.0)))) == (6.0, 3072.0)


# Any leaves: tree_map, eval_shape, Equinox. Validation never runs on unflatten.
ARBITRARY_LEAVES = {
    "bool mask": lambda x: True, "None": lambda x: None, "object()": lambda x: object(),
    "ShapeDtypeStruct": lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
    "string": lambda x: "not an array"}
LOSS_SCALES = {
    "NoOp": jaxmp.NoOpLossScale,
    "Static": lambda: jaxmp.StaticLossScale(8.0),
    "Dynamic": lambda: jaxmp.DynamicLossScale(
        16.0, 3, 5, hysteresis=2, consecutive_hysteresis=True),
    "in an optimizer state": lambda: jaxmp.loss_scaling(
        optax.adam(0.1), jaxmp.DynamicLossScale(hysteresis=2)).init({"w": jnp.ones(2)})}


@pytest.mark.parametrize("leaf", ARBITRARY_LEAVES, ids=list(ARBITRARY_LEAVES))
@pytest.mark.parametrize("make", LOSS_SCALES, ids=list(LOSS_SCALES))
def test_tree_map_to_arbitrary_leaves_and_back(make, leaf):
  tree = LOSS_SCALES[make]()
  mapped = jax.tree_util.tree_map(ARBITRARY_LEAVES[leaf], tree)
  is_leaf = lambda x: x is None
  assert (jax.tree_util.tree_structure(mapped, is_leaf=is_leaf)
          == jax.tree_util.tree_structure(tree, is_leaf=is_leaf))
  assert [type(x) for x in jax.tree_util.tree_leaves(mapped, is_leaf=is_leaf)] == [
      type(ARBITRARY_LEAVES[leaf](x)) for x in leaves(tree)]
  # And back: the original state, every field and the configuration kept.
  back = jax.tree_util.tree_map(lambda _, x: x, mapped, tree, is_leaf=is_leaf)
  chex.assert_trees_all_equal(back, tree)
  loss_scale = lambda t: t.loss_scale if isinstance(t, tuple) else t
  assert loss_scale(back) == loss_scale(tree) and (
      loss_scale(mapped).config() == loss_scale(tree).config())


@pytest.mark.parametrize("make", ["NoOp", "Static", "Dynamic"])
def test_eval_shape_of_a_step(make):
  # State leaves are float32 (the scale) and int32 (counters), kept by a step.
  ls = LOSS_SCALES[make]()
  shapes = jax.eval_shape(lambda ls: ls.adjust(jnp.array(True)), ls)
  assert type(shapes) is type(ls) and shapes.config() == ls.config()
  dtypes = [np.dtype(np.float32)] + [np.dtype(np.int32)] * 3
  assert [(x.shape, x.dtype) for x in leaves(shapes)] == [
      ((), x.dtype) for x in leaves(ls)] == [((), d) for d in dtypes[:len(leaves(ls))]]
  assert jnp.asarray(ls.loss_scale).dtype == jnp.float32


def test_equinox_partition_combine_and_filter_jit():
  eqx = pytest.importorskip("equinox")
  ls = jaxmp.DynamicLossScale(8.0, period=2, hysteresis=2, consecutive_hysteresis=True)
  dynamic, static = eqx.partition(ls, eqx.is_array)
  assert leaves(static) == [] and eqx.combine(dynamic, static) == ls
  step = eqx.filter_jit(chex.assert_max_traces(
      lambda ls, grads: ls.adjust(jaxmp.all_finite(grads)), n=1))
  for grads, expected in [(jnp.ones(2), (8.0, 1, 2)), (jnp.array([1.0, jnp.inf]), (8.0, 0, 1)),
                          (jnp.array([jnp.nan, 1.0]), (4.0, 0, 1)), (jnp.ones(2), (4.0, 1, 2)),
                          (jnp.ones(2), (8.0, 0, 2))]:
    ls = step(ls, grads)
    assert (float(ls.loss_scale), int(ls.counter), int(ls.hysteresis_left)) == expected


def test_values_given_as_arrays_or_traced_are_validated_and_stored_as_state():
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
  assert [(x.dtype, x.shape, x.item()) for x in leaves(ls)] == [
      (np.float32, (), 2.0**15), (np.int32, (), 3), (np.int32, (), 2), (np.int32, (), 7)]
  scale = jnp.float32(4.0)  # a float32 JAX array is kept as it is, on its device
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
  ls = jaxmp.DynamicLossScale(8.0, counter=INT32_MAX - 1, period=INT32_MAX,
                              hysteresis=INT32_MAX, overflows_at_min=INT32_MAX - 1)
  grown, spent = ls.adjust(jnp.array(True)), ls.adjust(jnp.array(False))  # no int32 overflow
  assert (float(grown.loss_scale), int(grown.counter), int(grown.hysteresis_left)) == (
      16.0, 0, INT32_MAX)  # the period-th finite step grows the scale
  assert (float(spent.loss_scale), int(spent.hysteresis_left)) == (8.0, INT32_MAX - 1)
  # Integer arrays are converted with jmp's warning; Python ints without.
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    ls = jaxmp.DynamicLossScale(jnp.asarray(4, jnp.int32), min_loss_scale=np.float32(1.0))
  assert ls.loss_scale.dtype == np.float32 and float(ls.loss_scale) == 4.0
  with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
    assert jaxmp.DynamicLossScale(8.0, min_loss_scale=jnp.asarray(2, jnp.int32)
                                 ).min_loss_scale == 2.0
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    assert float(jaxmp.StaticLossScale(np.int16(8)).loss_scale) == 8.0
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jaxmp.DynamicLossScale(16, min_loss_scale=2)
  # Traced values, in construction and in dataclasses.replace.
  ls, static = jax.jit(lambda scale, counter: (
      jaxmp.DynamicLossScale(scale, counter, period=8), jaxmp.StaticLossScale(scale)))(
          jnp.float16(64.0), jnp.int8(3))
  assert [(x.dtype, x.item()) for x in leaves((ls, static))] == [
      (jnp.float32, 64.0), (jnp.int32, 3), (jnp.int32, 1), (jnp.int32, 0), (jnp.float32, 64.0)]
  ls = jaxmp.DynamicLossScale(8.0, period=4)
  doubled = jax.jit(lambda ls: dataclasses.replace(ls, loss_scale=ls.loss_scale * 2))(ls)
  assert float(doubled.loss_scale) == 16.0 and doubled.config() == ls.config()
  assert int(jax.jit(lambda ls, c: dataclasses.replace(ls, counter=c))(
      ls, jnp.int32(3)).counter) == 3
  replaced = dataclasses.replace(ls, period=10)  # a concrete value, validated
  assert (replaced.config()["period"], int(replaced.counter)) == (10, 0)


def test_equality_compares_type_configuration_and_state_and_hash_the_configuration():
  ls = jaxmp.DynamicLossScale(8.0, period=4)
  nan = jax.tree_util.tree_map(lambda x: np.float32(np.nan), jaxmp.StaticLossScale(2.0))
  stack = lambda ls: jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
  for a, b, equal in [
      (ls, jaxmp.DynamicLossScale(jnp.float32(8.0), jnp.int32(0), 4), True),
      (ls, jax.tree_util.tree_map(lambda x: x, ls), True),
      (ls, jax.jit(lambda x: x)(ls), True),  # NumPy state against JAX arrays
      (ls, ls.adjust(jnp.array(True)), False),  # other state
      (ls, jaxmp.DynamicLossScale(8.0, period=5), False),  # other configuration
      (ls, jaxmp.StaticLossScale(8.0), False), (ls, 8.0, False),  # other types
      (jaxmp.StaticLossScale(2.0), jaxmp.StaticLossScale(jnp.float32(2.0)), True),
      (jaxmp.StaticLossScale(2.0), jaxmp.StaticLossScale(4.0), False),
      (jaxmp.NoOpLossScale(), jaxmp.NoOpLossScale(), True),
      (nan, jax.tree_util.tree_map(lambda x: np.float32(np.nan), nan), True),
      (stack(ls), stack(ls), True), (stack(ls), ls, False)]:  # pmap-stacked: as a whole
    assert (a == b, a != b) == (equal, not equal), (a, b)
  # The hash is that of the configuration.
  assert hash(ls) == hash(ls.adjust(jnp.array(False)))
  assert hash(ls) != hash(jaxmp.DynamicLossScale(8.0, period=5))
  assert len({jaxmp.NoOpLossScale(), jaxmp.NoOpLossScale()}) == 1
  assert {ls: "found"}[jaxmp.DynamicLossScale(jnp.float32(8.0), period=4)] == "found"


def test_all_finite_decides_as_the_per_leaf_check_on_every_kind_of_leaf(variant):
  """Against NumPy's ``isfinite`` per leaf, on leaves grouped by the check
  in every way (pairs, lone leaves of every dtype, scalars, empty, integers)."""
  all_finite = variant(jaxmp.all_finite)
  put = lambda shape, value=1.0, dtype=np.float32: jax.device_put(np.full(shape, value, dtype))
  tree = {"pair": [put((40, 50)), put((40, 50), 2.0)], "lone": put(1000),
          "half": put(40, dtype=jnp.bfloat16), "f16": put(40, dtype=np.float16),
          "z": put(40, dtype=np.complex64), "scalar": put((), 3.0), "python": 0.5,
          "empty": put((0, 3)), "steps": jax.device_put(np.arange(40, dtype=np.int32)),
          "mask": put(40, dtype=np.bool_)}
  result = all_finite(tree)
  assert result.shape == () and result.dtype == jnp.bool_ and bool(result) and per_leaf(tree)
  complex_bad = (complex(0, np.inf), complex(np.nan, 1))
  for path in [("pair", 0), ("pair", 1), ("lone",), ("half",), ("f16",), ("scalar",), ("z",)]:
    for bad in (jnp.inf, -jnp.inf, jnp.nan) + (complex_bad if path == ("z",) else ()):
      broken = {**tree, "pair": list(tree["pair"])}
      leaf = np.array(tree[path[0]][path[1]] if path[0] == "pair" else tree[path[0]])
      leaf[(7, 9) if path[0] == "pair" else () if path[0] == "scalar" else 17] = bad
      (broken["pair"] if path[0] == "pair" else broken)[path[-1]] = jax.device_put(leaf)
      assert not bool(all_finite(broken)) and not per_leaf(broken), path
  assert not bool(all_finite({**tree, "python": float("nan")}))
  integers = {"steps": tree["steps"], "max": put(1, 2**31 - 1, np.int32), "mask": put(3, 0, bool)}
  assert bool(all_finite(integers)) and per_leaf(integers)
  assert bool(all_finite({})) and bool(jaxmp.all_finite(None))  # empty trees
  # A float16 overflow inside the checked computation.
  assert not bool(variant(lambda x: jaxmp.all_finite(x * x * x))(
      jnp.array([300.0], jnp.float16)))


def test_all_finite_of_many_leaves_of_one_shape_reduces_them_in_bounded_groups():
  # One variadic reduce of 1000 leaves compiled in minutes on XLA:CPU; the
  # check reduces at most 64 leaves at a time (here 64 and a lone 65th).
  batch = {"w": jnp.ones((3, 40, 50)).at[1, 2, 3].set(jnp.nan),  # and under vmap
           "b": jnp.ones((3, 50)).at[2, 0].set(jnp.inf), "s": jnp.ones(3)}
  assert jax.jit(jax.vmap(jaxmp.all_finite))(batch).tolist() == [True, False, False]
  tree = [jnp.full(40, float(i)) for i in range(65)]
  all_finite = jax.jit(jaxmp.all_finite)
  assert bool(all_finite(tree))
  for i in (0, 63, 64):
    assert not bool(all_finite(tree[:i] + [tree[i].at[5].set(jnp.nan)] + tree[i + 1:])), i
  assert max(len(eqn.invars) for eqn in jax.make_jaxpr(jaxmp.all_finite)(tree).eqns
             if eqn.primitive.name == "reduce") == 2 * 64  # 64 leaves, 64 initial values


def test_select_tree_selects_whole_trees_as_jmp_does(variant):
  a, b = ({"w": jnp.full(2, w), "n": jnp.array(n), "h": jnp.full(2, h, jnp.float16),
           "bf": jnp.full(2, w, jnp.bfloat16)} for w, n, h in ((1.0, 3, 1.5), (0.0, 7, -2.0)))
  for pred, expected in ((jnp.bool_(True), a), (jnp.bool_(False), b)):
    chex.assert_trees_all_equal(variant(jaxmp.select_tree)(pred, a, b), expected,
                                jmp.select_tree(pred, a, b), strict=True)
  assert jaxmp.select_tree(jnp.array(True), None, None) is None
