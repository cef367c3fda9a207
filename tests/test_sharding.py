"""Loss scaling on several devices: GSPMD (jit over a mesh), shard_map, pmap.

Uses the eight simulated CPU devices that conftest.py sets up. The model is a
small MLP whose parameters and optimizer state are sharded over both axes of a
4x2 ("data", "fsdp") mesh, while the loss-scale state stays replicated.
"""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp
from models import bits

AXES = ("data", "fsdp")
# Parameters sharded over both mesh axes (data-parallel plus FSDP-style).
PARAM_SPECS = {"dense1": {"kernel": P("data", "fsdp"), "bias": P(AXES)},
               "dense2": {"kernel": P("fsdp", "data"), "bias": P(AXES)}}
BATCH_SPECS = {"x": P("data"), "y": P("data")}
# dense1.kernel[5, 20] lives on mesh position (5 // 4, 20 // 16) = (1, 1) alone.
POISONED = ("dense1", "kernel", (5, 20))


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices; tests/conftest.py sets them up")
  return jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Auto,) * 2)


def _init_params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {"dense1": {"kernel": jax.random.normal(k1, (16, 32)) * 0.3, "bias": jnp.zeros(32)},
          "dense2": {"kernel": jax.random.normal(k2, (32, 8)) * 0.3, "bias": jnp.zeros(8)}}
_init_params = functools.cache(jax.jit(_init_params))  # one program, drawn once


_batch = jax.jit(lambda step: dict(zip("xy", (jax.random.normal(k, (32, n)) for k, n in zip(
    jax.random.split(jax.random.fold_in(jax.random.key(1), step)), (16, 8))))))  # one program


def _poison(params, inject):
  """Zeros shaped like params, in NumPy; with ``inject``, one inf at POISONED."""
  poison = jax.tree_util.tree_map(lambda p: np.zeros(p.shape, np.float32), params)
  if inject:
    poison[POISONED[0]][POISONED[1]][POISONED[2]] = np.inf
  return poison


def _make_tx(axis_name=None):
  return jaxmp.loss_scaling(optax.adam(1e-2), jaxmp.DynamicLossScale(2.0**10, period=3),
                            axis_name=axis_name)


def _train_step(tx, params, opt_state, batch, poison):
  """One step of an MLP; ``poison`` is added to the scaled gradients (an overflow)."""

  def loss_fn(params):
    h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return jnp.mean((h @ params["dense2"]["kernel"] + params["dense2"]["bias"] - batch["y"]) ** 2)

  loss, grads = jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(opt_state))(params)
  updates, opt_state = tx.update(jax.tree_util.tree_map(jnp.add, grads, poison),
                                 opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _named(mesh, specs):
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def _opt_state_shardings(tx, params, param_shardings, replicated):
  """The documented recipe: moments like the params, the rest replicated."""
  return optax.tree_utils.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
      param_shardings, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, P))


@pytest.fixture(scope="module")
def sharded(mesh):
  """The sharded params and optimizer state, their shardings, and the
  documented step: shardings pinned on both sides."""
  tx, param_shardings = _make_tx(), _named(mesh, PARAM_SPECS)
  params = jax.device_put(_init_params(), param_shardings)
  opt_shardings = _opt_state_shardings(tx, params, param_shardings, NamedSharding(mesh, P()))
  step = jax.jit(functools.partial(_train_step, tx), in_shardings=(
      param_shardings, opt_shardings, _named(mesh, BATCH_SPECS), param_shardings),
                 out_shardings=(param_shardings, opt_shardings, NamedSharding(mesh, P())))
  return types.SimpleNamespace(
      tx=tx, params=params, opt_state=jax.jit(tx.init, out_shardings=opt_shardings)(params),
      param_shardings=param_shardings, opt_shardings=opt_shardings, step=step,
      poison=lambda inject: jax.device_put(_poison(params, inject), param_shardings))


