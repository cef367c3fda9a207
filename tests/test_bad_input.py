"""The bad-input catalogue: invalid inputs across the public API, one case per check.

Each case asserts the exception type (never a bare ``KeyError``, ``AttributeError``,
``IndexError``, ``OverflowError`` or ``AssertionError``), that the message names the
problem (what was wrong, usually with the offending value) and the fix (what to pass
instead), and that jaxmp raises it itself, not JAX, optax, orbax or NumPy deep inside.
A case that fails today names its ``defect``, which marks it ``xfail(strict=True)``:
delete the field when the defect is fixed (the strict mark fails the test until then).
"""

import dataclasses
import io
import os
import pathlib
import re
import sys
import tempfile
import traceback
from typing import Any, Callable
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxmp
import jaxmp.flax
from jaxmp import __main__ as cli

JAXMP_DIR = pathlib.Path(jaxmp.__file__).resolve().parent
PARAMS, WIDE = {"w": jnp.ones(2), "b": jnp.ones(1)}, {"w": jnp.ones(3), "b": jnp.ones(1)}
TX = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
STATE = TX.init(PARAMS)
LADDER = ("mixed_float16", "float32")
VE, TE = ValueError, TypeError
# Built-in errors that say nothing about what the user did wrong.
BARE_ERRORS = (KeyError, AttributeError, IndexError, OverflowError, AssertionError)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  call: Callable[[], Any]
  error: type
  problem: str  # a regular expression the message must match
  fix: str  # and another one
  defect: str = ""  # why the error is not yet explained (marks it xfail)


def builder(f):
  """``f(...)`` made a case's call, labelled ``f(...)``: a case without a name has it."""
  def build(*args, **kwargs):
    call = lambda: f(*args, **kwargs)
    call.label = f.__qualname__ + "(" + ", ".join(
        [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]) + ")"
    return call
  return build


(get_policy, path_policy, module_policy, torch_scaler, loss_scaling, multi_steps, monitor,
 create, select_tree, switch_precision, autocast, autocast_rules, check_loss_scale, dynamic,
 fallback, deepspeed) = map(builder, (
     jaxmp.get_policy, jaxmp.PathPolicy, jaxmp.flax.ModulePolicy, jaxmp.from_torch_grad_scaler,
     jaxmp.loss_scaling, jaxmp.multi_steps, jaxmp.LossScaleMonitor, jaxmp.flax.TrainState.create,
     jaxmp.select_tree, jaxmp.switch_precision, jaxmp.autocast, jaxmp.autocast_rules,
     jaxmp.check_loss_scale, jaxmp.DynamicLossScale, jaxmp.PrecisionFallback,
     jaxmp.from_deepspeed_config))
update_with = lambda grads, state=STATE: lambda: TX.update(grads, state, PARAMS)
jitted_update = lambda tx: lambda: jax.jit(tx.update)(PARAMS, tx.init(PARAMS), PARAMS)
retried_on = lambda state: lambda: jaxmp.retry_skipped(lambda state: (state, None))(state)
record_twice = lambda: [m.record(5, STATE) for m in [jaxmp.LossScaleMonitor()] * 2]
field_state = lambda: FieldState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(0.1), ema=PARAMS)
sgd_state = lambda loss_scale: jaxmp.loss_scaling(optax.sgd(0.1), loss_scale).init(PARAMS)
with_env = lambda variable, value, call: mock.patch.dict(os.environ, {variable: value})(call)
grads_of = lambda fun, loss_scale, x=jnp.ones(2), **kwargs: lambda: jaxmp.scaled_value_and_grad(
    fun, loss_scale, **kwargs)(x)
load_state = lambda **changes: lambda: jaxmp.PrecisionFallback(LADDER).load_state_dict(
    {**jaxmp.PrecisionFallback(LADDER).state_dict(), **changes} if changes else {})


def first_argument_value_and_grad(fun, *, has_aux=False):  # no argnums, as eqx's
  return jax.value_and_grad(fun, has_aux=has_aux)


def scoped_matmul(x):
  with jax.named_scope("head"):
    return x @ x


def linen_overlap():
  policy = jaxmp.flax.ModulePolicy({nn.Dense: "mixed_bfloat16", "layers_0": "f32"})
  model, x = nn.Sequential([nn.Dense(2)]), jnp.ones((1, 2))
  return policy.wrap_apply(model.apply)(model.init(jax.random.key(0), x), x)


class NnxRaw(nnx.Module):
  def __init__(self):
    self.w = nnx.Param(jnp.ones(2))


class Holder(nnx.Module):
  def __init__(self):
    self.raw, self.linear = NnxRaw(), nnx.Linear(2, 2, rngs=nnx.Rngs(0))


class FieldState(jaxmp.flax.TrainState):
  ema: Any


def restore_saved(save, target, **kwargs):
  """Saves with ``save(path)`` into a fresh folder, then restores into ``target``."""
  def call():
    with tempfile.TemporaryDirectory() as folder:
      save(os.path.join(folder, "ckpt"))
      return jaxmp.flax.restore_checkpoint(os.path.join(folder, "ckpt"), target, **kwargs)
  return call


def save_plain_orbax(path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, STATE)
  checkpointer.wait_until_finished()


def nnx_optimizer():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()), wrt=nnx.Param)


def float16_state():
  model = nn.Dense(2)
  return jaxmp.flax.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), jnp.ones((1, 2)))["params"],
      tx=optax.sgd(0.1), policy="mixed_float16")


def restore_switched(target, **kwargs):
  """A run ("state" or "nnx") switched to float32 at step 1, saved and restored."""
  def call():
    given = dict(kwargs)  # each call starts from the case's own arguments
    with tempfile.TemporaryDirectory() as folder:
      path, controller = os.path.join(folder, "ckpt"), jaxmp.PrecisionFallback(LADDER)
      if target == "nnx":
        model, optimizer = nnx_optimizer()
        controller.switch(optimizer, "float32", reason="a test", step=1, model=model)
        jaxmp.flax.save_checkpoint(path, (model, optimizer), fallback=controller)
        return jaxmp.flax.restore_checkpoint(path, nnx_optimizer()[1], **given)
      state = controller.switch(float16_state(), "float32", reason="a test", step=1)
      jaxmp.flax.save_checkpoint(
          path, state, fallback=controller if given.pop("saved_with_fallback", True) else None)
      return jaxmp.flax.restore_checkpoint(path, float16_state(), **given)
  return call


def save_a_policy_with_a_local_class(path):
  class Local(nn.Module):
    pass

  controller = jaxmp.PrecisionFallback(LADDER)
  policy = jaxmp.flax.ModulePolicy({Local: "float32"}, default="mixed_float16")
  state = controller.switch(float16_state(), policy, reason="a test", step=1)
  jaxmp.flax.save_checkpoint(path, state, fallback=controller)


class Wide(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head")(x)


def overflow_report(x, params=None):
  return jaxmp.flax.find_overflowing_modules(
      jaxmp.get_policy("mixed_float16").wrap_apply(Wide().apply),
      params or Wide().init(jax.random.key(0), jnp.ones((1, 2))), x)


def fp8_state(meta=None, policy="mixed_fp8", **kwargs):
  params = {"kernel": jnp.ones((3, 2))}
  return jaxmp.flax.TrainState.create(
      apply_fn=nn.Dense(2).apply, tx=optax.sgd(0.1), policy=policy,
      params=params if meta is None else {"params": params, "_overwrite_with_gradient": meta},
      **kwargs)


def fp8_apply(model, apply=False):
  """``model``'s init under FP8 (``apply``: then its apply on the params alone)."""
  policy, x = jaxmp.flax.ModulePolicy({}, default="mixed_fp8"), jnp.ones((1, 3))
  def call():
    variables = policy.wrap_apply(model.init)(jax.random.key(0), x)
    if apply:
      jaxmp.flax.find_overflowing_modules(
          policy.wrap_apply(model.apply), {"params": variables["params"]}, x)
  return call


def fp8_nnx_model(policy="mixed_fp8", **kwargs):
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0), **kwargs)
  jaxmp.flax.ModulePolicy({}, default=policy).set_nnx_dtypes(model)
  return model


VALID_DTYPES = r"Valid dtype names are: bf16, bfloat16, f16, f32"
# Every error about a policy string lists the keys, the dtype names and the presets.
POLICY_GRAMMAR = (r"Valid keys are p, params, c, compute, o, output\. " + VALID_DTYPES
                  + r".*fp16, fp32, fp64, full, half\. Presets are mixed_bfloat16")
