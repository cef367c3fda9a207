"""Tests of the optax wrapper loss_scaling, its state lookup, metrics and checks."""

import itertools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from models import NnxMLP, bits, f32, init_mlp, like_flax_init, make_batch, mse, poison


def inner_optimizer():
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 100)
  return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=1e-3))


negative_zeros = lambda tree: jax.tree_util.tree_map(lambda u: jnp.full_like(u, -0.0), tree)
SCALE = jaxmp.StaticLossScale(8.0)
mlp_params = lambda *sizes: like_flax_init(  # init_mlp's, drawn in NumPy: no init compiled
    jax.eval_shape(lambda: init_mlp(jax.random.key(0), sizes)))
PARAMS = {"w": jnp.ones(3)}


class LossScalingTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_non_finite_step_is_skipped_bit_identically(self):
    """After a finite step, which is the bare optimizer's on the unscaled grads."""
    rng = np.random.default_rng(1)  # in NumPy, four leaves of one shape: each op compiles once
    params, grads = ({k: rng.normal(size=3).astype(np.float32) for k in "abcd"} for _ in "pg")
    params["b"][0] = -0.0  # a signed zero too
    params, grads = jax.device_put((params, grads))
    bare_updates, bare_state = self.variant(inner_optimizer().update)(
        grads, inner_optimizer().init(params), params)
    for clip in (None, 1.0):  # the flag of all_finite, or of the clipping norm
      tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale(2.0**12),
                              clip_global_norm=clip)
      updates, state = self.variant(tx.update)(
          jax.tree_util.tree_map(lambda g: g * 2.0**12, grads), tx.init(params), params)
      # Differently compiled programs may fuse reductions differently.
      chex.assert_trees_all_close((updates, state.inner_state), (bare_updates, bare_state),
                                  rtol=1e-5, atol=1e-9)
      assert (int(state.skipped_steps), bool(state.last_finite),
              int(state.loss_scale.counter)) == (0, True, 1)
      bads, n = [jnp.inf, -jnp.inf, jnp.nan], len(jax.tree_util.tree_leaves(grads))
      for bad, leaf_index in (zip(bads * n, range(n)) if self.variant.type.name == "WITHOUT_JIT"
                              else itertools.product(bads, range(n))):  # op by op: each once
        updates, new_state = self.variant(tx.update)(
            poison(grads, bad, leaf_index=leaf_index), state, params)
        assert bits((optax.apply_updates(params, updates), updates, new_state.inner_state)
                    ) == bits((params, negative_zeros(updates), state.inner_state))
        assert (float(new_state.loss_scale.loss_scale), int(new_state.skipped_steps),
                bool(new_state.last_finite)) == (2.0**11, 1, False)


def train_step(tx, loss_fn):
  """The step of ``tx`` on the scaled gradients of ``loss_fn``: (params, state, loss)."""
  def step(params, state, *args):
    loss, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(state))(params, *args)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss
  return step


def test_training_with_injected_overflows_equals_training_without_them():
  """Jitted once, with no host transfer after the first step, however steps go."""
  params0, bare = mlp_params(4, 16, 3), inner_optimizer()
  tx = jaxmp.loss_scaling(inner_optimizer(), jaxmp.DynamicLossScale(2.0**10, period=3))
  step = jax.jit(chex.assert_max_traces(train_step(tx, lambda p, batch, inject: mse(
      p, batch) * jnp.where(inject, jnp.inf, jnp.float32(1))), n=1))
  bare_step = jax.jit(lambda params, state, batch: (lambda updates, state: (
      optax.apply_updates(params, updates), state))(*bare.update(
          jax.grad(mse)(params, batch), state, params)))
  injected = np.random.default_rng(0).random(60) < 0.15
  injected[10:14] = True  # a burst
  params, state, bare_params, bare_state, scales = params0, tx.init(params0), params0, (
      bare.init(params0)), []
  for i, inject in enumerate(injected):
    batch, inject_array = make_batch(i), jnp.asarray(inject)
    with jax.transfer_guard("disallow" if i else "allow"):  # the first step compiles
      params, state, _ = step(params, state, batch, inject_array)
      scales.append(state.loss_scale.loss_scale)
      if not inject:
        bare_params, bare_state = bare_step(bare_params, bare_state, batch)
  chex.assert_trees_all_close((params, state.inner_state), (bare_params, bare_state),
                              rtol=2e-5, atol=1e-7)
  assert int(state.skipped_steps) == int(injected.sum())
  scales = [float(x) for x in scales]
  assert min(scales) < 2.0**10  # backed off during the burst
  assert any(b > a for a, b in zip(scales, scales[1:]))  # and grew


