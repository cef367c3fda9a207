"""The small models and data that several test files train.

* A functional MLP: ``init_mlp``, ``mlp``, ``mse`` and ``make_batch`` (a
  regression batch), with ``poison`` to put a non-finite value in a tree.
* ``LinenMLP`` and ``NnxMLP``: the same classifier, Dense(16), relu, LayerNorm,
  Dense(3), in Flax Linen and Flax NNX (the LayerNorm is what per-module
  policies keep in float32); ``classification_batch`` feeds them.
* ``LinenBatchNormMLP`` and ``NnxBatchNormMLP``: Dense(8), BatchNorm, relu,
  Dense(3), whose batch statistics a skipped step must keep.

Each file's own models stay in that file when only it uses them. ``bits``
compares trees bit for bit. ``f32`` puts an array on the device,
``like_flax_init`` draws a Flax model's params and ``finite`` checks a tree, all in
NumPy: nothing compiled.

And two helpers for the tests that use the benchmarks: ``benchmark(name)``
imports ``benchmarks/<name>.py``, and ``DEFAULT_CODEGEN`` is the benchmarks'
compiler options for XLA's default code generator, which a test passes where
it asserts the compiler's figures (see conftest.py).

For the tests of the migration from PyTorch and DeepSpeed: ``recorder()`` is
``tests/data/make_oracle_fixtures.py``, ``trajectories`` runs a loss scale over
overflow sequences, and ``BLOG_CONFIG`` is a DeepSpeed config as blog posts
write it (comments, trailing commas).
"""

import functools
import importlib.util
import pathlib
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxmp

FLOAT32 = jaxmp.get_policy("float32")
BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark(name):
  """The module ``benchmarks/<name>.py``, imported as the benchmarks import
  each other (their folder on ``sys.path``)."""
  if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
  return importlib.import_module(name)


DEFAULT_CODEGEN = benchmark("overhead").DEFAULT_CODEGEN

BLOG_CONFIG = """\
{
  // Mixed precision: fp16 with dynamic loss scaling.
  "fp16": {
    "enabled": true,
    "loss_scale": 0,            // 0 means dynamic
    "loss_scale_window": 1000,  // grow after 1000 clean steps
    "initial_scale_power": 16,  // start at 2**16 = 65536
    "hysteresis": 2,            /* tolerate one overflow before backing off */
    "min_loss_scale": 1e-5,
  },
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8}},
  "gradient_clipping": 1.0,
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
  "wandb": {"project": "https://example.org//not-a-comment", /* multi
            line */ "note": "x /* y */ \\" // w,}", "tags": [1, 2,], "d": ",]"},
}
"""