SCALE_HINT = r"powers of two such as 2\.0\*\*15"
METRICS_FIX = r"Pass the dict returned by jaxmp\.loss_scaling_metrics\(opt_state\)"


# (name, call, error, problem, fix), or (call, ...) named by its label.
CASES = [Case(*row) if isinstance(row[0], str) else Case(row[0].label, *row) for row in [
    # Recovery (retry_skipped, keep_on_skip).
    ("retry_skipped: negative max_retries", lambda: jaxmp.retry_skipped(jnp.sum, max_retries=-1),
     VE, r"max_retries must be .*>= 0.*got -1", r"Pass how many times to run a skipped step again"),
    ("retry_skipped: a policy as the fallback",
     lambda: jaxmp.retry_skipped(jnp.sum, fallback="float32"), TE,
     r"retry_skipped\(fallback='float32'\): the fallback must be a step",
     r"fallback=train_step_float32"),
    ("retry_skipped: an accumulating optimizer",
     retried_on(jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2).init(PARAMS)), VE,
     r"the loss-scaling state sits inside gradient accumulation", r"Retry a step without "
     r"accumulation"),
    ("retry_skipped: a step that returns no aux",
     lambda: jaxmp.retry_skipped(lambda state: state)((PARAMS, STATE)), TE, r"retry_skipped: the "
     r"step must return \(state, aux\); it returned the state alone", r"Return an aux too"),
    ("retry_skipped: a state gaining an entry",
     lambda: jaxmp.retry_skipped(lambda state: ({**state, "loss": jnp.zeros([])}, None))(
         {"opt_state": STATE}),
     VE, r"retry_skipped: the state the step returned and the state it took differ in "
     r"tree structure", r"create every entry before the first step"),
    ("keep_on_skip: inside a plain optax.MultiSteps",
     lambda: jaxmp.keep_on_skip(optax.MultiSteps(TX, 2).init(PARAMS), PARAMS, PARAMS), VE,
     r"does not record whether this micro-batch's gradients were finite",
     r"Use jaxmp\.multi_steps\(.*should_skip_update_fn=optax\.skip_not_finite"),
    ("keep_on_skip: a new value of another structure",
     lambda: jaxmp.keep_on_skip(STATE, {"a": PARAMS}, PARAMS), VE, r"keep_on_skip.*structure",
     r"pass the updated collection itself"),
    # Policies.
    (get_policy(""), VE, r"Empty policy string", POLICY_GRAMMAR),
    (get_policy("p="), VE, r"Missing value after p= in policy 'p='", POLICY_GRAMMAR),
    (get_policy("c=float8"), VE,
     r"In policy 'c=float8', key 'c': Unknown dtype 'float8'.*" + POLICY_GRAMMAR, r"float8_e4m3fn, "
     r"float8_e5m2"),
    (get_policy("p=f32;c=bf16"), VE, r"Unknown dtype 'f32;c=bf16'", r"Separate the parts of a "
     r"policy with ','"),
    (get_policy("mixed_fp16"), VE, r"Unknown policy 'mixed_fp16': not a preset\. Unknown dtype "
     r"'mixed_fp16'", r"Did you mean 'mixed_float16'\?.*Presets are mixed_bfloat16, mixed_float16"),
    (get_policy(16), TE, r"got 16 of type int", r"a string such as 'mixed_bfloat16'"),
    (get_policy("param=f32,c=bf16"), VE, r"Unknown key 'param'",
     r"Did you mean 'params'\?.*" + POLICY_GRAMMAR),
    (get_policy("c=f16,c=bf16"), VE, r"Key 'c' in policy 'c=f16,c=bf16' sets compute_dtype a "
     r"second time", r"use policy\.with_compute_dtype\(\.\.\.\)"),
    (get_policy("p=f32,c=bf16,x"), VE, r"Policy part 'x' of 'p=f32,c=bf16,x' is not of the "
     r"form key=dtype", POLICY_GRAMMAR),
    ("Policy: non-floating dtype", lambda: jaxmp.Policy(jnp.float32, jnp.int8, jnp.float32), VE,
     r"Policy: compute_dtype must be a floating dtype .*got int8", VALID_DTYPES),
    ("Policy: None as a dtype", lambda: jaxmp.Policy(None, "f32", "f32"), TE,
     r"Policy: param_dtype must be a floating dtype .*got None of type NoneType",
     r"such as jnp\.float16 or jnp\.bfloat16.*" + VALID_DTYPES),
    ("Policy.with_output_dtype: unknown name",
     lambda: jaxmp.get_policy("float32").with_output_dtype("f17"), VE, r"Unknown dtype 'f17'",
     r"Did you mean 'f16'\?.*" + VALID_DTYPES),
    ("auto_policy: a platform name instead of a device", lambda: jaxmp.auto_policy("gpu"), TE,
     r"expects a JAX device or None, got 'gpu'", r"jax\.devices\(\)\[0\]"),
    (path_policy({"(": "f32"}), VE, r"PathPolicy: '\(' is not a valid regular expression",
     r"missing \), unterminated subpattern"),
    (path_policy({3: "f32"}), TE, r"PathPolicy: a pattern must be a regular-expression string, got "
     r"3 of type int", r"regular-expression string"),
    (path_policy({"head": "p=f32;c=bf16"}), VE, r"PathPolicy, rule 'head': In policy "
     r"'p=f32;c=bf16'", r"Separate the parts of a policy with ','"),
    (path_policy({}, default="f17"), VE, r"PathPolicy, default: Unknown policy 'f17'",
     POLICY_GRAMMAR),
    (path_policy([("x", "f32"), ("x", "mixed_bfloat16")]), VE, r"PathPolicy: the rule 'x' is "
     r"given twice", r"give each pattern once"),
    (path_policy(["x"]), TE, r"got the item 'x'", r"rules must be a dict \{pattern: policy\} or a "
     r"list of \(pattern, policy\) pairs"),
    (path_policy("bf16"), TE, r"got 'bf16' of type str", r"For one policy everywhere, use the "
     r"policy itself"),
    (path_policy({}, first_match="yes"), TE, r"PathPolicy: first_match must be True or "
     r"False, got 'yes'", r"True or False"),
    ("PathPolicy: overlapping patterns",
     lambda: jaxmp.PathPolicy({"bias$": "f32", "head": "mixed_bfloat16"}).policy_for(
         "params/head/bias"),
     VE, r"PathPolicy: the path 'params/head/bias' matches several rules: 'bias\$', 'head'",
     r"anchor the patterns with \^ and \$\), or pass first_match=True"),
    ("PathPolicy: an unmatched path without a default",
     lambda: jaxmp.PathPolicy({"head": "f32"}, default=None).cast_to_compute(
         {"body": {"w": jnp.ones(1)}}),
     VE, r"PathPolicy: no rule matches the path 'body/w' and there is no default policy\. The "
     r"rules are: 'head'", r"Add a rule for it, or pass default=\.\.\."),
    ("PathPolicy.wrap_apply: no default",
     lambda: jaxmp.PathPolicy({"head": "f32"}, default=None).wrap_apply(lambda v: v), VE,
     r"This PathPolicy needs a default policy: it is the policy of the model's inputs and outputs",
     r"Pass default=\.\.\."),
    ("ModulePolicy: a bad policy for a module", module_policy({nn.LayerNorm: "c=int8"}), VE,
     r"ModulePolicy, rule flax\.linen\.normalization\.LayerNorm: .*Unknown dtype 'int8'",
     VALID_DTYPES),
    (module_policy({3: "f32"}), TE, r"got 3 of type int", r"module classes \(e\.g\. "
     r"nn\.LayerNorm\) or strings"),
    (module_policy({}, override_dtype="dense"), TE, r"override_dtype .*got 'dense'",
     r"a tuple of module classes such as \(nn\.Dense, nn\.Conv\)"),
    ("ModulePolicy: override_dtype without dtype", module_policy({}, override_dtype=(nn.Dropout,)),
     VE, r"names flax\.linen\.stochastic\.Dropout, which has no dtype attribute", r"Name the Linen "
     r"layers that take dtype=.*set_nnx_dtypes sets every layer"),
    ("ModulePolicy: overlapping rules", linen_overlap, VE, r"ModulePolicy: the module Dense at "
     r"path 'layers_0' matches several rules: flax\.linen\.linear\.Dense, 'layers_0'",
     r"Make the rules exclusive.*or pass first_match=True"),
    ("ModulePolicy: a rule that matches no NNX module",
     lambda: jaxmp.flax.ModulePolicy({"Head": "f32"}).set_nnx_dtypes(Holder()), VE,
     r"the rule 'Head' matches no module of the model\. Module paths are: 'linear'",
     r"Check the rule for a typo"),
    ("ModulePolicy: NNX modules without dtype",
     lambda: jaxmp.flax.ModulePolicy({NnxRaw: "bf16"}).set_nnx_dtypes(Holder()), VE,
     r"matches modules without a dtype attribute", r"Name the layers inside them instead"),
    ("ModulePolicy.set_nnx_dtypes: a Linen model",
     lambda: jaxmp.flax.ModulePolicy({}).set_nnx_dtypes(nn.Dense(2)), TE, r"set_nnx_dtypes expects "
     r"an nnx\.Module.*Got Dense", r"use wrap_apply\(model\.apply\)"),
    # Loss scales, at construction: Python, NumPy and concrete array values alike.
    (dynamic(0.0), VE, r"loss_scale must be a number >= 1 and <= 3\.40282e\+38, got 0\.0",
     SCALE_HINT),
    (dynamic(float("inf")), VE, r"loss_scale must be finite, got inf", SCALE_HINT),
    (dynamic(jnp.float32(0.0)), VE, r"loss_scale must be a number >= 1 .*got Array\(0\., "
     r"dtype=float32\)", SCALE_HINT),
    (dynamic(np.float32(-2.0)), VE, r"loss_scale must be a number >= 1 .*got np\.float32\(-2\.0\)",
     SCALE_HINT),
    (dynamic(1.0, min_loss_scale=2.0), VE, r"loss_scale must be a number >= 2 .*got 1\.0",
     r"\[min_loss_scale, max_loss_scale\] = \[2, "),
    (dynamic(1e-40, min_loss_scale=0.0), VE, r"loss_scale must be a number >= 1\.17549e-38 "
     r".*got 1e-40", r"Scales below 2\*\*-126, the smallest normal float32, are flushed to 0"),
    ("StaticLossScale: zero scale", lambda: jaxmp.StaticLossScale(0), VE, r"loss_scale must be a "
     r"number >= 1\.17549e-38 .*got 0\b", SCALE_HINT),
    (dynamic("1024"), TE, r"loss_scale must be a number, got '1024' of type str", r"Pass a Python "
     r"float or a float32 array"),
    (dynamic(np.ones(2)), TE, r"loss_scale must be a scalar, got an array of shape \(2,\)",
     r"Pass a Python float or a float32 array"),
    (dynamic(period=0), VE, r"period must be an integer >= 1 and <= 2147483647, got 0",
     r"2000 is the usual choice"),
    (dynamic(period=2.5), TE, r"period must be an integer, got 2\.5", r"2000 is the usual choice"),
    ("DynamicLossScale: traced period",
     lambda: jax.jit(lambda p: jaxmp.DynamicLossScale(period=p))(jnp.int32(5)), TE,
     r"period must be an integer, got a traced value", r"configuration is static: pass a "
     r"Python number"),
    (dynamic(factor=1.0), VE, r"factor must be a number > 1, got 1\.0", r"2\.0 is the usual "
     r"choice\. Use StaticLossScale"),
    (dynamic(backoff_factor=1.5), VE, r"backoff_factor must be a number > 0 and < 1, got 1\.5",
     r"0\.5 halves it"),
    (dynamic(min_loss_scale=-1.0), VE, r"min_loss_scale must be a number >= 0 .*got -1\.0",
     r"The scale never backs off below it"),
    (dynamic(4.0, min_loss_scale=2.0, max_loss_scale=1.0), VE, r"max_loss_scale must be a number "
     r">= 2, got 1\.0", r"at least min_loss_scale \(2\.0\)\. Pass None"),
    (dynamic(hysteresis=0), VE, r"hysteresis must be an integer >= 1 and <= 2147483647, got 0",
     r"1 backs off on every overflow"),
    (dynamic(consecutive_hysteresis="yes"), TE, r"consecutive_hysteresis must be True or False",
     r"got 'yes' of type str"),
    (dynamic(hysteresis=2**32 + 1), VE, r"hysteresis must be .*got 4294967297", r"1 backs off"),
    (dynamic(counter=2**32 + 5), VE, r"counter .*got 4294967301", r"start with 0"), (dynamic(
        float("nan")), VE, r"loss_scale must be a number, got nan", SCALE_HINT),
    (dynamic(counter=5, period=5), VE, r"counter must be an integer >= 0 and <= 4, got 5",
     r"so it lies in \[0, period\); start with 0"),
    ("DynamicLossScale: traced float counter",
     lambda: jax.jit(lambda c: jaxmp.DynamicLossScale(counter=c))(jnp.float32(1)), TE,
     r"counter must be an integer, got a traced float32 value", r"Pass an array of dtype int32"),
    (dynamic(hysteresis=2, hysteresis_left=jnp.int32(3)), VE, r"hysteresis_left must be an integer "
     r">= 1 and <= 2, got Array\(3, dtype=int32\)", r"so it lies in \[1, hysteresis\]"),
    ("DynamicLossScale: negative overflows_at_min", dynamic(overflows_at_min=np.int32(-1)), VE,
     r"overflows_at_min must be an integer >= 0 and <= 2147483647, got np\.int32\(-1\)",
     r"start with 0"),
    ("DynamicLossScale: replace with a zero scale",
     lambda: dataclasses.replace(jaxmp.DynamicLossScale(), loss_scale=0.0), VE, r"loss_scale must "
     r"be a number >= 1 .*got 0\.0", SCALE_HINT),
    ("adjust: a float flag", lambda: jaxmp.DynamicLossScale().adjust(1.0), TE, r"adjust expects a "
     r"scalar boolean, got an array of shape \(\) and dtype float32",
     r"Pass e\.g\. jaxmp\.all_finite\(grads\)"),
    ("LossScale ==: traced state",
     lambda: jax.jit(lambda ls: ls == ls.adjust(jnp.array(True)))(jaxmp.DynamicLossScale()), TE,
     r"Loss scales holding traced arrays .* cannot be compared with ==",
     r"jnp\.array_equal\(a\.loss_scale, b\.loss_scale\)"),
    # select_tree.
    ("select_tree: non-scalar predicate",
     select_tree(jnp.array([True, False]), {"a": jnp.ones(2)}, {"a": jnp.zeros(2)}), TE,
     r"select_tree expects a scalar boolean, got an array of shape \(2,\)", r"reduce an array "
     r"first with jnp\.all\(x\)"),
    ("select_tree: different structures",
     select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)}), VE, r"a and b differ in "
     r"tree structure:\n  a: PyTreeDef\(\{'a': \*\}\)\n  b: PyTreeDef\(\{'b': \*\}\)",
     r"Pass two pytrees alike"),
    ("select_tree: different shapes",
     select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"a": jnp.ones(3)}), VE, r"a and b differ in "
     r"shape at \['a'\]: \(2,\) against \(3,\)", r"Pass two pytrees alike"),
    ("select_tree: different dtypes",
     select_tree(jnp.array(True), {"a": jnp.ones(2, jnp.int32)}, {"a": jnp.ones(2)}), TE,
     r"a and b differ in dtype at \['a'\]: int32 against float32", r"Pass two pytrees alike"),
    # The optax wrapper (value_and_grad, checks, monitor).
    ("loss_scaling: a number as the loss scale", loss_scaling(optax.sgd(0.1), 2.0**15), TE,
     r"got 32768\.0", r"such as jaxmp\.DynamicLossScale\(\)"),
    ("loss_scaling: a jmp loss scale",
     lambda: jaxmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(
         np.float32(2.0**15), period=100)),
     TE, r"That is jmp's DynamicLossScale, which jaxmp does not run",
     r"write jaxmp\.DynamicLossScale\(loss_scale=32768\.0, counter=0, period=100, factor=2, "
     r"min_loss_scale=1\.0\)\. Or import jaxmp as jmp instead of jmp, which makes "
     r"jmp\.DynamicLossScale\(\.\.\.\) jaxmp's"),
    ("loss_scaling: a name as the optimizer", loss_scaling("adam", jaxmp.DynamicLossScale()), TE,
     r"got 'adam'", r"e\.g\. optax\.adamw\(1e-3\)"),
    ("loss_scaling: wrapped twice",
     lambda: jaxmp.loss_scaling(TX, jaxmp.DynamicLossScale()).init(PARAMS), VE, r"the optimizer it "
     r"wraps is already wrapped with jaxmp\.loss_scaling .*unscaled twice", r"Wrap the bare "
     r"optimizer once: jaxmp\.loss_scaling\(optax\.adamw"),
    ("loss_scaling: around MultiSteps(loss_scaling)",
     lambda: jaxmp.loss_scaling(optax.MultiSteps(TX, 2), jaxmp.DynamicLossScale()).init(PARAMS), VE,
     r"holds a LossScalingState at MultiStepsState\.inner_opt_state",
     r"use jaxmp\.multi_steps\(optax\.adamw\(1e-3\), loss_scale, k\), which wraps it for you"),
    ("multi_steps: around loss_scaling",
     lambda: jaxmp.multi_steps(TX, jaxmp.DynamicLossScale(), 4).init(PARAMS), VE,
     r"jaxmp\.multi_steps: the optimizer it wraps is already wrapped with jaxmp\.loss_scaling",
     r"pass the bare optimizer, jaxmp\.multi_steps\(optax\.adamw\(1e-3\), loss_scale, k\)"),
    ("update: gradients of another tree structure", update_with({"w": jnp.ones(2)}), VE,
     r"the gradients and the params differ in tree structure", r"Differentiate with respect to the "
     r"same params you pass to update"),
    ("update: the bare optimizer's state", update_with(PARAMS, optax.sgd(0.1).init(PARAMS)), TE,
     r"is a tuple, not the LossScalingState", r"Pass the state returned by tx\.init"),
    ("update: an axis name outside pmap/shard_map",
     jitted_update(jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch")),
     VE, r"axis_name='batch'\): that axis name is not bound", r"inside jax\.shard_map or jax\.pmap "
     r".* or drop axis_name"),
    ("update: JAXMP_INPLACE_SELECT set to a word",
     with_env("JAXMP_INPLACE_SELECT", "off", jitted_update(TX)), VE, r"JAXMP_INPLACE_SELECT must "
     r"be 1 .* or 0 .*, got 'off'", r"the default on a CPU\) or 0 \(the form for other backends"),
    ("all_finite: JAXMP_GROUPED_CHECK set to a word",
     with_env("JAXMP_GROUPED_CHECK", "on", lambda: jaxmp.all_finite(PARAMS)), VE,
     r"JAXMP_GROUPED_CHECK must be 1 .* or 0 .*, got 'on'", r"the default on a CPU\) or 0 \(the "
     r"form for other backends"),
    ("get_loss_scale: a state without one",
     lambda: jaxmp.get_loss_scale(optax.adam(1e-3).init(PARAMS)), VE, r"get_loss_scale: no "
     r"jaxmp\.loss_scaling state found", r"Wrap the optimizer with "
     r"jaxmp\.loss_scaling\(optax\.adamw"),
    ("get_loss_scale: two loss-scaling states", lambda: jaxmp.get_loss_scale((STATE, STATE)), VE,
     r"holds 2 jaxmp\.loss_scaling states \(at \[0\], \[1\]\), so the loss scale is ambiguous",
     r"Wrap the whole optimizer once"),
    (check_loss_scale({"loss_scale": jnp.float32(1)}), VE, r"has no 'overflows_at_min' key",
     METRICS_FIX),
    (check_loss_scale({"overflows_at_min": "3", "loss_scale": 1.0}), TE,
     r"the metric 'overflows_at_min' must be a number .*got '3'", METRICS_FIX),
    ("check_loss_scale: negative tolerance", check_loss_scale(STATE, max_overflows_at_min=-1), VE,
     r"got -1", r"must be an integer >= 0"),
    ("scaled_value_and_grad: an optimizer state",
     lambda: jaxmp.scaled_value_and_grad(jnp.sum, STATE), TE, r"got a LossScalingState",
     r"pass jaxmp\.get_loss_scale\(opt_state\)"),
    ("scaled_value_and_grad: a number as the loss scale",
     lambda: jaxmp.scaled_value_and_grad(jnp.sum, 32.0), TE, r"expects a loss scale as its second "
     r"argument, got a float", r"pass jaxmp\.get_loss_scale\(opt_state\)"),
    ("scaled_value_and_grad: has_aux without a pair",
     grads_of(jnp.sum, jaxmp.NoOpLossScale(), has_aux=True), TE, r"has_aux=True\) expects fun",
     r"to return a pair \(loss, aux\)"),
    ("scaled_value_and_grad: (loss, aux) without has_aux",
     grads_of(lambda w: (jnp.sum(w), {"norm": jnp.linalg.norm(w)}), jaxmp.NoOpLossScale()), TE,
     r"expects fun to return a scalar loss, got a tuple", r"If fun returns \(loss, aux\), pass "
     r"has_aux=True"),
    ("scaled_value_and_grad: a dict for the loss",
     grads_of(lambda w: {"loss": jnp.sum(w)}, jaxmp.NoOpLossScale()), TE, r"expects fun to return "
     r"a scalar loss, got a dict", r"return \(loss, aux\) and pass has_aux=True"),
    ("scaled_value_and_grad: a non-scalar loss",
     grads_of(lambda w: 2 * w, jaxmp.StaticLossScale(2.0)), TE, r"scalar loss, got shape \(2,\)",
     r"Reduce it first, e\.g\. with jnp\.mean"),
    ("scaled_value_and_grad: an integer loss",
     grads_of(lambda w: jnp.sum(w).astype(jnp.int32), jaxmp.StaticLossScale(2.0)), TE,
     r"real floating-point loss, got dtype int32, whose gradients are all zero",
     r"Compute the loss from floating values"),
    ("scaled_value_and_grad: a complex loss",
     grads_of(lambda w: jnp.sum(w.astype(jnp.complex64) * jnp.complex64(1j)),
         jaxmp.StaticLossScale(2.0)),
     TE, r"got dtype complex64: only its real part would be differentiated", r"Return a real loss, "
     r"e\.g\. jnp\.abs\(z\) \*\* 2 or z\.real"),
    ("scaled_value_and_grad: an Equinox module",
     grads_of(lambda m: jnp.sum(m["act"](m["w"])), jaxmp.StaticLossScale(2.0),
         x={"w": jnp.ones(2), "act": jnp.tanh}),
     TE, r"argument 0 holds a leaf that is not an array at \['act'\]",
     r"Pass value_and_grad=eqx\.filter_value_and_grad"),
    ("scaled_value_and_grad: argnums it cannot pass",
     lambda: jaxmp.scaled_value_and_grad(jnp.sum, jaxmp.NoOpLossScale(), argnums=1,
         value_and_grad=first_argument_value_and_grad),
     TE, r"\(argnums=1\): .*first_argument_value_and_grad takes no argnums",
     r"Put what you differentiate first \(several objects as one tuple\)"),
    ("scaled_value_and_grad: value_and_grad not callable",
     lambda: jaxmp.scaled_value_and_grad(jnp.sum, jaxmp.NoOpLossScale(), value_and_grad="jax"), TE,
     r"value_and_grad must be a function .*got 'jax'", r"such as jax\.value_and_grad or "
     r"eqx\.filter_value_and_grad"),
    ("multi_steps: zero micro-batches", multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 0), VE,
     r"every_k_schedule must be an integer >= 1, got 0", r"Pass the number of micro-batches per "
     r"step, or a function"),
    (monitor(window=0), VE, r"window must be an integer >= 1, got 0", r"1000 measures the "
     r"overflow rate"),
    (monitor(warn_rate=0.0), VE, r"warn_rate must be a number > 0 and <= 1, got 0\.0",
     r"None never warns"),
    (monitor(every=2.5), TE, r"every must be an integer, got 2\.5", r"100 reads the metrics "
     r"every 100 steps"),
    ("LossScaleMonitor.update: a step as a string",
     lambda: jaxmp.LossScaleMonitor().update("5", STATE), TE, r"step must be an integer, got '5' "
     r"of type str", r"the number of updates done so far"),
    ("monitor.record: a step that does not increase", record_twice, VE, r"step 5 is not after the "
     r"last recorded step 5", r"steps must increase"),
    ("LossScaleMonitor.plot: nothing recorded yet",
     lambda: jaxmp.LossScaleMonitor().plot("unused.png"), VE, r"nothing recorded yet",
     r"Call monitor\.update\(step, opt_state\)"),
    # Migration.
    (deepspeed('{"fp16": {"enabled": true,,}}'), VE, r"is not valid JSON", r"at line 1, column 27"),
    (deepspeed("[1, 2]"), VE, r"got a list", r"must hold a JSON object \(a DeepSpeed config\)"),
    (deepspeed('{"fp16": /* open'), VE, r"unterminated /\* comment", r"close it with \*/"),
    (deepspeed('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}'), VE, r"gives the key "
     r"'fp16' twice in one object", r"DeepSpeed refuses duplicate keys\. Keep one of them"),
    (deepspeed({"fp16": {"enabled": True, "initial_scale_pwr": 12}}), VE,
     r"fp16\.initial_scale_pwr is not a key of the fp16 block",
     r"Did you mean 'initial_scale_power'\?"),
    ("DeepSpeed: deeply nested JSON", deepspeed("[" * 100_000 + "]" * 100_000), VE,
     r"the JSON string is nested too deeply to parse", r"check that this is the right file"),
    (deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}), VE, r"fp16 and bf16 are "
     r"both enabled", r"keep one"),
    (deepspeed({"fp16": True}), VE, r"'fp16' must be an object", r'such as \{"enabled": true\}'),
    (deepspeed({"fp16": {"enabled": "yes"}}), VE, r"fp16\.enabled must be True or False, got 'yes'",
     r"Write true or false, without quotes"),
    (deepspeed({"fp16": {"enabled": True, "loss_scale": -1}}), VE, r"fp16\.loss_scale .*got -1",
     r"Use 0 \(dynamic loss scaling\) or a positive"),
    (deepspeed({"fp16": {"enabled": True, "loss_scale": 1e-40}}), VE, r"got 1e-40; smaller scales "
     r"are flushed to 0", r"must be 0 or at least 2\*\*-126"),
    (deepspeed({"fp16": {"enabled": True, "initial_scale_power": 200}}), VE, r"initial_scale_power "
     r"must be an integer >= -126 and <= 127, got 200", r"is a float32; 16 is the usual value"),
    (deepspeed({"fp16": {"enabled": True, "loss_scale_window": "1000"}}), VE, r"loss_scale_window "
     r"must be an integer, got '1000' of type str", r"Write a JSON number, without quotes"),
    (deepspeed({"fp16": {"enabled": True, "hysteresis": True}}), VE, r"hysteresis must be an "
     r"integer, got True of type bool", r"1 backs off on every overflow"),
    (deepspeed({"fp16": {"enabled": True, "min_loss_scale": 0}}), VE, r"fp16\.min_loss_scale must "
     r"be a number > 0, got 0", r"DeepSpeed's default is 1"),
    (deepspeed("/nonexistent/ds_config.json"), VE, r"no such file: '/nonexistent/ds_config\.json'",
     r"pass a dict, a JSON string or the path"),
    (deepspeed({"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 32}}), VE,
     r"min_loss_scale \(32\.0\) is above the initial scale 2\*\*4", r"lower min_loss_scale or "
     r"raise initial_scale_power"),
    (deepspeed(3), TE, r"got a int", r"expects a dict, a JSON string or a path"),
    (deepspeed({"amp": {"enabled": True, "opt_level": "O1"}}), VE, r"amp\.enabled is true: "
     r"DeepSpeed hands mixed precision to NVIDIA apex", r'Replace the amp block with "fp16": '
     r'\{"enabled": true\}'),
    ("DeepSpeed: the Trainer's apex backend flag",
     deepspeed({"fp16": {"enabled": "auto"}},
               training_args=["--fp16", "--half_precision_backend", "apex"]),
     VE, r"fp16 with half_precision_backend 'apex' makes the Trainer fill in amp",
     r"Drop the apex backend"),
    (deepspeed({}, training_args=["--fp16", "--fp16_backend", "apex"]), VE,
     r"fp16 with half_precision_backend 'apex'", r"Drop the apex backend"),
    ("DeepSpeed: a value the Trainer contradicts",
     deepspeed({"bf16": {"enabled": True}, "gradient_accumulation_steps": 8},
         training_args=["--gradient_accumulation_steps", "4"]),
     VE, r"bf16\.enabled is true in the config and bf16 False in the Trainer's arguments; "
     r"gradient_accumulation_steps is 8 in the config and gradient_accumulation_steps 4",
     r'Set the value to "auto" in the config'),
    (deepspeed({}, training_args=["--fp16", "--bf16"]), VE, r"fp16 and bf16 are both true",
     r"keep one"),
    (deepspeed({}, training_args=["--bf61"]), VE, r"the flag --bf61 is not one the "
     r"conversion reads", r"Did you mean '--bf16'\?"),
    (deepspeed({}, training_args=["--gradient_accumulation_steps", "four"]), VE,
     r"--gradient_accumulation_steps: invalid int value: 'four'", r"Write the flags as the "
     r"Trainer's command line takes them"),
    (deepspeed({}, training_args={"bf16": "true"}), VE, r"Trainer arguments: bf16 must be True or "
     r"False, got 'true'", r"Write true or false, without quotes"),
    (deepspeed({}, training_args="/nonexistent/args.json"), VE, r"no such file: "
     r"'/nonexistent/args\.json'", r"the path of a file that holds the Trainer's arguments"),
    # The optimizer, clipping, accumulation: `jaxmp convert` prints no value optax refuses.
    (deepspeed('{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}'), VE,
     r"optimizer\.params\.lr must be a number, got nan", r'e\.g\. 1e-3, or \"auto\"'),
    (deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}), VE,
     r"optimizer\.params\.betas must be a list of two numbers", r"such as \[0\.9, 0\.999\]"),
    (deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}), VE,
     r"optimizer\.params\.betas\[1\] .*got 1\.5", r"must be a number >= 0 and < 1"),
    (deepspeed({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}}), VE,
     r"optimizer\.params\.weight_decay .*got -0\.1", r"must be a number >= 0"),
    (deepspeed({"optimizer": "adam"}), VE, r"'optimizer' must be an object .*got 'adam'",
     r'such as \{"type": "AdamW", "params": \{"lr": 1e-3\}\}'),
    (deepspeed({"optimizer": {"type": 3}}), VE, r"optimizer\.type must be a string",
     r'such as "AdamW"'),
    (deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}), VE, r"lr must be a "
     r"number, got '1e-3' of type str", r"without quotes"), (deepspeed({"bf16": {"enabeld": 1}}),
     VE, r"bf16\.enabeld is not a key of the bf16 block", r"Did you mean 'enabled'\?"),
    (deepspeed({"gradient_clipping": float("inf")}), VE, r"clipping must be finite, got inf",
     r"Use 0"), (deepspeed({"gradient_accumulation_steps": 2.5}), VE, r"got 2\.5", r"micro-batch"),
    (deepspeed({"gradient_clipping": -1}), VE, r"gradient_clipping must be a number >= 0, got -1",
     r"Use 0 for no clipping"),
    (deepspeed({"gradient_accumulation_steps": 0}), VE, r"gradient_accumulation_steps must be an "
     r"integer >= 1 .*got 0", r"the number of micro-batches per optimizer step"),
    (torch_scaler("cuda"), TE, r"init_scale must be a number, got 'cuda'", r"takes no device "
     r"argument, drop it"),
    (torch_scaler(init_scale="65536"), TE, r"init_scale must be a number, got '65536' of type str",
     r"Pass a number, not a string: init_scale=65536\."),
    (torch_scaler(init_scale=0.0), VE, r"init_scale must be a number > 0, got 0\.0",
     r"PyTorch's default is 65536\.0"),
    (torch_scaler(growth_factor=1.0), VE, r"growth_factor must be a number > 1, got 1\.0",
     r"default is 2\.0"),
    (torch_scaler(backoff_factor=1.0), VE, r"backoff_factor must be a number > 0 and < 1, got 1\.0",
     r"default is 0\.5"),
    (torch_scaler(growth_interval=2.5), TE, r"growth_interval must be an integer, got 2\.5",
     r"default is 2000"),
    (torch_scaler(enabled="yes"), TE, r"enabled must be True or False, got 'yes'",
     r"PyTorch's default is True"),
    # Flax, diagnostics, the precision audit, autocast.
    ("TrainState.create: a number as loss_scale", create(apply_fn=None, params=PARAMS, tx=optax.sgd(
        0.1), loss_scale=2.0**15), TE, r"a jaxmp loss scale .*32768\.0", r"DynamicLossScale\(\)"),
    ("TrainState.create: an optimizer already wrapped", create(apply_fn=None, params=PARAMS, tx=TX),
     VE, r"tx is already wrapped with jaxmp\.loss_scaling", r"Pass the bare optimizer"),
    ("precision_report: arguments without the function",
     lambda: jaxmp.precision_report(jnp.ones(2), jnp.ones(2)), TE, r"expects a function as its "
     r"first argument, got ArrayImpl", r"jaxmp\.precision_report\(loss_fn, params, batch\)"),
    ("flops_share: a function without matmuls",
     lambda: jaxmp.precision_report(jnp.tanh, jnp.ones(2)).flops_share("f16"), VE,
     r"the function has no matmul or convolution", r"Check report\.ops first"),
    ("PrecisionReport.flops: an unknown direction",
     lambda: jaxmp.precision_report(jnp.dot, jnp.ones(2), jnp.ones(2)).flops("backwards"), VE,
     r"got 'backwards'", r"direction must be None or one of 'forward', 'backward', 'recompute'"),
    ("TrainState.create: autocast with a PathPolicy",
     create(apply_fn=lambda v, x: x, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
         policy=jaxmp.PathPolicy({"w": "f32"}, default="mixed_bfloat16"), autocast=True),
     VE, r"PathPolicy: autocast casts the inputs of each operation, not each parameter",
     r"Pin modules with a jaxmp\.flax\.ModulePolicy.*or drop autocast=True"),
    ("TrainState.create: autocast not a bool",
     create(apply_fn=lambda v, x: x, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1), autocast="yes"),
     TE, r"TrainState.create: autocast must be True or False, got 'yes'", r"True or False"),
    (autocast("mixed_bfloat16"), TE, r"expects a function, got 'mixed_bfloat16'",
     r"jaxmp\.autocast\(loss_fn, 'mixed_bfloat16'\)"),
    ("autocast: no policy", autocast(jnp.sin), TE, r"needs a policy",
     r"pass policy='mixed_bfloat16'"),
    ("autocast: an unknown policy", autocast(jnp.sin, "mixed_bf16"), VE, r"jaxmp\.autocast, "
     r"policy: Unknown policy 'mixed_bf16'", r"mixed_bfloat16"),
    ("autocast: a module policy as the policy",
     autocast(jnp.sin, jaxmp.flax.ModulePolicy(
         {nn.LayerNorm: "float32"}, default="mixed_bfloat16")),
     TE, r"takes one jaxmp\.Policy .*got a ModulePolicy",
     r"scope_policies=\{'name_scope_pattern': policy\}"),
    ("autocast: a rule kind that does not exist",
     autocast(jnp.sin, "mixed_bfloat16", rules={"exp": "fp32"}), VE, r"the rule for 'exp' is "
     r"'fp32', which is not a rule kind", r"Valid kinds are 'compute', 'float32', 'promote', "
     r"'as_is', 'original'"),
    (autocast_rules({"dot_genral": "float32"}), VE, r"'dot_genral' is not the name of a "
     r"JAX primitive", r"Did you mean 'dot_general'"),
    (autocast_rules({"scan": "float32"}), VE, r"'scan' cannot be given a rule: autocast "
     r"enters scan", r"jax\.named_scope\(\.\.\.\) and pass scope_policies="),
    (autocast_rules(["exp", "float32"]), TE, r"got \['exp', 'float32'\] of type list",
     r"e\.g\. \{'exp': 'promote'\}"),
    ("autocast: a bad scope pattern",
     autocast(jnp.sin, "mixed_bfloat16", scope_policies={"LayerNorm_(": "float32"}), VE,
     r"scope_policies: 'LayerNorm_\(' is not a valid regular expression", r"wrap a literal name "
     r"in re\.escape"),
    ("autocast: tied scope patterns",
     lambda: jaxmp.autocast(scoped_matmul, "mixed_bfloat16",
         scope_policies={"head": "float32", "he.d": "bf16"})(jnp.ones((2, 2))),
     VE, r"the scope 'head' is matched by 'head', 'he\.d' with different policies",
     r"Make the patterns match different scopes"),
    ("autocast: a function assigning into its argument",
     lambda: jaxmp.autocast(lambda d: d.update(x=d["x"] * 2.0) or jnp.sum(d["x"]),
         "mixed_bfloat16")({"x": jnp.ones(2)}),
     TE, r"jaxmp\.autocast: <lambda> changed its arguments in place", r"Return the new values "
     r"instead of assigning them"),
    # Flax: TrainState, NNX and checkpoints.
    ("TrainState.create: tx is None", create(apply_fn=None, params=PARAMS, tx=None), TE,
     r"tx must be an optax\.GradientTransformation .*got None", r"such as optax\.adamw\(1e-3\)"),
    ("apply_gradients: an undeclared field",
     lambda: field_state().apply_gradients(grads=PARAMS, batch_stats={}), TE, r"'batch_stats' is "
     r"not a field of the state", r"Declare it in a subclass .*batch_stats: Any"),
    ("apply_gradients: a field of another structure",
     lambda: field_state().apply_gradients(grads=PARAMS, ema={"ema": PARAMS}), VE,
     r"apply_gradients\(ema=\.\.\.\): the new value and the state's value differ in tree structure",
     r"give the first value to create"),
    ("keep_on_skip: the model's own NNX variables",
     lambda: (lambda live: jaxmp.keep_on_skip(STATE, live, live))(
         nnx.state(nnx.BatchNorm(2, rngs=nnx.Rngs(0)), nnx.BatchStat)),
     VE, r"the old value holds the model's own NNX variables", r"Take a copy before the step: old "
     r"= jax\.tree\.map"),
    ("save_checkpoint: onto a checkpoint without force=True",
     restore_saved(lambda path: [jaxmp.flax.save_checkpoint(path, STATE) for _ in range(2)], STATE),
     VE, r"ckpt already exists", r"Pass force=True to overwrite it: .*replaces it only once "
     r"complete \(an atomic rename\)"),
    ("restore_checkpoint: no such directory",
     lambda: jaxmp.flax.restore_checkpoint("/nonexistent/step_1", STATE), FileNotFoundError,
     r"there is no checkpoint at /nonexistent/step_1", r"Pass the directory given to "
     r"jaxmp\.flax\.save_checkpoint"),
    ("restore_checkpoint: the checkpoints' parent folder",
     restore_saved(lambda path: os.makedirs(os.path.join(path, "step_1")), STATE), VE,
     r"is not a checkpoint .*its entries: step_1", r"Pass the directory of one checkpoint"),
    ("restore_checkpoint: a plain orbax checkpoint", restore_saved(save_plain_orbax, STATE), VE,
     r"is a plain orbax checkpoint .*holds no loss-scale configuration", r"Pass check_config=False "
     r"to restore its arrays"),
    ("restore_checkpoint: saved for another optimizer",
     restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, STATE), jaxmp.loss_scaling(
         optax.adam(0.1), jaxmp.DynamicLossScale()).init(PARAMS), check_config=False),
     VE, r"only in the target: inner_state/0/count, inner_state/0/mu/b", r"Build the target with "
     r"the model and optimizer that wrote it"),
    ("restore_checkpoint: saved for other shapes",
     restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, (PARAMS, STATE)),
         (WIDE, TX.init(WIDE))),
     VE, r"0/w: \(2,\) in the checkpoint, \(3,\) in the target", r"Build the target with the model "
     r"configuration that wrote it"),
    ("restore_checkpoint: a float32 run into a float16 target",
     restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, sgd_state(jaxmp.NoOpLossScale())),
         STATE, check_config=False),
     VE, r"holds a NoOpLossScale and the target a DynamicLossScale", r"Restore into a target built "
     r"with the saved configuration"),
    # Guard cost (clip_global_norm=, guard=) and accumulation.
    ("loss_scaling: clip_global_norm of zero",
     loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), clip_global_norm=0.0), VE,
     r"jaxmp\.loss_scaling: clip_global_norm must be a number > 0, got 0\.0",
     r"Pass the max global norm of the unscaled gradients, e\.g\. 1\.0, or None"),
    ("multi_steps: clip_global_norm as a string",
     multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2, clip_global_norm="1.0"), TE,
     r"jaxmp\.multi_steps: clip_global_norm must be a number, got '1\.0'",
     r"Pass the max global norm"),
    ("loss_scaling: guard=False with a dynamic scale",
     loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), guard=False), VE,
     r"jaxmp\.loss_scaling\(guard=False\) needs jaxmp\.NoOpLossScale\(\), got DynamicLossScale",
     r"Keep guard=True, or train in bfloat16 with jaxmp\.NoOpLossScale\(\)"),
    ("TrainState.create: guard as a string",
     create(apply_fn=lambda p, x: x, params=PARAMS, tx=optax.sgd(0.1), policy="mixed_bfloat16",
         guard="no"),
     TE, r"TrainState\.create: guard must be True or False, got 'no'", r"guard=False turns the "
     r"finiteness check off; it needs loss_scale=jaxmp\.NoOpLossScale\(\)"),
    ("multi_steps: use_grad_mean as a string",
     multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 2, use_grad_mean="yes"), TE,
     r"jaxmp\.multi_steps: use_grad_mean must be True or False, got 'yes'", r"True passes the mean "
     r"of the micro-batches' gradients to the optimizer, False their sum"),
    ("multi_steps: another optimizer's state",
     lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 2).update(
         PARAMS, optax.MultiSteps(optax.sgd(0.1), 2).init(PARAMS), PARAMS),
     TE, r"The state passed to the update of jaxmp\.multi_steps is a MultiStepsState, not the "
     r"optax\.MultiStepsState holding a LossScalingState its init returned", r"Pass the state "
     r"returned by tx\.init\(params\)"),
    # Precision fallback.
    (fallback("mixed_float16"), TE, r"ladder must be a sequence of policies.*got 'mixed_float16'",
     r"e\.g\. \('mixed_float16', 'float32'\)"),
    (fallback(()), VE, r"the ladder is empty", r"Give the policy the run starts in first"),
    (fallback(("mixed_float16",)), VE, r"the ladder has one rung \(p=f32,c=f16,o=f32\)",
     r"Add the policy to fall back to.*on_failure='raise'"),
    (fallback(("mixed_float16", "p=f32,c=f16,o=f32")), VE, r"names p=f32,c=f16,o=f32 twice "
     r"\(rungs 0 and 1\)", r"Each rung is a different policy"),
    (fallback(("float32", "mixed_float16")), VE, r"goes from p=f32,c=f32,o=f32, which needs no "
     r"loss scaling, back to p=f32,c=f16,o=f32", r"put the float16 policies first"),
    (fallback(("mixed_float16", "mixed_bfloat16", "float32")), VE, r"rung 1 of the ladder "
     r"\(p=f32,c=bf16,o=f32\) computes in bfloat16, which this hardware \(cpu: .*\) does not "
     r"run natively", r"Fall back to 'float32' instead.*jaxmp doctor"),
    (fallback(LADDER, on_failure="crash"), VE, r"on_failure must be 'switch' .* or "
     r"'raise'.*got 'crash'", r"fall back to the next policy of the ladder"),
    (fallback(LADDER, every=0), VE, r"PrecisionFallback: every must be .*1.*got 0", r"every"),
    (fallback(LADDER, max_overflow_rate=1.5), VE, r"max_overflow_rate .*got 1\.5",
     r"Pass None to switch only on overflows at the minimum scale"),
    (fallback(LADDER, hardware="gpu"), TE, r"hardware must be what jaxmp\.hardware_report\(\) "
     r"returns.*got 'gpu'", r"jaxmp\.hardware_report\(\)"),
    ("PrecisionFallback.update: no step", lambda: jaxmp.PrecisionFallback(LADDER).update(STATE), TE,
     r"pass step= .*with a plain optax state", r"a jaxmp\.flax\.TrainState or an nnx\.Optimizer "
     r"carries its own"),
    ("load_state_dict: an empty state", load_state(), VE, r"the state lacks ladder, rung, policy, "
     r"overflows_at_min_base, events", r"Pass the dict that "
     r"PrecisionFallback\.state_dict\(\) returned"),
    ("load_state_dict: a rung beyond the ladder", load_state(rung=5), VE, r"rung must be an "
     r"integer >= 0 and <= 1, got 5", r"It indexes the ladder of 2 policies"),
    ("load_state_dict: events that are not switches", load_state(events=3), VE, r"the event 3 is "
     r"not a dict with the fields of a PrecisionFallback\.events entry", r"Pass the dict that "
     r"PrecisionFallback\.state_dict\(\) returned"),
    ("PrecisionFallback.switch: no reason",
     lambda: jaxmp.PrecisionFallback(LADDER).switch(STATE, "float32", reason="", step=1), TE,
     r"reason must be a non-empty string .*got ''", r"it is logged and recorded"),
    ("switch_precision: a state without loss scaling",
     lambda: jaxmp.switch_precision(optax.adam(0.1).init(PARAMS), "float32"), VE,
     r"switch_precision needs a training state built on jaxmp\.loss_scaling.*no "
     r"jaxmp\.loss_scaling state found", r"Wrap the optimizer with jaxmp\.loss_scaling"),
    ("switch_precision: to float16 without a loss scale",
     lambda: jaxmp.switch_precision(sgd_state(jaxmp.NoOpLossScale()), "mixed_float16"), VE,
     r"the new policy p=f32,c=f16,o=f32 needs loss scaling, but the training state has "
     r"no loss scale", r"build a new state with jaxmp\.DynamicLossScale\(\)"),
    ("switch_precision: (params, opt_state) to 16-bit params",
     switch_precision((PARAMS, STATE), "bf16"), VE, r"stores the params in other dtypes "
     r".*\[0\]\['b'\]: float32 now, bfloat16", r"the policies of a ladder share their param_dtype"),
    ("switch_precision: nnx.Optimizer without model",
     lambda: jaxmp.switch_precision(nnx_optimizer()[1], "float32"), TE, r"an nnx\.Optimizer needs "
     r"its model.*got model=None", r"switch_precision\(optimizer, policy, model=model\)"),
    ("switch_precision: model= with a plain state",
     lambda: jaxmp.switch_precision(STATE, "float32", model=nnx_optimizer()[0]), TE,
     r"model= is for an nnx\.Optimizer", r"takes no model"),
    ("switch_precision: a PathPolicy for an NNX model",
     lambda: jaxmp.switch_precision(nnx_optimizer()[1], jaxmp.PathPolicy({"kernel": "float32"}),
         model=nnx_optimizer()[0]),
     TE, r"an NNX model takes a jaxmp\.Policy or a jaxmp\.flax\.ModulePolicy.*got PathPolicy",
     r"A PathPolicy casts a params tree"),
    ("find_overflowing_modules: a Linen module",
     lambda: jaxmp.flax.find_overflowing_modules(Wide(), {}, jnp.ones((1, 2))), TE,
     r"pass the apply function, not the Linen module", r"state\.apply_fn, or "
     r"policy\.wrap_apply\(model\.apply\)"),
    ("find_overflowing_modules: not a model", lambda: jaxmp.flax.find_overflowing_modules("model"),
     TE, r"model must be a Linen apply function .*got str", r"or an NNX module"),
    ("propose_policy: no overflow",
     lambda: overflow_report(jnp.ones((1, 2))).propose_policy("mixed_float16"), VE,
     r"every module's outputs are finite in this forward pass", r"Fall back to a wider policy"),
    ("propose_policy: non-finite inputs",
     lambda: overflow_report(jnp.full((1, 2), jnp.inf)).propose_policy("mixed_float16"), VE,
     r"the model's inputs already hold inf or nan", r"jaxmp\.nonfinite_paths\(batch\)"),
    ("propose_policy: an overflow float32 does not fix",
     lambda: overflow_report(jnp.ones((1, 2)), {"params": {"head": {
         "kernel": jnp.full((2, 2), 3e38), "bias": jnp.zeros(2)}}}).propose_policy("mixed_float16"),
     VE, r"which promotes 'head' to float32, the forward pass on the report's batch still produces "
     r"inf or nan in 'head'", r"Fall back to a wider policy"),
    ("propose_policy: a PathPolicy",
     lambda: overflow_report(jnp.full((1, 2), 1e5)).propose_policy(
         jaxmp.PathPolicy({"head": "float32"}, default="mixed_float16")),
     TE, r"module promotion needs a jaxmp\.Policy or a jaxmp\.flax\.ModulePolicy",
     r"A PathPolicy chooses dtypes per parameter"),
    ("restore_checkpoint: fallback= saved without one",
     restore_switched("state", saved_with_fallback=False, fallback=jaxmp.PrecisionFallback(LADDER)),
     VE, r"the checkpoint was saved without it", r"save with jaxmp\.flax\.save_checkpoint\(\.\.\., "
     r"fallback=fallback\)"),
    ("restore_checkpoint: another ladder",
     restore_switched("state", fallback=jaxmp.PrecisionFallback(
         ("mixed_float16", "p=f32,c=f32,o=f16"))),
     VE, r"with the ladder \['p=f32,c=f16,o=f32', 'p=f32,c=f32,o=f32'\], but the given one has",
     r"Build the controller with the ladder of the run"),
    ("restore_checkpoint: a switched run, no controller", restore_switched("state"), VE,
     r"saved with a jaxmp\.PrecisionFallback, whose run is in the policy p=f32,c=f32,o=f32 "
     r"after 1 switch", r"Pass the run's controller"),
    ("restore_checkpoint: fallback= of the wrong type",
     restore_switched("state", fallback="float32"), TE, r"fallback must be the "
     r"jaxmp\.PrecisionFallback .*got 'float32'", r"that watches the run"),
    ("restore_checkpoint: switched NNX into the optimizer",
     restore_switched("nnx", fallback=jaxmp.PrecisionFallback(LADDER)), VE, r"the saved run "
     r"switched to the policy p=f32,c=f32,o=f32, which sets the dtypes of the model's modules",
     r"restore into \(model, optimizer\)"),
    ("save_checkpoint: a policy naming a local class",
     restore_saved(save_a_policy_with_a_local_class, STATE), VE, r"names the module class .*Local, "
     r"which cannot be imported by its name", r"Define the class at the top level of a module"),
    # FP8.
    (get_policy("c=f8e4m3"), VE, r"compute_dtype=float8_e4m3fn would cast every activation .* with "
     r"no per-tensor scaling, which cannot train", r"use the policy 'mixed_fp8' \(= "
     r"'p=f32,c=bf16,o=f32,dot=fp8'\)"),
    ("Policy: a float8 output dtype",
     lambda: jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float8_e5m2), VE,
     r"output_dtype=float8_e5m2 would cast the outputs to float8", r"'mixed_fp8'"),
    (get_policy("c=bf16,dot=fp4"), VE, r"key 'dot': 'fp4' is not a matmul format", r"'dot=fp8'"),
    (get_policy("c=bf16,dot=fp8,amax_history=99999999999"), VE, r"In policy '.*': Fp8Policy: "
     r"amax_history_length must be an integer >= 1 and <= 65536, got 99999999999",
     r"amax_history=N in a policy string\), e\.g\. 16"),
    (get_policy("c=bf16,amax_history=16"), VE, r"sets amax_history without dot=fp8",
     r"Add ',dot=fp8'"),
    ("Fp8Policy: wrap_apply of the bare policy",
     lambda: jaxmp.get_policy("mixed_fp8").wrap_apply(nn.Dense(2).apply), VE, r"the FP8 matmuls "
     r"are injected into the Linen Dense .* which a plain policy",
     r"jaxmp\.flax\.ModulePolicy\(\{\}, default=policy\)"),
    ("ModulePolicy: nn.Einsum under FP8", fp8_apply(nn.Einsum((3, 2), "bi,io->bo")), VE,
     r"Linen nn\.Einsum, which computes with jnp\.einsum and takes no dot_general_cls",
     r"ModulePolicy\(\{Einsum: 'mixed_bfloat16'\}, default='mixed_fp8'\).*nn\.DenseGeneral"),
    ("TrainState.create: FP8 without FP8 meta", fp8_state, VE, r"runs FP8 matmuls, whose scales "
     r"and amax histories must be given", r"pass them whole, params=variables"),
    ("TrainState.create: FP8 meta next to batch_stats",
     create(apply_fn=None, params={"params": PARAMS, "_overwrite_with_gradient": {},
         "batch_stats": {}}, tx=optax.sgd(0.1)),
     VE, r"Flax's FP8 layout is \{'params': \.\.\., '_overwrite_with_gradient': \.\.\.\}, got the "
     r"keys \['_overwrite_with_gradient', 'batch_stats', 'params'\]", r"Keep other collections "
     r"\(batch_stats\) in fields of their own"),
    ("TrainState.create: the old fp8_meta=", lambda: fp8_state(fp8_meta={}), TE, r"takes the FP8 "
     r"meta inside params, as Flax's TrainState does", r"create\(params=variables\)"),
    ("loss_scaling: gradients that hold the FP8 meta",
     lambda: TX.update({"params": PARAMS, "_overwrite_with_gradient": {}}, STATE), VE,
     r"the gradients hold Flax's FP8 meta collection",
     r"Use jaxmp\.flax\.TrainState.*jaxmp\.keep_on_skip\(opt_state, new_meta, old_meta\)"),
    ("apply_gradients: no new FP8 meta",
     lambda: fp8_state(meta={"x": jnp.ones(1)}).apply_gradients(grads={"kernel": jnp.ones((3, 2))}),
     VE, r"the state has FP8 meta but the gradients bring no new meta",
     r"state\.value_and_grad\(loss_fn\)\(state\.params"),
    ("set_nnx_dtypes: FP8 over a Linear's own dot_general",
     lambda: fp8_nnx_model(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k)), VE,
     r"the Linear at '\(root\)' has its own dot_general, which the FP8 policy would replace",
     r"Give it its own rule with a policy without dot=fp8"),
    ("set_nnx_dtypes: another amax history",
     lambda: jaxmp.flax.ModulePolicy(
         {}, default="p=f32,c=bf16,o=f32,dot=fp8,amax_history=16").set_nnx_dtypes(fp8_nnx_model()),
     VE, r"already has jaxmp's FP8 op from an earlier set_nnx_dtypes, with an amax history of 1024",
     r"Build the model anew and call set_nnx_dtypes once"),
    ("NNX FP8 op: a layer called with out_sharding",
     lambda: fp8_nnx_model()(jnp.ones((1, 2)), out_sharding=jax.sharding.PartitionSpec()), VE,
     r"fp8_scaled_dot_general takes no out_sharding", r"Call the layer without it"),
    ("autocast: a model with FP8 meta",
     lambda: jaxmp.autocast(lambda model: jnp.sum(model(jnp.ones((1, 2))).astype(jnp.float32)),
         "mixed_bfloat16")(fp8_nnx_model()),
     VE, r"autocast: the model has FP8 meta \(jaxmp\.flax\.Fp8Meta\)", r"leave autocast out"),
    ("find_overflowing_modules: FP8 without its meta", fp8_apply(nn.Dense(2), apply=True), VE,
     r"the model runs FP8 matmuls, whose meta \(the '_overwrite_with_gradient' collection\) is not "
     r"in the variables given", r"find_overflowing_modules\(state\.apply_fn, state\.params, x\)"),
    ("switch_precision: to FP8 without FP8 meta",
     lambda: jaxmp.switch_precision(fp8_state(policy="mixed_float16"), "mixed_fp8"),
     VE, r"runs FP8 matmuls, but the state has no FP8 meta for them", r"build a new state with "
     r"the FP8 policy"),
]]