def test_wrapper_skips_for_every_kind_of_loss_scale():
  for loss_scale in [jaxmp.NoOpLossScale(), jaxmp.StaticLossScale(4.0)]:
    tx = jaxmp.loss_scaling(optax.sgd(0.1), loss_scale)
    updates, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0])}, tx.init(PARAMS), PARAMS)
    chex.assert_trees_all_equal(optax.apply_updates(PARAMS, updates), PARAMS)
    updates, state = tx.update({"w": jnp.full(3, 4.0)}, state, PARAMS)  # then a finite step
    np.testing.assert_allclose(updates["w"], -0.1 * 4.0 / float(loss_scale.loss_scale))
    assert int(state.skipped_steps) == 1 and bool(state.last_finite)


@pytest.mark.parametrize("wrap", [jaxmp.loss_scaling, lambda tx, ls: jaxmp.multi_steps(tx, ls, 4)],
    ids=["loss_scaling", "multi_steps"])
def test_equal_arguments_give_equal_transformations(wrap):
  # As Flax compares a TrainState's tx: one structure, however often it is built.
  tx = optax.adam(1e-3)
  a, b = wrap(tx, jaxmp.DynamicLossScale()), wrap(tx, jaxmp.DynamicLossScale())
  assert a == b and hash(a) == hash(b)
  assert a != wrap(tx, jaxmp.DynamicLossScale(2.0**10)) and a != wrap(
      tx, jaxmp.DynamicLossScale(period=7))
  assert a != wrap(optax.adam(1e-3), jaxmp.DynamicLossScale())  # another inner tx

  def traced(scale):  # a loss scale of traced values compares by identity
    ls = jaxmp.StaticLossScale(scale)
    assert wrap(tx, ls) == wrap(tx, ls) != wrap(tx, jaxmp.StaticLossScale(scale))
    return scale

  jax.jit(traced)(jnp.float32(2.0))


def test_the_inner_optimizer_gets_unscaled_gradients_in_the_params_dtype_and_extra_args():
  seen = {}  # unscale returns half-precision leaves in float32: the wrapper casts them back

  def update(grads, state, params=None, *, loss):
    seen.update(jax.tree_util.tree_map(lambda g: g.dtype, grads), loss=loss)
    return jax.tree_util.tree_map(lambda g: -loss * g, grads), state

  inner = optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)
  params = {"f16": np.ones(2, np.float16), "bf16": np.ones(2, jnp.bfloat16), "f32": f32(np.ones(2))}
  tx = jaxmp.loss_scaling(inner, jaxmp.StaticLossScale(2.0**10))
  grads = jax.tree_util.tree_map(lambda p: np.full(2, 3 * 2.0**10, p.dtype), params)
  updates, _ = jax.jit(lambda g, s, p: tx.update(g, s, p, loss=0.5))(grads, tx.init(params), params)
  assert seen == {**{k: p.dtype for k, p in params.items()}, "loss": 0.5}
  chex.assert_trees_all_equal(
      updates, jax.tree_util.tree_map(lambda p: np.full(2, -1.5, p.dtype), params), strict=True)


