"""Multi-host mixed-precision training: one global mesh over all processes.

A small decoder-only transformer (Flax Linen) trains with float16 compute and
dynamic loss scaling over a global ("data", "fsdp") mesh that spans every
process. Parameters and Adam moments are sharded FSDP-style over "fsdp", the
batch over "data", and the loss-scale state is replicated on every device.
At one step, one example in one process's shard of the batch is multiplied by
a large factor, so that its float16 activations overflow. The gradients are
non-finite, and every device of every process skips that step together: the
skip decision is a global reduction that XLA inserts, because the step is one
``jax.jit`` over global arrays.

Each process prints its own view (its local loss, over the examples it holds,
and the decision of each of its devices) next to the global metrics.

Usage::

  # On a laptop: spawn 2 processes on 127.0.0.1 with 2 CPU devices each.
  python examples/pjit_multihost.py --local-processes 2 --devices-per-process 2

  # On a cluster (SLURM, TPU pods, Kubernetes...), one process per host, as the
  # launcher starts them; jax.distributed.initialize() reads the environment.
  srun python examples/pjit_multihost.py

  # One process, no jax.distributed (e.g. 4 CPU devices as reference).
  python examples/pjit_multihost.py --single-process --devices-per-process 4

``--metrics-dir DIR`` writes ``DIR/process_<i>.json`` with each process's
per-step metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxmp

VOCAB = 64
SEQ_LEN = 16
AXES = ("data", "fsdp")


# ---------------------------------------------------------------------------
# Command line.


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  launch = parser.add_argument_group("launch")
  launch.add_argument(
      "--local-processes", type=int, default=0, metavar="N",
      help="spawn N processes on 127.0.0.1 (a free port is chosen) and wait "
      "for them; each gets --devices-per-process CPU devices",
  )
  launch.add_argument(
      "--single-process", action="store_true",
      help="run in this process without jax.distributed",
  )
  launch.add_argument(
      "--devices-per-process", type=int, default=2, metavar="D",
      help="CPU devices per process in local runs (default 2); ignored on "
      "GPUs and TPUs",
  )
  launch.add_argument(
      "--timeout", type=float, default=300.0,
      help="seconds before the local processes are killed (default 300)",
  )
  launch.add_argument("--coordinator-address", help=argparse.SUPPRESS)
  launch.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
  launch.add_argument("--process-id", type=int, help=argparse.SUPPRESS)

  train = parser.add_argument_group("training")
  train.add_argument("--steps", type=int, default=8)
  train.add_argument("--global-batch", type=int, default=8,
                     help="examples per step over all processes (default 8)")
  train.add_argument("--fsdp", type=int, default=2,
                     help="size of the 'fsdp' mesh axis (default 2); the "
                     "'data' axis takes the remaining devices")
  train.add_argument("--policy", default="mixed_float16",
                     help="a jaxmp dtype policy (default mixed_float16)")
  train.add_argument("--learning-rate", type=float, default=3e-3)
  train.add_argument("--init-scale", type=float, default=2.0**12)
  train.add_argument("--period", type=int, default=3,
                     help="finite steps before the loss scale grows")
  train.add_argument("--overflow-step", type=int, default=3,
                     help="step at which one example overflows (-1: never)")
  train.add_argument("--overflow-process", type=int, default=-1,
                     help="process whose shard gets the overflow (default: "
                     "the last)")
  train.add_argument("--overflow-factor", type=float, default=1e5,
                     help="the poisoned example's embeddings are multiplied "
                     "by this in the compute dtype (1e5 overflows float16)")
  train.add_argument("--metrics-dir", type=pathlib.Path)
  args = parser.parse_args(argv)
  if args.local_processes < 0 or args.devices_per_process < 1:
    parser.error("--local-processes must be >= 0, --devices-per-process >= 1")
  if args.local_processes and args.single_process:
    parser.error("--local-processes and --single-process exclude each other")
  return args


# ---------------------------------------------------------------------------
# Launching local processes.


def free_port() -> int:
  """A TCP port on 127.0.0.1 that is free now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
  """The environment of a local worker: CPU only, no forced device count."""
  env = dict(os.environ)
  flags = [
      flag for flag in env.get("XLA_FLAGS", "").split()
      if not flag.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags)
  env["JAX_PLATFORMS"] = "cpu"
  return env


