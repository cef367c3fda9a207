"""Griffe extension: renders jaxmp's docstrings well on the API pages.

The docstrings follow the house style (Google sections, Sphinx roles such as
``:func:`jaxmp.loss_scaling```, doctest examples). Before griffe parses them,
this extension

* turns each run of doctest lines (``>>>`` with its ``...`` continuations and
  its expected output) into a fenced ``pycon`` code block;
* turns a role whose target is a documented public name into a link to it
  (``[`jaxmp.loss_scaling`][jaxmp.loss_scaling]``) and any other role into
  inline code, so that no role reaches the page as raw text.
"""

from __future__ import annotations

import pathlib
import re
import sys

import griffe

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import api_coverage  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

_ROLE = re.compile(r":(?:py:)?\w+:`~?([^`]+)`")
_DOCS_DIR = pathlib.Path(__file__).parent.parent


def _link_roles(text: str, documented: set[str]) -> str:
  def replace(match):
    target = match.group(1).strip()
    if target.endswith("()"):
      target = target[:-2]
    for candidate in (target, f"jaxmp.{target}"):
      if candidate in documented:
        return f"[`{target}`][{candidate}]"
    return f"`{target}`"

  return _ROLE.sub(replace, text)


def _fence_doctests(text: str) -> str:
  out: list[str] = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    line = lines[i]
    stripped = line.lstrip()
    if not stripped.startswith(">>>"):
      out.append(line)
      i += 1
      continue
    indent = line[: len(line) - len(stripped)]
    out.append(f"{indent}```pycon")
    while i < len(lines) and lines[i].strip():
      out.append(lines[i])
      i += 1
    out.append(f"{indent}```")
  return "\n".join(out)


class JaxmpDocstrings(griffe.Extension):
  """Rewrites doctests and Sphinx roles before the docstrings are parsed."""

  def __init__(self) -> None:
    super().__init__()
    self._documented = set(api_coverage.documented_names(_DOCS_DIR))

  def on_object(self, *, obj, **kwargs) -> None:
    del kwargs
    docstring = obj.docstring
    if docstring is None or docstring.value is None:
      return
    text = _fence_doctests(docstring.value)
    docstring.value = _link_roles(text, self._documented)