def test_real_float16_overflow_backs_off_until_steps_succeed():
  """A float16 backward pass that overflows at 2**24, with no injection."""
  params, batch = mlp_params(4, 32, 3), make_batch(0, n=16)
  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**24, period=1000))
  step = jax.jit(train_step(tx, lambda p: mse(p, batch, jaxmp.get_policy("mixed_float16"))))
  state, finite, losses = tx.init(params), [], []
  for _ in range(40):
    params, state, loss = step(params, state)
    finite, losses = finite + [bool(state.last_finite)], losses + [float(loss)]
  assert not finite[0] and all(finite[-20:])  # overflowed, then succeeded after backing off
  assert float(state.loss_scale.loss_scale) < 2.0**24 and losses[-1] < losses[0]
  assert int(state.skipped_steps) == finite.index(True)
  assert all(leaf.dtype == jnp.float32 and np.isfinite(leaf).all()
             for leaf in jax.tree_util.tree_leaves(params))


def test_get_loss_scale_finds_the_scale_in_nested_states():
  wrapped = jaxmp.loss_scaling(optax.adam(1e-3), SCALE)
  nnx_optimizer = lambda tx: nnx.Optimizer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
  states = [
      wrapped.init(PARAMS), optax.MultiSteps(wrapped, every_k_schedule=2).init(PARAMS),
      jaxmp.multi_steps(optax.adam(1e-3), SCALE, 2).init(PARAMS),
      optax.inject_hyperparams(lambda learning_rate: jaxmp.loss_scaling(
          optax.sgd(learning_rate), SCALE))(0.1).init(PARAMS),
      nnx_optimizer(wrapped).opt_state,  # leaves wrapped in NNX variables
      nnx_optimizer(wrapped),
      # Containers of a user's: a tuple with the params, a dict.
      (PARAMS, wrapped.init(PARAMS)), {"params": PARAMS, "opt_state": wrapped.init(PARAMS)}]
  array = type(jnp.ones(1))  # not an NNX Variable
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # none of these is misplaced
    jitted = jax.jit(lambda states: [jaxmp.get_loss_scale(s) for s in states])(states)  # at once
    for state, in_jit in zip(states, jitted):
      loss_scale, metrics = jaxmp.get_loss_scale(state), jaxmp.loss_scaling_metrics(state)
      assert type(loss_scale) is jaxmp.StaticLossScale and type(loss_scale.loss_scale) is array
      assert all(type(v) is array for v in metrics.values())
      assert (float(loss_scale.loss_scale), float(metrics["loss_scale"]), float(
          in_jit.loss_scale)) == (8.0, 8.0, 8.0)
      jaxmp.check_loss_scale(state)
  dynamic = jaxmp.DynamicLossScale(2.0**8, period=7, hysteresis=2)  # from NNX's variables
  loss_scale = jaxmp.get_loss_scale(
      nnx_optimizer(jaxmp.loss_scaling(optax.adam(1e-3), dynamic)).opt_state)
  assert type(loss_scale) is jaxmp.DynamicLossScale and type(loss_scale.counter) is array
  assert loss_scale.config() == dynamic.config() and float(loss_scale.loss_scale) == 2.0**8


CHAIN, WRAPPER = "inside optax.chain, next to other transformations", (
    r"inside the state of an optax wrapper \(%s\)")


@pytest.mark.parametrize("build, path, where", [
    (lambda tx: optax.chain(optax.clip_by_global_norm(1.0), tx), "[1]", CHAIN),
    (lambda tx: optax.chain(tx, optax.add_decayed_weights(1e-4)), "[0]", CHAIN),
    (lambda tx: optax.named_chain(("clip", optax.clip_by_global_norm(1.0)), ("scaled", tx)),
     "['scaled']", "inside optax.named_chain, next to other transformations"),
    (lambda tx: optax.masked(tx, {"w": True}), "MaskedState.inner_state", WRAPPER % "MaskedState"),
    (lambda tx: optax.apply_if_finite(tx, 3), "ApplyIfFiniteState.inner_state",
     WRAPPER % "ApplyIfFiniteState"),
    (lambda tx: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), tx), 2),
     "MultiStepsState.inner_opt_state[1]", CHAIN)])
