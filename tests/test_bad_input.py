"""The bad-input catalogue: invalid inputs across the public API.

Each case asserts the exception type, that the message names the problem
(what was wrong, usually with the offending value) and the fix (what to pass
instead), and that the exception is raised by jaxmp itself, not from deep
inside JAX, optax, orbax or NumPy. A separate test checks that no case lets a
bare ``KeyError``, ``AttributeError``, ``IndexError``, ``OverflowError`` or
``AssertionError`` escape.

A case that fails today names its defect, which marks it ``xfail(strict=True)``:
``defect`` for the explanation test, ``escapes`` for the bare-error test. Delete
the field when the defect is fixed (the strict mark fails the test until then).
"""

import dataclasses
import pathlib
import re
import traceback
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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
  escapes: str = ""  # why a bare Python error still escapes (marks it xfail)


# Built-in errors that say nothing about what the user did wrong.
BARE_ERRORS = (KeyError, AttributeError, IndexError, OverflowError, AssertionError)


def dynamic(*args, **kwargs):
  return lambda: jaxmp.DynamicLossScale(*args, **kwargs)


def deepspeed(config):
  return lambda: jaxmp.from_deepspeed_config(config)


def update_with(grads, state=STATE, tx=TX):
  return lambda: tx.update(grads, state, PARAMS)


def jitted_update_on_unbound_axis():
  tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(), axis_name="batch")
  return jax.jit(tx.update)(PARAMS, tx.init(PARAMS), PARAMS)


VALID_DTYPES = r"Valid dtype names are: bf16, bfloat16, f16, f32"
SCALE_HINT = r"powers of two such as 2\.0\*\*15"
NO_STATE_FIX = r"Wrap the optimizer with jaxmp\.loss_scaling\(optax\.adamw"
SAME_PARAMS = r"Differentiate with respect to the same params you pass to update"