def _shardings(tree):
  # Compared as a list of leaves: a DynamicLossScale compares by identity.
  return jax.tree_util.tree_structure(tree), jax.tree_util.tree_leaves(
      jax.tree_util.tree_map(lambda x: getattr(x, "sharding", x), tree))


def _per_device(x):
  return [np.asarray(shard.data).item() for shard in x.addressable_shards]


def test_the_loss_scaling_state_is_found_by_tree_map_params(mesh, sharded):
  # optax finds the moments inside jaxmp.loss_scaling; the rest, the loss
  # scale with it, is replicated.
  opt_state, adam = sharded.opt_state, sharded.opt_state.inner_state[0]
  assert [jax.tree_util.tree_map(lambda x: x.sharding, moments) for moments in (
      adam.mu, adam.nu)] == [sharded.param_shardings] * 2
  scalars = [adam.count, opt_state.skipped_steps, opt_state.last_finite,
             *jax.tree_util.tree_leaves(opt_state.loss_scale)]
  assert [(x.sharding, x.sharding.is_fully_replicated) for x in scalars] == [
      (NamedSharding(mesh, P()), True)] * 7


def test_dynamic_loss_scale_keeps_none_leaves_when_rebuilt():
  # Regression: rebuilding a DynamicLossScale from None leaves (as jit does for
  # its layouts, given out_shardings of an optimizer state) used to fill in
  # hysteresis_left, which made jax.jit(..., out_shardings=...) fail.
  loss_scale = jaxmp.DynamicLossScale(2.0**10, hysteresis=2)
  assert jax.tree_util.tree_map(lambda _: None, loss_scale).hysteresis_left is None
  assert int(loss_scale.hysteresis_left) == 2
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  out = jax.jit(lambda ls: ls.adjust(jnp.array(False)), out_shardings=jax.tree_util.tree_map(
      lambda _: sharding, loss_scale))(loss_scale)
  assert int(out.hysteresis_left) == 1 and float(out.loss_scale) == 2.0**10


def test_gspmd_inf_on_one_shard_skips_on_every_device(mesh, sharded):
  finite, poisoned = sharded.poison(False), sharded.poison(True)
  layer, name, _ = POISONED  # the inf really lives on one shard of one device
  assert [s.device for s in poisoned[layer][name].addressable_shards
          if not np.isfinite(np.asarray(s.data)).all()] == [mesh.devices[1, 1]]
  params, opt_state, _ = sharded.step(sharded.params, sharded.opt_state, _batch(0), finite)
  before, scale = bits((params, opt_state.inner_state)), float(opt_state.loss_scale.loss_scale)
  params, opt_state, loss = sharded.step(params, opt_state, _batch(1), poisoned)
  assert np.isfinite(float(loss))  # the loss was fine; one gradient was not
  # Every device took the same decision and skipped.
  assert _per_device(opt_state.last_finite) == [False] * 8 and int(opt_state.skipped_steps) == 1
  assert _per_device(opt_state.loss_scale.loss_scale) == [scale / 2] * 8
  # Params and inner state bit-identical, and still sharded as before.
  assert bits((params, opt_state.inner_state)) == before
  assert _shardings(params) == _shardings(sharded.param_shardings)
  assert _shardings(opt_state) == _shardings(sharded.opt_shardings)
  # The next finite step updates every parameter.
  new, opt_state, _ = sharded.step(params, opt_state, _batch(2), finite)
  assert bool(opt_state.last_finite)
  assert all(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
      lambda a, b: bool(np.all(np.asarray(a) != np.asarray(b))), new, params)))


