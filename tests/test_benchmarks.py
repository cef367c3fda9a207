"""The benchmarks (tiny runs, their tables) and each figure they measure, asserted
on small programs from XLA's analyses: only the compiler's figures, which are
deterministic, never times; compiled as the benchmarks compile (``DEFAULT_CODEGEN``)."""

import contextlib
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp
from models import DEFAULT_CODEGEN, benchmark, init_mlp, mlp

pytestmark = pytest.mark.integration

VARIANTS = ["unguarded", "jaxmp", "jmp manual", "optax.apply_if_finite", "flax DynamicScale"]
TINY = ("--d-model 32 --layers 1 --heads 2 --seq-len 16 --batch-size 4 --rounds 1 "
        "--steps-per-round 1 --warmup-steps 1 --compile-repeats 0").split()


def _main(name, args, tmp_path_factory):
  """benchmarks/<name>.py's main() in this process, under standard promotion as the
  script runs (the demo's float16 attention meets Flax's float32 softmax): its
  standard output, and the folder it wrote to."""
  out, stdout = tmp_path_factory.mktemp(name), io.StringIO()
  with contextlib.redirect_stdout(stdout), jax.numpy_dtype_promotion("standard"):
    assert benchmark(name).main([*args, "--out", str(out)]) == 0
  return stdout.getvalue(), out


@pytest.fixture(scope="module")
def overhead_run(tmp_path_factory):
  stdout, out = _main("overhead", TINY, tmp_path_factory)
  return stdout, (out / "overhead.md").read_text(), json.loads((out / "overhead.json").read_text())


def test_overhead_writes_its_table_and_json(overhead_run):
  stdout, table, results = overhead_run
  assert table in stdout and table.startswith(
      "| variant | step time | temp memory | peak live memory | bytes accessed "
      "| compile time | kernels |")
  assert [line.split("|")[1].strip() for line in table.splitlines()[2:7]] == VARIANTS
  # Untimed (--compile-repeats 0): no compile-time column figures.
  assert "| unguarded | 1.000× | +0.0% | +0.000% | +0.0% | n/a | " in table
  assert " (+0) |" in table.splitlines()[2]
  assert "CPU only" in table and "JAX " in table
  assert list(results["variants"]) == VARIANTS and results["config"]["d_model"] == 32
  for figures in results["variants"].values():
    assert figures["temp_bytes"] > 0 and figures["bytes_accessed"] > 0
    assert figures["step_seconds_median"] > 0 and figures["compile_seconds"] is None
    # From XLA's dump: what is live at the peak includes the arguments.
    assert figures["peak_live_bytes"] > figures["argument_bytes"]
    assert isinstance(figures["kernels"], int) and figures["kernels"] > 0


def test_jaxmp_costs_less_than_its_peers(overhead_run):
  variants = overhead_run[2]["variants"]
  base, ours = variants["unguarded"], variants["jaxmp"]
  # The guard adds no temp memory beyond 0.5% (no copy of the moments).
  assert ours["temp_bytes"] <= base["temp_bytes"] * 1.005
  for name in VARIANTS[2:]:
    assert ours["temp_bytes"] <= variants[name]["temp_bytes"], name
    assert ours["bytes_accessed"] < variants[name]["bytes_accessed"], name
  # At the worst moment the guard holds nothing gradient- or state-sized more
  # than the unguarded step: only the loss scale's few scalars.
  assert 0 <= ours["peak_live_bytes"] - base["peak_live_bytes"] <= 256
  # The check compiles to some kernels of its own, but fewer than the peers'.
  assert base["kernels"] < ours["kernels"] < min(
      variants["jmp manual"]["kernels"], variants["optax.apply_if_finite"]["kernels"])


