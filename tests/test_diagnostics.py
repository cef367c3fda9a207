"""Tests of the diagnostics: exact values on hand-built trees, jit and not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

INF, NAN = float("inf"), float("nan")
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(function, jit, **kwargs):
  return jax.jit(function, **kwargs) if jit else function


def _tree():
  return {
      "dense": {"kernel": jnp.array([[3.0, 0.0], [0.0, -4.0]]),
                "bias": jnp.array([0.0, 0.0], jnp.float16)},
      "embed": [jnp.array([12.0], jnp.bfloat16)],
      "count": jnp.array([7, 0], jnp.int32),
  }


def test_nonfinite_paths():
  tree = _tree()
  assert jaxmp.nonfinite_paths(tree) == []
  tree["dense"]["bias"] = jnp.array([0.0, INF], jnp.float16)
  tree["embed"][0] = jnp.array([NAN], jnp.bfloat16)
  assert jaxmp.nonfinite_paths(tree) == ["['dense']['bias']", "['embed'][0]"]
  # NumPy arrays and Python floats too; other leaves are never reported.
  tree = (np.array([1.0, -np.inf]), 2.0, NAN, "text", None, optax.EmptyState())
  assert jaxmp.nonfinite_paths(tree) == ["[0]", "[2]"]


@JIT
@pytest.mark.parametrize("tree, expected", [
    # Floating values: 3, 0, 0, -4 | 0, 0 | 12 -> norm 13, 4 zeros of 7.
    (_tree(), (13.0, 12.0, 0, np.float32(4 / 7))),
    # float16 is squared in float32: no overflow.
    ({"g": jnp.array([60000.0, 0.0], jnp.float16)}, (60000.0, 60000.0, 0, 0.5)),
    ({"a": jnp.array([1.0, INF, -INF]), "b": jnp.array([NAN, 2.0])}, (NAN, NAN, 3, 0.0)),
    ({"a": jnp.array([1.0, INF])}, (INF, INF, 1, 0.0)),
    ({}, (0.0, 0.0, 0, 0.0)),
    ({"i": jnp.arange(3)}, (0.0, 0.0, 0, 0.0)),
], ids=["mixed", "float16", "nan", "inf", "empty", "integer"])
def test_grad_stats(tree, expected, jit):
  stats = _maybe_jit(jaxmp.grad_stats, jit)(tree)
  got = tuple(float(stats[k]) for k in ("global_norm", "max_abs", "nonfinite_count",
                                        "zero_fraction"))
  np.testing.assert_array_equal(got, expected)
  assert (stats["nonfinite_count"].dtype, stats["global_norm"].dtype) == (jnp.int32, jnp.float32)


F16_VALUES = [
    65504.0,   # max: fits
    65519.0,   # rounds down to max: fits
    65520.0,   # rounds up to inf: overflow
    -1e6,      # overflow
    2.0**-25,  # half the smallest subnormal: ties to zero, underflow
    2.0**-24,  # the smallest subnormal
    2.0**-15,  # subnormal
    2.0**-14,  # the smallest normal
    0.0, 1.0, INF, NAN]


@JIT
@pytest.mark.parametrize("values, dtype, expected", [
    (F16_VALUES, jnp.float16, tuple(np.float32(k / 12) for k in (2, 1, 2, 2))),
    ([1e38, 3.0e38, 1e-30, 0.0], jnp.bfloat16, (0.0, 0.0, 0.0, 0.0)),  # float32's range
    ([1e38, 3.0e38, 1e-30, 0.0], jnp.float32, (0.0, 0.0, 0.0, 0.0)),
    ([3.39e38, 3.4e38], jnp.bfloat16, (0.5, 0.0, 0.0, 0.0)),  # rounds up past bfloat16's max
    ([448.0, 500.0, 1e-4, 1.0], jnp.float8_e4m3fn, (0.25, 0.25, 0.0, 0.0)),
], ids=["float16", "bfloat16", "float32", "bfloat16-max", "float8_e4m3fn"])
def test_dtype_headroom(values, dtype, expected, jit):
  headroom = _maybe_jit(jaxmp.dtype_headroom, jit, static_argnums=1)(
      {"a": jnp.array(values), "i": jnp.arange(2)}, dtype)
  assert tuple(float(headroom[k]) for k in (
      "overflow", "underflow", "subnormal", "nonfinite")) == tuple(map(float, expected))
  # The thresholds agree with an actual cast: finite values that become inf or
  # nan, nonzero values that become zero.
  values = np.asarray(values, np.float32)
  with np.errstate(over="ignore", invalid="ignore"):
    cast = values.astype(dtype)
  overflow, underflow = np.isfinite(values) & ~np.isfinite(cast), (values != 0) & (cast == 0)
  assert (overflow.mean(dtype=np.float32), underflow.mean(dtype=np.float32)) == expected[:2]


@JIT
def test_suggest_loss_scale_gives_exact_powers(jit):
  suggest = _maybe_jit(jaxmp.suggest_loss_scale, jit, static_argnums=1)
  for max_abs, expected in [
      (1.0, 2.0**15),  # 2**15 <= 65504 < 2**16
      (0.5, 2.0**16), (65504.0 / 8, 8.0),  # exactly fits at 8
      (65504.0 / 8 + 1, 4.0), (1e-3, 2.0**25), (70000.0, 0.5)]:
    scale = float(suggest({"w": jnp.array([max_abs, -max_abs / 3]), "b": jnp.zeros(2)},
                          jnp.float16))
    assert scale == expected and max_abs * scale <= 65504.0 < max_abs * scale * 2, max_abs
  # Other dtypes, all-zero and non-finite gradients.
  assert float(suggest({"w": jnp.array([2.0**100])}, jnp.bfloat16)) == 2.0**27
  assert float(suggest({"w": jnp.zeros(2)}, jnp.float16)) == 2.0**127
  assert np.isnan(suggest({"w": jnp.array([INF])}, jnp.float16))
  assert suggest({"w": jnp.ones(1)}, jnp.float16).dtype == jnp.float32
