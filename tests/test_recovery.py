"""A skipped step (jaxmp.loss_scaling's guard), guarding other state on a skip
(jaxmp.keep_on_skip) and retrying a skipped batch (jaxmp.retry_skipped), each
promise tested once over plain optax, a Linen TrainState, NNX and Equinox (a
real BatchNorm's statistics over Linen and NNX)."""

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
from models import LinenBatchNormMLP, NnxBatchNormMLP, classification_batch

F16 = jnp.float16
# The fp16 backward pass computes scale * x * cos(w): with x = 6 it is over
# 65504 at 2**15 and 2**14, not at 2**13; with x = 0.6 it is finite at 2**15.
W = jnp.linspace(0.0, 0.5, 8, dtype=jnp.float32)
OVERFLOWS = jnp.full(8, 6.0)
FINITE = jnp.full(8, 0.6)
NAN = FINITE.at[3].set(jnp.nan)
KEY = jax.random.key(0)


def float16_loss(w, x):
  return jnp.sum(jnp.sin(w.astype(F16)) * x.astype(F16)).astype(jnp.float32)


def float32_loss(w, x):
  return jnp.sum(jnp.sin(w) * x)


def schedule(count):  # advances once per applied or skipped step
  return 1e-2 * (1.0 + count.astype(jnp.float32))


def optimizer(loss_scale):
  """adam inside loss_scaling, inside inject_hyperparams with a schedule."""
  return optax.inject_hyperparams(
      lambda learning_rate: jaxmp.loss_scaling(optax.adam(learning_rate), loss_scale)
  )(learning_rate=schedule)


def new_stats(stats, x):  # state the optimizer does not own (BatchNorm-like)
  return 0.9 * stats + 0.1 * x


# -- One train step, four frameworks ----------------------------------------------


class Optax:
  """``((w, stats), opt_state)``: params, a guarded statistic, optax state."""

  jit = staticmethod(jax.jit)

  def init(self, loss_scale):
    tx = optimizer(loss_scale)
    return (W, jnp.zeros(8)), tx.init(W)

  def step(self, loss_fn):
    def step(state, x):
      (w, stats), opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          loss_fn, jaxmp.get_loss_scale(opt_state))(w, x)
      tx = optimizer(jaxmp.get_loss_scale(opt_state))
      updates, opt_state = tx.update(grads, opt_state, w)
      stats = jaxmp.keep_on_skip(opt_state, new_stats(stats, x), stats)
      return ((optax.apply_updates(w, updates), stats), opt_state), loss
    return step

  def arrays(self, state):
    return state


class StatsState(jaxmp.flax.TrainState):
  stats: Any


class Linen:
  """A TrainState whose loss draws a dropout-like mask from ``state.step``."""

  jit = staticmethod(jax.jit)

  def init(self, loss_scale):
    # create wraps tx: the schedule's count sits inside the loss scaling.
    return StatsState.create(
        apply_fn=None, params={"w": W},
        tx=optax.inject_hyperparams(optax.adam)(learning_rate=schedule),
        policy="float32", loss_scale=loss_scale, stats=jnp.zeros(8))

  def step(self, loss_fn):
    def step(state, x):
      keep = jax.random.bernoulli(jax.random.fold_in(KEY, state.step), 0.75, (8,))

      def loss(params, x):
        return loss_fn(params["w"], jnp.where(keep, x, 0.0))

      loss, grads = state.value_and_grad(loss)(state.params, x)
      state = state.apply_gradients(grads=grads, stats=new_stats(state.stats, x))
      return state, loss
    return step

  def arrays(self, state):
    return {"step": state.step, "params": state.params,
            "opt_state": state.opt_state, "stats": state.stats}


