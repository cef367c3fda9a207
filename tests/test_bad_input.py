"""The bad-input catalogue: invalid inputs across the public API.

Each case asserts the exception type (never a bare ``KeyError``,
``AttributeError``, ``IndexError``, ``OverflowError`` or ``AssertionError``),
that the message names the problem (what was wrong, usually with the offending
value) and the fix (what to pass instead), and that the exception is raised by
jaxmp itself, not from deep inside JAX, optax, orbax or NumPy.

A case that fails today names its ``defect``, which marks it
``xfail(strict=True)``. Delete the field when the defect is fixed (the strict
mark fails the test until then).
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
PARAMS = {"w": jnp.ones(2), "b": jnp.ones(1)}
TX = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
STATE = TX.init(PARAMS)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  call: Callable[[], Any]
  error: type
  problem: str  # a regular expression the message must match
  fix: str  # and another one
  defect: str = ""  # why the error is not yet explained (marks it xfail)


# Built-in errors that say nothing about what the user did wrong.
BARE_ERRORS = (KeyError, AttributeError, IndexError, OverflowError, AssertionError)


def dynamic(*args, **kwargs):
  return lambda: jaxmp.DynamicLossScale(*args, **kwargs)


def deepspeed(config):
  return lambda: jaxmp.from_deepspeed_config(config)


def trainer(config, training_args):
  return lambda: jaxmp.from_deepspeed_config(config, training_args=training_args)


def update_with(grads, state=STATE, tx=TX):
  return lambda: tx.update(grads, state, PARAMS)


def scoped_matmul(x):
  with jax.named_scope("head"):
    return x @ x


def linen_overlap():
  policy = jaxmp.flax.ModulePolicy({nn.Dense: "mixed_bfloat16", "layers_0": "f32"})
  model = nn.Sequential([nn.Dense(2)])
  x = jnp.ones((1, 2))
  return policy.wrap_apply(model.apply)(model.init(jax.random.key(0), x), x)


class NnxRaw(nnx.Module):

  def __init__(self):
    self.w = nnx.Param(jnp.ones(2))


def nnx_model():

  class Holder(nnx.Module):

    def __init__(self):
      self.raw = NnxRaw()
      self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

  return Holder()


def update_with_select_switch(value):
  def call():
    with mock.patch.dict(os.environ, {"JAXMP_INPLACE_SELECT": value}):
      return jax.jit(TX.update)(PARAMS, STATE, PARAMS)
  return call


def all_finite_with_check_switch(value):
  def call():
    with mock.patch.dict(os.environ, {"JAXMP_GROUPED_CHECK": value}):
      return jaxmp.all_finite(PARAMS)
  return call


def first_argument_value_and_grad(fun, *, has_aux=False):
  """A value-and-grad without argnums, as eqx.filter_value_and_grad."""
  return jax.value_and_grad(fun, has_aux=has_aux)


def record_twice():
  monitor = jaxmp.LossScaleMonitor()
  monitor.record(5, STATE)
  monitor.record(5, STATE)


def jitted_update_on_unbound_axis():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch")
  return jax.jit(tx.update)(PARAMS, tx.init(PARAMS), PARAMS)


def retried_on(state):
  """A call of jaxmp.retry_skipped's step on ``state``."""
  return lambda: jaxmp.retry_skipped(lambda state: (state, None))(state)


VALID_DTYPES = r"Valid dtype names are: bf16, bfloat16, f16, f32"
# Every error about a policy string lists the keys, the dtype names and the presets.
POLICY_GRAMMAR = (r"Valid keys are p, params, c, compute, o, output\. " + VALID_DTYPES
                  + r".*fp16, fp32, fp64, full, half\. Presets are mixed_bfloat16")
SCALE_HINT = r"powers of two such as 2\.0\*\*15"
NO_STATE_FIX = r"Wrap the optimizer with jaxmp\.loss_scaling\(optax\.adamw"
SAME_PARAMS = r"Differentiate with respect to the same params you pass to update"
METRICS_FIX = r"Pass the dict returned by jaxmp\.loss_scaling_metrics\(opt_state\)"