def test_the_catalogue_is_large_and_distinct():
  names = [case.name for case in CASES]
  assert len(names) == len(set(names)) and len(CASES) >= 30
  expects_bare = [case.name for case in CASES if issubclass(case.error, BARE_ERRORS)]
  assert not expects_bare, f"cases that expect a bare Python error: {expects_bare}"


@pytest.fixture(autouse=True)
def unfiltered_tracebacks():
  """Keeps JAX's internal frames, so that an error raised there is seen."""
  previous = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "off")
  yield
  jax.config.update("jax_traceback_filtering", previous)


@pytest.mark.parametrize("case", [pytest.param(case, id=case.name, marks=[pytest.mark.xfail(
    strict=True, reason=case.defect)] if case.defect else []) for case in CASES])
def test_bad_input_is_explained(case):
  with pytest.raises(Exception) as info:
    case.call()
  error = info.value
  frame = traceback.extract_tb(error.__traceback__)[-1]  # the innermost
  assert not isinstance(error, BARE_ERRORS), (
      f"a bare {type(error).__name__} escaped from {frame.filename}:{frame.lineno}: {error}")
  assert isinstance(error, case.error), f"{type(error).__name__}: {error}"
  assert re.search(case.problem, str(error), re.DOTALL), str(error)
  assert re.search(case.fix, str(error), re.DOTALL), str(error)
  assert pathlib.Path(frame.filename).resolve().is_relative_to(JAXMP_DIR), (
      f"raised in {frame.filename}:{frame.lineno}")