class Model(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(W)
    self.stats = nnx.BatchStat(jnp.zeros(8))


class Nnx:
  """A model and its nnx.Optimizer, the step on the objects themselves."""

  jit = staticmethod(nnx.jit)

  def init(self, loss_scale):
    model = Model()
    return model, nnx.Optimizer(model, optimizer(loss_scale), wrt=nnx.Param)

  def step(self, loss_fn):
    def step(objects, x):
      model, opt = objects
      loss, grads = jaxmp.scaled_value_and_grad(
          lambda model, x: loss_fn(model.w[...], x),
          jaxmp.get_loss_scale(opt.opt_state),
          value_and_grad=nnx.value_and_grad)(model, x)
      opt.update(model, grads)
      model.stats[...] = jaxmp.keep_on_skip(
          opt.opt_state, new_stats(model.stats[...], x), model.stats[...])
      return objects, loss
    return step

  def arrays(self, objects):
    return jax.tree_util.tree_map(jnp.array, nnx.state(objects))


class EqxModel(eqx.Module):
  w: jax.Array
  activation: Any = jnp.sin  # a non-array leaf, as Equinox modules have


class Equinox:
  """``((model, stats), opt_state)`` with ``eqx.filter_value_and_grad``."""

  jit = staticmethod(eqx.filter_jit)

  def init(self, loss_scale):
    model = EqxModel(W)
    return (model, jnp.zeros(8)), optimizer(loss_scale).init(
        eqx.filter(model, eqx.is_array))

  def step(self, loss_fn):
    def step(state, x):
      (model, stats), opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          lambda model, x: loss_fn(model.w, x), jaxmp.get_loss_scale(opt_state),
          value_and_grad=eqx.filter_value_and_grad)(model, x)
      tx = optimizer(jaxmp.get_loss_scale(opt_state))
      updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
      stats = jaxmp.keep_on_skip(opt_state, new_stats(stats, x), stats)
      return ((eqx.apply_updates(model, updates), stats), opt_state), loss
    return step

  def arrays(self, state):
    return eqx.filter(state, eqx.is_array)


FRAMEWORKS = {"optax": Optax(), "linen": Linen(), "nnx": Nnx(), "equinox": Equinox()}
parametrize = pytest.mark.parametrize("name", sorted(FRAMEWORKS))


def run(name, state, x, recovering=True, loss_fn=float16_loss, **options):
  fw = FRAMEWORKS[name]
  step = fw.step(loss_fn)
  if recovering:
    fallback = options.pop("fallback", None)
    step = jaxmp.retry_skipped(
        step, fallback=fallback and fw.step(fallback), **options)
  return fw.jit(step)(state, x)


def snapshot(name, state, recovery_counters=False):
  """Every array of the state by path (the recovery counters left out)."""
  leaves = jax.tree_util.tree_flatten_with_path(FRAMEWORKS[name].arrays(state))[0]
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves
          if recovery_counters or not any(
              c in jax.tree_util.keystr(path)
              for c in ("recovered_steps", "fallback_steps"))}


def metrics(state):
  if isinstance(state, tuple) and isinstance(state[1], nnx.Optimizer):
    state = state[1].opt_state
  return {k: int(v) if v.dtype != jnp.float32 else float(v)
          for k, v in jaxmp.loss_scaling_metrics(state).items()}


# -- The promises ----------------------------------------------------------------


@parametrize
def test_a_finite_step_is_the_plain_step_without_retrace_or_transfer(name):
  fw = FRAMEWORKS[name]
  x = jnp.asarray(FINITE)
  plain_state, plain_loss = run(name, fw.init(jaxmp.DynamicLossScale(2.0**10)), x,
                                recovering=False)
  step = fw.jit(chex.assert_max_traces(jaxmp.retry_skipped(
      fw.step(float16_loss), fallback=fw.step(float32_loss)), n=1))
  state, loss, info = step(fw.init(jaxmp.DynamicLossScale(2.0**10)), x)
  chex.assert_trees_all_equal(snapshot(name, state), snapshot(name, plain_state))
  assert metrics(state) == metrics(plain_state)
  assert float(loss) == float(plain_loss)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite)) == (0, False, True)
  with jax.transfer_guard("disallow"):  # the second step: no trace, no transfer
    step(state, x)


@parametrize
def test_a_recovered_step_is_the_clean_step_at_the_backed_off_scale(name):
  # Every counter (the TrainState's step, which the dropout mask folds in;
  # the schedule's count; the NNX optimizer's step) advances once.
  fw = FRAMEWORKS[name]
  state, loss, info = run(name, fw.init(jaxmp.DynamicLossScale(2.0**15)), OVERFLOWS)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite)) == (2, False, True)
  assert float(info.loss_scale.loss_scale) == 2.0**13
  clean, clean_loss = run(name, fw.init(jaxmp.DynamicLossScale(2.0**13)), OVERFLOWS,
                          recovering=False)
  chex.assert_trees_all_equal(snapshot(name, state), snapshot(name, clean))
  recovered = metrics(state)
  assert recovered.pop("recovered_steps") == 1
  expected = metrics(clean)
  expected.pop("recovered_steps")
  assert recovered == expected
  assert float(loss) == float(clean_loss)