CASES = [
    # -- Recovery (retry_skipped, keep_on_skip) ----------------------------------
    Case("retry_skipped: negative max_retries",
         lambda: jaxmp.retry_skipped(jnp.sum, max_retries=-1),
         ValueError, r"max_retries must be .*>= 0.*got -1",
         r"Pass how many times to run a skipped step again"),
    Case("retry_skipped: a fractional max_retries",
         lambda: jaxmp.retry_skipped(jnp.sum, max_retries=2.5),
         TypeError, r"max_retries must be an integer.*2\.5",
         r"Pass how many times to run a skipped step again"),
    Case("retry_skipped: a policy as the fallback",
         lambda: jaxmp.retry_skipped(jnp.sum, fallback="float32"), TypeError,
         r"retry_skipped\(fallback='float32'\): the fallback must be a step",
         r"fallback=train_step_float32"),
    Case("retry_skipped: a state without loss scaling",
         retried_on((PARAMS, optax.sgd(0.1).init(PARAMS))), ValueError,
         r"retry_skipped: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("retry_skipped: an accumulating optimizer",
         retried_on(jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2)
                    .init(PARAMS)), ValueError,
         r"the loss-scaling state sits inside gradient accumulation",
         r"Retry a step without accumulation"),
    Case("retry_skipped: a step that returns no aux",
         lambda: jaxmp.retry_skipped(lambda state: state)((PARAMS, STATE)), TypeError,
         r"retry_skipped: the step must return \(state, aux\); it returned the state alone",
         r"Return an aux too"),
    Case("retry_skipped: a step that adds an entry to its state",
         lambda: jaxmp.retry_skipped(lambda state: ({**state, "loss": jnp.zeros([])}, None))(
             {"opt_state": STATE}), ValueError,
         r"retry_skipped: the state the step returned and the state it took differ "
         r"in tree structure", r"create every entry before the first step"),
    Case("keep_on_skip: inside optax.MultiSteps, which records no micro-batch's flag",
         lambda: jaxmp.keep_on_skip(optax.MultiSteps(TX, 2).init(PARAMS), PARAMS, PARAMS),
         ValueError, r"does not record whether this micro-batch's gradients were finite",
         r"Use jaxmp\.multi_steps\(.*should_skip_update_fn=optax\.skip_not_finite"),
    Case("keep_on_skip: a new value of another structure",
         lambda: jaxmp.keep_on_skip(STATE, {"a": PARAMS}, PARAMS), ValueError,
         r"keep_on_skip.*structure",
         r"pass the updated collection itself"),
    # -- Policies ------------------------------------------------------------
    Case("policy: empty string", lambda: jaxmp.get_policy(""), ValueError,
         r"Empty policy string", POLICY_GRAMMAR),
    Case("policy: missing dtype", lambda: jaxmp.get_policy("p="), ValueError,
         r"Missing value after p= in policy 'p='", POLICY_GRAMMAR),
    Case("policy: an unknown dtype name", lambda: jaxmp.get_policy("c=float8"), ValueError,
         r"In policy 'c=float8', key 'c': Unknown dtype 'float8'.*" + POLICY_GRAMMAR,
         r"float8_e4m3fn, float8_e5m2"),
    Case("policy: ';' separator", lambda: jaxmp.get_policy("p=f32;c=bf16"), ValueError,
         r"Unknown dtype 'f32;c=bf16'", r"Separate the parts of a policy with ','"),
    Case("policy: unknown preset", lambda: jaxmp.get_policy("mixed_fp16"), ValueError,
         r"Unknown policy 'mixed_fp16': not a preset\. Unknown dtype 'mixed_fp16'",
         r"Did you mean 'mixed_float16'\?.*Presets are mixed_bfloat16, mixed_float16"),
    Case("policy: not a string", lambda: jaxmp.get_policy(16), TypeError,
         r"got 16 of type int", r"a string such as 'mixed_bfloat16'"),
    Case("policy: unknown key", lambda: jaxmp.get_policy("q=f32"), ValueError,
         r"Unknown key 'q' in policy 'q=f32'", POLICY_GRAMMAR),
    Case("policy: misspelt key", lambda: jaxmp.get_policy("param=f32,c=bf16"), ValueError,
         r"Unknown key 'param'", r"Did you mean 'params'\?.*" + POLICY_GRAMMAR),
    Case("policy: key repeated to override (jmp keeps the last)",
         lambda: jaxmp.get_policy("c=f16,c=bf16"), ValueError,
         r"Key 'c' in policy 'c=f16,c=bf16' sets compute_dtype a second time",
         r"use policy\.with_compute_dtype\(\.\.\.\)"),
    Case("policy: part without '='", lambda: jaxmp.get_policy("p=f32,c=bf16,x"),
         ValueError, r"Policy part 'x' of 'p=f32,c=bf16,x' is not of the form key=dtype",
         POLICY_GRAMMAR),
    Case("Policy: non-floating dtype",
         lambda: jaxmp.Policy(jnp.float32, jnp.int8, jnp.float32), ValueError,
         r"Policy: compute_dtype must be a floating dtype .*got int8", VALID_DTYPES),
    Case("Policy: None as a dtype", lambda: jaxmp.Policy(None, "f32", "f32"), TypeError,
         r"Policy: param_dtype must be a floating dtype .*got None of type NoneType",
         r"such as jnp\.float16 or jnp\.bfloat16.*" + VALID_DTYPES),
    Case("Policy.with_output_dtype: unknown name",
         lambda: jaxmp.get_policy("float32").with_output_dtype("f17"), ValueError,
         r"Unknown dtype 'f17'", r"Did you mean 'f16'\?.*" + VALID_DTYPES),
    Case("auto_policy: a platform name instead of a device",
         lambda: jaxmp.auto_policy("gpu"), TypeError,
         r"expects a JAX device or None, got 'gpu'", r"jax\.devices\(\)\[0\]"),
    Case("PathPolicy: invalid regular expression", lambda: jaxmp.PathPolicy({"(": "f32"}),
         ValueError, r"PathPolicy: '\(' is not a valid regular expression",
         r"missing \), unterminated subpattern"),
    Case("PathPolicy: a pattern that is not a string",
         lambda: jaxmp.PathPolicy({3: "f32"}), TypeError,
         r"PathPolicy: a pattern must be a regular-expression string, got 3 of type int",
         r"regular-expression string"),
    Case("PathPolicy: a bad policy for a pattern",
         lambda: jaxmp.PathPolicy({"head": "p=f32;c=bf16"}), ValueError,
         r"PathPolicy, rule 'head': In policy 'p=f32;c=bf16'",
         r"Separate the parts of a policy with ','"),
    Case("PathPolicy: a bad default", lambda: jaxmp.PathPolicy({}, default="f17"),
         ValueError, r"PathPolicy, default: Unknown policy 'f17'", POLICY_GRAMMAR),
    Case("PathPolicy: a pattern given twice",
         lambda: jaxmp.PathPolicy([("x", "f32"), ("x", "mixed_bfloat16")]), ValueError,
         r"PathPolicy: the rule 'x' is given twice", r"give each pattern once"),
    Case("PathPolicy: rules that are not pairs", lambda: jaxmp.PathPolicy(["x"]),
         TypeError, r"got the item 'x'",
         r"rules must be a dict \{pattern: policy\} or a list of \(pattern, policy\) pairs"),
    Case("PathPolicy: a policy string as the rules", lambda: jaxmp.PathPolicy("bf16"),
         TypeError, r"got 'bf16' of type str",
         r"For one policy everywhere, use the policy itself"),
    Case("PathPolicy: first_match not a bool",
         lambda: jaxmp.PathPolicy({}, first_match="yes"), TypeError,
         r"PathPolicy: first_match must be True or False, got 'yes'", r"True or False"),
    Case("PathPolicy: overlapping patterns",
         lambda: jaxmp.PathPolicy({"bias$": "f32", "head": "mixed_bfloat16"}).policy_for(
             "params/head/bias"), ValueError,
         r"PathPolicy: the path 'params/head/bias' matches several rules: 'bias\$', 'head'",
         r"anchor the patterns with \^ and \$\), or pass first_match=True"),
    Case("PathPolicy: an unmatched path without a default",
         lambda: jaxmp.PathPolicy({"head": "f32"}, default=None).cast_to_compute(
             {"body": {"w": jnp.ones(1)}}), ValueError,
         r"PathPolicy: no rule matches the path 'body/w' and there is no default policy\. "
         r"The rules are: 'head'", r"Add a rule for it, or pass default=\.\.\."),
    Case("PathPolicy.wrap_apply: no default for the inputs and outputs",
         lambda: jaxmp.PathPolicy({"head": "f32"}, default=None).wrap_apply(lambda v: v),
         ValueError, r"This PathPolicy needs a default policy: it is the policy of the "
         r"model's inputs and outputs", r"Pass default=\.\.\."),
    Case("ModulePolicy: a bad policy for a module",
         lambda: jaxmp.flax.ModulePolicy({nn.LayerNorm: "c=int8"}), ValueError,
         r"ModulePolicy, rule flax\.linen\.normalization\.LayerNorm: .*Unknown dtype 'int8'",
         VALID_DTYPES),
    Case("ModulePolicy: a key that is neither a class nor a name",
         lambda: jaxmp.flax.ModulePolicy({3: "f32"}), TypeError,
         r"got 3 of type int", r"module classes \(e\.g\. nn\.LayerNorm\) or strings"),
    Case("ModulePolicy: an instance as the key",
         lambda: jaxmp.flax.ModulePolicy({nn.LayerNorm(): "f32"}), TypeError,
         r"got LayerNorm\(.*of type LayerNorm", r"module classes \(e\.g\. nn\.LayerNorm\)"),
    Case("ModulePolicy: override_dtype of a wrong kind",
         lambda: jaxmp.flax.ModulePolicy({}, override_dtype="dense"), TypeError,
         r"override_dtype .*got 'dense'", r"a tuple of module classes such as \(nn\.Dense, nn\.Conv\)"),
    Case("ModulePolicy: override_dtype of a class without dtype",
         lambda: jaxmp.flax.ModulePolicy({}, override_dtype=(nn.Dropout,)), ValueError,
         r"names flax\.linen\.stochastic\.Dropout, which has no dtype attribute",
         r"Name the Linen layers that take dtype=.*set_nnx_dtypes sets every layer"),
    Case("ModulePolicy: overlapping rules", linen_overlap, ValueError,
         r"ModulePolicy: the module Dense at path 'layers_0' matches several rules: "
         r"flax\.linen\.linear\.Dense, 'layers_0'",
         r"Make the rules exclusive.*or pass first_match=True"),
    Case("ModulePolicy: a rule that matches no NNX module",
         lambda: jaxmp.flax.ModulePolicy({"Head": "f32"}).set_nnx_dtypes(nnx_model()),
         ValueError, r"the rule 'Head' matches no module of the model\. "
         r"Module paths are: 'linear'", r"Check the rule for a typo"),
    Case("ModulePolicy: a rule for NNX modules without dtype",
         lambda: jaxmp.flax.ModulePolicy({NnxRaw: "bf16"}).set_nnx_dtypes(nnx_model()),
         ValueError, r"matches modules without a dtype attribute",
         r"Name the layers inside them instead"),
    Case("ModulePolicy.set_nnx_dtypes: a Linen model",
         lambda: jaxmp.flax.ModulePolicy({}).set_nnx_dtypes(nn.Dense(2)), TypeError,
         r"set_nnx_dtypes expects an nnx\.Module.*Got Dense", r"use wrap_apply\(model\.apply\)"),
    # -- Loss scales (validation at construction) -------------------------------
    # Python numbers, NumPy numbers and concrete arrays are validated alike.
    Case("DynamicLossScale: zero scale", dynamic(0.0), ValueError,
         r"loss_scale must be a number >= 1 and <= 3\.40282e\+38, got 0\.0", SCALE_HINT),
    Case("DynamicLossScale: negative scale", dynamic(-1.0), ValueError,
         r"loss_scale must be a number >= 1 .*got -1\.0", SCALE_HINT),
    Case("DynamicLossScale: inf scale", dynamic(float("inf")), ValueError,
         r"loss_scale must be finite, got inf", SCALE_HINT),
    Case("DynamicLossScale: nan scale", dynamic(float("nan")), ValueError,
         r"loss_scale must be a number, got nan", SCALE_HINT),
    Case("DynamicLossScale: nan array scale", dynamic(jnp.float32(jnp.nan)), ValueError,
         r"loss_scale must be a number, got nan", SCALE_HINT),
    Case("DynamicLossScale: inf array scale", dynamic(jnp.float32(jnp.inf)), ValueError,
         r"loss_scale must be finite, got inf", SCALE_HINT),
    Case("DynamicLossScale: zero array scale", dynamic(jnp.float32(0.0)), ValueError,
         r"loss_scale must be a number >= 1 .*got Array\(0\., dtype=float32\)", SCALE_HINT),
    Case("DynamicLossScale: negative NumPy scale", dynamic(np.float32(-2.0)), ValueError,
         r"loss_scale must be a number >= 1 .*got np\.float32\(-2\.0\)", SCALE_HINT),
    Case("DynamicLossScale: array scale below min_loss_scale",
         dynamic(jnp.float32(2.0), min_loss_scale=4.0), ValueError,
         r"loss_scale must be a number >= 4 .*got Array\(2\., dtype=float32\)",
         r"within \[min_loss_scale, max_loss_scale\] = \[4, 3\.40282e\+38\]: change "
         r"loss_scale or those bounds"),
    Case("DynamicLossScale: array scale above max_loss_scale",
         dynamic(jnp.float32(2.0**20), max_loss_scale=2.0**10), ValueError,
         r"loss_scale must be a number >= 1 and <= 1024, got Array\(1(\.048576e\+06|048576\.)",
         r"change loss_scale or those bounds"),
    Case("DynamicLossScale: min above the initial scale",
         dynamic(1.0, min_loss_scale=2.0), ValueError,
         r"loss_scale must be a number >= 2 .*got 1\.0",
         r"\[min_loss_scale, max_loss_scale\] = \[2, "),
    Case("DynamicLossScale: initial scale above max",
         dynamic(2.0**20, max_loss_scale=2.0**10), ValueError,
         r"loss_scale must be a number >= 1 and <= 1024, got 1048576\.0",
         r"change loss_scale or those bounds"),
    Case("DynamicLossScale: subnormal scale", dynamic(1e-40, min_loss_scale=0.0),
         ValueError, r"loss_scale must be a number >= 1\.17549e-38 .*got 1e-40",
         r"Scales below 2\*\*-126, the smallest normal float32, are flushed to 0"),
    Case("StaticLossScale: zero scale", lambda: jaxmp.StaticLossScale(0), ValueError,
         r"loss_scale must be a number >= 1\.17549e-38 .*got 0\b", SCALE_HINT),
    Case("StaticLossScale: negative scale", lambda: jaxmp.StaticLossScale(-4.0),
         ValueError, r"got -4\.0", SCALE_HINT),
    Case("StaticLossScale: subnormal scale", lambda: jaxmp.StaticLossScale(1e-40),
         ValueError, r"loss_scale must be a number >= 1\.17549e-38 .*got 1e-40",
         r"Scales below 2\*\*-126, the smallest normal float32, are flushed to 0 by XLA"),
    Case("StaticLossScale: subnormal NumPy scale",
         lambda: jaxmp.StaticLossScale(np.float32(1e-40)), ValueError,
         r"got np\.float32\(1e-40\)", r"Scales below 2\*\*-126"),
    Case("StaticLossScale: nan array scale",
         lambda: jaxmp.StaticLossScale(jnp.float32(jnp.nan)), ValueError,
         r"loss_scale must be a number, got nan", SCALE_HINT),
    # Values of the wrong kind.
    Case("DynamicLossScale: string scale", dynamic("1024"), TypeError,
         r"loss_scale must be a number, got '1024' of type str",
         r"Pass a Python float or a float32 array"),
    Case("DynamicLossScale: None scale", dynamic(None), TypeError,
         r"loss_scale must be a number, got None of type NoneType",
         r"Pass a Python float or a float32 array"),
    Case("StaticLossScale: string scale", lambda: jaxmp.StaticLossScale("2"), TypeError,
         r"loss_scale must be a number, got '2' of type str",
         r"Pass a Python float or a float32 array"),
    Case("DynamicLossScale: bool scale", dynamic(True), TypeError,
         r"loss_scale must be a number, got True of type bool",
         r"Pass a Python float or a float32 array"),
    Case("DynamicLossScale: vector scale", dynamic(np.ones(2)), TypeError,
         r"loss_scale must be a scalar, got an array of shape \(2,\)",
         r"Pass a Python float or a float32 array"),
    Case("StaticLossScale: complex scale", lambda: jaxmp.StaticLossScale(1 + 2j),
         TypeError, r"got \(1\+2j\) of type complex", r"Pass a Python float"),
    Case("StaticLossScale: complex array scale",
         lambda: jaxmp.StaticLossScale(jnp.complex64(2.0)), TypeError,
         r"got Array\(2\.\+0\.j, dtype=complex64\)", r"Pass a Python float"),
    # Configuration.
    Case("DynamicLossScale: period 0", dynamic(period=0), ValueError,
         r"period must be an integer >= 1 and <= 2147483647, got 0",
         r"2000 is the usual choice"),
    Case("DynamicLossScale: period beyond int32", dynamic(period=2**31), ValueError,
         r"period must be an integer >= 1 and <= 2147483647, got 2147483648",
         r"2000 is the usual choice"),
    Case("DynamicLossScale: non-integer period", dynamic(period=2.5), TypeError,
         r"period must be an integer, got 2\.5", r"2000 is the usual choice"),
    Case("DynamicLossScale: string period", dynamic(period="2000"), TypeError,
         r"period must be an integer, got '2000' of type str", r"2000 is the usual choice"),
    Case("DynamicLossScale: traced period",
         lambda: jax.jit(lambda p: jaxmp.DynamicLossScale(period=p))(jnp.int32(5)),
         TypeError, r"period must be an integer, got a traced value",
         r"configuration is static: pass a Python number"),
    Case("DynamicLossScale: factor 1", dynamic(factor=1.0), ValueError,
         r"factor must be a number > 1, got 1\.0",
         r"2\.0 is the usual choice\. Use StaticLossScale"),
    Case("DynamicLossScale: factor below 1", dynamic(factor=0.5), ValueError,
         r"factor must be a number > 1, got 0\.5", r"2\.0 is the usual choice"),
    Case("DynamicLossScale: backoff above 1", dynamic(backoff_factor=1.5), ValueError,
         r"backoff_factor must be a number > 0 and < 1, got 1\.5", r"0\.5 halves it"),
    Case("DynamicLossScale: backoff 0", dynamic(backoff_factor=0.0), ValueError,
         r"backoff_factor must be a number > 0 and < 1, got 0\.0", r"0\.5 halves it"),
    Case("DynamicLossScale: negative min", dynamic(min_loss_scale=-1.0), ValueError,
         r"min_loss_scale must be a number >= 0 .*got -1\.0",
         r"The scale never backs off below it"),
    Case("DynamicLossScale: nan array min", dynamic(min_loss_scale=jnp.float32(jnp.nan)),
         ValueError, r"min_loss_scale must be a number, got nan",
         r"The scale never backs off below it"),
    Case("DynamicLossScale: max below min",
         dynamic(4.0, min_loss_scale=2.0, max_loss_scale=1.0), ValueError,
         r"max_loss_scale must be a number >= 2, got 1\.0",
         r"at least min_loss_scale \(2\.0\)\. Pass None"),
    Case("DynamicLossScale: hysteresis 0", dynamic(hysteresis=0), ValueError,
         r"hysteresis must be an integer >= 1 and <= 2147483647, got 0",
         r"1 backs off on every overflow"),
    Case("DynamicLossScale: hysteresis beyond int32", dynamic(hysteresis=2**32 + 1),
         ValueError, r"hysteresis must be an integer >= 1 and <= 2147483647, got 4294967297",
         r"1 backs off on every overflow"),
    Case("DynamicLossScale: consecutive_hysteresis not a bool",
         dynamic(consecutive_hysteresis="yes"), TypeError,
         r"consecutive_hysteresis must be True or False", r"got 'yes' of type str"),
    # State beyond its range.
    Case("DynamicLossScale: counter beyond period", dynamic(counter=5, period=5),
         ValueError, r"counter must be an integer >= 0 and <= 4, got 5",
         r"so it lies in \[0, period\); start with 0"),
    Case("DynamicLossScale: array counter beyond period",
         dynamic(counter=jnp.int32(5), period=5), ValueError,
         r"counter must be an integer >= 0 and <= 4, got Array\(5, dtype=int32\)",
         r"start with 0"),
    Case("DynamicLossScale: counter beyond int32", dynamic(counter=2**32 + 5),
         ValueError, r"counter must be an integer >= 0 and <= 1999, got 4294967301",
         r"start with 0"),
    Case("DynamicLossScale: negative array counter", dynamic(counter=np.int32(-1)),
         ValueError, r"counter must be an integer >= 0 .*got np\.int32\(-1\)",
         r"start with 0"),
    Case("DynamicLossScale: non-integer counter", dynamic(counter=1.5), TypeError,
         r"counter must be an integer, got 1\.5", r"start with 0"),
    Case("DynamicLossScale: traced float counter",
         lambda: jax.jit(lambda c: jaxmp.DynamicLossScale(counter=c))(jnp.float32(1)),
         TypeError, r"counter must be an integer, got a traced float32 value",
         r"Pass an array of dtype int32"),
    Case("DynamicLossScale: hysteresis_left above hysteresis",
         dynamic(hysteresis=2, hysteresis_left=jnp.int32(3)), ValueError,
         r"hysteresis_left must be an integer >= 1 and <= 2, got Array\(3, dtype=int32\)",
         r"so it lies in \[1, hysteresis\]"),
    Case("DynamicLossScale: hysteresis_left 0", dynamic(hysteresis_left=0), ValueError,
         r"hysteresis_left must be an integer >= 1 and <= 1, got 0",
         r"leave it out to start with hysteresis"),
    Case("DynamicLossScale: hysteresis_left beyond int32",
         dynamic(hysteresis=2**31 - 1, hysteresis_left=2**32), ValueError,
         r"hysteresis_left must be an integer >= 1 and <= 2147483647, got 4294967296",
         r"so it lies in \[1, hysteresis\]"),
    Case("DynamicLossScale: negative overflows_at_min",
         dynamic(overflows_at_min=np.int32(-1)), ValueError,
         r"overflows_at_min must be an integer >= 0 and <= 2147483647, got np\.int32\(-1\)",
         r"start with 0"),
    Case("DynamicLossScale: overflows_at_min beyond int32",
         dynamic(overflows_at_min=2**31), ValueError,
         r"overflows_at_min must be an integer >= 0 and <= 2147483647, got 2147483648",
         r"start with 0"),
    Case("DynamicLossScale: dataclasses.replace with a zero scale",
         lambda: dataclasses.replace(jaxmp.DynamicLossScale(), loss_scale=0.0), ValueError,
         r"loss_scale must be a number >= 1 .*got 0\.0", SCALE_HINT),
    # Use.
    Case("adjust: a float flag", lambda: jaxmp.DynamicLossScale().adjust(1.0), TypeError,
         r"adjust expects a scalar boolean, got an array of shape \(\) and dtype float32",
         r"Pass e\.g\. jaxmp\.all_finite\(grads\)"),
    Case("adjust: a vector of flags",
         lambda: jaxmp.StaticLossScale(2.0).adjust(jnp.array([True, False])), TypeError,
         r"got an array of shape \(2,\) and dtype bool",
         r"Pass e\.g\. jaxmp\.all_finite\(grads\), or reduce an array first"),
    Case("LossScale ==: traced state",
         lambda: jax.jit(lambda ls: ls == ls.adjust(jnp.array(True)))(
             jaxmp.DynamicLossScale()), TypeError,
         r"Loss scales holding traced arrays .* cannot be compared with ==",
         r"jnp\.array_equal\(a\.loss_scale, b\.loss_scale\)"),
    # -- Pytree helpers -------------------------------------------------------
    Case("select_tree: non-scalar predicate",
         lambda: jaxmp.select_tree(jnp.array([True, False]), {"a": jnp.ones(2)},
                                   {"a": jnp.zeros(2)}),
         TypeError, r"select_tree expects a scalar boolean, got an array of shape \(2,\)",
         r"reduce an array first with jnp\.all\(x\)"),
    Case("select_tree: different structures",
         lambda: jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
         ValueError, r"a and b differ in tree structure:\n  a: PyTreeDef\(\{'a': \*\}\)\n"
         r"  b: PyTreeDef\(\{'b': \*\}\)", r"Pass two pytrees alike"),
    Case("select_tree: different shapes",
         lambda: jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"a": jnp.ones(3)}),
         ValueError, r"a and b differ in shape at \['a'\]: \(2,\) against \(3,\)",
         r"Pass two pytrees alike"),
    Case("select_tree: different dtypes",
         lambda: jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2, jnp.int32)},
                                   {"a": jnp.ones(2)}),
         TypeError, r"a and b differ in dtype at \['a'\]: int32 against float32",
         r"Pass two pytrees alike"),
    # -- The optax wrapper (value_and_grad, checks, monitor, diagnostics) -------
    Case("loss_scaling: a number as the loss scale",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), 2.0**15), TypeError,
         r"got 32768\.0", r"such as jaxmp\.DynamicLossScale\(\)"),
    Case("loss_scaling: a jmp loss scale",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), jmp.DynamicLossScale(
             np.float32(2.0**15), period=100)), TypeError,
         r"That is jmp's DynamicLossScale, which jaxmp does not run",
         r"write jaxmp\.DynamicLossScale\(loss_scale=32768\.0, counter=0, "
         r"period=100, factor=2, min_loss_scale=1\.0\)\. Or import jaxmp as jmp "
         r"instead of jmp, which makes jmp\.DynamicLossScale\(\.\.\.\) jaxmp's"),
    Case("loss_scaling: a name as the optimizer",
         lambda: jaxmp.loss_scaling("adam", jaxmp.DynamicLossScale()), TypeError,
         r"got 'adam'", r"e\.g\. optax\.adamw\(1e-3\)"),
    Case("loss_scaling: wrapped twice",
         lambda: jaxmp.loss_scaling(TX, jaxmp.DynamicLossScale()).init(PARAMS),
         ValueError, r"the optimizer it wraps is already wrapped with "
         r"jaxmp\.loss_scaling .*unscaled twice",
         r"Wrap the bare optimizer once: jaxmp\.loss_scaling\(optax\.adamw"),
    Case("loss_scaling: around optax.MultiSteps of loss_scaling",
         lambda: jaxmp.loss_scaling(optax.MultiSteps(TX, 2),
                                    jaxmp.DynamicLossScale()).init(PARAMS),
         ValueError, r"holds a LossScalingState at MultiStepsState\.inner_opt_state",
         r"use jaxmp\.multi_steps\(optax\.adamw\(1e-3\), loss_scale, k\), which "
         r"wraps it for you"),
    Case("multi_steps: around loss_scaling",
         lambda: jaxmp.multi_steps(TX, jaxmp.DynamicLossScale(), 4).init(PARAMS),
         ValueError, r"jaxmp\.multi_steps: the optimizer it wraps is already "
         r"wrapped with jaxmp\.loss_scaling",
         r"pass the bare optimizer, jaxmp\.multi_steps\(optax\.adamw\(1e-3\), "
         r"loss_scale, k\)"),
    Case("update: gradients of another tree structure", update_with({"w": jnp.ones(2)}),
         ValueError, r"the gradients and the params differ in tree structure", SAME_PARAMS),
    Case("update: gradients of other shapes",
         update_with({"w": jnp.ones(3), "b": jnp.ones(1)}), ValueError,
         r"differ in shape at \['w'\]: \(3,\) against \(2,\)", SAME_PARAMS),
    Case("update: the bare optimizer's state",
         update_with(PARAMS, state=optax.sgd(0.1).init(PARAMS)), TypeError,
         r"is a tuple, not the LossScalingState", r"Pass the state returned by tx\.init"),
    Case("update: an axis name outside pmap/shard_map", jitted_update_on_unbound_axis,
         ValueError, r"axis_name='batch'\): that axis name is not bound",
         r"inside jax\.shard_map or jax\.pmap .* or drop axis_name"),
    Case("update: JAXMP_INPLACE_SELECT set to a word", update_with_select_switch("off"),
         ValueError, r"JAXMP_INPLACE_SELECT must be 1 .* or 0 .*, got 'off'",
         r"the default on a CPU\) or 0 \(the form for other backends"),
    Case("all_finite: JAXMP_GROUPED_CHECK set to a word", all_finite_with_check_switch("on"),
         ValueError, r"JAXMP_GROUPED_CHECK must be 1 .* or 0 .*, got 'on'",
         r"the default on a CPU\) or 0 \(the form for other backends"),
    Case("get_loss_scale: a state without one",
         lambda: jaxmp.get_loss_scale(optax.adam(1e-3).init(PARAMS)), ValueError,
         r"get_loss_scale: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("get_loss_scale: two loss-scaling states",
         lambda: jaxmp.get_loss_scale((STATE, STATE)), ValueError,
         r"holds 2 jaxmp\.loss_scaling states \(at \[0\], \[1\]\), so the loss "
         r"scale is ambiguous", r"Wrap the whole optimizer once"),
    Case("loss_scaling_metrics: a state without a loss scale",
         lambda: jaxmp.loss_scaling_metrics(optax.adam(1e-3).init(PARAMS)), ValueError,
         r"loss_scaling_metrics: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("check_loss_scale: a state without a loss scale",
         lambda: jaxmp.check_loss_scale(optax.sgd(0.1).init(PARAMS)), ValueError,
         r"check_loss_scale: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("check_loss_scale: an incomplete metrics dict",
         lambda: jaxmp.check_loss_scale({"loss_scale": jnp.float32(1)}), ValueError,
         r"has no 'overflows_at_min' key", METRICS_FIX),
    Case("check_loss_scale: a metric that is not a number",
         lambda: jaxmp.check_loss_scale({"overflows_at_min": "3", "loss_scale": 1.0}),
         TypeError, r"the metric 'overflows_at_min' must be a number .*got '3'",
         METRICS_FIX),
    Case("check_loss_scale: negative tolerance",
         lambda: jaxmp.check_loss_scale(STATE, max_overflows_at_min=-1), ValueError,
         r"got -1", r"must be an integer >= 0"),
    Case("check_loss_scale: a string tolerance",
         lambda: jaxmp.check_loss_scale(STATE, max_overflows_at_min="1"), TypeError,
         r"max_overflows_at_min must be an integer, got '1'",
         r"the number of overflows at the minimum scale to tolerate"),
    Case("scaled_value_and_grad: an optimizer state as the loss scale",
         lambda: jaxmp.scaled_value_and_grad(jnp.sum, STATE), TypeError,
         r"got a LossScalingState", r"pass jaxmp\.get_loss_scale\(opt_state\)"),
    Case("scaled_value_and_grad: a number as the loss scale",
         lambda: jaxmp.scaled_value_and_grad(jnp.sum, 32.0), TypeError,
         r"expects a loss scale as its second argument, got a float",
         r"pass jaxmp\.get_loss_scale\(opt_state\)"),
    Case("scaled_value_and_grad: has_aux without a pair, with nnx.value_and_grad",
         lambda: jaxmp.scaled_value_and_grad(
             lambda m: jnp.sum(m.w[...]), jaxmp.StaticLossScale(2.0), has_aux=True,
             value_and_grad=nnx.value_and_grad)(NnxRaw()),
         TypeError, r"has_aux=True\) expects fun", r"to return a pair \(loss, aux\)"),
    Case("scaled_value_and_grad: has_aux without a pair",
         lambda: jaxmp.scaled_value_and_grad(
             jnp.sum, jaxmp.NoOpLossScale(), has_aux=True)(jnp.ones(2)),
         TypeError, r"has_aux=True\) expects fun", r"to return a pair \(loss, aux\)"),
    Case("scaled_value_and_grad: a (loss, aux) pair without has_aux",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: (jnp.sum(w), {"norm": jnp.linalg.norm(w)}),
             jaxmp.NoOpLossScale())(jnp.ones(2)),
         TypeError, r"expects fun to return a scalar loss, got a tuple",
         r"If fun returns \(loss, aux\), pass has_aux=True"),
    Case("scaled_value_and_grad: a dict for the loss",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: {"loss": jnp.sum(w)}, jaxmp.NoOpLossScale())(jnp.ones(2)),
         TypeError, r"expects fun to return a scalar loss, got a dict",
         r"return \(loss, aux\) and pass has_aux=True"),
    Case("scaled_value_and_grad: a jmp loss scale",
         lambda: jaxmp.scaled_value_and_grad(jnp.sum, jmp.StaticLossScale(
             np.float32(2.0**15)))(jnp.ones(2)), TypeError,
         r"That is jmp's StaticLossScale, which jaxmp does not run",
         r"write jaxmp\.StaticLossScale\(loss_scale=32768\.0\)\. Or import jaxmp as jmp"),
    Case("scaled_value_and_grad: a non-scalar loss",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: 2 * w, jaxmp.StaticLossScale(2.0))(jnp.ones(2)),
         TypeError, r"scalar loss, got shape \(2,\)", r"Reduce it first, e\.g\. with jnp\.mean"),
    Case("scaled_value_and_grad: an integer loss",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: jnp.sum(w).astype(jnp.int32), jaxmp.StaticLossScale(2.0))(
                 jnp.ones(2)),
         TypeError, r"real floating-point loss, got dtype int32, whose gradients are "
         r"all zero", r"Compute the loss from floating values"),
    Case("scaled_value_and_grad: a complex loss",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: jnp.sum(w.astype(jnp.complex64) * jnp.complex64(1j)), jaxmp.StaticLossScale(2.0))(jnp.ones(2)),
         TypeError, r"got dtype complex64: only its real part would be differentiated",
         r"Return a real loss, e\.g\. jnp\.abs\(z\) \*\* 2 or z\.real"),
    Case("scaled_value_and_grad: a function leaf (an Equinox module)",
         lambda: jaxmp.scaled_value_and_grad(
             lambda m: jnp.sum(m["act"](m["w"])), jaxmp.StaticLossScale(2.0))(
                 {"w": jnp.ones(2), "act": jnp.tanh}),
         TypeError, r"argument 0 holds a leaf that is not an array at \['act'\]",
         r"Pass value_and_grad=eqx\.filter_value_and_grad"),
    Case("scaled_value_and_grad: argnums for a value_and_grad without them",
         lambda: jaxmp.scaled_value_and_grad(
             jnp.sum, jaxmp.NoOpLossScale(), argnums=1,
             value_and_grad=first_argument_value_and_grad),
         TypeError, r"\(argnums=1\): .*first_argument_value_and_grad takes no argnums",
         r"Put what you differentiate first \(several objects as one tuple\)"),
    Case("scaled_value_and_grad: value_and_grad not a function",
         lambda: jaxmp.scaled_value_and_grad(
             jnp.sum, jaxmp.NoOpLossScale(), value_and_grad="jax"),
         TypeError, r"value_and_grad must be a function .*got 'jax'",
         r"such as jax\.value_and_grad or eqx\.filter_value_and_grad"),
    Case("multi_steps: zero micro-batches",
         lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 0), ValueError,
         r"every_k_schedule must be an integer >= 1, got 0",
         r"Pass the number of micro-batches per step, or a function"),
    Case("LossScaleMonitor: window 0", lambda: jaxmp.LossScaleMonitor(window=0),
         ValueError, r"window must be an integer >= 1, got 0",
         r"1000 measures the overflow rate"),
    Case("LossScaleMonitor: warn_rate 0", lambda: jaxmp.LossScaleMonitor(warn_rate=0.0),
         ValueError, r"warn_rate must be a number > 0 and <= 1, got 0\.0",
         r"None never warns"),
    Case("LossScaleMonitor: warn_rate as a string",
         lambda: jaxmp.LossScaleMonitor(warn_rate="0.1"), TypeError,
         r"warn_rate must be a number, got '0\.1' of type str",
         r"0\.1 warns when a tenth of the steps are skipped"),
    Case("LossScaleMonitor: a fractional every",
         lambda: jaxmp.LossScaleMonitor(every=2.5), TypeError,
         r"every must be an integer, got 2\.5", r"100 reads the metrics every 100 steps"),
    Case("LossScaleMonitor.update: a step as a string",
         lambda: jaxmp.LossScaleMonitor().update("5", STATE), TypeError,
         r"step must be an integer, got '5' of type str",
         r"the number of updates done so far"),
    Case("LossScaleMonitor.record: a step that does not increase",
         record_twice, ValueError, r"step 5 is not after the last recorded step 5",
         r"steps must increase"),
    Case("LossScaleMonitor.record: an incomplete metrics dict",
         lambda: jaxmp.LossScaleMonitor().record(1, {"loss_scale": jnp.float32(1)}),
         ValueError, r"has no 'skipped_steps', 'last_finite', 'overflows_at_min' keys",
         METRICS_FIX),
    Case("LossScaleMonitor.plot: nothing recorded yet",
         lambda: jaxmp.LossScaleMonitor().plot("unused.png"), ValueError,
         r"nothing recorded yet", r"Call monitor\.update\(step, opt_state\)"),
    # -- Migration ---------------------------------------------------------------
    Case("DeepSpeed: unparsable JSON", deepspeed('{"fp16": {"enabled": true,,}}'),
         ValueError, r"is not valid JSON", r"at line 1, column 27"),
    Case("DeepSpeed: not a JSON object", deepspeed("[1, 2]"), ValueError,
         r"got a list", r"must hold a JSON object \(a DeepSpeed config\)"),
    Case("DeepSpeed: unterminated comment", deepspeed('{"fp16": /* open'), ValueError,
         r"unterminated /\* comment", r"close it with \*/"),
    Case("DeepSpeed: a block given twice",
         deepspeed('{"fp16": {"enabled": true}, "fp16": {"enabled": false}}'), ValueError,
         r"gives the key 'fp16' twice in one object", r"DeepSpeed refuses duplicate keys\. "
         r"Keep one of them"),
    Case("DeepSpeed: a key given twice inside fp16",
         deepspeed('{"fp16": {"enabled": true, "loss_scale": 0, "enabled": false}}'),
         ValueError, r"the key 'enabled' twice .*keys 'enabled', 'loss_scale'",
         r"Keep one of them"),
    Case("DeepSpeed: a misspelt fp16 key",
         deepspeed({"fp16": {"enabled": True, "initial_scale_pwr": 12}}), ValueError,
         r"fp16\.initial_scale_pwr is not a key of the fp16 block",
         r"Did you mean 'initial_scale_power'\?"),
    Case("DeepSpeed: a misspelt fp16 key while disabled",
         deepspeed({"fp16": {"enabled": False, "loss_scael": 0}}), ValueError,
         r"fp16\.loss_scael is not a key", r"Did you mean 'loss_scale'\?"),
    Case("DeepSpeed: a misspelt bf16 enabled",
         deepspeed({"bf16": {"enabeld": True}}), ValueError,
         r"bf16\.enabeld is not a key of the bf16 block, and DeepSpeed refuses it too",
         r"Did you mean 'enabled'\?"),
    Case("DeepSpeed: deeply nested JSON", deepspeed("[" * 100_000 + "]" * 100_000),
         ValueError, r"the JSON string is nested too deeply to parse",
         r"check that this is the right file"),
    Case("DeepSpeed: fp16 and bf16 both enabled",
         deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}), ValueError,
         r"fp16 and bf16 are both enabled", r"keep one"),
    Case("DeepSpeed: fp16 not an object", deepspeed({"fp16": True}), ValueError,
         r"'fp16' must be an object", r'such as \{"enabled": true\}'),
    Case("DeepSpeed: enabled given as a string",
         deepspeed({"fp16": {"enabled": "yes"}}), ValueError,
         r"fp16\.enabled must be True or False, got 'yes'",
         r"Write true or false, without quotes"),
    Case("DeepSpeed: negative loss scale",
         deepspeed({"fp16": {"enabled": True, "loss_scale": -1}}), ValueError,
         r"fp16\.loss_scale .*got -1", r"Use 0 \(dynamic loss scaling\) or a positive"),
    Case("DeepSpeed: infinite loss scale",
         deepspeed({"fp16": {"enabled": True, "loss_scale": float("inf")}}), ValueError,
         r"fp16\.loss_scale must be finite, got inf", r"Use 0 \(dynamic loss scaling\)"),
    Case("DeepSpeed: NaN loss scale",
         deepspeed('{"fp16": {"enabled": true, "loss_scale": NaN}}'), ValueError,
         r"fp16\.loss_scale must be a number, got nan", r"Use 0 \(dynamic loss scaling\)"),
    Case("DeepSpeed: subnormal static loss scale",
         deepspeed({"fp16": {"enabled": True, "loss_scale": 1e-40}}), ValueError,
         r"got 1e-40; smaller scales are flushed to 0",
         r"must be 0 or at least 2\*\*-126"),
    Case("DeepSpeed: non-numeric power",
         deepspeed({"fp16": {"enabled": True, "initial_scale_power": "sixteen"}}),
         ValueError, r"initial_scale_power .*got 'sixteen'", r"must be an integer"),
    Case("DeepSpeed: power beyond float32",
         deepspeed({"fp16": {"enabled": True, "initial_scale_power": 200}}), ValueError,
         r"initial_scale_power must be an integer >= -126 and <= 127, got 200",
         r"is a float32; 16 is the usual value"),
    Case("DeepSpeed: window 0",
         deepspeed({"fp16": {"enabled": True, "loss_scale_window": 0}}), ValueError,
         r"loss_scale_window must be an integer >= 1 .*got 0", r"1000 is DeepSpeed's default"),
    Case("DeepSpeed: fractional window",
         deepspeed({"fp16": {"enabled": True, "loss_scale_window": 10.5}}), ValueError,
         r"loss_scale_window must be an integer, got 10\.5", r"1000 is DeepSpeed's default"),
    Case("DeepSpeed: quoted window",
         deepspeed({"fp16": {"enabled": True, "loss_scale_window": "1000"}}), ValueError,
         r"loss_scale_window must be an integer, got '1000' of type str",
         r"Write a JSON number, without quotes"),
    Case("DeepSpeed: hysteresis 0",
         deepspeed({"fp16": {"enabled": True, "hysteresis": 0}}), ValueError,
         r"hysteresis must be an integer >= 1 and <= \d+, got 0", r"DeepSpeed's default is 2"),
    Case("DeepSpeed: hysteresis given as a bool",
         deepspeed({"fp16": {"enabled": True, "hysteresis": True}}), ValueError,
         r"hysteresis must be an integer, got True of type bool",
         r"1 backs off on every overflow"),
    Case("DeepSpeed: consecutive_hysteresis given as a number",
         deepspeed({"fp16": {"enabled": True, "consecutive_hysteresis": 1}}), ValueError,
         r"consecutive_hysteresis must be True or False, got 1",
         r"Write true or false, without quotes"),
    Case("DeepSpeed: min_loss_scale 0",
         deepspeed({"fp16": {"enabled": True, "min_loss_scale": 0}}), ValueError,
         r"fp16\.min_loss_scale must be a number > 0, got 0", r"DeepSpeed's default is 1"),
    Case("DeepSpeed: missing file", deepspeed("/nonexistent/ds_config.json"), ValueError,
         r"no such file: '/nonexistent/ds_config\.json'",
         r"pass a dict, a JSON string or the path"),
    Case("DeepSpeed: min_loss_scale above the initial scale",
         deepspeed({"fp16": {"enabled": True, "initial_scale_power": 4,
                             "min_loss_scale": 32}}), ValueError,
         r"min_loss_scale \(32\.0\) is above the initial scale 2\*\*4",
         r"lower min_loss_scale or raise initial_scale_power"),
    Case("DeepSpeed: not a config at all", deepspeed(3), TypeError,
         r"got a int", r"expects a dict, a JSON string or a path"),
    Case("DeepSpeed: apex AMP enabled",
         deepspeed({"amp": {"enabled": True, "opt_level": "O1"}}), ValueError,
         r"amp\.enabled is true: DeepSpeed hands mixed precision to NVIDIA apex",
         r'Replace the amp block with "fp16": \{"enabled": true\}'),
    Case("DeepSpeed: the Trainer's apex backend",
         trainer({"fp16": {"enabled": "auto"}},
                 {"fp16": True, "half_precision_backend": "apex"}), ValueError,
         r"fp16 with half_precision_backend 'apex' makes the Trainer fill in amp",
         r"Drop the apex backend"),
    Case("DeepSpeed: the Trainer's apex backend on its command line",
         trainer({"fp16": {"enabled": "auto"}},
                 ["--fp16", "--half_precision_backend", "apex"]), ValueError,
         r"fp16 with half_precision_backend 'apex' makes the Trainer fill in amp",
         r"Drop the apex backend"),
    Case("DeepSpeed: the Trainer's older fp16_backend apex",
         trainer({}, {"fp16": True, "fp16_backend": "apex"}), ValueError,
         r"fp16 with half_precision_backend 'apex'", r"Drop the apex backend"),
    Case("DeepSpeed: the Trainer's older fp16_backend apex on its command line",
         trainer({}, ["--fp16", "--fp16_backend", "apex"]), ValueError,
         r"fp16 with half_precision_backend 'apex'", r"Drop the apex backend"),
    Case("DeepSpeed: a config value the Trainer's argument contradicts",
         trainer({"bf16": {"enabled": True}, "gradient_accumulation_steps": 8},
                 ["--gradient_accumulation_steps", "4"]), ValueError,
         r"bf16\.enabled is true in the config and bf16 False in the Trainer's "
         r"arguments; gradient_accumulation_steps is 8 in the config and "
         r"gradient_accumulation_steps 4", r'Set the value to "auto" in the config'),
    Case("DeepSpeed: the Trainer's fp16 and bf16 both",
         trainer({}, ["--fp16", "--bf16"]), ValueError,
         r"fp16 and bf16 are both true", r"keep one"),
    Case("DeepSpeed: a misspelt Trainer flag", trainer({}, ["--bf61"]), ValueError,
         r"the flag --bf61 is not one the conversion reads", r"Did you mean '--bf16'\?"),
    Case("DeepSpeed: a Trainer flag's value that is not a number",
         trainer({}, ["--gradient_accumulation_steps", "four"]), ValueError,
         r"--gradient_accumulation_steps: invalid int value: 'four'",
         r"Write the flags as the Trainer's command line takes them"),
    Case("DeepSpeed: the Trainer's bf16 given as a string",
         trainer({}, {"bf16": "true"}), ValueError,
         r"Trainer arguments: bf16 must be True or False, got 'true'",
         r"Write true or false, without quotes"),
    Case("DeepSpeed: the Trainer's arguments in a missing file",
         trainer({}, "/nonexistent/args.json"), ValueError,
         r"no such file: '/nonexistent/args\.json'",
         r"the path of a file that holds the Trainer's arguments"),
    # The optimizer, clipping and accumulation are checked too, so that the
    # code `jaxmp convert` prints never holds a value that optax refuses or
    # that trains into nan.
    Case("DeepSpeed: a NaN learning rate",
         deepspeed('{"optimizer": {"type": "AdamW", "params": {"lr": NaN}}}'), ValueError,
         r"optimizer\.params\.lr must be a number, got nan", r"e\.g\. 1e-3, or \"auto\""),
    Case("DeepSpeed: an infinite learning rate",
         deepspeed('{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}'),
         ValueError, r"optimizer\.params\.lr must be finite, got inf", r"e\.g\. 1e-3"),
    Case("DeepSpeed: a quoted learning rate",
         deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": "1e-3"}}}), ValueError,
         r"optimizer\.params\.lr must be a number, got '1e-3' of type str",
         r"Write a JSON number, without quotes"),
    Case("DeepSpeed: a bool learning rate",
         deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": True}}}), ValueError,
         r"optimizer\.params\.lr must be a number, got True of type bool", r"e\.g\. 1e-3"),
    Case("DeepSpeed: one beta",
         deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}), ValueError,
         r"optimizer\.params\.betas must be a list of two numbers", r"such as \[0\.9, 0\.999\]"),
    Case("DeepSpeed: a beta of 1.5",
         deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.5]}}}),
         ValueError, r"optimizer\.params\.betas\[1\] .*got 1\.5",
         r"must be a number >= 0 and < 1"),
    Case("DeepSpeed: a negative weight decay",
         deepspeed({"optimizer": {"type": "AdamW", "params": {"weight_decay": -0.1}}}),
         ValueError, r"optimizer\.params\.weight_decay .*got -0\.1", r"must be a number >= 0"),
    Case("DeepSpeed: an optimizer that is not an object", deepspeed({"optimizer": "adam"}),
         ValueError, r"'optimizer' must be an object .*got 'adam'",
         r'such as \{"type": "AdamW", "params": \{"lr": 1e-3\}\}'),
    Case("DeepSpeed: an optimizer type that is not a string",
         deepspeed({"optimizer": {"type": 3}}), ValueError,
         r"optimizer\.type must be a string", r'such as "AdamW"'),
    Case("DeepSpeed: infinite clipping", deepspeed('{"gradient_clipping": Infinity}'),
         ValueError, r"gradient_clipping must be finite, got inf",
         r"Use 0 for no clipping, or the max global norm"),
    Case("DeepSpeed: quoted clipping", deepspeed({"gradient_clipping": "1.0"}), ValueError,
         r"gradient_clipping must be a number, got '1\.0'", r"Write a JSON number, without quotes"),
    Case("DeepSpeed: negative clipping", deepspeed({"gradient_clipping": -1}), ValueError,
         r"gradient_clipping must be a number >= 0, got -1", r"Use 0 for no clipping"),
    Case("DeepSpeed: quoted accumulation", deepspeed({"gradient_accumulation_steps": "4"}),
         ValueError, r"gradient_accumulation_steps must be an integer, got '4'",
         r"without quotes"),
    Case("DeepSpeed: bool accumulation", deepspeed({"gradient_accumulation_steps": True}),
         ValueError, r"gradient_accumulation_steps must be an integer, got True",
         r"the number of micro-batches per optimizer step"),
    Case("DeepSpeed: accumulation 0", deepspeed({"gradient_accumulation_steps": 0}),
         ValueError, r"gradient_accumulation_steps must be an integer >= 1 .*got 0",
         r"the number of micro-batches per optimizer step"),
    Case("DeepSpeed: fractional accumulation", deepspeed({"gradient_accumulation_steps": 2.5}),
         ValueError, r"gradient_accumulation_steps must be an integer, got 2\.5",
         r"the number of micro-batches per optimizer step"),
    Case("from_torch_grad_scaler: a device name",
         lambda: jaxmp.from_torch_grad_scaler("cuda"), TypeError,
         r"init_scale must be a number, got 'cuda'", r"takes no device argument, drop it"),
    Case("from_torch_grad_scaler: a device name before the scale",
         lambda: jaxmp.from_torch_grad_scaler("cuda", 2.0**16), TypeError,
         r"init_scale must be a number, got 'cuda'", r"It looks like a device name"),
    Case("from_torch_grad_scaler: a scale in quotes",
         lambda: jaxmp.from_torch_grad_scaler(init_scale="65536"), TypeError,
         r"init_scale must be a number, got '65536' of type str",
         r"Pass a number, not a string: init_scale=65536\."),
    Case("from_torch_grad_scaler: an interval in quotes",
         lambda: jaxmp.from_torch_grad_scaler(growth_interval="2000"), TypeError,
         r"growth_interval must be an integer, got '2000'",
         r"Pass a number, not a string: growth_interval=2000\."),
    Case("from_torch_grad_scaler: zero scale",
         lambda: jaxmp.from_torch_grad_scaler(init_scale=0.0), ValueError,
         r"init_scale must be a number > 0, got 0\.0", r"PyTorch's default is 65536\.0"),
    Case("from_torch_grad_scaler: infinite scale",
         lambda: jaxmp.from_torch_grad_scaler(init_scale=float("inf")), ValueError,
         r"init_scale must be finite, got inf", r"PyTorch's default is 65536\.0"),
    Case("from_torch_grad_scaler: growth factor 1",
         lambda: jaxmp.from_torch_grad_scaler(growth_factor=1.0), ValueError,
         r"growth_factor must be a number > 1, got 1\.0", r"default is 2\.0"),
    Case("from_torch_grad_scaler: backoff factor 1",
         lambda: jaxmp.from_torch_grad_scaler(backoff_factor=1.0), ValueError,
         r"backoff_factor must be a number > 0 and < 1, got 1\.0", r"default is 0\.5"),
    Case("from_torch_grad_scaler: fractional growth interval",
         lambda: jaxmp.from_torch_grad_scaler(growth_interval=2.5), TypeError,
         r"growth_interval must be an integer, got 2\.5", r"default is 2000"),
    Case("from_torch_grad_scaler: enabled given as a string",
         lambda: jaxmp.from_torch_grad_scaler(enabled="yes"), TypeError,
         r"enabled must be True or False, got 'yes'", r"PyTorch's default is True"),
    # -- Flax, diagnostics, distributed --------------------------------------------
    Case("TrainState.create: an optimizer already wrapped",
         lambda: jaxmp.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=TX),
         ValueError, r"tx is already wrapped with jaxmp\.loss_scaling",
         r"Pass the bare optimizer"),
    Case("TrainState.create: a number as the loss scale",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=None, params=PARAMS, tx=optax.sgd(0.1), loss_scale=1024.0),
         TypeError, r"got 1024\.0", r"such as jaxmp\.DynamicLossScale\(\)"),
    Case("dtype_headroom: an integer dtype",
         lambda: jaxmp.dtype_headroom(jnp.ones(2), jnp.int8), ValueError,
         r"dtype_headroom: dtype must be a floating dtype .*got int8",
         r"such as jnp\.float16 or jnp\.bfloat16"),
    Case("suggest_loss_scale: an integer dtype",
         lambda: jaxmp.suggest_loss_scale({"w": jnp.ones(2)}, jnp.int8), ValueError,
         r"suggest_loss_scale: dtype must be a floating dtype .*got int8",
         r"such as jnp\.float16 or jnp\.bfloat16"),
    Case("dtype_headroom: not a dtype",
         lambda: jaxmp.dtype_headroom(jnp.ones(2), "not a dtype"), TypeError,
         r"dtype_headroom: dtype must be a floating dtype .*got 'not a dtype' of type str",
         r"such as jnp\.float16 or jnp\.bfloat16"),
    # -- The precision audit ------------------------------------------------------
    Case("precision_report: arguments without the function",
         lambda: jaxmp.precision_report(jnp.ones(2), jnp.ones(2)), TypeError,
         r"expects a function as its first argument, got ArrayImpl",
         r"jaxmp\.precision_report\(loss_fn, params, batch\)"),
    Case("PrecisionReport.flops_share: a function without matmuls",
         lambda: jaxmp.precision_report(jnp.tanh, jnp.ones(2)).flops_share("f16"),
         ValueError, r"the function has no matmul or convolution",
         r"Check report\.ops first"),
    Case("PrecisionReport.flops: an unknown direction",
         lambda: jaxmp.precision_report(jnp.dot, jnp.ones(2), jnp.ones(2)).flops(
             "backwards"), ValueError, r"got 'backwards'",
         r"direction must be None or one of 'forward', 'backward', 'recompute'"),
    Case("PrecisionReport.ops_outside: an unknown dtype name",
         lambda: jaxmp.precision_report(jnp.dot, jnp.ones(2), jnp.ones(2)).ops_outside(
             "f17"), ValueError, r"Unknown dtype 'f17'", VALID_DTYPES),
    # -- autocast -------------------------------------------------------------------
    Case("TrainState.create: autocast with a PathPolicy",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=lambda v, x: x, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
             policy=jaxmp.PathPolicy({"w": "f32"}, default="mixed_bfloat16"),
             autocast=True), ValueError,
         r"PathPolicy: autocast casts the inputs of each operation, not each parameter",
         r"Pin modules with a jaxmp\.flax\.ModulePolicy.*or drop autocast=True"),
    Case("TrainState.create: autocast not a bool",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=lambda v, x: x, params={"w": jnp.ones(2)}, tx=optax.sgd(0.1),
             autocast="yes"), TypeError,
         r"TrainState.create: autocast must be True or False, got 'yes'", r"True or False"),
    Case("autocast: not a function",
         lambda: jaxmp.autocast("mixed_bfloat16"), TypeError,
         r"expects a function, got 'mixed_bfloat16'",
         r"jaxmp\.autocast\(loss_fn, 'mixed_bfloat16'\)"),
    Case("autocast: no policy", lambda: jaxmp.autocast(jnp.sin), TypeError,
         r"needs a policy", r"pass policy='mixed_bfloat16'"),
    Case("autocast: an unknown policy",
         lambda: jaxmp.autocast(jnp.sin, "mixed_bf16"), ValueError,
         r"jaxmp\.autocast, policy: Unknown policy 'mixed_bf16'", r"mixed_bfloat16"),
    Case("autocast: a module policy as the policy",
         lambda: jaxmp.autocast(jnp.sin, jaxmp.flax.ModulePolicy(
             {nn.LayerNorm: "float32"}, default="mixed_bfloat16")), TypeError,
         r"takes one jaxmp\.Policy .*got a ModulePolicy",
         r"scope_policies=\{'name_scope_pattern': policy\}"),
    Case("autocast: a rule kind that does not exist",
         lambda: jaxmp.autocast(jnp.sin, "mixed_bfloat16", rules={"exp": "fp32"}),
         ValueError, r"the rule for 'exp' is 'fp32', which is not a rule kind",
         r"Valid kinds are 'compute', 'float32', 'promote', 'as_is', 'original'"),
    Case("autocast: a misspelt primitive",
         lambda: jaxmp.autocast_rules({"dot_genral": "float32"}), ValueError,
         r"'dot_genral' is not the name of a JAX primitive",
         r"Did you mean 'dot_general'"),
    Case("autocast: a rule for a primitive it enters",
         lambda: jaxmp.autocast_rules({"scan": "float32"}), ValueError,
         r"'scan' cannot be given a rule: autocast enters scan",
         r"jax\.named_scope\(\.\.\.\) and pass scope_policies="),
    Case("autocast: rules that are not a mapping",
         lambda: jaxmp.autocast_rules(["exp", "float32"]), TypeError,
         r"got \['exp', 'float32'\] of type list", r"e\.g\. \{'exp': 'promote'\}"),
    Case("autocast: a bad scope pattern",
         lambda: jaxmp.autocast(jnp.sin, "mixed_bfloat16",
                                scope_policies={"LayerNorm_(": "float32"}),
         ValueError,
         r"scope_policies: 'LayerNorm_\(' is not a valid regular expression",
         r"wrap a literal name in re\.escape"),
    Case("autocast: scope patterns that tie with different policies",
         lambda: jaxmp.autocast(scoped_matmul, "mixed_bfloat16", scope_policies={
             "head": "float32", "he.d": "bf16"})(jnp.ones((2, 2))), ValueError,
         r"the scope 'head' is matched by 'head', 'he\.d' with different policies",
         r"Make the patterns match different scopes"),
    Case("autocast: a function that assigns into its argument",
         lambda: jaxmp.autocast(lambda d: d.update(x=d["x"] * 2.0) or jnp.sum(d["x"]),
                                "mixed_bfloat16")({"x": jnp.ones(2)}),
         TypeError, r"jaxmp\.autocast: <lambda> changed its arguments in place",
         r"Return the new values instead of assigning them"),
]


