"""A skipped step (loss_scaling's guard), other state guarded (keep_on_skip) and a
skipped batch retried (retry_skipped), each over plain optax, a Linen TrainState,
NNX and Equinox (a real BatchNorm's statistics over Linen and NNX)."""

import functools
import re
from typing import Any

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from models import LinenBatchNormMLP, NnxBatchNormMLP, f32, finite

F16 = jnp.float16
# The fp16 backward pass computes scale * x * cos(w): with x = 6 it is over
# 65504 at 2**15 and 2**14, not at 2**13; with x = 0.6 it is finite at 2**15.
W, OVERFLOWS, FINITE = f32(np.linspace(0.0, 0.5, 8)), f32(np.full(8, 6.0)), f32(np.full(8, 0.6))
NAN = f32(np.where(np.arange(8) == 3, np.nan, 0.6))
KEY = jax.random.key(0)
float16_loss = lambda w, x: jnp.sum(jnp.sin(w.astype(F16)) * x.astype(F16)).astype(jnp.float32)
float32_loss = lambda w, x: jnp.sum(jnp.sin(w) * x)
schedule = lambda count: 1e-2 * (1.0 + count.astype(jnp.float32))  # counts skipped steps too
new_stats = lambda stats, x: 0.5 * (stats + x)  # state the optimizer does not own (BatchNorm-like)
optimizer = lambda loss_scale: optax.inject_hyperparams(  # adam in loss_scaling, scheduled
    lambda learning_rate: jaxmp.loss_scaling(optax.adam(learning_rate), loss_scale))(
        learning_rate=schedule)
# Built once: equal loss scales, equal optimizers, one trace (NNX; Linen, which create wraps).
nnx_optimizer, linen_tx = functools.cache(optimizer), optax.inject_hyperparams(optax.adam)(
    learning_rate=schedule)


# One train step, four frameworks: ``init(loss_scale, tx)`` and ``step(loss_fn,
# tx)``, ``tx(loss_scale)`` building the optimizer (Linen: the one create wraps).
class Functional:
  """``((model, stats), opt_state)``: an array and jax, or an Equinox module and Equinox."""

  def __init__(self, model, weights, value_and_grad, jit, apply_updates):
    self.model, self.weights, self.value_and_grad = model, weights, value_and_grad
    self.jit, self.apply_updates = jit, apply_updates

  def init(self, loss_scale, tx=optimizer):
    return (self.model, jnp.zeros(8)), tx(loss_scale).init(self.arrays(self.model))

  def step(self, loss_fn, tx=optimizer):
    def step(state, x):
      (model, stats), opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          lambda model, x: loss_fn(self.weights(model), x), jaxmp.get_loss_scale(opt_state),
          value_and_grad=self.value_and_grad)(model, x)
      updates, opt_state = tx(jaxmp.get_loss_scale(opt_state)).update(
          grads, opt_state, self.arrays(model))
      # The flag found in any pytree that holds the state: here (model, opt_state).
      stats = jaxmp.keep_on_skip((model, opt_state), new_stats(stats, x), stats)
      return ((self.apply_updates(model, updates), stats), opt_state), loss
    return step

  arrays = staticmethod(lambda state: eqx.filter(state, eqx.is_array))


class EqxModel(eqx.Module):  # with a non-array leaf, as Equinox modules have
  w: jax.Array
  activation: Any = jnp.sin


class StatsState(jaxmp.flax.TrainState):
  stats: Any


class Linen:
  """A TrainState whose loss draws a dropout-like mask from ``state.step``."""
  jit = staticmethod(jax.jit)

  def init(self, loss_scale, tx=lambda _: linen_tx):
    return StatsState.create(apply_fn=None, params={"w": W}, tx=tx(loss_scale),
                             policy="float32", loss_scale=loss_scale, stats=jnp.zeros(8))

  def step(self, loss_fn, tx=None):
    def step(state, x):
      keep = jax.random.bernoulli(jax.random.fold_in(KEY, state.step), 0.75, (8,))
      loss, grads = state.value_and_grad(
          lambda params, x: loss_fn(params["w"], jnp.where(keep, x, 0.0)))(state.params, x)
      return state.apply_gradients(grads=grads, stats=new_stats(state.stats, x)), loss
    return step

  arrays = staticmethod(lambda state: {"step": state.step, "params": state.params,
                                       "opt_state": state.opt_state, "stats": state.stats})