def launch_local(args: argparse.Namespace, argv: Sequence[str]) -> int:
  """Runs ``args.local_processes`` copies of this script; returns an exit code.

  Every process is bounded by ``args.timeout``. When one fails, the others
  are stopped at once (they would wait for it in a collective).
  """
  port = free_port()
  address = f"127.0.0.1:{port}"
  print(f"launching {args.local_processes} processes x "
        f"{args.devices_per_process} CPU devices, coordinator {address}",
        flush=True)
  forwarded = _without_launch_flags(argv)
  env = worker_env()
  processes = []
  try:
    for process_id in range(args.local_processes):
      command = [
          sys.executable, os.path.abspath(__file__), *forwarded,
          "--coordinator-address", address,
          "--num-processes", str(args.local_processes),
          "--process-id", str(process_id),
          "--devices-per-process", str(args.devices_per_process),
          "--timeout", str(args.timeout),
      ]
      processes.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + args.timeout
    while True:
      codes = [p.poll() for p in processes]
      if any(code not in (None, 0) for code in codes):
        failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
        print(f"process(es) {failed} failed; stopping the others",
              file=sys.stderr, flush=True)
        return 1
      if all(code == 0 for code in codes):
        return 0
      if time.monotonic() > deadline:
        print(f"timed out after {args.timeout:g} s; stopping the processes",
              file=sys.stderr, flush=True)
        return 124
      time.sleep(0.1)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
      process.wait()


def _without_launch_flags(argv: Sequence[str]) -> list[str]:
  dropped = {"--local-processes", "--devices-per-process", "--timeout"}
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.split("=", 1)[0]
    if name in dropped:
      skip = "=" not in arg
      continue
    out.append(arg)
  return out


def initialize(args: argparse.Namespace) -> None:
  """Sets up the CPU devices and ``jax.distributed`` for this process."""
  if args.coordinator_address or args.single_process:
    # Only the CPU backend reads this; GPUs and TPUs keep their devices.
    jax.config.update("jax_num_cpu_devices", args.devices_per_process)
  if args.single_process:
    return
  if args.coordinator_address:
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=int(args.timeout),
    )
    return
  try:
    jax.distributed.initialize()  # SLURM, TPU pods, Kubernetes, MPI...
  except (ValueError, RuntimeError) as error:
    raise SystemExit(
        f"jax.distributed.initialize() found no cluster environment: {error}\n"
        "On one machine, run with --local-processes N (N local processes) or "
        "--single-process."
    ) from error


# ---------------------------------------------------------------------------
# Model, data and the training step.


def make_model(policy):
  compute, param = policy.compute_dtype, policy.param_dtype

  class TinyTransformer(nn.Module):
    """A one-block pre-LayerNorm decoder; runs in the policy's compute dtype."""

    d_model: int = 32
    num_heads: int = 2

    @nn.compact
    def __call__(self, tokens, input_scale):
      d_model = self.d_model
      x = nn.Embed(VOCAB, d_model, dtype=compute, param_dtype=param)(tokens)
      position = self.param(
          "position", nn.initializers.normal(0.02), (SEQ_LEN, d_model), param
      )
      x = x + position.astype(compute)
      # 1.0 everywhere, except for the poisoned example.
      x = x * input_scale[:, None, None].astype(compute)
      h = nn.LayerNorm(dtype=compute, param_dtype=param)(x)
      x = x + nn.MultiHeadDotProductAttention(
          num_heads=self.num_heads, dtype=compute, param_dtype=param
      )(h, h, mask=nn.make_causal_mask(tokens))
      h = nn.LayerNorm(dtype=compute, param_dtype=param)(x)
      h = nn.gelu(nn.Dense(4 * d_model, dtype=compute, param_dtype=param)(h))
      x = x + nn.Dense(d_model, dtype=compute, param_dtype=param)(h)
      x = nn.LayerNorm(dtype=compute, param_dtype=param)(x)
      return nn.Dense(VOCAB, dtype=compute, param_dtype=param)(x)

  return TinyTransformer()