# -- Flax: TrainState, NNX and checkpoints --------------------------------------


class FieldState(jaxmp.flax.TrainState):
  ema: Any


def field_state():
  return FieldState.create(apply_fn=None, params=PARAMS, tx=optax.sgd(0.1), ema=PARAMS)


def keep_on_skip_live_nnx_variables():
  from flax import nnx  # pylint: disable=g-import-not-at-top

  model = nnx.BatchNorm(2, rngs=nnx.Rngs(0))
  live = nnx.state(model, nnx.BatchStat)
  jaxmp.keep_on_skip(STATE, live, live)


def restore_saved(save, target, **kwargs):
  """Saves with ``save(path)`` into a fresh folder, then restores into ``target``."""

  def call():
    with tempfile.TemporaryDirectory() as folder:
      path = os.path.join(folder, "ckpt")
      save(path)
      return jaxmp.flax.restore_checkpoint(path, target, **kwargs)

  return call


def save_plain_orbax(path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, STATE)
  checkpointer.wait_until_finished()


def save_twice():
  with tempfile.TemporaryDirectory() as folder:
    jaxmp.flax.save_checkpoint(os.path.join(folder, "step_1"), STATE)
    jaxmp.flax.save_checkpoint(os.path.join(folder, "step_1"), STATE)


