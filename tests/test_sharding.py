"""Loss scaling on several devices: GSPMD (jit over a mesh), shard_map, pmap.

Uses the eight simulated CPU devices that conftest.py sets up. The model is a
small MLP whose parameters and optimizer state are sharded over both axes of a
4x2 ("data", "fsdp") mesh, while the loss-scale state stays replicated.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp

AXES = ("data", "fsdp")
# Parameters sharded over both mesh axes (data-parallel plus FSDP-style).
PARAM_SPECS = {
    "dense1": {"kernel": P("data", "fsdp"), "bias": P(AXES)},
    "dense2": {"kernel": P("fsdp", "data"), "bias": P(AXES)},
}
BATCH_SPECS = {"x": P("data"), "y": P("data")}
# One element of one shard: dense1.kernel[5, 20] lives on mesh position
# (data=5 // 4, fsdp=20 // 16) = (1, 1), and on no other device.
POISONED = ("dense1", "kernel", (5, 20))


def _needs_eight_devices():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices; tests/conftest.py sets them up")


@pytest.fixture(scope="module")
def mesh():
  _needs_eight_devices()
  return jax.make_mesh((4, 2), AXES, axis_types=(AxisType.Auto,) * 2)


def _init_params(seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {
      "dense1": {
          "kernel": jax.random.normal(k1, (16, 32), jnp.float32) * 0.3,
          "bias": jnp.zeros((32,), jnp.float32),
      },
      "dense2": {
          "kernel": jax.random.normal(k2, (32, 8), jnp.float32) * 0.3,
          "bias": jnp.zeros((8,), jnp.float32),
      },
  }


def _batch(step):
  kx, ky = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
  return {
      "x": jax.random.normal(kx, (32, 16), jnp.float32),
      "y": jax.random.normal(ky, (32, 8), jnp.float32),
  }


def _poison(params, inject):
  """Zeros shaped like params; with ``inject``, one inf at POISONED."""
  poison = jax.tree_util.tree_map(jnp.zeros_like, params)
  if inject:
    layer, name, index = POISONED
    poison[layer][name] = poison[layer][name].at[index].set(jnp.inf)
  return poison


def _loss_fn(params, batch):
  h = jnp.tanh(batch["x"] @ params["dense1"]["kernel"] + params["dense1"]["bias"])
  out = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
  return jnp.mean((out - batch["y"]) ** 2)


def _make_tx(axis_name=None):
  return jaxmp.loss_scaling(
      optax.adam(1e-2),
      jaxmp.DynamicLossScale(2.0**10, period=3),
      axis_name=axis_name,
  )


def _train_step(tx, params, opt_state, batch, poison):
  """One step; ``poison`` is added to the scaled gradients (an overflow)."""
  loss_scale = jaxmp.get_loss_scale(opt_state)
  loss, grads = jaxmp.scaled_value_and_grad(_loss_fn, loss_scale)(params, batch)
  grads = jax.tree_util.tree_map(jnp.add, grads, poison)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def _named(mesh, specs):
  return jax.tree_util.tree_map(lambda spec: NamedSharding(mesh, spec), specs)


def _opt_state_shardings(tx, params, param_shardings, replicated):
  """The documented recipe: moments like the params, the rest replicated."""
  return optax.tree_utils.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
      param_shardings, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, P))


def _sharded_setup(mesh, tx):
  param_shardings = _named(mesh, PARAM_SPECS)
  params = jax.device_put(_init_params(), param_shardings)
  opt_shardings = _opt_state_shardings(tx, params, param_shardings,
                                       NamedSharding(mesh, P()))
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  return params, opt_state, param_shardings, opt_shardings


def _sharded_step(mesh, tx, param_shardings, opt_shardings):
  """The documented pattern: shardings pinned on both sides of the step."""
  batch_shardings = _named(mesh, BATCH_SPECS)
  return jax.jit(
      functools.partial(_train_step, tx),
      in_shardings=(param_shardings, opt_shardings, batch_shardings,
                    param_shardings),
      out_shardings=(param_shardings, opt_shardings,
                     NamedSharding(mesh, P())),
  )


def _host(tree):
  return jax.tree_util.tree_map(np.asarray, tree)


def _assert_shardings(tree, shardings):
  # Compared leaf by leaf: a DynamicLossScale compares by identity.
  got = jax.tree_util.tree_map(lambda x: x.sharding, tree)
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(
      shardings)
  assert jax.tree_util.tree_leaves(got) == jax.tree_util.tree_leaves(shardings)


def _per_device_values(x):
  return [np.asarray(shard.data) for shard in x.addressable_shards]


# --- optimizer-state shardings (optax.tree_utils.tree_map_params) ---------


def test_the_loss_scaling_state_is_found_by_tree_map_params(mesh):
  # optax finds the moments inside jaxmp.loss_scaling; the rest, the loss
  # scale with it, is replicated.
  tx = _make_tx()
  params, opt_state, param_shardings, _ = _sharded_setup(mesh, tx)
  adam_state = opt_state.inner_state[0]
  for moments in (adam_state.mu, adam_state.nu):
    got = jax.tree_util.tree_map(lambda x: x.sharding, moments)
    assert got == param_shardings
  replicated = NamedSharding(mesh, P())
  scalars = [adam_state.count, opt_state.skipped_steps, opt_state.last_finite]
  scalars += jax.tree_util.tree_leaves(opt_state.loss_scale)
  assert len(scalars) == 7
  for leaf in scalars:
    assert leaf.sharding == replicated
    assert leaf.sharding.is_fully_replicated


def test_dynamic_loss_scale_keeps_none_leaves_when_rebuilt():
  # Regression: rebuilding a DynamicLossScale from None leaves (as jit does for
  # its layouts, given out_shardings of an optimizer state) used to fill in
  # hysteresis_left, which made jax.jit(..., out_shardings=...) fail.
  loss_scale = jaxmp.DynamicLossScale(2.0**10, hysteresis=2)
  rebuilt = jax.tree_util.tree_map(lambda _: None, loss_scale)
  assert rebuilt.hysteresis_left is None
  assert int(loss_scale.hysteresis_left) == 2
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  shardings = jax.tree_util.tree_map(lambda _: sharding, loss_scale)
  out = jax.jit(lambda ls: ls.adjust(jnp.array(False)), out_shardings=shardings)(
      loss_scale
  )
  assert int(out.hysteresis_left) == 1 and float(out.loss_scale) == 2.0**10


# --- GSPMD: plain jit over sharded arrays, no axis name -----------------------


def test_gspmd_inf_on_one_shard_skips_on_every_device(mesh):
  tx = _make_tx()
  params, opt_state, param_shardings, opt_shardings = _sharded_setup(mesh, tx)
  step = _sharded_step(mesh, tx, param_shardings, opt_shardings)
  finite = jax.device_put(_poison(params, False), param_shardings)
  poisoned = jax.device_put(_poison(params, True), param_shardings)
  # The inf really lives on one shard of one device.
  layer, name, _ = POISONED
  holders = [
      s.device for s in poisoned[layer][name].addressable_shards
      if not np.isfinite(np.asarray(s.data)).all()
  ]
  assert holders == [mesh.devices[1, 1]]

  params, opt_state, _ = step(params, opt_state, _batch(0), finite)
  before_params, before_inner = _host(params), _host(opt_state.inner_state)
  scale_before = float(opt_state.loss_scale.loss_scale)

  params, opt_state, loss = step(params, opt_state, _batch(1), poisoned)
  assert np.isfinite(float(loss))  # the loss was fine; one gradient was not
  # Every device took the same decision and skipped.
  assert _per_device_values(opt_state.last_finite) == [False] * 8
  assert int(opt_state.skipped_steps) == 1
  assert float(opt_state.loss_scale.loss_scale) == scale_before / 2
  assert _per_device_values(opt_state.loss_scale.loss_scale) == [
      scale_before / 2
  ] * 8
  # Params and inner state bit-identical, and still sharded as before.
  jax.tree_util.tree_map(
      np.testing.assert_array_equal, _host(params), before_params
  )
  jax.tree_util.tree_map(
      np.testing.assert_array_equal, _host(opt_state.inner_state), before_inner
  )
  _assert_shardings(params, param_shardings)
  _assert_shardings(opt_state, opt_shardings)

  # The next finite step updates every parameter.
  params, opt_state, _ = step(params, opt_state, _batch(2), finite)
  assert bool(opt_state.last_finite)
  changed = jax.tree_util.tree_map(
      lambda new, old: bool(np.all(np.asarray(new) != old)), params,
      before_params,
  )
  assert all(jax.tree_util.tree_leaves(changed))


def test_gspmd_step_keeps_shardings_without_pinning_outputs(mesh):
  # Even when out_shardings is left to the compiler, the outputs keep the
  # input shardings: nothing is silently gathered onto one device.
  tx = _make_tx()
  params, opt_state, _, _ = _sharded_setup(mesh, tx)
  batch = jax.device_put(_batch(0), _named(mesh, BATCH_SPECS))
  poison = jax.device_put(_poison(params, False), _named(mesh, PARAM_SPECS))
  compiled = jax.jit(functools.partial(_train_step, tx)).lower(
      params, opt_state, batch, poison
  ).compile()
  in_params, in_state = compiled.input_shardings[0][:2]
  out_params, out_state, _ = compiled.output_shardings
  for got, want, arrays in ((out_params, in_params, params),
                            (out_state, in_state, opt_state)):
    for g, w, x in zip(jax.tree_util.tree_leaves(got),
                       jax.tree_util.tree_leaves(want),
                       jax.tree_util.tree_leaves(arrays)):
      assert g.is_equivalent_to(w, x.ndim), (g, w)
      assert g.is_equivalent_to(x.sharding, x.ndim), (g, x.sharding)


def test_gspmd_matches_single_device_over_20_steps(mesh):
  overflow_steps = {3, 4, 11}
  tx = _make_tx()
  params, opt_state, param_shardings, opt_shardings = _sharded_setup(mesh, tx)
  sharded_step = _sharded_step(mesh, tx, param_shardings, opt_shardings)
  device = jax.devices()[0]
  ref_params = jax.device_put(_init_params(), device)
  ref_state = jax.device_put(tx.init(ref_params), device)
  ref_step = jax.jit(functools.partial(_train_step, tx))

  history, ref_history = [], []
  for step in range(20):
    batch = _batch(step)
    poison = _poison(ref_params, step in overflow_steps)
    params, opt_state, loss = sharded_step(
        params, opt_state, batch, jax.device_put(poison, param_shardings)
    )
    ref_params, ref_state, ref_loss = ref_step(
        ref_params, ref_state, jax.device_put(batch, device), poison
    )
    for hist, state, value in ((history, opt_state, loss),
                               (ref_history, ref_state, ref_loss)):
      metrics = _host(jaxmp.loss_scaling_metrics(state))
      hist.append((float(value), float(metrics["loss_scale"]),
                   bool(metrics["last_finite"]), int(metrics["skipped_steps"])))

  # Skips and scales agree exactly; losses and parameters to float32 rounding.
  assert [h[1:] for h in history] == [h[1:] for h in ref_history]
  assert [not h[2] for h in history].count(True) == len(overflow_steps)
  scales = [h[1] for h in history]
  assert min(scales) < 2.0**10 < max(scales)  # backed off and grew again
  np.testing.assert_allclose([h[0] for h in history],
                             [h[0] for h in ref_history], rtol=1e-5)
  jax.tree_util.tree_map(
      functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6),
      _host(params), _host(ref_params),
  )
  _assert_shardings(params, param_shardings)


# --- shard_map: the axis name is needed ---------------------------------------


def _shard_map_update(mesh, axis_name):
  """An update inside shard_map where every device holds one gradient shard."""
  tx = _make_tx(axis_name)
  opt_specs = _opt_state_shardings(tx, _init_params(), PARAM_SPECS, P())
  per_device = P(AXES)

  def body(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    # Per-device copies of the decision and the scale, stacked along the mesh.
    return (optax.apply_updates(params, updates), opt_state.last_finite[None],
            opt_state.loss_scale.loss_scale[None])

  update = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(PARAM_SPECS, opt_specs, PARAM_SPECS),
      out_specs=(PARAM_SPECS, per_device, per_device),
  ))
  return tx, opt_specs, update


def _shard_map_inputs(mesh, tx, opt_specs):
  params = jax.device_put(_init_params(), _named(mesh, PARAM_SPECS))
  opt_state = jax.jit(tx.init, out_shardings=_named(mesh, opt_specs))(params)
  grads = jax.tree_util.tree_map(
      jnp.add, _poison(params, True), jax.tree_util.tree_map(jnp.ones_like, params)
  )
  return params, opt_state, jax.device_put(grads, _named(mesh, PARAM_SPECS))


def test_shard_map_with_axis_name_all_devices_skip(mesh):
  tx, opt_specs, update = _shard_map_update(mesh, axis_name=AXES)
  params, opt_state, grads = _shard_map_inputs(mesh, tx, opt_specs)
  new_params, finite, scale = update(grads, opt_state, params)
  np.testing.assert_array_equal(np.asarray(finite), [False] * 8)
  np.testing.assert_array_equal(np.asarray(scale), [2.0**9] * 8)
  jax.tree_util.tree_map(
      np.testing.assert_array_equal, _host(new_params), _host(params)
  )


def test_shard_map_without_axis_name_devices_disagree(mesh):
  # This is why loss_scaling takes axis_name: inside shard_map each device
  # only sees its own gradient shard. Device (1, 1) skips, the others update,
  # and the "replicated" loss scale now differs between devices.
  tx, opt_specs, update = _shard_map_update(mesh, axis_name=None)
  params, opt_state, grads = _shard_map_inputs(mesh, tx, opt_specs)
  new_params, finite, scale = update(grads, opt_state, params)
  flat_position = int(np.flatnonzero(mesh.devices.ravel() == mesh.devices[1, 1])[0])
  expected = np.ones(8, bool)
  expected[flat_position] = False
  np.testing.assert_array_equal(np.asarray(finite), expected)
  np.testing.assert_array_equal(
      np.asarray(scale), np.where(expected, 2.0**10, 2.0**9)
  )
  changed = np.asarray(new_params["dense2"]["kernel"]) != np.asarray(
      params["dense2"]["kernel"]
  )
  assert changed.any()  # devices that did not see the inf applied the update


def test_shard_map_refuses_replicated_state_without_axis_name(mesh):
  # With shard_map's default check_vma=True, returning the loss-scale state as
  # replicated (P()) without axis_name is an error at trace time.
  tx = _make_tx()
  opt_specs = _opt_state_shardings(tx, _init_params(), PARAM_SPECS, P())
  params, opt_state, grads = _shard_map_inputs(mesh, tx, opt_specs)
  update = jax.jit(jax.shard_map(
      lambda g, s, p: tx.update(g, s, p), mesh=mesh,
      in_specs=(PARAM_SPECS, opt_specs, PARAM_SPECS),
      out_specs=(PARAM_SPECS, opt_specs),
  ))
  with pytest.raises(ValueError, match="out_specs"):
    update(grads, opt_state, params)


# --- pmap --------------------------------------------------------------------


@pytest.mark.parametrize("axis_name", ["devices", None])
def test_pmap_inf_on_one_replica(axis_name):
  _needs_eight_devices()
  tx = _make_tx(axis_name="devices" if axis_name else None)
  params = {"w": jnp.ones((8, 4), jnp.float32)}
  opt_state = tx.init(params)
  replicate = lambda tree: jax.tree_util.tree_map(
      lambda x: jnp.broadcast_to(x, (8,) + x.shape), tree
  )
  # Per-replica gradients: replica 6 holds one inf.
  grads = {"w": jnp.ones((8, 8, 4), jnp.float32).at[6, 2, 1].set(jnp.inf)}

  def step(grads, opt_state, params):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  new_params, new_state = jax.pmap(step, axis_name="devices")(
      grads, replicate(opt_state), replicate(params)
  )
  finite = np.asarray(new_state.last_finite)
  if axis_name:
    np.testing.assert_array_equal(finite, [False] * 8)
    np.testing.assert_array_equal(np.asarray(new_params["w"]), 1.0)
    np.testing.assert_array_equal(np.asarray(new_state.skipped_steps), 1)
  else:
    np.testing.assert_array_equal(finite, [True] * 6 + [False, True])
  # The host-side checks read the stacked state, member by member.
  jaxmp.check_loss_scale(new_state)
  monitor = jaxmp.LossScaleMonitor(every=1, warn_rate=None)
  monitor.update(1, new_state)
  assert monitor.history["skipped_steps"] == [1]
  assert monitor.history["last_finite"] == [False]


# --- a sharded TrainState, built the Flax way --------------------------------


def test_a_train_state_is_sharded_as_flax_examples_build_it(mesh):
  # Flax's lm1b example (after MaxText): the shardings come from jax.eval_shape
  # of the state, the state from jax.jit(..., out_shardings=...); the two
  # calls of make_state must give one pytree structure.
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jaxmp.flax  # pylint: disable=g-import-not-at-top

  init = nn.initializers.lecun_normal()

  class Mlp(nn.Module):

    @nn.compact
    def __call__(self, x):
      x = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
      return nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(x)

  model, tx, x = Mlp(), optax.adam(1e-3), jnp.ones((8, 16))

  def make_state(key):
    return jaxmp.flax.TrainState.create(
        apply_fn=model.apply, params=model.init(key, x)["params"], tx=tx,
        policy="mixed_float16")

  specs = nn.get_partition_spec(jax.eval_shape(make_state, jax.random.key(0)))
  shardings = nn.logical_to_mesh_sharding(specs, mesh, (("embed", "data"), ("mlp", "fsdp")))
  with jax.set_mesh(mesh):
    state = jax.jit(make_state, out_shardings=shardings)(jax.random.key(0))
  kernel = state.params["Dense_0"]["kernel"].value
  assert kernel.sharding.spec == P("data", "fsdp") and len(kernel.addressable_shards) == 8
  mu = state.opt_state.inner_state[0].mu["Dense_1"]["kernel"].value
  assert mu.sharding.spec == P("fsdp", "data")  # the moments like the params
  assert state.opt_state.loss_scale.loss_scale.sharding.is_fully_replicated
