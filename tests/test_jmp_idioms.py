"""`import jaxmp as jmp`: jmp's public names and README idioms give jmp's results."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmp


def test_jmp_public_names_exist():
  jmp = pytest.importorskip("jmp")  # Policy, get_policy, the loss scales, the casts...
  assert {n for n in dir(jmp) if not n.startswith("_")} <= set(dir(jaxmp))


def _jmp_style_training(jmp):
  """jmp's README idioms, written against the module passed in."""
  policy = jmp.get_policy("params=float32,compute=float16,output=float32")
  params = {"w": jnp.full((3,), 0.5), "step": jnp.zeros((), jnp.int32)}
  half, out = jmp.cast_to_half(params), []
  full = jmp.cast_to_full(half)
  loss_scale = jmp.DynamicLossScale(jnp.float32(2**15), period=2)
  for g in [1.0, jnp.inf, 1.0, 1.0]:
    grads = loss_scale.unscale(loss_scale.scale({"w": jnp.full((3,), g, jnp.float32)}))
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    new = jmp.select_tree(finite, {"w": params["w"] - 0.1}, {"w": params["w"]})
    out.append((float(loss_scale.loss_scale), bool(finite), new["w"].tolist()))
  return (
      policy.compute_dtype == jnp.float16,
      policy.cast_to_compute(params)["w"].dtype, half["w"].dtype, half["step"].dtype,
      full["w"].dtype, jmp.half_dtype() == jnp.float16, jmp.half_dtype()(2.0).dtype,
      float(jmp.StaticLossScale(jnp.float32(2**4)).scale(jnp.float32(2.0))),
      float(jmp.NoOpLossScale().scale(3.0)), out)


def test_jmp_idioms_give_the_same_results():
  jmp = pytest.importorskip("jmp")
  # jmp's own adjust multiplies a float32 array by a Python float, which
  # strict dtype promotion refuses.
  with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
    warnings.simplefilter("ignore", DeprecationWarning)
    expected = _jmp_style_training(jmp)
  assert _jmp_style_training(jaxmp) == expected


def _imagenet_train_step(jmp, loss_scale, params, x, y):
  """dm-haiku's ImageNet step (examples/imagenet/train.py), its mixed-precision part: the
  gradients of the scaled loss are cast to the compute dtype (for the all-reduce), unscaled,
  cast to the param dtype, checked, and the step kept or skipped. Returns the unscaled
  gradients, the new params and the new scale."""
  policy = jmp.get_policy("p=f32,c=f16,o=f32")

  def loss_fn(params):
    p, xc, yc = policy.cast_to_compute((params, x, y))
    return loss_scale.scale(policy.cast_to_output(jnp.mean((xc @ p["w"] - yc) ** 2)))

  unscaled = loss_scale.unscale(policy.cast_to_compute(jax.grad(loss_fn)(params)))
  grads = policy.cast_to_param(unscaled)
  grads_finite = jmp.all_finite(grads)
  new_params = jmp.select_tree(grads_finite, jax.tree_util.tree_map(
      lambda p, g: p - 0.1 * g, params, grads), params)
  return unscaled, new_params, loss_scale.adjust(grads_finite).loss_scale


IMAGENET_SCALES = {
    "NoOp": lambda jmp: jmp.NoOpLossScale(),
    "Static": lambda jmp: jmp.StaticLossScale(jnp.float32(2**15)),
    "Dynamic": lambda jmp: jmp.DynamicLossScale(jnp.float32(2**15)),
}


@pytest.mark.parametrize("kind", IMAGENET_SCALES)
def test_imagenet_example_unscales_as_jmp_does(kind):
  jmp = pytest.importorskip("jmp")
  # The last input column is tiny: its gradient, about 2**-27, is below
  # float16's smallest subnormal (2**-24) once unscaled.
  x = jax.random.normal(jax.random.key(0), (16, 3)) * jnp.array([1.0, 2.0**-10, 2.0**-25])
  params = {"w": jnp.full((3,), 0.5)}
  y = x @ jnp.array([1.0, -2.0, 3.0])
  step = jax.jit(_imagenet_train_step, static_argnums=0)
  with warnings.catch_warnings(), jax.numpy_dtype_promotion("standard"):
    warnings.simplefilter("ignore", DeprecationWarning)
    want, want_params, want_scale = step(jmp, IMAGENET_SCALES[kind](jmp), params, x, y)
  got, got_params, got_scale = step(jaxmp, IMAGENET_SCALES[kind](jaxmp), params, x, y)
  # float16 gradients come back in float32 (NoOp: unchanged, float16), bit
  # for bit as jmp's, and so does the step.
  assert got["w"].dtype == (jnp.float16 if kind == "NoOp" else jnp.float32)
  np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]), strict=True)
  np.testing.assert_array_equal(got_params["w"], want_params["w"], strict=True)
  assert float(got_scale) == float(want_scale)
  if kind != "NoOp":
    assert 0 < abs(float(got["w"][2])) < 2.0**-24