WIDE = {"w": jnp.ones(3), "b": jnp.ones(1)}
FLAX_CASES = [
    Case("TrainState.create: tx is None",
         lambda: jaxmp.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=None),
         TypeError, r"tx must be an optax\.GradientTransformation .*got None",
         r"such as optax\.adamw\(1e-3\)"),
    Case("TrainState.apply_gradients: a field the state does not declare",
         lambda: field_state().apply_gradients(grads=PARAMS, batch_stats={}),
         TypeError, r"'batch_stats' is not a field of the state",
         r"Declare it in a subclass .*batch_stats: Any"),
    Case("TrainState.apply_gradients: a field of another structure",
         lambda: field_state().apply_gradients(grads=PARAMS, ema={"ema": PARAMS}),
         ValueError, r"apply_gradients\(ema=\.\.\.\): the new value and the state's value "
         r"differ in tree structure", r"give the first value to create"),
    Case("TrainState.apply_gradients: a field of another shape",
         lambda: field_state().apply_gradients(grads=PARAMS, ema=WIDE),
         ValueError, r"differ in shape at \['w'\]: \(3,\) against \(2,\)",
         r"must have its structure and shapes"),
    Case("keep_on_skip: the model's own NNX variables as the old value",
         keep_on_skip_live_nnx_variables, ValueError,
         r"the old value holds the model's own NNX variables",
         r"Take a copy before the step: old = jax\.tree\.map"),
    Case("save_checkpoint: onto an existing checkpoint without force=True",
         save_twice, ValueError, r"step_1 already exists",
         r"Pass force=True to overwrite it: .*replaces it only once complete "
         r"\(an atomic rename\)"),
    Case("restore_checkpoint: no such directory",
         lambda: jaxmp.flax.restore_checkpoint("/nonexistent/step_1", STATE),
         FileNotFoundError, r"there is no checkpoint at /nonexistent/step_1",
         r"Pass the directory given to jaxmp\.flax\.save_checkpoint"),
    Case("restore_checkpoint: the parent folder of the checkpoints",
         restore_saved(lambda path: os.makedirs(os.path.join(path, "step_1")), STATE),
         ValueError, r"is not a checkpoint .*its entries: step_1",
         r"Pass the directory of one checkpoint"),
    Case("restore_checkpoint: a plain orbax checkpoint",
         restore_saved(save_plain_orbax, STATE), ValueError,
         r"is a plain orbax checkpoint .*holds no loss-scale configuration",
         r"Pass check_config=False to restore its arrays"),
    Case("restore_checkpoint: saved for another optimizer",
         restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, STATE),
                       jaxmp.loss_scaling(optax.adam(0.1), jaxmp.DynamicLossScale()).init(PARAMS),
                       check_config=False),
         ValueError, r"only in the target: inner_state/0/count, "
         r"inner_state/0/mu/b", r"Build the target with the model and optimizer that wrote it"),
    Case("restore_checkpoint: saved for other shapes",
         restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, (PARAMS, STATE)),
                       (WIDE, TX.init(WIDE))),
         ValueError, r"0/w: \(2,\) in the checkpoint, \(3,\) in the target",
         r"Build the target with the model configuration that wrote it"),
    Case("restore_checkpoint: a float32 run's checkpoint into a float16 target",
         restore_saved(lambda path: jaxmp.flax.save_checkpoint(path, jaxmp.loss_scaling(
             optax.sgd(0.1), jaxmp.NoOpLossScale()).init(PARAMS)), STATE, check_config=False),
         ValueError, r"holds a NoOpLossScale and the target a DynamicLossScale",
         r"Restore into a target built with the saved configuration"),
]

