"""Every public name has a runnable example, and the examples are run.

pytest runs the examples of every module of jaxmp as doctests
(``--doctest-modules`` over ``jaxmp/``, see pyproject.toml), with the set-up of
the tests (conftest.py: eight CPU devices, strict dtype promotion).
"""

import inspect
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import api_coverage  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

# Public names that need no example of their own: states and reports that
# jaxmp returns rather than the user builds, a base class and an exception.
NO_EXAMPLE_NEEDED = {
    "jaxmp.LossScale",
    "jaxmp.LossScaleAtMinimumError",
}


def test_every_public_name_has_an_example():
  missing = []
  for name in api_coverage.public_names():
    if name in NO_EXAMPLE_NEEDED:
      continue
    doc = inspect.getdoc(api_coverage.resolve(name)) or ""
    if ">>>" not in doc:
      missing.append(name)
  assert not missing, (
      "These public names have no runnable example (a '>>>' line) in their "
      f"docstring: {', '.join(missing)}")


def test_the_examples_are_collected_as_doctests():
  """`make test` and `make test-fast` run the doctests of jaxmp/."""
  config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
  options = config["tool"]["pytest"]["ini_options"]
  assert "jaxmp" in options["testpaths"]
  assert "--doctest-modules" in options["addopts"].split()
  assert "ELLIPSIS" in options["doctest_optionflags"]
