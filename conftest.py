"""Set-up shared by the tests (tests/) and the docstring examples (jaxmp/).

pytest loads this file before it imports any test module or any module of
jaxmp, so both run alike:

* the processes they start (examples, the command line, the docs build)
  import this checkout's jaxmp (``PYTHONPATH``);
* eight simulated CPU devices (``XLA_FLAGS``, which must be set before JAX
  starts): single-device code runs on the first, the distributed tests use all;
* XLA:CPU compiles faster than by default, because compiling is most of the
  suite's time (each setting is left alone where ``XLA_FLAGS`` sets it):

  - LLVM's optimisations are off (``--xla_backend_optimization_level=0``),
    which cuts the suite's CPU time by about 40%;
  - the kernels come from XLA:CPU's older code generator
    (``--xla_cpu_use_fusion_emitters=false``), which emits LLVM IR directly
    instead of through MLIR, and takes about 40% less CPU time again. It also
    changes a few of XLA's decisions (for instance where a dynamic-update-slice
    is done in place), and so the compiler's figures.

  So a test that asserts the compiler's figures (bytes accessed, temp and peak
  memory, copies, kernel count), or that two different programs give the same
  bits, compiles with XLA's default code generator: it passes
  ``compiler_options=DEFAULT_CODEGEN`` (``tests/models.py``), as every
  compilation of the benchmarks does. Results can differ from a default
  compilation in the last bits, so the tests compare only results computed
  under the same settings;
* Python's cycle collector skips what collection imported and runs less often
  (``pytest_collection_finish`` below);
* strict dtype promotion (``jax_numpy_dtype_promotion="strict"``): an
  operation that mixes dtypes, such as a float16 array times a float32 one,
  raises instead of silently upcasting. jaxmp, the tests, the docstring
  examples and the guides' code all run strict. Two kinds of code run under
  standard promotion instead:

  - the few functions of optax, Flax and jmp that are not clean under strict
    promotion (``NOT_STRICT_CLEAN`` below, each with the reason), so that a
    test of jaxmp is not refused for what its dependencies do;
  - a test that exercises user code relying on standard promotion (jmp's own
    tests, jmp's README loop) opts out with the marker
    ``@pytest.mark.standard_promotion(reason=...)``.

Compiled programs are kept between runs in ``.pytest_cache/jax-compilation-cache``
(JAX's persistent compilation cache; ``JAX_COMPILATION_CACHE_DIR`` chooses
another folder): the first run compiles everything, later runs of unchanged
code skip XLA's compilation (tracing and lowering still run). The settings are
passed on in the environment, so the processes the tests start (the examples,
the command line, the docs' figure script, the workers of the multi-process
test) share the cache. Delete the folder, or run ``pytest --cache-clear``, to
start afresh.

The tiers:

* the unit tier, ``make test-fast`` (``pytest -m "not integration"``): the
  tests of each module and the docstring examples, to run before every commit;
* the integration tier, marked ``integration``: the examples, the benchmarks,
  several processes, the documentation site, and the long fault-injection runs.
  ``make test`` runs both tiers;
* ``slow``: the longest variants, skipped unless ``--run-slow`` (``make
  test-slow``).
"""

import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent
# The processes the tests start (examples, the command line, the docs build)
# import the jaxmp of this checkout, as the tests themselves do.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# JAX's persistent compilation cache, for this process and (through the
# environment, which JAX reads when it starts) for the processes it starts.
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  os.environ["JAX_COMPILATION_CACHE_DIR"] = str(
      ROOT / ".pytest_cache" / "jax-compilation-cache")
# The tests' programs are small: cache them all. (No size limit: JAX needs
# the filelock package for one, which the test extra does not install.)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import functools  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import importlib  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import gc  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

jax.config.update("jax_numpy_dtype_promotion", "strict")

# In case JAX was imported before this file (by a plugin), the same settings.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))

# Functions of the dependencies that strict promotion refuses, as
# (module, attribute): reason. They run under standard promotion.
NOT_STRICT_CLEAN = {
    ("optax.tree", "bias_correction"):
        "Adam-style bias correction computes `decay**count`, a float to an int32 power",
    ("optax.tree_utils", "tree_bias_correction"): "the same function, by its other name",
    ("flax.linen.normalization", "_compute_stats"):
        "LayerNorm/BatchNorm call jnp.promote_types(float16, float32)",
    ("flax.linen.normalization", "_normalize"):
        "LayerNorm/BatchNorm subtract their float32 mean from half-precision inputs",
    ("flax.nnx.nn.normalization", "_compute_stats"):
        "LayerNorm/BatchNorm call jnp.promote_types(float16, float32)",
    ("flax.nnx.nn.normalization", "_normalize"):
        "LayerNorm/BatchNorm subtract their float32 mean from half-precision inputs",
    # jmp, which the tests compare jaxmp with.
    ("jmp", "DynamicLossScale.adjust"): "jmp multiplies its int32 counter by a bool",
    ("jmp", "DynamicLossScale.scale"): "jmp multiplies float16 values by a float32 scale",
    ("jmp", "DynamicLossScale.unscale"): "jmp multiplies float16 values by a float32 scale",
    ("jmp", "StaticLossScale.scale"): "jmp multiplies float16 values by a float32 scale",
    ("jmp", "StaticLossScale.unscale"): "jmp multiplies float16 values by a float32 scale",
}
# The schedules that optax's schedule factories return mix Python floats with
# the int32 step count: each factory's schedule runs under standard promotion.
SCHEDULE_FACTORIES = ("optax", "optax.schedules")
# And optax.MultiSteps.update, whose own arithmetic mixes its int32 counters
# and its bool "emit" flag with floats; the optimizer it wraps (often
# jaxmp.loss_scaling) still runs under the caller's promotion.