CASES += FLAX_CASES

# Guard cost: clip_global_norm= and guard= of loss_scaling, multi_steps and
# TrainState.create.
GUARD_COST_CASES = [
    Case("loss_scaling: clip_global_norm of zero",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(),
                                    clip_global_norm=0.0),
         ValueError, r"jaxmp\.loss_scaling: clip_global_norm must be a number > 0, got 0\.0",
         r"Pass the max global norm of the unscaled gradients, e\.g\. 1\.0, or None"),
    Case("loss_scaling: clip_global_norm of inf",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(),
                                    clip_global_norm=float("inf")),
         ValueError, r"clip_global_norm must be finite, got inf",
         r"Pass the max global norm"),
    Case("multi_steps: clip_global_norm as a string",
         lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.DynamicLossScale(), 2,
                                   clip_global_norm="1.0"),
         TypeError, r"jaxmp\.multi_steps: clip_global_norm must be a number, got '1\.0'",
         r"Pass the max global norm"),
    Case("loss_scaling: guard=False with a dynamic scale",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(),
                                    guard=False),
         ValueError, r"jaxmp\.loss_scaling\(guard=False\) needs jaxmp\.NoOpLossScale\(\), "
         r"got DynamicLossScale",
         r"Keep guard=True, or train in bfloat16 with jaxmp\.NoOpLossScale\(\)"),
    Case("TrainState.create: guard as a string",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=lambda p, x: x, params=PARAMS, tx=optax.sgd(0.1),
             policy="mixed_bfloat16", guard="no"),
         TypeError, r"TrainState\.create: guard must be True or False, got 'no'",
         r"guard=False turns the finiteness check off; it needs "
         r"loss_scale=jaxmp\.NoOpLossScale\(\)"),
]
CASES += GUARD_COST_CASES