class Model(nnx.Module):
  def __init__(self):
    self.w, self.stats = nnx.Param(W), nnx.BatchStat(jnp.zeros(8))


class Nnx:
  """A model and its nnx.Optimizer, the step on the objects themselves."""
  jit = staticmethod(nnx.jit)

  def init(self, loss_scale, tx=nnx_optimizer):
    model = Model()
    return model, nnx.Optimizer(model, tx(loss_scale), wrt=nnx.Param)

  def step(self, loss_fn, tx=None):
    def step(objects, x):
      model, opt = objects
      loss, grads = jaxmp.scaled_value_and_grad(
          lambda model, x: loss_fn(model.w[...], x), jaxmp.get_loss_scale(opt.opt_state),
          value_and_grad=nnx.value_and_grad)(model, x)
      opt.update(model, grads)
      model.stats[...] = jaxmp.keep_on_skip(
          opt.opt_state, new_stats(model.stats[...], x), model.stats[...])
      return objects, loss
    return step

  arrays = staticmethod(lambda objects: jax.tree_util.tree_map(np.array, nnx.state(objects)))


FRAMEWORKS = {"optax": Functional(W, lambda w: w, jax.value_and_grad, jax.jit,
                                 optax.apply_updates),
              "linen": Linen(), "nnx": Nnx(),
              "equinox": Functional(EqxModel(W), lambda m: m.w, eqx.filter_value_and_grad,
                                    eqx.filter_jit, eqx.apply_updates)}
parametrize = pytest.mark.parametrize("name", sorted(FRAMEWORKS))


@pytest.fixture(autouse=True)
def fresh_trace_counts():  # optax's and Equinox's steps share their source
  chex.clear_trace_counter()


PARAM_PATHS = {"optax": "[0][0]", "linen": "['params']['w']", "nnx": "[0]['w'].value",
               "equinox": "[0][0].w"}
STATS_PATHS = {"optax": "[0][1]", "linen": "['stats']", "nnx": "[0]['stats'].value",
               "equinox": "[0][1]"}


@functools.cache  # the cases share one jitted step per framework, loss and retry options
def jitted_step(name, loss_fn, retry=None):  # retry: retry_skipped's options, as items
  fw, options = FRAMEWORKS[name], dict(retry or ())
  options["fallback"] = options.get("fallback") and fw.step(options["fallback"])
  return fw.jit(fw.step(loss_fn) if retry is None else chex.assert_max_traces(
      jaxmp.retry_skipped(fw.step(loss_fn), **options), n=1))


def snapshot(name, state):
  """Every array of the state by path (the recovery counters left out: metrics)."""
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_flatten_with_path(FRAMEWORKS[name].arrays(state))[0]
          if not any(c in jax.tree_util.keystr(path) for c in ("recovered_", "fallback_"))}


def metrics(state):
  return {k: v.item() for k, v in jax.device_get(jaxmp.loss_scaling_metrics(state)).items()}


dyn, three = jaxmp.DynamicLossScale, dict(max_retries=3, fallback=float32_loss)
RETRIES = {  # case: the loss scale, x, options; (retries, fell back, finite, the last
    # attempt's scale); the plain step that leaves the same state (its scale and
    # loss); the recovery counters. The cases with a fallback share one step (`three`).
    "finite": (dyn(2.0**15), FINITE, three, (0, False, True, 2.0**15),
               (dyn(2.0**15), float16_loss), {}),
    "recovered": (dyn(2.0**15), OVERFLOWS, {}, (2, False, True, 2.0**13),
                  (dyn(2.0**13), float16_loss), {"recovered_steps": 1}),
    # The fallback runs once, after the retries (all three overflow): one back-off lower.
    "fallback": (dyn(2.0**17), OVERFLOWS, three, (3, True, True, 2.0**13),
                 (dyn(2.0**13), float32_loss), {"recovered_steps": 1, "fallback_steps": 1}),
    # A static scale does not change on a skip: no retry, straight to the fallback.
    "static": (jaxmp.StaticLossScale(2.0**15), OVERFLOWS, dict(fallback=float32_loss),
               (0, True, True, 2.0**15), (jaxmp.StaticLossScale(2.0**15), float32_loss),
               {"recovered_steps": 1, "fallback_steps": 1}),
    # A lost batch: the retries' backoffs undone; at the floor the overflows count once.
    **{f"lost at {scale}": (dyn(scale), NAN, three, (3, True, False, max(scale / 2**4, 1.0)),
                            (dyn(scale), float16_loss), {}) for scale in (2.0**15, 1.0)},
}