def test_a_wrapper_that_is_not_outermost_is_warned_about(build, path, where):
  state = build(jaxmp.loss_scaling(optax.sgd(0.1), SCALE)).init(PARAMS)
  message = (rf"the jaxmp.loss_scaling state sits at {re.escape(path)} of the "
             rf"optimizer state, {where}\. .*Put every transformation inside "
             r"and wrap the whole optimizer once: jaxmp\.loss_scaling\(optax\.chain\(")
  for read in (jaxmp.get_loss_scale, jaxmp.loss_scaling_metrics, jaxmp.check_loss_scale):
    with pytest.warns(UserWarning, match=read.__name__ + ": " + message) as record:
      read(state)
    assert record[0].filename == __file__  # it points at the caller


def test_warned_misuse_is_real():
  """What it prevents: weight decay after the wrapper moves params. Once per trace."""
  nan = {"w": jnp.full(3, jnp.nan)}
  tx = optax.chain(jaxmp.loss_scaling(optax.sgd(0.1), SCALE), optax.add_decayed_weights(0.5))
  updates, state = tx.update(nan, tx.init(PARAMS), PARAMS)
  read = jax.jit(lambda s: jaxmp.loss_scaling_metrics(s)["skipped_steps"])
  with pytest.warns(UserWarning, match="inside optax.chain") as record:
    assert int(read(state)) == int(read(state)) == 1  # compiled: no second trace or warning
  assert len(record) == 1
  np.testing.assert_array_equal(optax.apply_updates(PARAMS, updates)["w"], 1.5)
  inside = jaxmp.loss_scaling(optax.chain(optax.sgd(0.1), optax.add_decayed_weights(0.5)), SCALE)
  updates, _ = inside.update(nan, inside.init(PARAMS), PARAMS)
  np.testing.assert_array_equal(optax.apply_updates(PARAMS, updates)["w"], 1.0)


def test_metrics_are_scalar_arrays_usable_in_jit():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**4, period=3))
  step = jax.jit(lambda g, s: tx.update({"w": jnp.full(3, g)}, s, PARAMS)[1])
  states = [tx.init(PARAMS)]
  for g in (1.0, jnp.nan, 1.0):
    states.append(step(g, states[-1]))
  metrics = [jax.jit(jaxmp.loss_scaling_metrics)(s) for s in states]
  assert {k: (v.shape, v.dtype.name) for k, v in metrics[-1].items()} == {
      "loss_scale": ((), "float32"), "last_finite": ((), "bool"), **dict.fromkeys((
          "skipped", "skipped_steps", "overflows_at_min", "steps_since_adjustment",
          "recovered_steps", "fallback_steps", "lost_steps"), ((), "int32"))}
  # `skipped` is this step's 0/1, `skipped_steps` the running total.
  assert [(int(m["skipped"]), int(m["skipped_steps"])) for m in metrics] == [
      (0, 0), (0, 0), (1, 1), (0, 1)]
  assert jax.device_get(metrics[-1]) == {
      "loss_scale": 8.0, "skipped": 0, "skipped_steps": 1, "last_finite": True,
      "overflows_at_min": 0, "steps_since_adjustment": 1,
      # Without recovery, a skipped step is a lost batch.
      "recovered_steps": 0, "fallback_steps": 0, "lost_steps": 1}