# Accumulation: multi_steps' use_grad_mean, and the state its update takes.
ACCUMULATION_CASES = [
    Case("multi_steps: use_grad_mean as a string",
         lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 2,
                                   use_grad_mean="yes"),
         TypeError, r"jaxmp\.multi_steps: use_grad_mean must be True or False, got 'yes'",
         r"True passes the mean of the micro-batches' gradients to the "
         r"optimizer, False their sum"),
    Case("multi_steps: update with the state of another optimizer",
         lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 2).update(
             PARAMS, optax.MultiSteps(optax.sgd(0.1), 2).init(PARAMS), PARAMS),
         TypeError, r"The state passed to the update of jaxmp\.multi_steps is a "
         r"MultiStepsState, not the optax\.MultiStepsState holding a "
         r"LossScalingState its init returned",
         r"Pass the state returned by tx\.init\(params\)"),
]

CASES += ACCUMULATION_CASES


# -- Precision fallback ---------------------------------------------------------
# jaxmp.PrecisionFallback, jaxmp.switch_precision, jaxmp.flax.find_overflowing_modules
# and the checkpoints of a run that switched.

LADDER = ("mixed_float16", "float32")


def fallback(ladder=LADDER, **kwargs):
  return lambda: jaxmp.PrecisionFallback(ladder, **kwargs)


