"""Tests of the diagnostics: exact values on hand-built trees, jit and not."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

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


def test_nonfinite_paths_numpy_python_and_nested_objects():
  tree = (np.array([1.0, -np.inf]), 2.0, NAN, "text", None, optax.EmptyState())
  assert jaxmp.nonfinite_paths(tree) == ["[0]", "[2]"]
  assert jaxmp.nonfinite_paths({}) == []


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

  @chex.variants(with_jit=True, without_jit=True)
  def test_float16_does_not_overflow_when_squared(self):
    stats = self.variant(jaxmp.grad_stats)({"g": jnp.array([60000.0, 0.0], jnp.float16)})
    self.assertEqual(float(stats["global_norm"]), 60000.0)

  @chex.variants(with_jit=True, without_jit=True)
  def test_nonfinite(self):
    tree = {"a": jnp.array([1.0, INF, -INF]), "b": jnp.array([NAN, 2.0])}
    stats = self.variant(jaxmp.grad_stats)(tree)
    self.assertEqual(int(stats["nonfinite_count"]), 3)
    self.assertTrue(np.isnan(float(stats["max_abs"])))
    self.assertTrue(np.isnan(float(stats["global_norm"])))
    stats = self.variant(jaxmp.grad_stats)({"a": jnp.array([1.0, INF])})
    self.assertEqual(float(stats["max_abs"]), INF)
    self.assertEqual(int(stats["nonfinite_count"]), 1)


def test_grad_stats_of_empty_and_non_floating_trees():
  for tree in ({}, {"i": jnp.arange(3)}):
    stats = jaxmp.grad_stats(tree)
    assert {k: float(v) for k, v in stats.items()} == {
        "global_norm": 0.0, "max_abs": 0.0, "nonfinite_count": 0.0,
        "zero_fraction": 0.0}


def test_grad_stats_strict_promotion():
  stats = jax.jit(jaxmp.grad_stats)(_tree())
  assert float(stats["global_norm"]) == 13.0


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

  @chex.variants(with_jit=True, without_jit=True)
  def test_bfloat16_and_float32_have_float32_range(self):
    tree = {"a": jnp.array([1e38, 3.0e38, 1e-30, 0.0]), "i": jnp.arange(4)}
    for dtype in (jnp.bfloat16, jnp.float32):
      headroom = self.variant(jaxmp.dtype_headroom, static_argnums=1)(tree, dtype)
      self.assertEqual({k: float(v) for k, v in headroom.items()},
                       {"overflow": 0.0, "underflow": 0.0, "subnormal": 0.0,
                        "nonfinite": 0.0})
    headroom = jaxmp.dtype_headroom(jnp.array([3.39e38, 3.4e38]), jnp.bfloat16)
    self.assertEqual(float(headroom["overflow"]), 0.5)


def test_headroom_of_float8():
  headroom = jaxmp.dtype_headroom(jnp.array([448.0, 500.0, 1e-4, 1.0]),
                                  jnp.float8_e4m3fn)
  assert float(headroom["overflow"]) == 0.25
  assert float(headroom["underflow"]) == 0.25


# suggest_loss_scale


class SuggestTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_exact_powers(self):
    suggest = self.variant(jaxmp.suggest_loss_scale)
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
      self.assertEqual(float(suggest(grads)), expected, max_abs)
      scale = float(suggest(grads))
      self.assertLessEqual(max_abs * scale, 65504.0)
      self.assertGreater(max_abs * scale * 2, 65504.0)


def test_suggest_loss_scale_for_other_dtypes_and_edges():
  grads = {"w": jnp.array([2.0**100])}
  assert float(jaxmp.suggest_loss_scale(grads, jnp.bfloat16)) == 2.0**27
  assert float(jaxmp.suggest_loss_scale({"w": jnp.zeros(2)})) == 2.0**127
  assert np.isnan(float(jaxmp.suggest_loss_scale({"w": jnp.array([INF])})))
  assert jaxmp.suggest_loss_scale({"w": jnp.ones(1)}).dtype == jnp.float32


# Putting the mask in the metrics of a training step.


def test_mask_in_metrics_of_a_training_step():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4))
  params = {"a": jnp.ones(2), "b": jnp.ones(2)}

  @jax.jit
  def step(params, opt_state, x):
    loss_fn = lambda p: jnp.sum(p["a"] * x) + jnp.sum(p["b"])
    scale = jaxmp.get_loss_scale(opt_state)
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, scale)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    metrics = {**jaxmp.loss_scaling_metrics(opt_state),
               "finite": jax.tree.map(lambda g: jnp.isfinite(g).all(), grads),
               **jaxmp.grad_stats(grads)}
    return optax.apply_updates(params, updates), opt_state, metrics

  opt_state = tx.init(params)
  params, opt_state, metrics = step(params, opt_state, jnp.array([1.0, INF]))
  assert not bool(metrics["last_finite"])
  bad = [jax.tree_util.keystr(p) for p, ok in
         jax.tree_util.tree_leaves_with_path(jax.device_get(metrics["finite"])) if not ok]
  assert bad == ["['a']"]
  assert int(metrics["nonfinite_count"]) == 1