CASES = [
    # -- Policies ------------------------------------------------------------
    Case("policy: empty string", lambda: jaxmp.get_policy(""), ValueError,
         r"Empty policy string", r"Use a preset \(mixed_bfloat16, mixed_float16"),
    Case("policy: missing dtype", lambda: jaxmp.get_policy("p="), ValueError,
         r"Missing dtype after p= in policy 'p='", VALID_DTYPES),
    Case("policy: integer dtype", lambda: jaxmp.get_policy("c=int32"), ValueError,
         r"key 'c': Unknown dtype 'int32'", VALID_DTYPES),
    Case("policy: ';' separator", lambda: jaxmp.get_policy("p=f32;c=bf16"), ValueError,
         r"Unknown dtype 'f32;c=bf16'", r"Separate the parts of a policy with ','"),
    Case("policy: unknown preset", lambda: jaxmp.get_policy("mixed_float8"), ValueError,
         r"Unknown policy 'mixed_float8'", r"Use a preset \(mixed_bfloat16"),
    Case("policy: not a string", lambda: jaxmp.get_policy(16), TypeError,
         r"got 16 of type int", r"a string such as 'mixed_bfloat16'"),
    Case("policy: unknown key", lambda: jaxmp.get_policy("q=f32"), ValueError,
         r"Unknown key 'q'", r"Valid keys are p, params, c, compute, o, output"),
    Case("policy: key given twice", lambda: jaxmp.get_policy("p=f32,params=bf16"),
         ValueError, r"sets param_dtype a second time", r"at most once"),
    Case("policy: part without '='", lambda: jaxmp.get_policy("p=f32,c=bf16,x"),
         ValueError, r"Policy part 'x' .* is not of the form key=dtype",
         r"e\.g\. 'p=f32,c=bf16,o=f32'"),
    Case("Policy: non-floating dtype",
         lambda: jaxmp.Policy(jnp.float32, jnp.int8, jnp.float32), ValueError,
         r"must be floating, got int8", VALID_DTYPES),
    Case("Policy.with_output_dtype: unknown name",
         lambda: jaxmp.get_policy("float32").with_output_dtype("f17"), ValueError,
         r"Unknown dtype 'f17'", VALID_DTYPES),
    Case("auto_policy: a platform name instead of a device",
         lambda: jaxmp.auto_policy("gpu"), TypeError,
         r"expects a JAX device or None, got 'gpu'", r"jax\.devices\(\)\[0\]"),
    # -- Loss scales ----------------------------------------------------------
    Case("DynamicLossScale: zero scale", dynamic(0.0), ValueError,
         r"loss_scale must be positive and finite, got 0\.0", SCALE_HINT),
    Case("DynamicLossScale: negative scale", dynamic(-1.0), ValueError,
         r"loss_scale must be positive and finite, got -1\.0", SCALE_HINT),
    Case("DynamicLossScale: inf scale", dynamic(float("inf")), ValueError,
         r"loss_scale must be positive and finite, got inf", SCALE_HINT),
    Case("DynamicLossScale: nan scale", dynamic(float("nan")), ValueError,
         r"loss_scale must be positive and finite, got nan", SCALE_HINT),
    Case("DynamicLossScale: period 0", dynamic(period=0), ValueError,
         r"period must be an integer between 1 and \d+ .*got 0", r"2000 is the usual choice"),
    Case("DynamicLossScale: non-integer period", dynamic(period=2.5), TypeError,
         r"period .*got 2\.5", r"must be an integer"),
    Case("DynamicLossScale: factor 1", dynamic(factor=1.0), ValueError,
         r"factor must be a finite number > 1 .*got 1\.0",
         r"2\.0 is the usual choice; use StaticLossScale"),
    Case("DynamicLossScale: factor below 1", dynamic(factor=0.5), ValueError,
         r"factor .*got 0\.5", r"2\.0 is the usual choice"),
    Case("DynamicLossScale: backoff above 1", dynamic(backoff_factor=1.5), ValueError,
         r"backoff_factor must lie strictly between 0 and 1, got 1\.5",
         r"0\.5 halves the scale"),
    Case("DynamicLossScale: backoff 0", dynamic(backoff_factor=0.0), ValueError,
         r"backoff_factor .*got 0\.0", r"0\.5 halves the scale"),
    Case("DynamicLossScale: min above the initial scale",
         dynamic(1.0, min_loss_scale=2.0), ValueError,
         r"min_loss_scale \(2\.0\) is above the initial loss_scale \(1\.0\)",
         r"lower min_loss_scale or raise loss_scale"),
    Case("DynamicLossScale: negative min", dynamic(min_loss_scale=-1.0), ValueError,
         r"min_loss_scale .*got -1\.0", r"must be finite and >= 0"),
    Case("DynamicLossScale: max below min",
         dynamic(4.0, min_loss_scale=2.0, max_loss_scale=1.0), ValueError,
         r"max_loss_scale \(1\.0\)", r"must be positive and at least min_loss_scale \(2\.0\)"),
    Case("DynamicLossScale: initial scale above max",
         dynamic(2.0**20, max_loss_scale=2.0**10), ValueError,
         r"initial loss_scale \(1048576\.0\) is above max_loss_scale",
         r"lower loss_scale or raise max_loss_scale"),
    Case("DynamicLossScale: hysteresis 0", dynamic(hysteresis=0), ValueError,
         r"hysteresis must be an integer >= 1, got 0", r"1 backs off on every overflow"),
    Case("DynamicLossScale: consecutive_hysteresis not a bool",
         dynamic(consecutive_hysteresis="yes"), TypeError, r"got 'yes'", r"must be a bool"),
    Case("DynamicLossScale: float16 NumPy scale", dynamic(np.float16(1024)), TypeError,
         r"given as float16, whose range is too small",
         r"Pass a Python float or a float32 value"),
    Case("DynamicLossScale: float16 JAX scale",
         dynamic(jnp.asarray(1024, jnp.float16)), TypeError,
         r"got dtype float16", r"jnp\.asarray\(value, jnp\.float32\)"),
    Case("DynamicLossScale: vector scale", dynamic(np.ones(2)), TypeError,
         r"got shape \(2,\)", r"must be a scalar"),
    Case("DynamicLossScale: bool scale", dynamic(True), TypeError,
         r"got the bool True", r"must be a number"),
    Case("DynamicLossScale: counter beyond period", dynamic(counter=5, period=5),
         ValueError, r"got 5 with period 5", r"counter must lie in \[0, period\)"),
    Case("StaticLossScale: zero scale", lambda: jaxmp.StaticLossScale(0.0), ValueError,
         r"loss_scale must be positive and finite, got 0\.0", SCALE_HINT),
    Case("StaticLossScale: float16 scale",
         lambda: jaxmp.StaticLossScale(jnp.asarray(8, jnp.float16)), TypeError,
         r"got dtype float16", r"Pass a Python number"),
    Case("adjust: a float flag", lambda: jaxmp.DynamicLossScale().adjust(1.0), TypeError,
         r"got shape \(\) and dtype float32", r"e\.g\. jaxmp\.all_finite\(grads\)"),
    Case("adjust: a vector of flags",
         lambda: jaxmp.DynamicLossScale().adjust(jnp.array([True, False])), TypeError,
         r"got shape \(2,\) and dtype bool", r"e\.g\. jaxmp\.all_finite\(grads\)"),
    # -- Pytree helpers -------------------------------------------------------
    Case("select_tree: non-scalar predicate",
         lambda: jaxmp.select_tree(jnp.array([True, False]), {"a": jnp.ones(2)},
                                   {"a": jnp.zeros(2)}),
         TypeError, r"predicate, got an array of shape \(2,\)",
         r"Reduce it first, e\.g\. with jaxmp\.all_finite"),
    Case("select_tree: different structures",
         lambda: jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"b": jnp.ones(2)}),
         ValueError, r"got PyTreeDef\(\{'a': \*\}\) and PyTreeDef\(\{'b': \*\}\)",
         r"two pytrees of the same structure"),
    Case("select_tree: different shapes",
         lambda: jaxmp.select_tree(jnp.array(True), {"a": jnp.ones(2)}, {"a": jnp.ones(3)}),
         ValueError, r"leaves at \['a'\] have shapes \(2,\) and \(3,\)",
         r"Pass two pytrees of the same shapes"),
    # -- The optax wrapper ------------------------------------------------------
    Case("loss_scaling: a number as the loss scale",
         lambda: jaxmp.loss_scaling(optax.sgd(0.1), 2.0**15), TypeError,
         r"got 32768\.0", r"such as jaxmp\.DynamicLossScale\(\)"),
    Case("loss_scaling: a name as the optimizer",
         lambda: jaxmp.loss_scaling("adam", jaxmp.DynamicLossScale()), TypeError,
         r"got 'adam'", r"e\.g\. optax\.adamw\(1e-3\)"),
    Case("update: gradients of another tree structure", update_with({"w": jnp.ones(2)}),
         ValueError, r"do not have the tree structure of the params", SAME_PARAMS),
    Case("update: gradients of other shapes",
         update_with({"w": jnp.ones(3), "b": jnp.ones(1)}), ValueError,
         r"at \['w'\] the gradient has shape \(3,\) and the param \(2,\)", SAME_PARAMS),
    Case("update: the bare optimizer's state",
         update_with(PARAMS, state=optax.sgd(0.1).init(PARAMS)), TypeError,
         r"is a tuple, not the LossScalingState", r"Pass the state returned by tx\.init"),
    Case("update: an axis name outside pmap/shard_map", jitted_update_on_unbound_axis,
         ValueError, r"axis_name='batch'\): that axis name is not bound",
         r"inside jax\.shard_map or jax\.pmap .* or drop axis_name"),
    Case("get_loss_scale: a state without one",
         lambda: jaxmp.get_loss_scale(optax.adam(1e-3).init(PARAMS)), ValueError,
         r"get_loss_scale: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("get_loss_scale: two loss-scaling states",
         lambda: jaxmp.get_loss_scale((STATE, STATE)), ValueError,
         r"holds 2 jaxmp\.loss_scaling states, so the loss scale is ambiguous",
         r"Wrap the whole optimizer once"),
    Case("loss_scaling_metrics: a state without a loss scale",
         lambda: jaxmp.loss_scaling_metrics(optax.adam(1e-3).init(PARAMS)), ValueError,
         r"loss_scaling_metrics: no jaxmp\.loss_scaling state found", NO_STATE_FIX),
    Case("check_loss_scale: an incomplete metrics dict",
         lambda: jaxmp.check_loss_scale({"loss_scale": jnp.float32(1)}), ValueError,
         r"has no 'overflows_at_min' key",
         r"Pass the dict returned by jaxmp\.loss_scaling_metrics"),
    Case("check_loss_scale: negative tolerance",
         lambda: jaxmp.check_loss_scale(STATE, max_overflows_at_min=-1), ValueError,
         r"got -1", r"must be an integer >= 0"),
    Case("scaled_value_and_grad: an optimizer state as the loss scale",
         lambda: jaxmp.scaled_value_and_grad(jnp.sum, STATE), TypeError,
         r"got a LossScalingState", r"pass jaxmp\.get_loss_scale\(opt_state\)"),
    Case("scaled_value_and_grad: has_aux without a pair",
         lambda: jaxmp.scaled_value_and_grad(
             jnp.sum, jaxmp.NoOpLossScale(), has_aux=True)(jnp.ones(2)),
         TypeError, r"has_aux=True\) expects fun", r"to return a pair \(loss, aux\)"),
    Case("scaled_value_and_grad: a non-scalar loss",
         lambda: jaxmp.scaled_value_and_grad(
             lambda w: 2 * w, jaxmp.StaticLossScale(2.0))(jnp.ones(2)),
         TypeError, r"scalar loss, got shape \(2,\)", r"Reduce it first, e\.g\. with jnp\.mean"),
    Case("multi_steps: zero micro-batches",
         lambda: jaxmp.multi_steps(optax.sgd(0.1), jaxmp.NoOpLossScale(), 0), ValueError,
         r"every_k_schedule .*got 0", r"must be an integer >= 1 .* or a function"),
    # -- Migration ---------------------------------------------------------------
    Case("DeepSpeed: unparsable JSON", deepspeed('{"fp16": {"enabled": true,,}}'),
         ValueError, r"is not valid JSON", r"at line 1, column 27"),
    Case("DeepSpeed: fp16 and bf16 both enabled",
         deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}), ValueError,
         r"fp16 and bf16 are both enabled", r"keep one"),
    Case("DeepSpeed: negative loss scale",
         deepspeed({"fp16": {"enabled": True, "loss_scale": -1}}), ValueError,
         r"fp16\.loss_scale .*got -1", r"must be 0 \(dynamic loss scaling\) or a positive"),
    Case("DeepSpeed: non-numeric power",
         deepspeed({"fp16": {"enabled": True, "initial_scale_power": "sixteen"}}),
         ValueError, r"initial_scale_power .*got 'sixteen'", r"must be an integer"),
    Case("DeepSpeed: missing file", deepspeed("/nonexistent/ds_config.json"), ValueError,
         r"no such file: '/nonexistent/ds_config\.json'",
         r"pass a dict, a JSON string or the path"),
    Case("DeepSpeed: hysteresis 0",
         deepspeed({"fp16": {"enabled": True, "hysteresis": 0}}), ValueError,
         r"hysteresis must be >= 1, got 0", r"DeepSpeed's default is 2"),
    Case("DeepSpeed: min_loss_scale above the initial scale",
         deepspeed({"fp16": {"enabled": True, "initial_scale_power": 4,
                             "min_loss_scale": 32}}), ValueError,
         r"min_loss_scale \(32\) is above the initial scale 2\*\*4",
         r"lower min_loss_scale or raise initial_scale_power"),
    Case("DeepSpeed: not a config at all", deepspeed(3), TypeError,
         r"got a int", r"expects a dict, a JSON string or a path"),
    Case("from_torch_grad_scaler: a device name",
         lambda: jaxmp.from_torch_grad_scaler("cuda"), TypeError,
         r"init_scale must be a number, got 'cuda'", r"takes no device argument, drop it"),
    Case("from_torch_grad_scaler: growth factor 1",
         lambda: jaxmp.from_torch_grad_scaler(growth_factor=1.0), ValueError,
         r"growth_factor must be a finite number > 1, got 1\.0", r"default is 2\.0"),
    # -- Flax, diagnostics, distributed --------------------------------------------
    Case("TrainState.create: an optimizer already wrapped",
         lambda: jaxmp.flax.TrainState.create(apply_fn=None, params=PARAMS, tx=TX),
         ValueError, r"tx is already wrapped with jaxmp\.loss_scaling",
         r"Pass the bare optimizer"),
    Case("TrainState.create: a number as the loss scale",
         lambda: jaxmp.flax.TrainState.create(
             apply_fn=None, params=PARAMS, tx=optax.sgd(0.1), loss_scale=1024.0),
         TypeError, r"got 1024\.0", r"such as jaxmp\.DynamicLossScale\(\)"),
    Case("ModulePolicy: a bad policy for a module",
         lambda: jaxmp.flax.ModulePolicy({nn.LayerNorm: "c=int8"}), ValueError,
         r"LayerNorm: .*Unknown dtype 'int8'", VALID_DTYPES),
    Case("dtype_headroom: an integer dtype",
         lambda: jaxmp.dtype_headroom(jnp.ones(2), jnp.int8), TypeError,
         r"got <class 'jax\.numpy\.int8'>", r"such as jnp\.float16 or jnp\.bfloat16"),
    Case("suggest_loss_scale: an integer dtype",
         lambda: jaxmp.suggest_loss_scale({"w": jnp.ones(2)}, jnp.int8), TypeError,
         r"suggest_loss_scale: .*got <class 'jax\.numpy\.int8'>",
         r"such as jnp\.float16 or jnp\.bfloat16"),
    Case("LossScaleMonitor: every 0", lambda: jaxmp.LossScaleMonitor(every=0), ValueError,
         r"got 0", r"every must be an integer >= 1"),
    Case("opt_state_shardings: shardings of another structure",
         lambda: jaxmp.opt_state_shardings(TX, PARAMS, {"w": None}), ValueError,
         r"param_shardings must have the structure of params",
         r"one sharding or PartitionSpec per leaf"),
]


