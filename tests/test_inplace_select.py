"""Tests of the in-place select of loss_scaling: same values as the plain update."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from jaxmp._src.inplace_select import update_or_keep


def _with_odd_state():
  """A transformation whose state has a passthrough, a constant and a duplicate."""

  def init(params):
    del params
    return {"kept": jnp.arange(3.0), "const": jnp.zeros([], jnp.int32),
            "a": jnp.ones([]), "b": jnp.ones([])}

  def update(updates, state, params=None):
    del params
    total = sum(jnp.sum(u) for u in jax.tree_util.tree_leaves(updates))
    new = {"kept": state["kept"], "const": jnp.zeros([], jnp.int32),
           "a": state["a"] + total, "b": state["a"] + total}
    scaled = jax.tree_util.tree_map(lambda u: u * new["a"], updates)
    return scaled, new

  return optax.GradientTransformation(init, update)


OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "chain_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, 10), weight_decay=0.1),
    ),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=1e-2),
    "trace": lambda: optax.sgd(1e-2, momentum=0.9),
    "lion": lambda: optax.lion(1e-3),
    "adafactor": lambda: optax.adafactor(1e-2),
    "lamb": lambda: optax.lamb(1e-2),
    # Control flow inside the inner update: lax.cond and a schedule of k.
    "multisteps_inside": lambda: optax.MultiSteps(optax.adam(1e-2), 2).gradient_transformation(),
    "apply_if_finite_inside": lambda: optax.apply_if_finite(optax.adam(1e-2), 3),
    "odd_state": _with_odd_state,
}


def _inputs():
  params = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.array([0.5, -0.0])}
  grads = {"w": jnp.full((2, 3), 0.25), "b": jnp.array([-1.0, 2.0])}
  return params, grads


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("jit", [True, False])
def test_finite_and_skipped_steps(name, jit):
  tx = OPTIMIZERS[name]()
  params, grads = _inputs()
  state = tx.init(params)
  # A first step so that moments and counters are non-trivial.
  _, state = tx.update(grads, state, params)

  def fold(finite, grads, state, params):
    return update_or_keep(tx.update, finite, grads, state, params)

  plain = tx.update
  if jit:
    fold, plain = jax.jit(fold), jax.jit(plain)
  expected_updates, expected_state = plain(grads, state, params)
  updates, new_state = fold(jnp.array(True), grads, state, params)
  chex.assert_trees_all_equal(updates, expected_updates)
  chex.assert_trees_all_equal(new_state, expected_state)

  bad = jax.tree_util.tree_map(lambda g: g.at[0].set(jnp.inf), grads)
  _, kept = fold(jnp.array(False), bad, state, params)
  chex.assert_trees_all_equal(kept, state)


def test_state_of_another_structure_is_an_error():
  def init(params):
    del params
    return {"a": jnp.zeros([])}

  def update(updates, state, params=None):
    del params
    return updates, {"a": state["a"], "b": state["a"]}

  with pytest.raises(ValueError, match="structure"):
    update_or_keep(update, jnp.array(True), {"w": jnp.ones(2)}, init(None), None)


def test_jitted_step_writes_each_moment_once():
  # The plain where over the new state makes XLA copy the donated moments;
  # the folded select does not.
  tx = optax.adam(1e-3)
  params = {"w": jnp.ones((64, 64)), "v": jnp.ones((64,))}

  def step(params, state, grads):
    finite = jnp.all(jnp.isfinite(grads["w"]))
    updates, state = update_or_keep(tx.update, finite, grads, state, params)
    return optax.apply_updates(params, updates), state

  grads = jax.tree_util.tree_map(lambda p: 0.5 * p, params)
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      params, tx.init(params), grads).compile()
  entry = compiled.as_text().split("ENTRY")[1]
  assert " copy(" not in entry