def test_check_loss_scale_raises_only_after_an_overflow_at_the_minimum():
  """Also in each member of stacked states (vmapped, pmap replicas): the worst named."""
  tx = jaxmp.loss_scaling(
      optax.sgd(0.1), jaxmp.DynamicLossScale(4.0, min_loss_scale=1.0, hysteresis=2))
  state, params = tx.init(PARAMS), {"w": jnp.ones(2)}
  step = jax.jit(lambda s: tx.update({"w": jnp.full(3, jnp.inf)}, s, PARAMS)[1])
  for expected_scale in [4.0, 2.0, 1.0]:  # hysteresis, then two back-offs
    state = step(state)
    assert float(jaxmp.get_loss_scale(state).loss_scale) == expected_scale
    jaxmp.check_loss_scale(state)
    jaxmp.check_loss_scale(jaxmp.loss_scaling_metrics(state))
  state = step(state)  # at the minimum with no budget left
  jaxmp.check_loss_scale(state, max_overflows_at_min=1)  # tolerated
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0, min_loss_scale=1.0))
  states = jax.jit(jax.vmap(lambda _: tx.init(params)))(np.arange(4))
  step = jax.jit(jax.vmap(lambda g, s: tx.update({"w": g}, s, params)[1]))
  # Member 2 overflows three times (two of them at the minimum), member 1 twice.
  for bad in ([2], [1, 2], [1, 2]):
    states = step(np.float32([[np.inf if i in bad else 1.0] * 2 for i in range(4)]), states)
  metrics = jax.device_get(jaxmp.loss_scaling_metrics(states))
  assert (metrics["overflows_at_min"].tolist(), metrics["skipped"].tolist()) == (
      [0, 1, 2, 0], [0, 1, 1, 0])
  jaxmp.check_loss_scale(states, max_overflows_at_min=2)
  for sources, tolerated, raised in (
      ((state, jaxmp.get_loss_scale(state), jaxmp.loss_scaling_metrics(state)), 0, ""),
      ((states, metrics, jaxmp.get_loss_scale(states)), 1, " (member 2 of the 4 stacked states)")):
    for source in sources:  # the remedies that follow: test_faults.py
      with pytest.raises(jaxmp.LossScaleAtMinimumError) as info:
        jaxmp.check_loss_scale(source, max_overflows_at_min=tolerated)
      assert str(info.value).startswith(
          f"Current loss scale already at minimum (1.0): {tolerated + 1} overflow(s) at the "
          f"minimum scale{raised}.\n")
  # Two stacking axes (e.g. pmap over vmap): the member is an index pair.
  grid = jax.device_put(jax.tree_util.tree_map(
      lambda x: np.asarray(x).reshape((2, 2) + x.shape[1:]), states))
  with pytest.raises(jaxmp.LossScaleAtMinimumError, match=r"member \(1, 0\) of the 2x2"):
    jaxmp.check_loss_scale(grid)


class ScaledValueAndGradTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_returns_unscaled_value_and_scaled_grads(self):
    loss_fn = lambda w, x: jnp.sum((w * x) ** 2)
    w, x = jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5])
    loss, grads = self.variant(jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.StaticLossScale(16.0)))(w, x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(w, x)
    chex.assert_trees_all_equal((loss, grads), (ref_loss, ref_grads * 16.0))
    # With aux and several argnums; the loss keeps its dtype.
    fn = jaxmp.scaled_value_and_grad(
        lambda w, b: (jnp.sum(w * b).astype(jnp.float16), {"norm": jnp.linalg.norm(w)}),
        jaxmp.StaticLossScale(4.0), argnums=(0, 1), has_aux=True)
    (loss, aux), grads = self.variant(fn)(jnp.array([1.0, 2.0]), jnp.array([3.0, 4.0]))
    assert loss.dtype == jnp.float16 and float(loss) == 11.0
    assert float(aux["norm"]) == pytest.approx(np.sqrt(5.0))
    chex.assert_trees_all_equal(grads, (jnp.array([12.0, 16.0]), jnp.array([4.0, 8.0])))


def _equinox_case():  # a module that holds functions, through eqx.filter_jit
  eqx = pytest.importorskip("equinox")
  return (eqx.filter_jit(lambda: eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(0)))(),  # one compile
          f32(np.linspace(-1.0, 1.0, 15).reshape(5, 3)),
          lambda m, x: jnp.mean((jax.vmap(m)(x) - 0.5) ** 2), eqx.filter_value_and_grad,
          eqx.filter_jit, lambda grads: eqx.filter(grads, eqx.is_array))