def test_the_catalogue_is_large_and_distinct():
  names = [case.name for case in CASES]
  assert len(names) == len(set(names))
  assert len(CASES) >= 30
  expects_bare = [case.name for case in CASES if issubclass(case.error, BARE_ERRORS)]
  assert not expects_bare, f"cases that expect a bare Python error: {expects_bare}"


def _cases(reason_field):
  """The catalogue as pytest parameters, xfail where ``reason_field`` is set."""
  params = []
  for case in CASES:
    reason = getattr(case, reason_field)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
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


@pytest.mark.parametrize("case", _cases("escapes"))
def test_no_bare_python_error_escapes(case):
  try:
    case.call()
  except BARE_ERRORS as error:
    frame = traceback.extract_tb(error.__traceback__)[-1]
    pytest.fail(f"a bare {type(error).__name__} escaped from {frame.filename}:"
                f"{frame.lineno}: {error}", pytrace=False)
  except Exception:  # pylint: disable=broad-except
    pass  # what it should be is test_bad_input_is_explained's concern


@pytest.mark.parametrize("case", _cases("defect"))
def test_bad_input_is_explained(case):
  with pytest.raises(Exception) as info:
    case.call()
  error = info.value
  assert isinstance(error, case.error), f"{type(error).__name__}: {error}"
  message = str(error)
  assert re.search(case.problem, message, re.DOTALL), message
  assert re.search(case.fix, message, re.DOTALL), message
  frame = traceback.extract_tb(error.__traceback__)[-1]
  assert raised_by_jaxmp(error), f"raised in {frame.filename}:{frame.lineno}"