@functools.cache
def recorder():
  """``tests/data/make_oracle_fixtures.py``, the recorder of the oracles' fixtures."""
  spec = importlib.util.spec_from_file_location(
      "make_oracle_fixtures", pathlib.Path(__file__).parent / "data" / "make_oracle_fixtures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@functools.partial(jax.jit, static_argnums=2)
def _trajectories(loss_scale, finite, fields):
  def step(ls, ok):
    ls = ls.adjust(ok)
    return ls, tuple(getattr(ls, field) for field in fields)
  return jax.vmap(lambda row: jax.lax.scan(step, loss_scale, row)[1])(finite)


def trajectories(loss_scale, overflows, *fields):
  """``fields`` of ``loss_scale`` after each step, ``[sequence, step]``, adjusted
  by overflow sequences (strings of 0/1, the recordings' form). Compiles once
  per configuration (the static configuration is the pytree structure)."""
  finite = np.array([[c == "0" for c in s] for s in overflows])
  return [np.asarray(x) for x in _trajectories(loss_scale, finite, fields)]


# The functional MLP.
def init_mlp(key, sizes=(4, 16, 3)):
  """Float32 params of a tanh MLP, ``{"layer<i>": {"w", "b"}}``."""
  keys = jax.random.split(key, len(sizes) - 1)
  return {
      f"layer{i}": {
          "w": jax.random.normal(k, (a, b)) / np.sqrt(a),
          "b": jnp.zeros(b),
      }
      for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
  }


def mlp(params, x):
  n = len(params)
  for i in range(n):
    layer = params[f"layer{i}"]
    x = x @ layer["w"] + layer["b"]
    if i < n - 1:
      x = jnp.tanh(x)
  return x


def mse(params, batch, policy=FLOAT32):
  """The mean squared error of ``mlp`` on ``batch``, computed under ``policy``."""
  pred = mlp(policy.cast_to_compute(params), policy.cast_to_compute(batch["x"]))
  pred = policy.cast_to_output(pred)
  return jnp.mean((pred - batch["y"]) ** 2)


def make_batch(seed, n=8):
  """A float32 regression batch ``{"x": (n, 4), "y": (n, 3)}``."""
  rng = np.random.default_rng(seed)
  return {
      "x": f32(rng.normal(size=(n, 4))),
      "y": f32(rng.normal(size=(n, 3))),
  }


def poison(tree, value, leaf_index=0, flat_index=0):
  """``tree`` with ``value`` at one element of one leaf."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  leaves[leaf_index] = leaves[leaf_index].ravel().at[flat_index].set(value).reshape(
      leaves[leaf_index].shape)
  return jax.tree_util.tree_unflatten(treedef, leaves)


def bits(tree):
  """Treedef and each leaf's dtype, shape, bytes: equal when bit-identical (-0.0 != 0.0)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return treedef, [(np.asarray(x).dtype, np.shape(x), np.asarray(x).tobytes()) for x in leaves]


def finite(tree):
  """True iff no leaf of ``tree`` holds inf or nan, checked in NumPy: nothing compiled."""
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(tree))


def f32(a):
  """``a`` put on the device as float32: nothing compiled (``jnp.asarray`` compiles a copy)."""
  return jax.device_put(np.asarray(a, np.float32))


def like_flax_init(shapes):
  """Params of ``shapes`` (``jax.eval_shape`` of a Linen init) drawn in NumPy as Flax draws
  them (lecun normal, unit scales, zero biases, 0.02 for ``position``): nothing compiled."""
  rng = np.random.default_rng(0)

  def draw(path, leaf):
    name, shape = path[-1].key, leaf.shape
    fan_in = np.prod(shape[:-1]) if "['out']" in jax.tree_util.keystr(path) else shape[
        name == "embedding"]  # an attention's out kernel: heads x features; an embedding's
    return f32(np.full(shape, float(name == "scale")) if name in ("bias", "scale")
               else rng.normal(size=shape) * (0.02 if name == "position" else fan_in**-0.5))
  return jax.tree_util.tree_map_with_path(draw, shapes)


# The Flax classifier.
class LinenMLP(nn.Module):
  """Dense(16), relu, LayerNorm, Dense(3): 4 features in, 3 logits out."""

  dtype: object = None  # declared on every layer when set (None: the inputs' dtype)

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dtype=self.dtype)(x))
    x = nn.LayerNorm(dtype=self.dtype)(x)
    return nn.Dense(3, dtype=self.dtype)(x)


class NnxMLP(nnx.Module):
  """``LinenMLP`` in NNX."""

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.dense2 = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense2(self.norm(nnx.relu(self.dense1(x))))


class LinenBatchNormMLP(nn.Module):
  """Dense(8), BatchNorm (momentum 0.9), relu, Dense(3)."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(8)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(3)(nn.relu(x))


class NnxBatchNormMLP(nnx.Module):
  """``LinenBatchNormMLP`` in NNX (``train()`` and ``eval()`` choose the statistics)."""

  def __init__(self, rngs):
    self.dense1 = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dense2 = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.dense2(nnx.relu(self.norm(self.dense1(x))))


def classification_batch(seed=0, n=8):
  """``(x, y)``: ``n`` float32 rows of 4 features and their labels in 0..2."""
  rng = np.random.default_rng(seed)
  return f32(rng.normal(size=(n, 4))), jax.device_put(rng.integers(0, 3, n, np.int32))