@parametrize
@pytest.mark.parametrize("case", list(RETRIES))
def test_a_retried_step_leaves_the_state_of_the_plain_step_that_worked_or_was_skipped(name, case):
  """Traced once (by the first case that shares it), with no host transfer. Every
  counter (the TrainState's step, which the dropout mask folds in, the schedule's
  count, the NNX optimizer's step) advances once."""
  fw, (loss_scale, x, options, outcome, (plain_scale, plain_loss), counters) = (
      FRAMEWORKS[name], RETRIES[case])
  step = jitted_step(name, float16_loss, tuple(options.items()))
  state, loss, info = step(fw.init(loss_scale), x)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite),
          float(info.loss_scale.loss_scale)) == outcome
  plain, plain_loss = jitted_step(name, plain_loss)(fw.init(plain_scale), x)
  chex.assert_trees_all_equal(snapshot(name, state), snapshot(name, plain))
  assert metrics(state) == {**metrics(plain), **counters}
  assert (float(loss) == float(plain_loss)) if info.finite else not np.isfinite(loss)
  if case.startswith("lost"):
    assert [metrics(state)[k] for k in ("lost_steps", "skipped_steps", "overflows_at_min")] == [
        1, 1, int(loss_scale.loss_scale == 1.0)]
  with jax.transfer_guard("disallow"):  # the next step: no trace, no transfer
    step(state, x)


# A skipped step may advance these: the loss scale's state, the skip counters, and the step
# counters outside the inner optimizer (a TrainState's step, an nnx.Optimizer's,
# inject_hyperparams' count and the learning rate it schedules), but not adam's own count.
SKIP_MAY_CHANGE = re.compile(r"loss_scale|skipped_steps|lost_steps|last_finite|learning_rate|"
                             r"\['step'\]|(?<!\[0\])(\.count|\['count'\])")


@parametrize
def test_a_skipped_step_changes_no_array_and_a_finite_step_moves_every_one(name):
  """Without retry_skipped: the guard of jaxmp.loss_scaling, in each framework's
  own state, under its own jit, traced once."""
  fw = FRAMEWORKS[name]
  state = fw.init(jaxmp.DynamicLossScale(2.0**8, hysteresis=2, consecutive_hysteresis=True))
  step = fw.jit(chex.assert_max_traces(fw.step(float16_loss), n=1))
  nan = f32(np.full(8, np.nan))  # whatever Linen's dropout-like mask keeps
  inputs = [FINITE, nan, FINITE, nan, FINITE, nan, nan, FINITE]
  trajectory = []  # (hysteresis left, loss scale)
  for x in inputs:
    before = snapshot(name, state)
    state, loss = step(state, x)
    after = snapshot(name, state)
    assert {p: a.dtype for p, a in after.items()} == {p: a.dtype for p, a in before.items()}
    loss_scale = jaxmp.get_loss_scale(state)
    trajectory.append((int(loss_scale.hysteresis_left), float(loss_scale.loss_scale)))
    finite = x is not nan
    assert bool(np.isfinite(loss)) == finite == metrics(state)["last_finite"]
    if finite:  # the params and the guarded statistic move
      for path in (PARAM_PATHS[name], STATS_PATHS[name]):
        assert np.any(after[path] != before[path]), path
    else:
      for path, value in before.items():
        if not SKIP_MAY_CHANGE.search(path):
          assert after[path].tobytes() == value.tobytes(), path
  # Each overflow spends one unit of hysteresis and each clean step refills it; the second of two
  # in a row backs the scale off (the budget stays spent until a clean step).
  assert trajectory == list(zip([2, 1, 2, 1, 2, 1, 1, 2], [2.0**8] * 6 + [2.0**7] * 2))
  assert metrics(state)["skipped_steps"] == 4
  if name in ("linen", "nnx"):  # a TrainState and an nnx.Optimizer count calls
    assert int(state.step if name == "linen" else state[1].step[...]) == len(inputs)


ACCUMULATORS = {
    "multi_steps": lambda loss_scale: jaxmp.multi_steps(optax.sgd(0.1), loss_scale, 3),
    "MultiSteps": lambda loss_scale: optax.MultiSteps(jaxmp.loss_scaling(
        optax.sgd(0.1), loss_scale), 3, should_skip_update_fn=optax.skip_not_finite),
    # A TrainState wraps its tx: the accumulation sits inside the wrapper.
    "inside": lambda loss_scale: optax.MultiSteps(optax.sgd(0.1), 3),
}