def _nnx_case():
  policy, model = jaxmp.get_policy("mixed_float16"), nnx.jit(lambda: NnxMLP(nnx.Rngs(0)))()
  jaxmp.flax.ModulePolicy({nnx.LayerNorm: "float32"}, default=policy).set_nnx_dtypes(model)
  return model, make_batch(0)["x"], lambda m, x: jnp.mean(policy.cast_to_output(
      m(policy.cast_to_compute(x))) ** 2), nnx.value_and_grad, nnx.jit, nnx.to_pure_dict


@pytest.mark.parametrize("framework", [_nnx_case, _equinox_case], ids=["nnx", "equinox"])
def test_scaled_value_and_grad_takes_each_frameworks_value_and_grad(framework):
  model, x, loss_fn, value_and_grad, jit, arrays_of = framework()
  scaled = jaxmp.scaled_value_and_grad(  # the batch passes through as an argument
      lambda m, x: (loss_fn(m, x), {"n": 5}), jaxmp.StaticLossScale(2.0**10), has_aux=True,
      value_and_grad=value_and_grad)
  reference = value_and_grad(lambda m, x: (loss_fn(m, x) * jnp.float32(2.0**10), {"n": 5}),
                             has_aux=True)
  (loss, aux), grads = jit(scaled)(model, x)
  (expected_loss, expected_aux), expected_grads = jit(reference)(model, x)
  assert aux == expected_aux == {"n": 5}
  # The loss comes back unscaled, the gradients scaled: exactly (a power of two).
  chex.assert_trees_all_equal((loss * 2.0**10, arrays_of(grads)),
                              (expected_loss, arrays_of(expected_grads)))


DECISIONS = [  # (case, gradients, finite): every form of the check must decide alike
    (f"{dtype.__name__}-{name}-{shape}", {"other": jnp.full(3, 2.0), "g": jax.device_put(np.where(
        (np.arange(1000) == 3) | (shape == "many"), np.array(value, dtype), np.ones(1000, dtype)))},
     name in ("finite", "huge", "subnormal"))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16)
    for name, value in (("finite", 1.5), ("inf", np.inf), ("-inf", -np.inf), ("nan", np.nan),
                        ("huge", float(jnp.finfo(dtype).max)),
                        ("subnormal", float(jnp.finfo(dtype).smallest_subnormal)))
    for shape in ("one", "many")]


def _forms_of_the_check(grads):
  """Each form's flag: the update's with and without clipping, multi_steps' on 1 or 2 batches."""
  zeros, flags = jax.tree_util.tree_map(jnp.zeros_like, grads), {}
  for k, clip in itertools.product((0, 1, 2), (None, 1.0)):
    tx = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.NoOpLossScale(), k, clip_global_norm=clip) if (
        k) else jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale(), clip_global_norm=clip)
    state = tx.init(zeros)  # k = 0: loss_scaling
    for micro_batch in [grads] + [zeros] * (max(k, 1) - 1):
      _, state = tx.update(micro_batch, state, zeros)
    flags[f"{k=} {clip=}"] = getattr(state, "inner_opt_state", state).last_finite
  return flags


JITTED_FORMS = jax.jit(lambda grads: {  # all, independent, in one program compiled once a dtype
    "all_finite": jaxmp.all_finite(grads), **_forms_of_the_check(grads)})


