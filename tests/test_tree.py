"""Tests of jaxmp.tree: all_finite and select_tree."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp


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