def test_unknown_cli_subcommand(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["frobnicate"])
  stderr = capsys.readouterr().err
  assert info.value.code == 2 and "Traceback" not in stderr
  assert re.search(r"invalid choice: 'frobnicate'", stderr)  # the problem
  assert re.search(r"choose from .*doctor", stderr)  # and the valid ones


def test_cli_convert_of_a_bad_file(tmp_path, capsys, monkeypatch):
  """`jaxmp convert` prints one line, "jaxmp convert: error: ...", exits with 2 and
  prints no code; it reads the config as from_deepspeed_config does."""
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": true, "loss_scale": -1}}')
  monkeypatch.setattr(sys, "stdin", io.StringIO("[" * 100_000))
  for argv, problem, fix in [
      ([str(path)], r"fp16\.loss_scale must be a number >= 0 .*got -1",
       r"Use 0 \(dynamic loss scaling\) or a positive static scale"),
      ([str(tmp_path / "missing.json")], r"no such file: .*missing\.json", r"pass a dict"),
      (["-"], r"standard input is nested too deeply to parse",
       r"check that this is the right file")]:
    code, captured = cli.main(["convert", *argv]), capsys.readouterr()
    assert code == 2 and captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxmp convert: error: "), captured.err
    assert re.search(problem, lines[0]) and re.search(fix, lines[0]), lines[0]