def test_the_gpu_benchmark_measures_every_model_and_precision(tmp_path_factory):
  _, out = _main("gpu", ["--tiny", "--budget-seconds", "3600"], tmp_path_factory)
  results, table = json.loads((out / "gpu.json").read_text()), (out / "gpu.md").read_text()
  assert list(results["models"]) == ["gpt2-124m", "demo-4m"]
  assert results["date"] and results["versions"]["jax"] == jax.__version__
  for model in results["models"].values():
    assert model["parameters"] > 0 and model["model_flops_per_step"] > 0
    precision, guard = model["groups"]["precision"], model["groups"]["guard"]
    assert list(precision["rows"]) == ["float32", "mixed_bfloat16", "mixed_float16", "mixed_fp8"]
    for row in precision["rows"].values():
      assert min(row[k] for k in ("step_seconds_median", "tokens_per_second",
                                  "time_ratio_vs_float32", "time_ratio_vs_mixed_bfloat16")) > 0
      assert row["memory_bytes"] > row["argument_bytes"] > 0 and "mfu" not in row  # no CPU peak
    assert list(guard["rows"]) == [*VARIANTS, "jaxmp, CPU forms"]
    assert all(row["time_ratio_vs_unguarded"] > 0 for row in guard["rows"].values())
    profiles = {**guard["profile"], **precision["profile"]}
    assert "finiteness check" not in profiles["unguarded"]["us_per_step"]
    assert min(profiles["jaxmp"]["us_per_step"]["finiteness check"],
               profiles["jaxmp"]["select_us_per_step"],
               profiles["mixed_fp8"]["us_per_step"]["FP8 quantize/amax"],
               *(profile["us_per_step"]["GEMMs"] for profile in profiles.values())) > 0
  assert table.startswith("Run: `make bench-gpu`") and "Targets (gpt2-124m): " in table


def test_the_gpu_benchmark_sets_a_device_against_its_datasheet_peak():
  kinds = {"NVIDIA H100 80GB HBM3": "H100 SXM", "NVIDIA H100 PCIe": "H100 PCIe",
           "NVIDIA H100 NVL": "H100 NVL", "NVIDIA H200": "H200 SXM",
           "NVIDIA H200 NVL": "H200 NVL", "NVIDIA A100-SXM4-80GB": None, "cpu": None}
  assert {kind: benchmark("gpu").peak_name(kind) for kind in kinds} == kinds


def test_the_gpu_benchmark_batch_fits_the_memory_limit():
  gpu = benchmark("gpu")
  spec, model = gpu.TINY[0], gpu.make_model(gpu.TINY[0])
  params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, spec.seq_len), jnp.int32))["params"]
  config = gpu.precision_configs(spec, model, gpu.make_batch(spec, 1), params,
                                 names=("float32",))[0]

  def lower_at(batch_size):
    return config.lower(config.state, gpu.make_batch(spec, batch_size))

  def memory(batch_size):
    return gpu.memory_bytes(lower_at(batch_size).compile(compiler_options=DEFAULT_CODEGEN))

  held = 3 * gpu.state_bytes(config.state)
  limit = (memory(64) + held) / 0.9  # a batch of 64 just fits
  rule = gpu.largest_batch(lower_at, limit, held)
  assert rule["fits"] and 48 <= rule["batch_size"] <= 64
  assert memory(rule["batch_size"]) + held <= 0.9 * limit


MACHINE = {"platform": "cpu", "device_kind": "cpu", "cpu_count": 2, "python": "3.11",
           "jax": "0.0", "optax": "0.0", "flax": "0.0", "jmp": "0.0"}
H200 = {**MACHINE, "platform": "gpu", "device_kind": "NVIDIA H200", "cpu_count": 16}
CONFIG = {"d_model": 8, "layers": 1, "heads": 1, "batch_size": 2, "seq_len": 4, "rounds": 1,
          "steps_per_round": 1, "compile_repeats": 1}


def test_policy_speed_table_says_cpu_only():
  figures = {"time_ratio": 1.0, "tokens_per_second": 1000.0, "temp_bytes": 2**20,
             "bytes_accessed": 2**30, "policy": "p=f32,c=f32,o=f32"}
  results = {"config": CONFIG, "parameters": 100, "machine": MACHINE, "policies": {
      "float32": figures, "mixed_fp8": {**figures, "time_ratio": 3.0, "time_ratio_vs_bfloat16":
                                        2.5, "policy": "p=f32,c=bf16,o=f32,dot=fp8"}}}
  table = benchmark("policy_speed").markdown(results)
  assert "| float32 (`p=f32,c=f32,o=f32`) | 1.00× | 1,000 | 1.0 MiB | 1024 MiB |" in table
  assert "| mixed_fp8 (`p=f32,c=bf16,o=f32,dot=fp8`) | 3.00× |" in table and "CPU only" in table
  assert "the FP8 row's time says nothing about FP8 on a GPU" in table
  table = benchmark("policy_speed").markdown({**results, "machine": H200})
  assert "FP8 step time vs bfloat16: 2.50×." in table and "CPU" not in table