def test_gspmd_step_keeps_shardings_without_pinning_outputs(mesh, sharded):
  # Even when out_shardings is left to the compiler, the outputs keep the
  # input shardings: nothing is silently gathered onto one device.
  args = (sharded.params, sharded.opt_state, jax.device_put(_batch(0), _named(mesh, BATCH_SPECS)),
          sharded.poison(False))
  compiled = jax.jit(functools.partial(_train_step, sharded.tx)).lower(*args).compile()
  for got, want, arrays in zip(compiled.output_shardings[:2], compiled.input_shardings[0][:2],
                               args[:2]):
    for g, w, x in zip(*map(jax.tree_util.tree_leaves, (got, want, arrays))):
      assert g.is_equivalent_to(w, x.ndim) and g.is_equivalent_to(x.sharding, x.ndim), (g, w)


def test_gspmd_matches_single_device_over_20_steps(sharded):
  overflow_steps, device = {3, 4, 11}, jax.devices()[0]
  params, opt_state = sharded.params, sharded.opt_state
  ref_params, ref_state = jax.device_put((sharded.params, sharded.opt_state), device)  # gathered
  ref_step = jax.jit(functools.partial(_train_step, sharded.tx))

  def record(state, loss):
    metrics = jaxmp.loss_scaling_metrics(state)
    return (float(loss), float(metrics["loss_scale"]), bool(metrics["last_finite"]),
            int(metrics["skipped_steps"]))

  history = []  # of (sharded, single device)
  for step in range(20):
    batch, poison = _batch(step), _poison(ref_params, step in overflow_steps)
    params, opt_state, loss = sharded.step(
        params, opt_state, batch, jax.device_put(poison, sharded.param_shardings))
    ref_params, ref_state, ref_loss = ref_step(
        ref_params, ref_state, jax.device_put(batch, device), poison)
    history.append((record(opt_state, loss), record(ref_state, ref_loss)))
  # Skips and scales agree exactly; losses and parameters to float32 rounding.
  assert [h[1:] for h, _ in history] == [r[1:] for _, r in history]
  assert [h[2] for h, _ in history].count(False) == len(overflow_steps)
  scales = [h[1] for h, _ in history]
  assert min(scales) < 2.0**10 < max(scales)  # backed off and grew again
  np.testing.assert_allclose(*zip(*[(h[0], r[0]) for h, r in history]), rtol=1e-5)
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
                         jax.device_get(params), jax.device_get(ref_params))
  assert _shardings(params) == _shardings(sharded.param_shardings)


def _shard_map_update(mesh, axis_name, out=True):
  """An update inside shard_map where each device holds one gradient shard,
  and its inputs; it returns the new params and each device's decision and
  scale, or without ``out`` the optimizer state as replicated."""
  tx = _make_tx(axis_name)
  opt_specs = _opt_state_shardings(tx, _init_params(), PARAM_SPECS, P())

  def body(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    if not out:
      return updates, opt_state
    return (optax.apply_updates(params, updates), opt_state.last_finite[None],
            opt_state.loss_scale.loss_scale[None])

  update = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(PARAM_SPECS, opt_specs, PARAM_SPECS),
      out_specs=(PARAM_SPECS, P(AXES), P(AXES)) if out else (PARAM_SPECS, opt_specs)))
  params = jax.device_put(_init_params(), _named(mesh, PARAM_SPECS))
  opt_state = jax.jit(tx.init, out_shardings=_named(mesh, opt_specs))(params)
  grads = jax.tree_util.tree_map(lambda p: p + 1.0, _poison(params, True))
  return update, (jax.device_put(grads, _named(mesh, PARAM_SPECS)), opt_state, params)


def test_shard_map_with_axis_name_all_devices_skip(mesh):
  update, args = _shard_map_update(mesh, axis_name=AXES)
  new_params, finite, scale = update(*args)
  np.testing.assert_array_equal(np.asarray(finite), [False] * 8)
  np.testing.assert_array_equal(np.asarray(scale), [2.0**9] * 8)
  assert bits(new_params) == bits(args[2])


