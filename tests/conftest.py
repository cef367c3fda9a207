"""Test set-up: eight simulated CPU devices, set before JAX starts.

Single-device tests run on the first device; the distributed tests use all.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def pytest_addoption(parser):
  parser.addoption(
      "--run-slow", action="store_true", default=False,
      help="run the tests marked slow",
  )


def pytest_collection_modifyitems(config, items):
  if config.getoption("--run-slow"):
    return
  skip = pytest.mark.skip(reason="slow: run with `make test-slow`")
  for item in items:
    if "slow" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def strict_promotion():
  """Runs a test with strict dtype promotion, to catch silent upcasts."""
  with jax.numpy_dtype_promotion("strict"):
    yield