def test_unknown_cli_subcommand(capsys):
  with pytest.raises(SystemExit) as info:
    cli.main(["frobnicate"])
  assert info.value.code == 2
  stderr = capsys.readouterr().err
  assert "Traceback" not in stderr
  assert re.search(r"invalid choice: 'frobnicate'", stderr)  # the problem
  assert re.search(r"choose from .*doctor", stderr)  # and the valid ones


def test_cli_convert_of_a_bad_file(tmp_path, capsys):
  path = tmp_path / "ds_config.json"
  path.write_text('{"fp16": {"enabled": true, "loss_scale": -1}}')
  assert cli.main(["convert", str(path)]) == 2
  captured = capsys.readouterr()
  assert captured.out == "" and "Traceback" not in captured.err
  assert captured.err.startswith("jaxmp convert: error: ")
  assert "fp16.loss_scale must be 0 (dynamic loss scaling) or a positive" in captured.err
  assert cli.main(["convert", str(tmp_path / "missing.json")]) == 2
  assert "no such file" in capsys.readouterr().err


def test_a_changed_loss_scale_kind_in_a_checkpoint(tmp_path):
  """Restoring a float32 run into a float16 one: jaxmp explains, not orbax."""
  float32 = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.NoOpLossScale()).init(PARAMS)
  jaxmp.flax.save_checkpoint(tmp_path / "ckpt", float32)
  with pytest.raises(ValueError) as info:
    jaxmp.flax.restore_checkpoint(tmp_path / "ckpt", STATE, check_config=False)
  message = str(info.value)
  assert "holds a NoOpLossScale and the target a DynamicLossScale" in message
  assert "Restore into a target built with the saved configuration" in message
  assert raised_by_jaxmp(info.value)
