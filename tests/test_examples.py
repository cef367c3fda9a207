"""Runs the examples, shortened, under float16 and bfloat16 compute.

Each example trains on scikit-learn's digits, and every matrix product of its
train step (forward and backward) runs in the policy's compute dtype: checked
on the step's jaxpr, not on the params.
"""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jaxmp
from matmul_dtypes import input_dtypes

pytestmark = pytest.mark.integration

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
POLICIES = [("mixed_float16", "float16"), ("mixed_bfloat16", "bfloat16")]


def load(name):
  spec = importlib.util.spec_from_file_location(
      f"examples_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses (Linen modules) look it up
  spec.loader.exec_module(module)
  return module


def a_batch(n=32):
  rng = np.random.default_rng(0)
  return (rng.uniform(size=(n, 64)).astype(np.float32),
          rng.integers(0, 10, n).astype(np.int32))


@pytest.mark.parametrize("policy, compute", POLICIES)
def test_quickstart(policy, compute, capsys):
  module = load("quickstart")
  assert module.main(["--policy", policy, "--steps", "120", "--log-every", "40"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith(f"policy {jaxmp.get_policy(policy)}")
  rows = [line.split() for line in lines if line.split()[0].isdigit()]
  assert [int(r[0]) for r in rows] == [1, 40, 80, 120]
  losses, scales = [float(r[1]) for r in rows], [float(r[2]) for r in rows]
  skipped = [int(r[3]) for r in rows]
  assert losses[-1] < 0.5 * losses[0]
  if compute == "float16":
    assert skipped[0] == 1  # 2**24 overflows float16 on the first step
    assert scales[-1] < 2**24  # ...so the scale backed off
  else:  # bfloat16 needs no loss scaling
    assert skipped == [0] * 4 and scales == [1.0] * 4
  assert float(lines[-1].split()[2].rstrip(";")) > 0.9  # test accuracy
  assert "params stay float32" in lines[-1]
  tx = module.make_optimizer(jaxmp.get_policy(policy))
  params = module.init_params(jax.random.key(0))
  step = module.make_train_step(jaxmp.get_policy(policy), tx)
  assert input_dtypes(step, params, tx.init(params), *a_batch()) == {compute}


def linen_step(module, policy):
  return module.train_step, (module.create_state(policy),)


def nnx_step(module, policy):
  graphdef, state = nnx.split(module.create(policy))

  def step(state, x, y):
    model, optimizer = nnx.merge(graphdef, state)
    return module.train_step(model, optimizer, x, y, policy)

  return step, (state,)


def equinox_step(module, policy):
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  model, tx, opt_state = module.create(policy)
  step, (params, static) = module.make_train_step(policy, tx), eqx.partition(model, eqx.is_array)
  return (lambda params, opt_state, x, y: eqx.filter(
      step(eqx.combine(params, static), opt_state, x, y), eqx.is_array)), (params, opt_state)


MLPS = {  # what each example prints first; its train step and state
    "flax_linen": ("Linen MLP on digits, policy {} (LayerNorm in float32)", linen_step),
    "flax_nnx": ("NNX MLP on digits, policy {} (LayerNorm in float32)", nnx_step),
    "equinox_mlp": ("Equinox MLP on digits, policy {}", equinox_step),
}


@pytest.mark.parametrize("policy, compute", POLICIES)
@pytest.mark.parametrize("example", sorted(MLPS))
def test_an_mlp_example_trains_its_matmuls_in_the_compute_dtype(example, policy, compute, capsys):
  module, (title, step_and_state) = load(example), MLPS[example]
  summary = module.main(["--policy", policy, "--steps", "20", "--batch-size", "64"])
  assert capsys.readouterr().out.startswith(title.format(jaxmp.get_policy(policy)))
  assert (summary["steps"], summary["param_dtypes"]) == (20, ["float32"])
  assert summary["test_accuracy"] > 0.5  # chance is 0.1
  if compute == "float16":
    assert summary["loss_scale"] >= 1.0
  else:
    assert summary["loss_scale"] == 1.0 and summary["skipped_steps"] == 0
  step, state = step_and_state(module, jaxmp.get_policy(policy))
  assert input_dtypes(step, *state, *a_batch()) == {compute}


# -- A translation Transformer whose layers declare dtype=float32 ----------------

HALF_MODES = {"autocast-float16": "float16", "autocast-bfloat16": "bfloat16",
              "module-policy-float16": "float16"}


@pytest.fixture(scope="module")
def wmt():
  """The example and its runs of 40 steps. The model adds its float32 position table to embeddings
  that a policy may have cast, relying on standard promotion as user code does."""
  module = load("wmt_transformer")
  with jax.numpy_dtype_promotion("standard"):
    return module, {mode: module.train(mode, steps=40) for mode in module.MODES}


def losses_by_update(history):
  """The loss before the n-th applied update, for n = 0, 1, ...: a skipped step does not move the
  params, so its successor is compared to the same float32 step."""
  losses, applied = [], 0
  for loss, skipped in zip(history["loss"], history["skipped"]):
    if len(losses) == applied:
      losses.append(loss)
    applied += 1 - skipped
  return np.array(losses)


@pytest.mark.parametrize("mode", sorted(HALF_MODES))
def test_the_wmt_transformer_trains_like_float32_with_its_matmuls_in_half_precision(wmt, mode):
  module, runs = wmt
  history = runs[mode]
  settle = 5  # float16's scale may back off in the first steps, not later
  assert sum(history["skipped"][settle:]) == 0
  assert np.isfinite(history["loss"]).all()
  ours = losses_by_update(history)
  reference = losses_by_update(runs["float32"])[: len(ours)]
  assert len(ours) >= 40 - settle
  np.testing.assert_allclose(ours, reference, rtol=0.01)  # measured: 0.2%
  assert ours[-1] < 0.85 * ours[0]  # it learns
  state = module.create_state(mode)
  inputs, targets = module.synthetic_batch(np.random.default_rng(0), 4, module.Config())
  with jax.numpy_dtype_promotion("standard"):
    assert input_dtypes(module.step_loss(state), state.params, inputs, targets,
                        jax.random.key(0)) == {HALF_MODES[mode]}