def global_batch(step: int, batch_size: int):
  """The whole global batch, the same on every process (NumPy, on the host).

  Sequences count up modulo VOCAB with a random start and stride; the model
  learns to continue them.
  """
  rng = np.random.default_rng(step)
  start = rng.integers(0, VOCAB, (batch_size, 1))
  stride = rng.integers(1, 4, (batch_size, 1))
  sequence = (start + stride * np.arange(SEQ_LEN + 1)) % VOCAB
  return sequence[:, :-1].astype(np.int32), sequence[:, 1:].astype(np.int32)


def fsdp_spec(shape: Sequence[int], fsdp: int):
  """Shards the largest dimension divisible by ``fsdp``; vectors replicated."""
  if len(shape) < 2:
    return P()
  for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[dim] % fsdp == 0:
      spec = [None] * len(shape)
      spec[dim] = "fsdp"
      return P(*spec)
  return P()


def make_mesh(fsdp: int, devices=None):
  """A ("data", "fsdp") mesh; ``devices`` defaults to all processes' devices."""
  devices = jax.devices() if devices is None else list(devices)
  if len(devices) % fsdp:
    raise SystemExit(
        f"--fsdp {fsdp} does not divide the {len(devices)} devices")
  # Auto axes: GSPMD-style propagation (make_mesh defaults to Explicit here).
  return jax.make_mesh(
      (len(devices) // fsdp, fsdp), AXES, axis_types=(AxisType.Auto,) * 2,
      devices=devices,
  )


def overflow_row(mesh, batch_size: int, process: int) -> int:
  """The first global batch row held by a device of ``process``."""
  sharding = NamedSharding(mesh, P("data"))
  rows = [
      index[0].start or 0
      for device, index in sharding.devices_indices_map((batch_size,)).items()
      if device.process_index == process
  ]
  if not rows:
    raise SystemExit(f"process {process} holds no part of the batch")
  return min(rows)


def _local_mean(x) -> float:
  """Mean over the rows this process holds (each row counted once)."""
  rows = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    for offset, value in enumerate(np.asarray(shard.data)):
      rows[start + offset] = float(value)
  return float(np.mean(list(rows.values())))


def train(
    mesh,
    *,
    steps: int = 8,
    batch_size: int = 8,
    policy: str = "mixed_float16",
    learning_rate: float = 3e-3,
    init_scale: float = 2.0**12,
    period: int = 3,
    overflow_step: int = 3,
    overflow_row_index: int = 0,
    overflow_factor: float = 1e5,
    log=print,
) -> list[dict[str, Any]]:
  """Trains over ``mesh``; returns this process's metrics, one dict per step."""
  policy = jaxmp.get_policy(policy)
  model = make_model(policy)
  tx = jaxmp.loss_scaling(
      optax.adam(learning_rate),
      jaxmp.DynamicLossScale(init_scale, period=period),
  )
  fsdp = mesh.shape["fsdp"]
  replicated = NamedSharding(mesh, P())
  batch_sharding = NamedSharding(mesh, P("data"))

  tokens0, _ = global_batch(0, batch_size)
  init = lambda key: model.init(key, tokens0, np.ones(batch_size, np.float32))
  shapes = jax.eval_shape(init, jax.random.key(0))
  param_shardings = jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, fsdp_spec(x.shape, fsdp)), shapes
  )
  params = jax.jit(init, out_shardings=param_shardings)(jax.random.key(0))
  # Moments sharded like the params (optax finds the parameter-shaped parts
  # of the state), the rest, with the loss scale, replicated.
  opt_shardings = optax.tree_utils.tree_map_params(
      tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, params),
      param_shardings, transform_non_params=lambda _: NamedSharding(mesh, P()))
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)

  def loss_fn(params, tokens, targets, input_scale):
    logits = policy.cast_to_output(model.apply(params, tokens, input_scale))
    per_example = optax.softmax_cross_entropy_with_integer_labels(
        logits, targets
    ).mean(axis=-1)
    return jnp.mean(per_example), per_example

  def train_step(params, opt_state, tokens, targets, input_scale):
    loss_scale = jaxmp.get_loss_scale(opt_state)
    (loss, per_example), grads = jaxmp.scaled_value_and_grad(
        loss_fn, loss_scale, has_aux=True
    )(params, tokens, targets, input_scale)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, loss, per_example,
            jaxmp.loss_scaling_metrics(opt_state))

  step_fn = jax.jit(
      train_step,
      in_shardings=(param_shardings, opt_shardings, batch_sharding,
                    batch_sharding, batch_sharding),
      out_shardings=(param_shardings, opt_shardings, replicated,
                     batch_sharding, replicated),
      donate_argnums=(0, 1),
  )

  def to_global(array):
    # Every process builds the same host batch and hands over its own rows.
    sharding = NamedSharding(mesh, P("data", *[None] * (array.ndim - 1)))
    return jax.make_array_from_callback(
        array.shape, sharding, lambda index: array[index]
    )

  me = jax.process_index()
  records = []
  for step in range(steps):
    tokens, targets = global_batch(step, batch_size)
    input_scale = np.ones(batch_size, np.float32)
    if step == overflow_step:
      input_scale[overflow_row_index] = overflow_factor
    params, opt_state, loss, per_example, metrics = step_fn(
        params, opt_state, to_global(tokens), to_global(targets),
        to_global(input_scale),
    )
    # Global metrics are replicated: every process can read them.
    metrics = jax.device_get(metrics)
    # The skip decision as each of this process's devices holds it.
    decisions = [
        bool(np.asarray(shard.data))
        for shard in opt_state.last_finite.addressable_shards
    ]
    record = {
        "step": step,
        "process": me,
        "loss": float(loss),
        "local_loss": _local_mean(per_example),
        "loss_scale": float(metrics["loss_scale"]),
        "skipped": not bool(metrics["last_finite"]),
        "skipped_steps": int(metrics["skipped_steps"]),
        "local_device_finite": decisions,
    }
    records.append(record)
    log(
        f"[process {me}] step {step}: loss {record['loss']:.4f} "
        f"(local {record['local_loss']:.4f}) scale {record['loss_scale']:g} "
        f"{'SKIPPED' if record['skipped'] else 'applied'} "
        f"(skipped so far {record['skipped_steps']}; this process's devices "
        f"finite: {decisions})"
    )
  # Host-side check, on fully replicated state: fine on every process.
  jaxmp.check_loss_scale(opt_state)
  return records


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  if args.local_processes:
    return launch_local(args, argv)
  initialize(args)

  mesh = make_mesh(args.fsdp)
  me, count = jax.process_index(), jax.process_count()
  target = count - 1 if args.overflow_process < 0 else args.overflow_process
  if not 0 <= target < count:
    raise SystemExit(
        f"--overflow-process {target}: there are {count} processes")
  row = overflow_row(mesh, args.global_batch, target)
  local = [d.id for d in jax.local_devices()]
  print(f"[process {me}] {count} processes, {jax.device_count()} devices "
        f"(mine: {local}); mesh {dict(mesh.shape)}; the overflow at step "
        f"{args.overflow_step} hits batch row {row}, held by process {target}",
        flush=True)
  log = lambda line: print(line, flush=True)
  records = train(
      mesh, steps=args.steps, batch_size=args.global_batch, policy=args.policy,
      learning_rate=args.learning_rate, init_scale=args.init_scale,
      period=args.period, overflow_step=args.overflow_step,
      overflow_row_index=row, overflow_factor=args.overflow_factor, log=log,
  )
  skipped = [r["step"] for r in records if r["skipped"]]
  if me == 0:
    print(f"global: final loss {records[-1]['loss']:.4f}, loss scale "
          f"{records[-1]['loss_scale']:g}, skipped steps {skipped} on every "
          "device of every process", flush=True)
  if args.metrics_dir:
    args.metrics_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "process": me, "num_processes": count,
        "local_devices": local, "overflow_row": row,
        "overflow_process": target, "steps": records,
    }
    path = args.metrics_dir / f"process_{me}.json"
    path.write_text(json.dumps(summary, indent=1))
  if args.coordinator_address or not args.single_process:
    jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