@parametrize
@pytest.mark.parametrize("scale", [2.0**15, 1.0])  # 1.0: at the floor
def test_a_lost_batch_leaves_the_state_the_plain_skipped_step_leaves(name, scale):
  """Bit for bit, counters and loss scale included: the retries' backoffs are
  undone, and at the floor the overflows count once."""
  fw = FRAMEWORKS[name]
  state, _, info = run(name, fw.init(jaxmp.DynamicLossScale(scale)), NAN,
                       max_retries=3, fallback=float32_loss)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite)) == (3, True, False)
  # The scale the last attempt, the fallback, ran at.
  assert float(info.loss_scale.loss_scale) == max(scale / 2**4, 1.0)
  plain, _ = run(name, fw.init(jaxmp.DynamicLossScale(scale)), NAN, recovering=False)
  chex.assert_trees_all_equal(snapshot(name, state, recovery_counters=True),
                              snapshot(name, plain, recovery_counters=True))
  m = metrics(state)
  assert m == metrics(plain)
  assert (m["lost_steps"], m["skipped_steps"], m["overflows_at_min"]) == (1, 1, int(scale == 1.0))


@parametrize
def test_the_fallback_runs_once_after_the_retries(name):
  fw = FRAMEWORKS[name]
  state, _, info = run(name, fw.init(jaxmp.DynamicLossScale(2.0**15)), OVERFLOWS,
                       max_retries=1, fallback=float32_loss)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite)) == (1, True, True)
  m = metrics(state)
  assert (m["recovered_steps"], m["fallback_steps"], m["skipped_steps"]) == (1, 1, 0)
  # A static scale does not change on a skip: no retry, straight to the fallback.
  state, _, info = run(name, fw.init(jaxmp.StaticLossScale(2.0**15)), OVERFLOWS,
                       fallback=float32_loss)
  assert (int(info.retries), bool(info.fell_back), bool(info.finite)) == (0, True, True)


# A skipped step may advance these: the loss scale's state, the skip counters,
# and the step counters outside the inner optimizer (a TrainState's step, an
# nnx.Optimizer's, inject_hyperparams' count and the learning rate it
# schedules), but not adam's own count.
SKIP_MAY_CHANGE = re.compile(r"loss_scale|skipped_steps|lost_steps|last_finite|learning_rate|"
                             r"\['step'\]|(?<!\[0\])(\.count|\['count'\])")
PARAM_PATHS = {"optax": "[0][0]", "linen": "['params']['w']", "nnx": "[0]['w'].value",
               "equinox": "[0][0].w"}
STATS_PATHS = {"optax": "[0][1]", "linen": "['stats']", "nnx": "[0]['stats'].value",
               "equinox": "[0][1]"}


def opt_state_of(state):
  if isinstance(state, tuple) and isinstance(state[1], nnx.Optimizer):
    return state[1].opt_state
  return state[1] if isinstance(state, tuple) else state.opt_state


@parametrize
def test_a_skipped_step_changes_no_array_and_a_finite_step_moves_every_one(name):
  """Without retry_skipped: the guard of jaxmp.loss_scaling, in each framework's
  own state, under its own jit, traced once."""
  fw = FRAMEWORKS[name]
  state = fw.init(jaxmp.DynamicLossScale(2.0**8, hysteresis=2, consecutive_hysteresis=True))
  step = fw.jit(chex.assert_max_traces(fw.step(float16_loss), n=1))
  nan = jnp.full(8, jnp.nan)  # whatever Linen's dropout-like mask keeps
  inputs = [FINITE, nan, FINITE, nan, FINITE, nan, nan, FINITE]
  hysteresis_left, scales = [], []
  for x in inputs:
    before = snapshot(name, state)
    state, loss = step(state, x)
    after = snapshot(name, state)
    assert {p: a.dtype for p, a in after.items()} == {p: a.dtype for p, a in before.items()}
    loss_scale = jaxmp.get_loss_scale(opt_state_of(state))
    hysteresis_left.append(int(loss_scale.hysteresis_left))
    scales.append(float(loss_scale.loss_scale))
    finite = x is not nan
    assert bool(np.isfinite(loss)) == finite == metrics(state)["last_finite"]
    if finite:  # the params and the guarded statistic move
      for path in (PARAM_PATHS[name], STATS_PATHS[name]):
        assert np.any(after[path] != before[path]), path
    else:
      for path, value in before.items():
        if not SKIP_MAY_CHANGE.search(path):
          assert after[path].tobytes() == value.tobytes(), path
  # Each overflow spends one unit of hysteresis and each clean step refills
  # it; the second of two in a row backs the scale off (the budget stays
  # spent until a clean step).
  assert hysteresis_left == [2, 1, 2, 1, 2, 1, 1, 2]
  assert scales == [2.0**8] * 6 + [2.0**7] * 2
  assert metrics(state)["skipped_steps"] == 4
  if name in ("linen", "nnx"):  # a TrainState and an nnx.Optimizer count calls
    assert int(state.step if name == "linen" else state[1].step[...]) == len(inputs)


