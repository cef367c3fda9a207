"""Tests of the diagnostics: exact values on hand-built trees, jit and not."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmp

INF, NAN = float("inf"), float("nan")


def _tree():
  return {
      "dense": {"kernel": jnp.array([[3.0, 0.0], [0.0, -4.0]]),
                "bias": jnp.array([0.0, 0.0], jnp.float16)},
      "embed": [jnp.array([12.0], jnp.bfloat16)],
      "count": jnp.array([7, 0], jnp.int32),
  }


# nonfinite_paths


def test_nonfinite_paths():
  tree = _tree()
  assert jaxmp.nonfinite_paths(tree) == []
  tree["dense"]["bias"] = jnp.array([0.0, INF], jnp.float16)
  tree["embed"][0] = jnp.array([NAN], jnp.bfloat16)
  assert jaxmp.nonfinite_paths(tree) == ["['dense']['bias']", "['embed'][0]"]
  # NumPy arrays and Python floats too; other leaves are never reported.
  tree = (np.array([1.0, -np.inf]), 2.0, NAN, "text", None, optax.EmptyState())
  assert jaxmp.nonfinite_paths(tree) == ["[0]", "[2]"]


# grad_stats


class GradStatsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_exact_values(self):
    stats = self.variant(jaxmp.grad_stats)(_tree())
    # Floating values: 3, 0, 0, -4 | 0, 0 | 12 -> norm 13, 5 zeros of 7.
    self.assertEqual(float(stats["global_norm"]), 13.0)
    self.assertEqual(float(stats["max_abs"]), 12.0)
    self.assertEqual(int(stats["nonfinite_count"]), 0)
    self.assertEqual(float(stats["zero_fraction"]), np.float32(4 / 7))
    self.assertEqual(stats["nonfinite_count"].dtype, jnp.int32)
    self.assertEqual(stats["global_norm"].dtype, jnp.float32)


@pytest.mark.parametrize("tree, expected", [
    # float16 is squared in float32: no overflow.
    ({"g": jnp.array([60000.0, 0.0], jnp.float16)}, (60000.0, 60000.0, 0, 0.5)),
    ({"a": jnp.array([1.0, INF, -INF]), "b": jnp.array([NAN, 2.0])}, (NAN, NAN, 3, 0.0)),
    ({"a": jnp.array([1.0, INF])}, (INF, INF, 1, 0.0)),
    ({}, (0.0, 0.0, 0, 0.0)),
    ({"i": jnp.arange(3)}, (0.0, 0.0, 0, 0.0)),
], ids=["float16", "nan", "inf", "empty", "integer"])
def test_grad_stats_edges(tree, expected):
  stats = jax.jit(jaxmp.grad_stats)(tree)
  got = tuple(float(stats[k]) for k in (
      "global_norm", "max_abs", "nonfinite_count", "zero_fraction"))
  np.testing.assert_array_equal(got, expected)


# dtype_headroom


class HeadroomTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_float16_thresholds(self):
    values = jnp.array([
        65504.0,       # max: fits
        65519.0,       # rounds down to max: fits
        65520.0,       # rounds up to inf: overflow
        -1e6,          # overflow
        2.0**-25,      # half the smallest subnormal: ties to zero, underflow
        2.0**-24,      # the smallest subnormal
        2.0**-15,      # subnormal
        2.0**-14,      # the smallest normal
        0.0, 1.0, INF, NAN,
    ])
    headroom = self.variant(jaxmp.dtype_headroom, static_argnums=1)(
        {"x": values}, jnp.float16)
    n = values.size
    self.assertEqual(
        {k: float(v) for k, v in headroom.items()},
        {"overflow": np.float32(2 / n), "underflow": np.float32(1 / n),
         "subnormal": np.float32(2 / n), "nonfinite": np.float32(2 / n)},
    )
    # The thresholds agree with an actual cast.
    with np.errstate(over="ignore"):
      cast = np.asarray(values[:8]).astype(np.float16)
    self.assertEqual(np.isinf(cast).sum(), 2)
    self.assertEqual((cast == 0).sum(), 1)


@pytest.mark.parametrize("values, dtype, overflow, underflow", [
    ([1e38, 3.0e38, 1e-30, 0.0], jnp.bfloat16, 0.0, 0.0),  # float32's range
    ([1e38, 3.0e38, 1e-30, 0.0], jnp.float32, 0.0, 0.0),
    ([3.39e38, 3.4e38], jnp.bfloat16, 0.5, 0.0),  # rounds up past bfloat16's max
    ([448.0, 500.0, 1e-4, 1.0], jnp.float8_e4m3fn, 0.25, 0.25),
])
def test_headroom_of_other_dtypes(values, dtype, overflow, underflow):
  headroom = jaxmp.dtype_headroom({"a": jnp.array(values), "i": jnp.arange(2)}, dtype)
  assert (float(headroom["overflow"]), float(headroom["underflow"])) == (overflow, underflow)
  assert float(headroom["subnormal"]) == float(headroom["nonfinite"]) == 0.0


# suggest_loss_scale


class SuggestTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_exact_powers(self):
    suggest = self.variant(jaxmp.suggest_loss_scale, static_argnums=1)
    cases = [
        (1.0, 2.0**15),            # 2**15 <= 65504 < 2**16
        (0.5, 2.0**16),
        (65504.0 / 8, 8.0),        # exactly fits at 8
        (65504.0 / 8 + 1, 4.0),
        (1e-3, 2.0**25),
        (70000.0, 0.5),
    ]
    for max_abs, expected in cases:
      grads = {"w": jnp.array([max_abs, -max_abs / 3]), "b": jnp.zeros(2)}
      scale = float(suggest(grads, jnp.float16))
      self.assertEqual(scale, expected, max_abs)
      self.assertLessEqual(max_abs * scale, 65504.0)
      self.assertGreater(max_abs * scale * 2, 65504.0)
    # Other dtypes, all-zero and non-finite gradients.
    self.assertEqual(float(suggest({"w": jnp.array([2.0**100])}, jnp.bfloat16)), 2.0**27)
    self.assertEqual(float(suggest({"w": jnp.zeros(2)}, jnp.float16)), 2.0**127)
    self.assertTrue(np.isnan(suggest({"w": jnp.array([INF])}, jnp.float16)))
    self.assertEqual(suggest({"w": jnp.ones(1)}, jnp.float16).dtype, jnp.float32)
