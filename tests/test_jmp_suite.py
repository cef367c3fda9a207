"""jmp's own test suite, run against jaxmp: the drop-in promise, tested.

The jmp wheel ships its tests (``jmp/_src/policy_test.py``, ``loss_scale_test.py``).
This module reads them from the installed jmp, changes only their import line
(``import jaxmp as jmp``) and exposes their ``TestCase`` classes to pytest; nothing
of jmp's code is copied here. Tests that read a name jmp does not export are
skipped (``PRIVATE``); tests that fail on purpose are ``xfail(strict=True)``
(``KNOWN_FAILURES``: a fixed one fails, and leaves the table). They run under
standard promotion, as jmp's users do (jmp's ``test_cast_to_half`` compares a
float16 array with a float32 one). Without jmp (the test extra installs it) the
module is skipped.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import types
import unittest

import pytest

pytest.importorskip("absl.testing.parameterized", reason="jmp's tests need absl-py")
_SPEC = importlib.util.find_spec("jmp")
if _SPEC is None or _SPEC.origin is None:
  pytest.skip("jmp is not installed: pip install -e '.[test]' (make test does)",
              allow_module_level=True)

pytestmark = [
    pytest.mark.standard_promotion(
        reason="jmp's tests compare float16 with float32 arrays"),
    # jmp's own arithmetic in its test (init / factor**100 in float32).
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
]

JMP_DIR = pathlib.Path(_SPEC.origin).parent
# Each test file of jmp, with the one line that imports what it tests.
SUITES = {
    "policy_test.py": "from jmp._src import policy as jmp",
    "loss_scale_test.py": "from jmp._src import loss_scale as jmp",
}
REPLACEMENT = "import jaxmp as jmp"

# Tests that reach past jmp's public names: "Class.method" -> reason.
PRIVATE = dict.fromkeys([f"PolicyTest.test_str{i}" for i in range(5)],
                        "reads jmp._src.policy.dtype_to_names, which jmp does not export")

# The tests that fail on purpose (documented in docs/migration-jmp.md):
# "Class.method" -> the difference (one line).
KNOWN_FAILURES = {
    "LossScaleTest.test_dynamic_loss_scale_tree":
        "DynamicLossScale has 4 leaves (jmp: scale, counter) and compares by identity",
    "LossScaleTest.test_select_tree_rejects_non_scalar":
        "a non-scalar predicate raises TypeError where jmp raises AssertionError",
    "LossScaleTest.test_static_empty_trees_StaticLossScale":
        "StaticLossScale(0) is refused (ValueError), on purpose",
}


def _load(filename: str, import_line: str) -> types.ModuleType:
  """jmp's test file ``filename``, executed with jaxmp in place of jmp."""
  path = JMP_DIR / "_src" / filename
  lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
  found = [i for i, line in enumerate(lines) if line.strip() == import_line]
  if len(found) != 1:
    raise RuntimeError(
        f"{path} no longer has exactly one line {import_line!r} (found "
        f"{len(found)}): this jmp version's tests import differently; update "
        "SUITES in tests/test_jmp_suite.py")
  indent = lines[found[0]][: len(lines[found[0]]) - len(lines[found[0]].lstrip())]
  lines[found[0]] = f"{indent}{REPLACEMENT}\n"  # the line count stays the same
  module = sys.modules[f"jmp_suite_{path.stem}"] = types.ModuleType(f"jmp_suite_{path.stem}")
  module.__file__ = str(path)
  # Compiled with jmp's path, so that tracebacks point into jmp's file.
  exec(compile("".join(lines), str(path), "exec"), module.__dict__)  # pylint: disable=exec-used
  return module


def _test_cases(module: types.ModuleType) -> list[type[unittest.TestCase]]:
  return [value for value in vars(module).values()
          if isinstance(value, type) and issubclass(value, unittest.TestCase)
          and value.__module__ == module.__name__]


def _mark(cls: type[unittest.TestCase], seen: set[str]) -> None:
  """Applies the PRIVATE skips and the KNOWN_FAILURES xfails to ``cls``."""
  for attribute in dir(cls):
    key = f"{cls.__name__}.{attribute}"
    if key in PRIVATE or key in KNOWN_FAILURES:
      mark = (pytest.mark.skip(reason=PRIVATE[key]) if key in PRIVATE
              else pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[key]))
      setattr(cls, attribute, mark(getattr(cls, attribute)))
      seen.add(key)


_MARKED: set[str] = set()
_CLASSES: list[type[unittest.TestCase]] = []
for _filename, _import_line in SUITES.items():
  for _cls in _test_cases(_load(_filename, _import_line)):
    _mark(_cls, _MARKED)
    _CLASSES.append(_cls)
    # pytest collects the unittest.TestCase classes of this module's globals.
    globals()[_cls.__name__] = _cls
del _filename, _import_line, _cls  # else pytest collects the last class twice


def test_the_tables_name_only_tests_of_the_suite():
  """A renamed or removed jmp test must not leave a stale entry behind."""
  stale = (set(PRIVATE) | set(KNOWN_FAILURES)) - _MARKED
  assert not stale, f"not tests of jmp's suite: {sorted(stale)}"
  assert not set(PRIVATE) & set(KNOWN_FAILURES)


def test_the_whole_suite_is_collected():
  names = {cls.__name__ for cls in _CLASSES}
  assert names == {"PolicyTest", "LossScaleTest"}
  count = sum(len(unittest.defaultTestLoader.getTestCaseNames(cls)) for cls in _CLASSES)
  assert count == 97  # jmp 0.0.4's suite; update when jmp's suite changes