# -- keep_on_skip -------------------------------------------------------------------


def _skipped_state(wrap):
  tx = wrap(jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()))
  state = tx.init(jnp.ones(2))
  _, state = tx.update(jnp.array([jnp.inf, 0.0]), state, jnp.ones(2))
  return state


WRAPPERS = {
    "bare": lambda tx: tx,
    "inject_hyperparams": lambda tx: optax.inject_hyperparams(lambda: tx)(),
    "MultiSteps": lambda tx: optax.MultiSteps(
        tx, 1, should_skip_update_fn=optax.skip_not_finite),
    "tuple": lambda tx: tx,
}


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_keep_on_skip_finds_the_flag_wherever_the_state_sits(wrapper):
  state = _skipped_state(WRAPPERS[wrapper])
  holder = (jnp.zeros(3), {"opt": state}) if wrapper == "tuple" else state
  old = {"mean": jnp.zeros(2, jnp.float32)}
  kept = jaxmp.keep_on_skip(holder, {"mean": jnp.full(2, jnp.inf, jnp.float16)}, old)
  chex.assert_trees_all_equal(kept, old)  # old's values and dtypes


ACCUMULATORS = {
    "multi_steps": lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 3),
    "MultiSteps": lambda: optax.MultiSteps(
        jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()), 3,
        should_skip_update_fn=optax.skip_not_finite),
    # A TrainState wraps its tx: the accumulation sits inside the wrapper.
    "inside": lambda: optax.MultiSteps(optax.sgd(0.1), 3),
}


def accumulating(name, tx):
  """``(state, step(state, x) -> (state, stats))`` keeping ``stats + x``."""
  loss_fn = lambda w, x: jnp.sum(w * x)
  if name == "linen":
    state = StatsState.create(apply_fn=None, params={"w": W}, tx=tx, policy="float32",
                              loss_scale=jaxmp.DynamicLossScale(), stats=jnp.zeros(8))

    def step(state, x):
      _, grads = state.value_and_grad(lambda p: loss_fn(p["w"], x))(state.params)
      state = state.apply_gradients(grads=grads, stats=state.stats + x)
      return state, state.stats
    return state, jax.jit(step)
  if name == "nnx":
    model = Model()

    def step(objects, x):
      model, opt = objects
      _, grads = jaxmp.scaled_value_and_grad(
          lambda m: loss_fn(m.w[...], x), jaxmp.get_loss_scale(opt.opt_state),
          value_and_grad=nnx.value_and_grad)(model)
      opt.update(model, grads)
      model.stats[...] = jaxmp.keep_on_skip(
          opt.opt_state, model.stats[...] + x, model.stats[...])
      return objects, model.stats[...]
    return (model, nnx.Optimizer(model, tx, wrt=nnx.Param)), nnx.jit(step)

  def step(state, x):
    (w, stats), opt_state = state
    _, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(opt_state))(w, x)
    updates, opt_state = tx.update(grads, opt_state, w)
    stats = jaxmp.keep_on_skip(opt_state, stats + x, stats)
    return ((optax.apply_updates(w, updates), stats), opt_state), stats
  return ((W, jnp.zeros(8)), tx.init(W)), jax.jit(step)


@pytest.mark.parametrize("name, accumulator", [
    ("optax", "multi_steps"), ("optax", "MultiSteps"), ("nnx", "multi_steps"),
    ("nnx", "MultiSteps"), ("linen", "inside")])
def test_keep_on_skip_under_accumulation_writes_each_finite_micro_batch(name, accumulator):
  """Never a nan micro-batch's values, and not the flag of the last step."""
  state, step = accumulating(name, ACCUMULATORS[accumulator]())
  written = []
  for x in (jnp.ones(8), jnp.ones(8).at[0].set(jnp.nan), jnp.ones(8)):
    state, stats = step(state, x)
    written.append(np.asarray(stats))
  np.testing.assert_array_equal(np.stack(written), [[1.0] * 8, [1.0] * 8, [2.0] * 8])