def test_overhead_table_names_an_accelerator():
  figures = {"time_ratio": 1.015, "temp_ratio": 1.015, "peak_live_ratio": None,
             "bytes_accessed_ratio": 1.015, "compile_ratio": 1.015, "kernels": None,
             "step_seconds_median": 0.01, "temp_bytes": 2**20, "peak_live_bytes": None,
             "bytes_accessed": 2**30, "compile_seconds": 2.0}
  unguarded = {**figures, **dict.fromkeys(
      ("time_ratio", "temp_ratio", "bytes_accessed_ratio", "compile_ratio"), 1.0)}
  table = benchmark("overhead").markdown({"config": CONFIG, "parameters": 100, "machine": H200,
                                          "variants": {"unguarded": unguarded, "jaxmp": figures}})
  # Kernel modules are counted from LLVM dumps, which only the CPU writes; a
  # back end that dumps no live ranges has no peak live figure.
  assert "| jaxmp | 1.015× | +1.5% | n/a | +1.5% | 1.01× | n/a |" in table
  assert "Accelerator: NVIDIA H200" in table
  assert "live at the peak" not in table and "CPU only" not in table


def test_scaling_table_puts_each_setting_against_its_unguarded_step():

  def figures(ratio, kernels, extra):
    return {"bytes_accessed_ratio": ratio, "temp_ratio": 1.0, "kernels": kernels,
            "compile_seconds": 2.0 * ratio, "compile_ratio": ratio,
            "extra_bytes_per_param": extra, "parameters": 4_100_000, "leaves": 86}

  table = benchmark("scaling").markdown({
      "config": {"settings": ["params"], "repeats": 3}, "machine": MACHINE,
      "settings": {"transformer 4M": {"unguarded": figures(1.0, 130, 0.0),
                                      "jaxmp": figures(1.01, 179, 4.03)}}})
  assert table.startswith("| setting | variant | bytes accessed | extra B/param |")
  assert ("| transformer 4M (4.1M params, 86 leaves) | jaxmp | +1.00% | +4.03 | "
          "+0.00% | 179 (+49) | 2.02 | 1.01× |") in table
  assert "median CPU seconds of 3 fresh traces" in table


def test_the_forms_check_forms_measures_decide_as_all_finite_does():
  # benchmarks/README.md compares these forms by their cost only because they
  # take the same decisions; the table is the one of tests/test_loss_scaling.py.
  from test_loss_scaling import DECISIONS  # pylint: disable=import-outside-toplevel
  forms = {name: jax.jit(form) for name, form in benchmark("check_forms").FORMS.items()}
  for case, grads, expected in DECISIONS:
    assert {name: bool(form(grads)) for name, form in forms.items()} == dict.fromkeys(
        forms, expected), case


# The figures of small programs, from XLA's analyses.
def _bytes_accessed(compiled):
  return benchmark("overhead").compiler_figures(compiled)["bytes_accessed"]


def _floating_bytes(tree):
  return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)
             if jnp.issubdtype(np.asarray(x).dtype, jnp.inexact))


MIXED_TREE = {  # leaves grouped by the check in every way
    "pair": [jnp.ones((40, 50)), jnp.full((40, 50), 2.0)],
    "lone": jnp.ones(1000), "half": jnp.ones(40, jnp.bfloat16),
    "scalar": jnp.float32(3.0), "python": 0.5, "empty": jnp.zeros((0, 3)),
    "steps": jnp.arange(40), "mask": jnp.ones(40, jnp.bool_)}


@pytest.mark.parametrize("tree, scalars", [
    (MIXED_TREE, 64),
    # Two groups (64 leaves and a lone one), a flag per leaf: a mask of 40
    # booleans per leaf would add 2600 bytes written and read again.
    ([jnp.full(40, float(i)) for i in range(65)], 256),
], ids=["mixed leaves", "65 leaves of one shape"])
def test_all_finite_reads_each_leaf_once_and_writes_no_mask(tree, scalars):
  # Every floating leaf read once, plus a few scalars (the flags, the result). (XLA:CPU
  # splits a one-operand reduce of more than 32 elements into a reduce-window and a
  # reduce, and writes the isfinite mask between them: the mask's bytes would count.)
  compiled = jax.jit(jaxmp.all_finite, compiler_options=DEFAULT_CODEGEN).lower(tree).compile()
  assert _floating_bytes(tree) <= _bytes_accessed(compiled) <= _floating_bytes(tree) + scalars


def test_all_finite_of_sharded_leaves_moves_only_flags():
  # Each device checks its own shards and only the flags travel. A check that
  # flattened the leaves would have XLA all-gather every leaf sharded on a trailing
  # axis (here 5.6 times the bytes of the local shards), which the bytes would count.
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices; tests/conftest.py sets them up")
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
  shardings = {"a": P(None, "fsdp"), "b": P("data", "fsdp"), "c": P(None, "data", "fsdp")}
  tree = {"a": jnp.ones((8, 64)), "b": jnp.ones((64, 8)), "c": jnp.ones((2, 8, 16))}
  tree = {k: jax.device_put(v, NamedSharding(mesh, shardings[k])) for k, v in tree.items()}
  compiled = jax.jit(lambda t: jaxmp.all_finite(jax.tree.map(lambda x: x * 2, t)),
                     compiler_options=DEFAULT_CODEGEN).lower(tree).compile()
  local = sum(x.addressable_shards[0].data.nbytes for x in tree.values())
  assert local <= _bytes_accessed(compiled) <= local + 256