@pytest.mark.parametrize("name, accumulator", [
    ("optax", "multi_steps"), ("optax", "MultiSteps"), ("nnx", "multi_steps"),
    ("nnx", "MultiSteps"), ("linen", "inside")])
def test_keep_on_skip_under_accumulation_writes_each_finite_micro_batch(name, accumulator):
  """Never a nan micro-batch's values, and not the flag of the last step."""
  fw, tx = FRAMEWORKS[name], ACCUMULATORS[accumulator]
  state, step = fw.init(jaxmp.DynamicLossScale(), tx), fw.jit(fw.step(float32_loss, tx))
  written = []
  for x in (jnp.ones(8), jnp.full(8, jnp.nan, jnp.float32), jnp.ones(8)):  # one dtype
    state, _ = step(state, x)
    written.append(snapshot(name, state)[STATS_PATHS[name]])
  np.testing.assert_array_equal(np.stack(written), [[0.5] * 8, [0.5] * 8, [0.75] * 8])


@pytest.mark.parametrize("name", ["optax", "linen"])
@pytest.mark.parametrize("applied", [False, True])
def test_keep_on_skip_keeps_or_writes_a_typed_prng_key(name, applied):
  """Eagerly, as a TrainState's field too."""
  old = {"key": jax.random.key(0), "mean": jnp.zeros(2)}  # new is cast to old's dtypes
  new = {"key": jax.random.key(1), "mean": jnp.ones(2, jnp.float16)}
  grads = {"w": jnp.array([1.0 if applied else jnp.inf, 0.0])}
  if name == "linen":
    kept = StatsState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                             loss_scale=jaxmp.DynamicLossScale(), stats=old, policy="float32"
                             ).apply_gradients(grads=grads, stats=new).stats
  else:
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    kept = jaxmp.keep_on_skip(tx.update(grads, tx.init({"w": jnp.ones(2)}))[1], new, old)
  as_data = lambda tree: {**tree, "key": jax.random.key_data(tree["key"])}
  chex.assert_trees_all_equal(as_data(kept), as_data(
      {**new, "mean": jnp.ones(2)} if applied else old), strict=True)


cross_entropy = lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
    logits.astype(jnp.float32), y).mean()


class LinenBatchNorm:
  """The Flax recipe: the new statistics go to apply_gradients, kept on a skip."""

  def init(self):
    model = LinenBatchNormMLP()
    variables = jax.jit(model.init, static_argnames="train")(KEY, jnp.ones((1, 4)), train=False)
    return StatsState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2),
        policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**8),
        stats=variables["batch_stats"])

  @staticmethod
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):  # (state, the statistics the forward pass computed)
    def loss_fn(params, x, y):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.stats}, x,
                                       train=True, mutable=["batch_stats"])
      return cross_entropy(logits, y), updates["batch_stats"]

    (_, computed), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
    return state.apply_gradients(grads=grads, stats=computed), computed

  params_and_stats = staticmethod(lambda state: (state.params, state.stats))
  steps = staticmethod(lambda state: int(state.step))
  evaluate = staticmethod(jax.jit(lambda state, x: state.apply_fn(  # on the running averages
      {"params": state.params, "batch_stats": state.stats}, x, train=False)))


class NnxBatchNorm:
  """BatchStat updated in place: keep_on_skip writes back a copy taken before."""

  def init(self):
    model = nnx.jit(lambda: NnxBatchNormMLP(nnx.Rngs(0)))()  # one compile, not op by op
    jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
    return model, nnx.Optimizer(model, jaxmp.loss_scaling(
        optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**8)), wrt=nnx.Param)

  @staticmethod
  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(objects, x, y):
    model, optimizer = objects
    old = jax.tree_util.tree_map(lambda v: v, nnx.state(model, nnx.BatchStat))
    _, grads = jaxmp.scaled_value_and_grad(lambda model: cross_entropy(model(x.astype(F16)), y),
        jaxmp.get_loss_scale(optimizer.opt_state), value_and_grad=nnx.value_and_grad)(model)
    optimizer.update(model, grads)
    computed = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    nnx.update(model, jaxmp.keep_on_skip(
        optimizer.opt_state, nnx.state(model, nnx.BatchStat), old))
    return objects, computed

  params_and_stats = staticmethod(lambda objects: tuple(
      nnx.to_pure_dict(nnx.state(objects[0], kind)) for kind in (nnx.Param, nnx.BatchStat)))
  steps = staticmethod(lambda objects: int(objects[1].step[...]))  # nnx.Optimizer counts calls

  def evaluate(self, objects, x):
    objects[0].eval()
    logits = nnx.jit(lambda model, x: model(x))(objects[0], x)
    objects[0].train()
    return logits