@pytest.mark.parametrize("name", ["optax", "linen"])
@pytest.mark.parametrize("applied", [False, True])
def test_keep_on_skip_keeps_or_writes_a_typed_prng_key(name, applied):
  """Eagerly, as a TrainState's field too."""
  old = {"key": jax.random.key(0), "mean": jnp.zeros(2)}
  new = {"key": jax.random.split(old["key"])[0], "mean": jnp.ones(2)}
  grads = {"w": jnp.array([1.0 if applied else jnp.inf, 0.0])}
  if name == "linen":
    state = StatsState.create(apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
                              policy="float32", loss_scale=jaxmp.DynamicLossScale(), stats=old)
    kept = state.apply_gradients(grads=grads, stats=new).stats
  else:
    tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    _, state = tx.update(grads, tx.init({"w": jnp.ones(2)}))
    kept = jaxmp.keep_on_skip(state, new, old)
  expected = new if applied else old
  chex.assert_trees_all_equal(jax.random.key_data(kept["key"]),
                              jax.random.key_data(expected["key"]))
  chex.assert_trees_all_equal(kept["mean"], expected["mean"])


# -- BatchNorm statistics, Linen and NNX ---------------------------------------------


class BatchStatsState(jaxmp.flax.TrainState):
  batch_stats: Any


def cross_entropy(logits, y):
  return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


class LinenBatchNorm:
  """The Flax recipe: the new statistics go to ``apply_gradients``, which
  keeps the old ones on a skipped step."""

  def init(self):
    model = LinenBatchNormMLP()
    variables = model.init(KEY, jnp.ones((1, 4)), train=False)
    return BatchStatsState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-2),
        policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**8),
        batch_stats=variables["batch_stats"])

  @staticmethod
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(state, x, y):
    """``(state, the statistics the forward pass computed)``."""

    def loss_fn(params, x, y):
      logits, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats}, x, train=True,
          mutable=["batch_stats"])
      return cross_entropy(logits, y), updates["batch_stats"]

    (_, computed), grads = state.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
    return state.apply_gradients(grads=grads, batch_stats=computed), computed

  def params_and_stats(self, state):
    return state.params, state.batch_stats

  def steps(self, state):
    return int(state.step)

  def evaluate(self, state, x):  # on the running averages
    return state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                          x, train=False)


class NnxBatchNorm:
  """The layers update their BatchStat variables in place: a copy taken
  before the step is written back by keep_on_skip."""

  def init(self):
    model = NnxBatchNormMLP(nnx.Rngs(0))
    jaxmp.flax.ModulePolicy({}, default="mixed_float16").set_nnx_dtypes(model)
    return model, nnx.Optimizer(
        model, jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**8)),
        wrt=nnx.Param)

  @staticmethod
  @nnx.jit
  @chex.assert_max_traces(n=1)
  def step(objects, x, y):
    model, optimizer = objects
    old = jax.tree_util.tree_map(lambda v: v, nnx.state(model, nnx.BatchStat))
    _, grads = jaxmp.scaled_value_and_grad(
        lambda model: cross_entropy(model(x.astype(F16)), y),
        jaxmp.get_loss_scale(optimizer.opt_state), value_and_grad=nnx.value_and_grad)(model)
    optimizer.update(model, grads)
    computed = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    nnx.update(model, jaxmp.keep_on_skip(
        optimizer.opt_state, nnx.state(model, nnx.BatchStat), old))
    return objects, computed

  def params_and_stats(self, objects):
    model = objects[0]
    return tuple(nnx.to_pure_dict(nnx.state(model, kind)) for kind in (nnx.Param, nnx.BatchStat))

  def steps(self, objects):
    return int(objects[1].step[...])  # nnx.Optimizer counts calls

  def evaluate(self, objects, x):
    model = objects[0]
    model.eval()
    logits = model(x)
    model.train()
    return logits


BATCH_NORMS = {"linen": LinenBatchNorm(), "nnx": NnxBatchNorm()}