def test_clipping_inside_the_guard_reads_the_gradients_no_more():
  params, x = init_mlp(jax.random.PRNGKey(0), sizes=(256,) * 5), jnp.ones((8, 256))

  def bytes_accessed(tx, guarded):
    def step(state, x):
      p, o = state
      scale = jaxmp.get_loss_scale(o).scale if guarded else (lambda loss: loss)
      grads = jax.grad(lambda p: scale(jnp.mean(mlp(p, x) ** 2)))(p)
      updates, o = tx.update(grads, o, p)
      return optax.apply_updates(p, updates), o
    return _bytes_accessed(jax.jit(step, donate_argnums=0, compiler_options=DEFAULT_CODEGEN)
                           .lower((params, tx.init(params)), x).compile())

  baseline = bytes_accessed(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), False)
  assert bytes_accessed(jaxmp.loss_scaling(optax.adamw(1e-3), jaxmp.DynamicLossScale(),
                                           clip_global_norm=1.0), True) <= 1.002 * baseline


@pytest.mark.standard_promotion(
    reason="the benchmark transformer is examples/train_lm.py's model, whose "
           "float16 attention meets Flax's float32 softmax (as in the demo)")
def test_a_finite_retrying_step_costs_within_half_a_percent_of_plain():
  recovery = benchmark("recovery")
  loss16, loss32, params = recovery.loss_fns(recovery.build_parser().parse_args(
      ["--d-model", "32", "--layers", "1", "--seq-len", "16", "--batch-size", "2"]))
  steps, tx = recovery.make_steps(loss16, loss32)
  figures = recovery.compile_figures({k: steps[k] for k in ("plain", "retry_skipped")},
                                     (params, tx.init(params)), jnp.zeros((2, 17), jnp.int32),
                                     timed=False)
  for key in ("bytes_accessed", "temp_bytes", "peak_live_bytes"):
    assert figures["retry_skipped"][key] <= 1.005 * figures["plain"][key], key


def test_the_peak_counts_a_buffer_shared_by_two_values_once():
  buffers = """allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}:
 value: <1 p @0> (size=8,offset=0): f32[2]{0}
 value: <2 while.1{0} (phi) @0> (size=8,offset=0): f32[2]{0}
allocation 1: size 12, preallocated-temp:
 value: <3 t @0> (size=4,offset=0): f32[]
 value: <4 u @0> (size=4,offset=8): f32[]
"""
  # p hands over to the loop's value at 3, where both are listed; t and u
  # overlap at 5; t's buffer is live again from 7.
  ranges = """BufferLiveRange:
    p{}:0-3
    while.1{0}:3-9
    t{}:2-5
    u{}:5-6
    t{}:7-8
  Live ranges at 3 (peak):
"""
  assert benchmark("recovery").distinct_peak(ranges, buffers) == 8 + 4 + 4


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no clip", "clip"])
def test_accumulation_costs_no_more_than_optax_multisteps(clip):
  """jaxmp.multi_steps against optax.MultiSteps, unguarded: bytes accessed within +2%, temp memory
  within +0.5%, and at most 4 more kernels per distinct gradient shape (the norm's reduction, and
  the micro-batch's own check that keep_on_skip reads) and 2 more for the loss scale's work."""
  scaling, shapes = benchmark("scaling"), 8
  # An elementwise loss: the optimizer and the guard are most of the step.
  loss_fn, params, batch = scaling.leaves_loss(shapes, True, 200_000)
  variants = scaling.accumulation_variants(loss_fn, clip_global_norm=clip)[:2]
  # optax.MultiSteps' running mean divides by its int32 counter.
  with jax.numpy_dtype_promotion("standard"):
    figures = scaling.measure_problem(scaling.Problem(variants, params, batch), repeats=0)
  base, ours = figures["unguarded"], figures["jaxmp"]
  assert ours["bytes_accessed"] <= 1.02 * base["bytes_accessed"]
  assert ours["temp_bytes"] <= 1.005 * base["temp_bytes"]
  assert ours["kernels"] <= base["kernels"] + 4 * shapes + 2