def test_shard_map_without_axis_name_devices_disagree(mesh):
  # This is why loss_scaling takes axis_name: inside shard_map each device
  # only sees its own gradient shard. Device (1, 1) skips, the others update,
  # and the "replicated" loss scale now differs between devices.
  update, args = _shard_map_update(mesh, axis_name=None)
  new_params, finite, scale = update(*args)
  expected = mesh.devices.ravel() != mesh.devices[1, 1]
  assert expected.sum() == 7
  np.testing.assert_array_equal(np.asarray(finite), expected)
  np.testing.assert_array_equal(np.asarray(scale), np.where(expected, 2.0**10, 2.0**9))
  # The devices that did not see the inf applied the update.
  assert (np.asarray(new_params["dense2"]["kernel"]) != args[2]["dense2"]["kernel"]).any()
  # With shard_map's default check_vma=True, returning the loss-scale state as
  # replicated (P()) without axis_name is an error at trace time.
  update, args = _shard_map_update(mesh, axis_name=None, out=False)
  with pytest.raises(ValueError, match="out_specs"):
    update(*args)


@pytest.mark.usefixtures("mesh")  # 8 devices
@pytest.mark.parametrize("axis_name", ["devices", None])
def test_pmap_inf_on_one_replica(axis_name):
  tx, params = _make_tx(axis_name=axis_name), {"w": np.ones((8, 4), np.float32)}
  replicate = functools.partial(jax.tree_util.tree_map, lambda x: np.stack([x] * 8))
  grads = {"w": np.ones((8, 8, 4), np.float32)}  # per replica: replica 6 holds one inf
  grads["w"][6, 2, 1] = np.inf

  def step(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new_params, new_state = jax.pmap(step, axis_name="devices")(
      grads, replicate(jax.device_get(tx.init(params))), replicate(params))
  np.testing.assert_array_equal(new_state.last_finite,
                                [False] * 8 if axis_name else [True] * 6 + [False, True])
  if axis_name:
    np.testing.assert_array_equal(np.asarray(new_params["w"]), 1.0)
    np.testing.assert_array_equal(np.asarray(new_state.skipped_steps), 1)
  # The host-side checks read the stacked state, member by member.
  jaxmp.check_loss_scale(new_state)
  monitor = jaxmp.LossScaleMonitor(every=1, warn_rate=None)
  monitor.update(1, new_state)
  assert (monitor.history["skipped_steps"], monitor.history["last_finite"]) == ([1], [False])


def test_a_train_state_is_sharded_as_flax_examples_build_it(mesh):
  # Flax's lm1b example (after MaxText): the shardings come from jax.eval_shape
  # of the state, the state from jax.jit(..., out_shardings=...); the two
  # calls of make_state must give one pytree structure.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jaxmp.flax  # pylint: disable=g-import-not-at-top

  dense = lambda features, axes: nn.Dense(features, kernel_init=nn.with_logical_partitioning(
      nn.initializers.lecun_normal(), axes))
  model = nn.Sequential([dense(32, ("embed", "mlp")), dense(8, ("mlp", "embed"))])
  tx, x = optax.adam(1e-3), np.ones((8, 16), np.float32)
  make_state = lambda key: jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=model.init(key, x)["params"], tx=tx, policy="mixed_float16")
  specs = nn.get_partition_spec(jax.eval_shape(make_state, jax.random.key(0)))
  shardings = nn.logical_to_mesh_sharding(specs, mesh, (("embed", "data"), ("mlp", "fsdp")))
  with jax.set_mesh(mesh):
    state = jax.jit(make_state, out_shardings=shardings)(jax.random.key(0))
  kernel = state.params["layers_0"]["kernel"].value
  assert kernel.sharding.spec == P("data", "fsdp") and len(kernel.addressable_shards) == 8
  mu = state.opt_state.inner_state[0].mu["layers_1"]["kernel"].value
  assert mu.sharding.spec == P("fsdp", "data")  # the moments like the params
  assert state.opt_state.loss_scale.loss_scale.sharding.is_fully_replicated