@pytest.mark.parametrize("case,grads,expected", DECISIONS, ids=[c[0] for c in DECISIONS])
def test_every_form_of_the_check_decides_alike(case, grads, expected):
  flags = {"all_finite": jaxmp.all_finite(grads),
           **{f"{name} jitted": flag for name, flag in JITTED_FORMS(grads).items()}}
  if case.startswith("float16-") and case.endswith("-one"):  # op by op on one dtype's rows
    flags.update(_forms_of_the_check(grads))  # of one shape: the jitted forms' code
  assert {name: bool(flag) for name, flag in flags.items()} == dict.fromkeys(flags, expected)


# The global norm in float64, by NumPy: XLA's float32 sum of squares of many
# leaves depends on its order, which changes between JAX versions.
_norm = lambda tree: float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                                       for x in jax.tree_util.tree_leaves(tree))))


def test_clip_global_norm_clips_as_optax_does():
  params = mlp_params(64, 300, 10)
  scaled = lambda grads: jax.tree_util.tree_map(lambda g: g * np.float32(2.0**10), grads)  # exact
  grads = jax.tree_util.tree_map(lambda p: np.full(p.shape, 3.0, np.float32), params)
  scale = jaxmp.StaticLossScale(2.0**10)
  chained = jaxmp.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), scale)
  sharing = jaxmp.loss_scaling(optax.sgd(1.0), scale, clip_global_norm=1.0)
  expected, _ = jax.jit(chained.update)(scaled(grads), chained.init(params), params)
  got, state = jax.jit(sharing.update)(scaled(grads), sharing.init(params), params)
  chex.assert_trees_all_close(got, expected, rtol=1e-6)
  assert _norm(got) == pytest.approx(1.0, rel=1e-6) and bool(state.last_finite)
  # Below the norm the gradients pass unchanged, bit for bit.
  small = jax.tree_util.tree_map(lambda g: g * np.float32(1e-4), grads)
  got, _ = jax.jit(sharing.update)(scaled(small), sharing.init(params), params)
  chex.assert_trees_all_equal(got, jax.tree_util.tree_map(np.negative, small))
  # Huge finite gradients, whose plain float32 sum of squares overflows, step.
  huge = float(jnp.finfo(jnp.float32).max)
  grads = {"a": f32([huge, -huge, 3.0]), "b": f32(np.full(4, 1e20))}
  params = jax.tree_util.tree_map(np.zeros_like, grads)
  tx = jaxmp.loss_scaling(optax.sgd(1.0), jaxmp.NoOpLossScale(), clip_global_norm=2.0)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_finite) and _norm(updates) == pytest.approx(2.0, rel=1e-6)
  np.testing.assert_allclose(updates["a"], [-np.sqrt(2.0), np.sqrt(2.0), 0.0],
                             rtol=1e-6, atol=1e-30)


def test_an_unjitted_update_compiles_nothing_the_second_time():
  """Un-jitted, the check and the clipped norm find the programs their first call compiled."""
  compiled, params = [], {"w": f32(np.ones((2, 3))), "b": f32(np.ones(3))}
  listener = lambda event, *_, **__: compiled.append(event) if "backend_compile" in event else None
  txs = [jaxmp.loss_scaling(optax.sgd(1.0), SCALE, clip_global_norm=c) for c in (None, 1.0)]
  run = lambda: [tx.update(params, tx.init(params), params) for tx in txs]
  run()
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    run()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  assert compiled == []


def test_guard_false_runs_the_bare_update():
  grads = {"w": jnp.array([1.0, jnp.nan, 2.0])}
  tx = jaxmp.loss_scaling(optax.adamw(0.1), jaxmp.NoOpLossScale(), guard=False)
  updates, state = jax.jit(tx.update)(grads, tx.init(PARAMS), PARAMS)
  chex.assert_trees_all_equal(  # the nan step is applied
      (updates, state.inner_state), optax.adamw(0.1).update(grads, optax.adamw(0.1).init(
          PARAMS), PARAMS))
  assert int(state.skipped_steps) == 0 and bool(state.last_finite)