def nnx_optimizer():
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(
      model, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()),
      wrt=nnx.Param)


def float16_state():
  model = nn.Dense(2)
  params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
  return jaxmp.flax.TrainState.create(apply_fn=model.apply, params=params,
                                      tx=optax.sgd(0.1), policy="mixed_float16")


def switched_run(path, fallback_to_save=True, target=None):
  """Saves a run that switched to float32 at step 1; returns its controller."""
  controller = jaxmp.PrecisionFallback(LADDER)
  state = controller.switch(target or float16_state(), "float32", reason="a test",
                            step=1)
  jaxmp.flax.save_checkpoint(path, state,
                             fallback=controller if fallback_to_save else None)
  return controller


def restore_switched(target_or_nnx, **given):
  def call():
    kwargs = dict(given)  # each call starts from the case's own arguments
    with tempfile.TemporaryDirectory() as folder:
      path = os.path.join(folder, "ckpt")
      if target_or_nnx == "nnx":
        model, optimizer = nnx_optimizer()
        controller = jaxmp.PrecisionFallback(LADDER)
        controller.switch(optimizer, "float32", reason="a test", step=1, model=model)
        jaxmp.flax.save_checkpoint(path, (model, optimizer), fallback=controller)
        return jaxmp.flax.restore_checkpoint(path, nnx_optimizer()[1], **kwargs)
      switched_run(path, fallback_to_save=kwargs.pop("saved_with_fallback", True))
      return jaxmp.flax.restore_checkpoint(path, float16_state(), **kwargs)

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


def overflow_report(x):
  apply = jaxmp.get_policy("mixed_float16").wrap_apply(Wide().apply)
  return jaxmp.flax.find_overflowing_modules(
      apply, Wide().init(jax.random.key(0), jnp.ones((1, 2))), x)


FALLBACK_CASES = [
    Case("PrecisionFallback: a string for the ladder", fallback("mixed_float16"),
         TypeError, r"ladder must be a sequence of policies.*got 'mixed_float16'",
         r"e\.g\. \('mixed_float16', 'float32'\)"),
    Case("PrecisionFallback: an empty ladder", fallback(()), ValueError,
         r"the ladder is empty", r"Give the policy the run starts in first"),
    Case("PrecisionFallback: one rung and nothing to switch to",
         fallback(("mixed_float16",)), ValueError,
         r"the ladder has one rung \(p=f32,c=f16,o=f32\)",
         r"Add the policy to fall back to.*on_failure='raise'"),
    Case("PrecisionFallback: a rung named twice",
         fallback(("mixed_float16", "p=f32,c=f16,o=f32")), ValueError,
         r"names p=f32,c=f16,o=f32 twice \(rungs 0 and 1\)",
         r"Each rung is a different policy"),
    Case("PrecisionFallback: float16 after float32", fallback(("float32", "mixed_float16")),
         ValueError, r"goes from p=f32,c=f32,o=f32, which needs no loss scaling, back "
         r"to p=f32,c=f16,o=f32", r"put the float16 policies first"),
    Case("PrecisionFallback: a bfloat16 rung on hardware without bfloat16",
         fallback(("mixed_float16", "mixed_bfloat16", "float32")), ValueError,
         r"rung 1 of the ladder \(p=f32,c=bf16,o=f32\) computes in bfloat16, which "
         r"this hardware \(cpu: .*\) does not run natively",
         r"Fall back to 'float32' instead.*jaxmp doctor"),
    Case("PrecisionFallback: an unknown on_failure", fallback(on_failure="crash"),
         ValueError, r"on_failure must be 'switch' .* or 'raise'.*got 'crash'",
         r"fall back to the next policy of the ladder"),
    Case("PrecisionFallback: every=0", fallback(every=0), ValueError,
         r"PrecisionFallback: every must be .*1.*got 0", r"every"),
    Case("PrecisionFallback: a rate above 1", fallback(max_overflow_rate=1.5),
         ValueError, r"max_overflow_rate .*got 1\.5",
         r"Pass None to switch only on overflows at the minimum scale"),
    Case("PrecisionFallback: a platform name for hardware", fallback(hardware="gpu"),
         TypeError, r"hardware must be what jaxmp\.hardware_report\(\) returns.*got 'gpu'",
         r"jaxmp\.hardware_report\(\)"),
    Case("PrecisionFallback.update: an optax state without step",
         lambda: jaxmp.PrecisionFallback(LADDER).update(STATE), TypeError,
         r"pass step= .*with a plain optax state",
         r"a jaxmp\.flax\.TrainState or an nnx\.Optimizer carries its own"),
    Case("PrecisionFallback.load_state_dict: an empty state",
         lambda: jaxmp.PrecisionFallback(LADDER).load_state_dict({}), ValueError,
         r"the state lacks ladder, rung, policy, overflows_at_min_base, events",
         r"Pass the dict that PrecisionFallback\.state_dict\(\) returned"),
    Case("PrecisionFallback.load_state_dict: a rung beyond the ladder",
         lambda: jaxmp.PrecisionFallback(LADDER).load_state_dict(
             {**jaxmp.PrecisionFallback(LADDER).state_dict(), "rung": 5}), ValueError,
         r"rung must be an integer >= 0 and <= 1, got 5",
         r"It indexes the ladder of 2 policies"),
    Case("PrecisionFallback.load_state_dict: events that are not switches",
         lambda: jaxmp.PrecisionFallback(LADDER).load_state_dict(
             {**jaxmp.PrecisionFallback(LADDER).state_dict(), "events": 3}), ValueError,
         r"the event 3 is not a dict with the fields of a PrecisionFallback\.events entry",
         r"Pass the dict that PrecisionFallback\.state_dict\(\) returned"),
    Case("PrecisionFallback.switch: no reason",
         lambda: jaxmp.PrecisionFallback(LADDER).switch(STATE, "float32", reason="",
                                                        step=1),
         TypeError, r"reason must be a non-empty string .*got ''",
         r"it is logged and recorded"),
    Case("switch_precision: a state without loss scaling",
         lambda: jaxmp.switch_precision(optax.adam(0.1).init(PARAMS), "float32"),
         ValueError, r"switch_precision needs a training state built on "
         r"jaxmp\.loss_scaling.*no jaxmp\.loss_scaling state found",
         r"Wrap the optimizer with jaxmp\.loss_scaling"),
    Case("switch_precision: to float16 from a state without a loss scale",
         lambda: jaxmp.switch_precision(
             jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.NoOpLossScale()).init(PARAMS),
             "mixed_float16"),
         ValueError, r"the new policy p=f32,c=f16,o=f32 needs loss scaling, but the "
         r"training state has no loss scale", r"build a new state with "
         r"jaxmp\.DynamicLossScale\(\)"),
    Case("switch_precision: a policy that stores the params in bfloat16",
         lambda: jaxmp.switch_precision(float16_state(), "p=bf16,c=bf16,o=f32"),
         ValueError, r"stores the params in other dtypes .*float32 now, bfloat16",
         r"the policies of a ladder share their param_dtype"),
    Case("switch_precision: (params, opt_state) to a policy that stores bfloat16",
         lambda: jaxmp.switch_precision((PARAMS, STATE), "bf16"),
         ValueError, r"stores the params in other dtypes .*\[0\]\['b'\]: "
         r"float32 now, bfloat16", r"the policies of a ladder share their param_dtype"),
    Case("switch_precision: an nnx.Optimizer without its model",
         lambda: jaxmp.switch_precision(nnx_optimizer()[1], "float32"), TypeError,
         r"an nnx\.Optimizer needs its model.*got model=None",
         r"switch_precision\(optimizer, policy, model=model\)"),
    Case("switch_precision: a model with a plain optax state",
         lambda: jaxmp.switch_precision(STATE, "float32", model=nnx_optimizer()[0]),
         TypeError, r"model= is for an nnx\.Optimizer", r"takes no model"),
    Case("switch_precision: a PathPolicy for an NNX model",
         lambda: jaxmp.switch_precision(
             nnx_optimizer()[1], jaxmp.PathPolicy({"kernel": "float32"}),
             model=nnx_optimizer()[0]),
         TypeError, r"an NNX model takes a jaxmp\.Policy or a "
         r"jaxmp\.flax\.ModulePolicy.*got PathPolicy",
         r"A PathPolicy casts a params tree"),
    Case("find_overflowing_modules: a Linen module instead of its apply",
         lambda: jaxmp.flax.find_overflowing_modules(Wide(), {}, jnp.ones((1, 2))),
         TypeError, r"pass the apply function, not the Linen module",
         r"state\.apply_fn, or policy\.wrap_apply\(model\.apply\)"),
    Case("find_overflowing_modules: neither a function nor an NNX module",
         lambda: jaxmp.flax.find_overflowing_modules("model"), TypeError,
         r"model must be a Linen apply function .*got str", r"or an NNX module"),
    Case("OverflowReport.propose_policy: a forward pass without overflow",
         lambda: overflow_report(jnp.ones((1, 2))).propose_policy("mixed_float16"),
         ValueError, r"every module's outputs are finite in this forward pass",
         r"Fall back to a wider policy"),
    Case("OverflowReport.propose_policy: inputs that are not finite",
         lambda: overflow_report(jnp.full((1, 2), jnp.inf)).propose_policy(
             "mixed_float16"),
         ValueError, r"the model's inputs already hold inf or nan",
         r"jaxmp\.nonfinite_paths\(batch\)"),
    Case("OverflowReport.propose_policy: an overflow that float32 does not fix",
         lambda: jaxmp.flax.find_overflowing_modules(
             jaxmp.get_policy("mixed_float16").wrap_apply(Wide().apply),
             {"params": {"head": {"kernel": jnp.full((2, 2), 3e38),
                                  "bias": jnp.zeros(2)}}},
             jnp.ones((1, 2))).propose_policy("mixed_float16"),
         ValueError, r"which promotes 'head' to float32, the forward pass on the "
         r"report's batch still produces inf or nan in 'head'",
         r"Fall back to a wider policy"),
    Case("OverflowReport.propose_policy: a PathPolicy",
         lambda: overflow_report(jnp.full((1, 2), 1e5)).propose_policy(
             jaxmp.PathPolicy({"head": "float32"}, default="mixed_float16")),
         TypeError, r"module promotion needs a jaxmp\.Policy or a "
         r"jaxmp\.flax\.ModulePolicy", r"A PathPolicy chooses dtypes per parameter"),
    Case("restore_checkpoint: fallback= for a checkpoint saved without one",
         restore_switched("state", saved_with_fallback=False,
                          fallback=jaxmp.PrecisionFallback(LADDER)),
         ValueError, r"the checkpoint was saved without it",
         r"save with jaxmp\.flax\.save_checkpoint\(\.\.\., fallback=fallback\)"),
    Case("restore_checkpoint: a controller with another ladder",
         restore_switched("state", fallback=jaxmp.PrecisionFallback(
             ("mixed_float16", "p=f32,c=f32,o=f16"))),
         ValueError, r"with the ladder \['p=f32,c=f16,o=f32', 'p=f32,c=f32,o=f32'\], "
         r"but the given one has", r"Build the controller with the ladder of the run"),
    Case("restore_checkpoint: a switched run without its controller",
         restore_switched("state"), ValueError,
         r"saved with a jaxmp\.PrecisionFallback, whose run is in the policy "
         r"p=f32,c=f32,o=f32 after 1 switch", r"Pass the run's controller"),
    Case("restore_checkpoint: fallback= of the wrong type",
         restore_switched("state", fallback="float32"), TypeError,
         r"fallback must be the jaxmp\.PrecisionFallback .*got 'float32'",
         r"that watches the run"),
    Case("restore_checkpoint: a switched NNX run into the optimizer alone",
         restore_switched("nnx", fallback=jaxmp.PrecisionFallback(LADDER)),
         ValueError, r"the saved run switched to the policy p=f32,c=f32,o=f32, which "
         r"sets the dtypes of the model's modules",
         r"restore into \(model, optimizer\)"),
    Case("save_checkpoint: a policy naming a class defined in a function",
         restore_saved(save_a_policy_with_a_local_class, STATE), ValueError,
         r"names the module class .*Local, which cannot be imported by its name",
         r"Define the class at the top level of a module"),
]