BATCH_NORMS = {"linen": LinenBatchNorm(), "nnx": NnxBatchNorm()}


bits = lambda tree: {jax.tree_util.keystr(path): (np.asarray(x).dtype, np.asarray(x).tobytes())
                     for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("framework", sorted(BATCH_NORMS))
def test_a_skipped_step_keeps_the_batch_statistics_bit_identical_and_a_finite_one_writes_them(
    framework):
  """Jitted and traced once (eagerly the same jnp.where runs, op by op: a TrainState
  field kept eagerly, test_flax_train_state.py)."""
  fw = BATCH_NORMS[framework]
  x, y = np.float32(np.random.default_rng(0).normal(size=(8, 4))), np.int32(np.arange(8) % 3)
  (bad := x.copy())[0, 0] = np.inf
  state, _ = fw.step(fw.init(), x, y)
  params_before, stats_before = fw.params_and_stats(state)
  # One inf pixel: the statistics the forward pass computes are poisoned, the step skipped.
  state, poisoned = fw.step(state, bad, y)
  assert not finite(poisoned)
  assert metrics(state)["skipped_steps"] == 1 and fw.steps(state) == 2
  assert bits(fw.params_and_stats(state)) == bits((params_before, stats_before))
  assert finite(fw.evaluate(state, x))
  # A finite step writes exactly the statistics computed and moves every parameter.
  state, computed = fw.step(state, x, y)
  params, stats = fw.params_and_stats(state)
  assert metrics(state)["last_finite"] and bits(stats) == bits(computed)
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda a, b: not np.array_equal(a, b), (params, stats), (params_before, stats_before))))


P = jax.sharding.PartitionSpec


def test_eight_devices_agree_on_each_retry_under_sharded_jit_and_shard_map():
  """Only the rows of device 5 overflow, and only above 2**13. Under shard_map
  the step's aux is each device's own loss."""
  mesh = jax.make_mesh((8,), ("batch",))
  rows = jax.sharding.NamedSharding(mesh, P("batch"))
  x = jax.device_put(np.where(np.arange(8)[:, None] == 5, OVERFLOWS, FINITE), rows)
  w = jax.device_put(np.broadcast_to(W, (8, 8)), rows)
  tx = lambda loss_scale: jaxmp.loss_scaling(optax.adam(1e-2), loss_scale)
  state = lambda scale: ((w, jnp.zeros_like(w)), tx(jaxmp.DynamicLossScale(scale)).init(w))
  step = FRAMEWORKS["optax"].step(float16_loss, tx)
  ((new_w, _), _), _, info = jax.jit(jaxmp.retry_skipped(step))(state(2.0**15), x)
  assert int(info.retries) == 2 and bool(info.finite)
  # Every device's rows were updated from gradients taken at 2**13.
  ((direct_w, _), _), _ = jax.jit(step)(state(2.0**13), x)
  chex.assert_trees_all_equal(np.asarray(new_w), np.asarray(direct_w))

  def run_sharded(scale, step):
    tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(scale), axis_name="batch")

    def device_step(state, x):
      w, opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          float16_loss, jaxmp.get_loss_scale(opt_state))(w, x[0])
      updates, opt_state = tx.update(grads, opt_state, w)
      return (optax.apply_updates(w, updates), opt_state), loss[None]

    out_specs = (P(), P("batch")) + ((P(),) if step is jaxmp.retry_skipped else ())
    return jax.jit(jax.shard_map(step(device_step), mesh=mesh, in_specs=(P(), P("batch")),
                                 out_specs=out_specs))((W, tx.init(W)), x)

  (w, _), losses, info = run_sharded(2.0**15, jaxmp.retry_skipped)
  # The gradients of the replicated w are summed over the devices, in
  # float16: the sum overflows above 2**12.
  assert int(info.retries) == 3 and bool(info.finite)
  (direct_w, _), direct_losses = run_sharded(2.0**12, lambda step: step)
  chex.assert_trees_all_equal((np.asarray(w), np.asarray(losses)),
                              (np.asarray(direct_w), np.asarray(direct_losses)))