def bits(tree):
  """Each leaf's dtype and bytes by path: equal only if bit-identical."""
  return {jax.tree_util.keystr(path): (np.asarray(leaf).dtype, np.asarray(leaf).tobytes())
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("framework", sorted(BATCH_NORMS))
def test_a_skipped_step_keeps_the_batch_statistics_bit_identical_and_a_finite_one_writes_them(
    framework):
  """Jitted only (and traced once): eagerly the same jnp.where runs, op by op
  (a TrainState field kept eagerly: test_flax_train_state.py::
  test_apply_gradients_keeps_the_fields_dtypes_and_replaces_static_ones)."""
  fw = BATCH_NORMS[framework]
  x, y = classification_batch()
  state, _ = fw.step(fw.init(), x, y)
  params_before, stats_before = fw.params_and_stats(state)
  params_bits, stats_bits = bits(params_before), bits(stats_before)
  # One inf pixel: the statistics the forward pass computes are poisoned and
  # the step is skipped.
  state, poisoned = fw.step(state, x.at[0, 0].set(jnp.inf), y)
  assert not jaxmp.all_finite(poisoned)
  assert metrics(state)["skipped_steps"] == 1 and fw.steps(state) == 2
  params, stats = fw.params_and_stats(state)
  assert bits(stats) == stats_bits and bits(params) == params_bits
  assert jaxmp.all_finite(fw.evaluate(state, x))
  # A finite step writes exactly the statistics the model computed, and
  # moves every parameter.
  state, computed = fw.step(state, x, y)
  assert metrics(state)["last_finite"]
  params, stats = fw.params_and_stats(state)
  assert bits(stats) == bits(computed)
  changed = jax.tree_util.tree_map(lambda a, b: bool(jnp.any(a != b)),
                                   (params, stats), (params_before, stats_before))
  assert all(jax.tree_util.tree_leaves(changed))


# -- Several devices ----------------------------------------------------------------


def test_eight_devices_under_sharded_jit_agree_on_each_retry():
  mesh = jax.make_mesh((8,), ("batch",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))
  # Only the rows of device 5 overflow, and only above 2**13.
  x = jax.device_put(jnp.broadcast_to(FINITE, (8, 8)).at[5].set(OVERFLOWS), rows)
  w = jax.device_put(jnp.broadcast_to(W, (8, 8)), rows)

  def step_of(tx):
    def step(state, x):
      w, opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          float16_loss, jaxmp.get_loss_scale(opt_state))(w, x)
      updates, opt_state = tx.update(grads, opt_state, w)
      return (optax.apply_updates(w, updates), opt_state), loss
    return step

  tx = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**15))
  (new_w, _), _, info = jax.jit(jaxmp.retry_skipped(step_of(tx)))((w, tx.init(w)), x)
  assert int(info.retries) == 2 and bool(info.finite)
  # Every device's rows were updated from gradients taken at 2**13.
  direct = jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**13))
  (direct_w, _), _ = jax.jit(step_of(direct))((w, direct.init(w)), x)
  chex.assert_trees_all_equal(np.asarray(new_w), np.asarray(direct_w))


def test_eight_devices_under_shard_map_retry_a_step_whose_aux_varies():
  """The step's aux is each device's own loss."""
  mesh = jax.make_mesh((8,), ("batch",))
  rows = jax.sharding.PartitionSpec("batch")
  x = jax.device_put(jnp.broadcast_to(FINITE, (8, 8)).at[5].set(OVERFLOWS),
                     jax.sharding.NamedSharding(mesh, rows))

  def run_sharded(tx, step):
    def device_step(state, x):
      w, opt_state = state
      loss, grads = jaxmp.scaled_value_and_grad(
          float16_loss, jaxmp.get_loss_scale(opt_state))(w, x[0])
      updates, opt_state = tx.update(grads, opt_state, w)
      return (optax.apply_updates(w, updates), opt_state), loss

    def body(state, x):
      state, loss, *info = step(device_step)(state, x)
      return (state, loss[None], *info)
    out_specs = (jax.sharding.PartitionSpec(), rows) + (
        (jax.sharding.PartitionSpec(),) if step is jaxmp.retry_skipped else ())
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(
        jax.sharding.PartitionSpec(), rows), out_specs=out_specs))((W, tx.init(W)), x)

  def scaling(scale):
    return jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(scale),
                              axis_name="batch")
  (w, _), losses, info = run_sharded(scaling(2.0**15), jaxmp.retry_skipped)
  # The gradients of the replicated w are summed over the devices, in
  # float16: the sum overflows above 2**12.
  assert int(info.retries) == 3 and bool(info.finite)
  (direct_w, _), direct_losses = run_sharded(scaling(2.0**12), lambda step: step)
  chex.assert_trees_all_equal(np.asarray(w), np.asarray(direct_w))
  chex.assert_trees_all_equal(np.asarray(losses), np.asarray(direct_losses))