CASES += FALLBACK_CASES


# -- FP8 training -----------------------------------------------------------------


def fp8_state(meta=None, **kwargs):
  params = {"kernel": jnp.ones((3, 2))}
  return jaxmp.flax.TrainState.create(
      apply_fn=nn.Dense(2).apply, tx=optax.sgd(0.1), policy="mixed_fp8",
      params=params if meta is None else {"params": params, "_overwrite_with_gradient": meta},
      **kwargs)


def fp8_apply(model):
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_fp8")
  return lambda: policy.wrap_apply(model.init)(jax.random.key(0), jnp.ones((1, 3)))


FP8_CASES = [
    Case("policy: a bare float8 compute dtype", lambda: jaxmp.get_policy("c=f8e4m3"),
         ValueError, r"compute_dtype=float8_e4m3fn would cast every activation .* "
         r"with no per-tensor scaling, which cannot train",
         r"use the policy 'mixed_fp8' \(= 'p=f32,c=bf16,o=f32,dot=fp8'\)"),
    Case("Policy: a float8 output dtype",
         lambda: jaxmp.Policy(jnp.float32, jnp.bfloat16, jnp.float8_e5m2), ValueError,
         r"output_dtype=float8_e5m2 would cast the outputs to float8", r"'mixed_fp8'"),
    Case("policy: an unknown matmul format", lambda: jaxmp.get_policy("c=bf16,dot=fp4"),
         ValueError, r"key 'dot': 'fp4' is not a matmul format", r"'dot=fp8'"),
    Case("policy: an amax history out of range (too long to allocate)",
         lambda: jaxmp.get_policy("c=bf16,dot=fp8,amax_history=99999999999"), ValueError,
         r"In policy '.*': Fp8Policy: amax_history_length must be an integer >= 1 and "
         r"<= 65536, got 99999999999", r"amax_history=N in a policy string\), e\.g\. 16"),
    Case("policy: an amax history without FP8 matmuls",
         lambda: jaxmp.get_policy("c=bf16,amax_history=16"), ValueError,
         r"sets amax_history without dot=fp8", r"Add ',dot=fp8'"),
    Case("Fp8Policy: wrap_apply of the bare policy",
         lambda: jaxmp.get_policy("mixed_fp8").wrap_apply(nn.Dense(2).apply), ValueError,
         r"the FP8 matmuls are injected into the Linen Dense .* which a plain policy",
         r"jaxmp\.flax\.ModulePolicy\(\{\}, default=policy\)"),
    Case("ModulePolicy: a Linen nn.Einsum under an FP8 policy",
         fp8_apply(nn.Einsum((3, 2), "bi,io->bo")), ValueError,
         r"Linen nn\.Einsum, which computes with jnp\.einsum and takes no dot_general_cls",
         r"ModulePolicy\(\{Einsum: 'mixed_bfloat16'\}, default='mixed_fp8'\).*nn\.DenseGeneral"),
    Case("TrainState.create: an FP8 policy without FP8 meta", fp8_state, ValueError,
         r"runs FP8 matmuls, whose scales and amax histories must be given",
         r"pass them whole, params=variables"),
    Case("TrainState.create: the FP8 meta next to another collection",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=None, params={"params": PARAMS, "_overwrite_with_gradient": {},
                                    "batch_stats": {}}, tx=optax.sgd(0.1)), ValueError,
         r"Flax's FP8 layout is \{'params': \.\.\., '_overwrite_with_gradient': "
         r"\.\.\.\}, got the keys \['_overwrite_with_gradient', 'batch_stats', 'params'\]",
         r"Keep other collections \(batch_stats\) in fields of their own"),
    Case("TrainState.create: the FP8 meta as fp8_meta= (the old API)",
         lambda: fp8_state(fp8_meta={}), TypeError,
         r"takes the FP8 meta inside params, as Flax's TrainState does",
         r"create\(params=variables\)"),
    Case("loss_scaling: gradients that hold the FP8 meta",
         lambda: TX.update({"params": PARAMS, "_overwrite_with_gradient": {}}, STATE),
         ValueError, r"the gradients hold Flax's FP8 meta collection",
         r"Use jaxmp\.flax\.TrainState.*jaxmp\.keep_on_skip\(opt_state, new_meta, old_meta\)"),
    Case("TrainState.apply_gradients: no new FP8 meta",
         lambda: fp8_state(meta={"x": jnp.ones(1)}).apply_gradients(
             grads={"kernel": jnp.ones((3, 2))}), ValueError,
         r"the state has FP8 meta but the gradients bring no new meta",
         r"state\.value_and_grad\(loss_fn\)\(state\.params"),
]

CASES += FP8_CASES


# -- FP8 training of NNX models ----------------------------------------------------


def fp8_nnx_model(policy="mixed_fp8", **kwargs):
  model = nnx.Linear(2, 2, rngs=nnx.Rngs(0), **kwargs)
  jaxmp.flax.ModulePolicy({}, default=policy).set_nnx_dtypes(model)
  return model


FP8_NNX_CASES = [
    Case("set_nnx_dtypes: an nnx.Linear with its own dot_general under an FP8 policy",
         lambda: fp8_nnx_model(dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k)),
         ValueError, r"the Linear at '\(root\)' has its own dot_general, which the "
         r"FP8 policy would replace", r"Give it its own rule with a policy without dot=fp8"),
    Case("set_nnx_dtypes: another amax history for a model that has FP8 ops",
         lambda: jaxmp.flax.ModulePolicy(
             {}, default="p=f32,c=bf16,o=f32,dot=fp8,amax_history=16").set_nnx_dtypes(
                 fp8_nnx_model()), ValueError,
         r"already has jaxmp's FP8 op from an earlier set_nnx_dtypes, with an amax "
         r"history of 1024", r"Build the model anew and call set_nnx_dtypes once"),
    Case("NNX FP8 op: a layer called with out_sharding",
         lambda: fp8_nnx_model()(jnp.ones((1, 2)), out_sharding=jax.sharding.PartitionSpec()),
         ValueError, r"fp8_scaled_dot_general takes no out_sharding",
         r"Call the layer without it"),
    Case("autocast: a model with FP8 meta",
         lambda: jaxmp.autocast(
             lambda model: jnp.sum(model(jnp.ones((1, 2))).astype(jnp.float32)),
             "mixed_bfloat16")(fp8_nnx_model()), ValueError,
         r"autocast: the model has FP8 meta \(jaxmp\.flax\.Fp8Meta\)",
         r"leave autocast out"),
]

CASES += FP8_NNX_CASES


# -- FP8 models and the fallback helpers (find_overflowing_modules, switch_precision)


def fp8_find_without_meta():
  policy = jaxmp.flax.ModulePolicy({}, default="mixed_fp8")
  x = jnp.ones((1, 3))
  variables = policy.wrap_apply(nn.Dense(2).init)(jax.random.key(0), x)
  jaxmp.flax.find_overflowing_modules(
      policy.wrap_apply(nn.Dense(2).apply), {"params": variables["params"]}, x)


def switch_plain_state_to_fp8():
  state = jaxmp.flax.TrainState.create(
      apply_fn=nn.Dense(2).apply, params={"kernel": jnp.ones((3, 2))},
      tx=optax.sgd(0.1), policy="mixed_float16")
  jaxmp.switch_precision(state, "mixed_fp8")


FP8_FALLBACK_CASES = [
    Case("find_overflowing_modules: an FP8 model's variables without the FP8 meta",
         fp8_find_without_meta, ValueError,
         r"the model runs FP8 matmuls, whose meta \(the '_overwrite_with_gradient' "
         r"collection\) is not in the variables given",
         r"find_overflowing_modules\(state\.apply_fn, state\.params, x\)"),
    Case("switch_precision: a TrainState without FP8 meta to an FP8 policy",
         switch_plain_state_to_fp8, ValueError,
         r"runs FP8 matmuls, but the state has no FP8 meta for them",
         r"build a new state with the FP8 policy"),
]

CASES += FP8_FALLBACK_CASES


def test_the_catalogue_is_large_and_distinct():
  names = [case.name for case in CASES]
  assert len(names) == len(set(names))
  assert len(CASES) >= 30
  expects_bare = [case.name for case in CASES if issubclass(case.error, BARE_ERRORS)]
  assert not expects_bare, f"cases that expect a bare Python error: {expects_bare}"


def _cases():
  """The catalogue as pytest parameters, xfail where a defect is named."""
  params = []
  for case in CASES:
    marks = [pytest.mark.xfail(strict=True, reason=case.defect)] if case.defect else []
    params.append(pytest.param(case, id=case.name, marks=marks))
  return params


@pytest.fixture(autouse=True)
def unfiltered_tracebacks():
  """Keeps JAX's internal frames, so that an error raised there is seen."""
  previous = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "off")
  yield
  jax.config.update("jax_traceback_filtering", previous)


def raised_by_jaxmp(error):
  """Whether the innermost frame of the traceback is in the jaxmp package."""
  frame = traceback.extract_tb(error.__traceback__)[-1]
  return pathlib.Path(frame.filename).resolve().is_relative_to(JAXMP_DIR)


@pytest.mark.parametrize("case", _cases())
def test_bad_input_is_explained(case):
  with pytest.raises(Exception) as info:
    case.call()
  error = info.value
  frame = traceback.extract_tb(error.__traceback__)[-1]
  assert not isinstance(error, BARE_ERRORS), (
      f"a bare {type(error).__name__} escaped from {frame.filename}:{frame.lineno}: {error}")
  assert isinstance(error, case.error), f"{type(error).__name__}: {error}"
  message = str(error)
  assert re.search(case.problem, message, re.DOTALL), message
  assert re.search(case.fix, message, re.DOTALL), message
  assert raised_by_jaxmp(error), f"raised in {frame.filename}:{frame.lineno}"


def test_unknown_cli_subcommand(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["frobnicate"])
  assert info.value.code == 2
  stderr = capsys.readouterr().err
  assert "Traceback" not in stderr
  assert re.search(r"invalid choice: 'frobnicate'", stderr)  # the problem
  assert re.search(r"choose from .*doctor", stderr)  # and the valid ones


# -- Migration: `jaxmp convert` ------------------------------------------------
# The command prints one line, "jaxmp convert: error: ...", exits with 2 and
# prints no code; it reads the config as from_deepspeed_config does (above).


def test_cli_convert_of_a_bad_file(tmp_path, capsys, monkeypatch):
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": true, "loss_scale": -1}}')
  monkeypatch.setattr(sys, "stdin", io.StringIO("[" * 100_000))
  for argv, problem, fix in [
      ([str(path)], r"fp16\.loss_scale must be a number >= 0 .*got -1",
       r"Use 0 \(dynamic loss scaling\) or a positive static scale"),
      ([str(tmp_path / "missing.json")], r"no such file: .*missing\.json", r"pass a dict"),
      (["-"], r"standard input is nested too deeply to parse",
       r"check that this is the right file")]:
    code = cli.main(["convert", *argv])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxmp convert: error: "), captured.err
    assert re.search(problem, lines[0]) and re.search(fix, lines[0]), lines[0]