def _under_standard_promotion(function):
  @functools.wraps(function)
  def wrapped(*args, **kwargs):
    with jax.numpy_dtype_promotion("standard"):
      return function(*args, **kwargs)
  return wrapped


def _let_dependencies_run_under_standard_promotion():
  for (module_name, path), _ in NOT_STRICT_CLEAN.items():
    try:
      owner = importlib.import_module(module_name)
    except ImportError:  # Flax and jmp are optional for the core tests
      continue
    *owners, attribute = path.split(".")
    for name in owners:
      owner = getattr(owner, name)
    setattr(owner, attribute, _under_standard_promotion(getattr(owner, attribute)))
  try:
    import optax  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  except ImportError:
    return
  for name in dir(optax.schedules):
    factory = getattr(optax.schedules, name)
    if not (name.endswith("_schedule") or name == "exponential_decay"):
      continue

    @functools.wraps(factory)
    def standard_schedule(*args, factory=factory, **kwargs):
      return _under_standard_promotion(factory(*args, **kwargs))

    for module_name in SCHEDULE_FACTORIES:
      module = importlib.import_module(module_name)
      if getattr(module, name, None) is factory:
        setattr(module, name, standard_schedule)
  construct, update = optax.MultiSteps.__init__, optax.MultiSteps.update
  caller_promotion = []  # the promotion of the code that calls update

  def inner_update(function):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
      with jax.numpy_dtype_promotion(caller_promotion[-1]):
        return function(*args, **kwargs)
    return wrapped

  @functools.wraps(construct)
  def multi_steps_init(self, *args, **kwargs):
    construct(self, *args, **kwargs)
    inner = self._opt  # pylint: disable=protected-access
    self._opt = inner._replace(update=inner_update(inner.update))  # pylint: disable=protected-access

  @functools.wraps(update)
  def multi_steps_update(self, *args, **kwargs):
    caller_promotion.append(jax.config.jax_numpy_dtype_promotion)
    try:
      with jax.numpy_dtype_promotion("standard"):
        return update(self, *args, **kwargs)
    finally:
      caller_promotion.pop()

  optax.MultiSteps.__init__ = multi_steps_init
  optax.MultiSteps.update = multi_steps_update


_let_dependencies_run_under_standard_promotion()


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
  """Runs a test marked ``standard_promotion`` under standard promotion."""
  marker = request.node.get_closest_marker("standard_promotion")
  if marker is None:
    yield
    return
  if not marker.kwargs.get("reason"):
    raise pytest.UsageError(
        f"{request.node.nodeid}: say why it needs standard promotion, with "
        "@pytest.mark.standard_promotion(reason=...)")
  with jax.numpy_dtype_promotion("standard"):
    yield


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="run the tests marked slow",
  )


# Docstring examples that show code relying on standard promotion, with the
# reason (a test's own opt-out is its standard_promotion marker).
STANDARD_PROMOTION_DOCTESTS = {
    "jaxmp._src.path_policy.PathPolicy.wrap_apply":
        "it shows a float32 layer fed by a bfloat16 one, whose dtypes Flax "
        "promotes (PathPolicy casts params only; the docstring says so)",
}


def pytest_collection_modifyitems(config, items):
  for item in items:
    reason = STANDARD_PROMOTION_DOCTESTS.get(item.name)
    if reason is not None:
      item.add_marker(pytest.mark.standard_promotion(reason=reason))
  # The integration tests run longest: starting them first keeps both xdist
  # workers busy to the end, instead of leaving one long module for last.
  items.sort(key=lambda item: item.get_closest_marker("integration") is None)
  if config.getoption("--run-slow"):
    return
  skip = pytest.mark.skip(reason="slow: run with `make test-slow`")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


def pytest_collection_finish(session):
  # Collection imported JAX, Flax, optax and every test module: Python's cycle
  # collector need not walk those objects again (``gc.freeze``), and tracing
  # makes many short-lived objects, which generation 0's default threshold of
  # 700 collected some 5,000 times per worker (about 6% of the unit tier's time).
  gc.collect()
  gc.freeze()
  gc.set_threshold(10_000, 50, 100)
