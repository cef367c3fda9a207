"""The guarantees page names tests that exist, for every promise it makes."""

import ast
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guarantees.md"
NODE_ID = re.compile(r"`(tests/[\w/]+\.py)((?:::\w+)+)`")


@functools.cache  # a file named several times is parsed once
def defined_tests(path):
  """Node-ID suffixes (``::name`` or ``::Class::name``) defined in a test file."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  names = set()
  for node in tree.body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      names.add(f"::{node.name}")
    elif isinstance(node, ast.ClassDef):
      for item in node.body:
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
          names.add(f"::{node.name}::{item.name}")
  return names


def sections():
  """The promise sections of the page: (title, text)."""
  parts = re.split(r"^## ", PAGE.read_text(encoding="utf-8"), flags=re.MULTILINE)
  return [(part.splitlines()[0], part) for part in parts[1:]]


def test_every_named_test_exists():
  text = PAGE.read_text(encoding="utf-8")
  references = NODE_ID.findall(text)
  assert references
  missing = []
  for file, suffix in references:
    path = ROOT / file
    if not path.exists() or suffix not in defined_tests(path):
      missing.append(file + suffix)
  assert not missing, missing


def test_every_promise_is_proved_by_tests():
  promises = [(title, text) for title, text in sections()
              if not title.startswith("What is left to the user")]
  assert promises
  for title, text in promises:
    assert "Proved by:" in text and NODE_ID.search(text), title

