"""mkdocs hook: every public name of jaxmp is in the API reference.

The reference is one Markdown page per topic under ``docs/api/``, each listing
names with mkdocstrings' ``::: jaxmp.name`` syntax. This hook

* warns (so ``mkdocs build --strict`` fails) for every name of
  ``jaxmp.__all__`` or ``jaxmp.flax.__all__`` that no page lists, and for
  every listed name that is not public;
* fills the marker ``<!-- api-summary -->`` of ``api/index.md`` with a table
  of all documented names, their page and the first line of their docstring.

To document a new public name, add ``::: jaxmp.new_name`` to the page of its
topic. ``tests/test_docs.py`` imports this module to check the built HTML.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pathlib
import re

log = logging.getLogger("mkdocs.hooks.api_coverage")

PUBLIC_MODULES = ("jaxmp", "jaxmp.flax")
API_DIR = "api"
SUMMARY_MARKER = "<!-- api-summary -->"
_DIRECTIVE = re.compile(r"^:::\s+(\S+)\s*$", re.MULTILINE)


def public_names() -> list[str]:
  """The dotted names of every public object: ``jaxmp.X`` and ``jaxmp.flax.Y``."""
  names = []
  for module_name in PUBLIC_MODULES:
    try:
      module = importlib.import_module(module_name)
    except ImportError:
      if module_name == "jaxmp":
        raise
      continue
    names += [f"{module_name}.{name}" for name in module.__all__]
  return names


def documented_names(docs_dir: str | pathlib.Path) -> dict[str, str]:
  """Maps each ``::: name`` of the API pages to its page (relative to docs)."""
  docs_dir = pathlib.Path(docs_dir)
  found = {}
  for page in sorted((docs_dir / API_DIR).glob("*.md")):
    for name in _DIRECTIVE.findall(page.read_text(encoding="utf-8")):
      found[name] = page.relative_to(docs_dir).as_posix()
  return found


def resolve(name: str):
  """The object a dotted public name refers to."""
  module_name, _, attr = name.rpartition(".")
  return getattr(importlib.import_module(module_name), attr)


def documented_as(name: str, documented: dict[str, str]) -> str | None:
  """The identifier under which ``name`` is documented, or None.

  A name of ``jaxmp.flax`` that is the very object of a ``jaxmp`` name (a
  re-export) counts as documented when that ``jaxmp`` name is.
  """
  if name in documented:
    return name
  obj = resolve(name)
  for other in documented:
    if other.startswith("jaxmp.") and other.count(".") <= 2:
      try:
        if resolve(other) is obj:
          return other
      except (AttributeError, ImportError):
        continue
  return None


def missing_names(docs_dir: str | pathlib.Path) -> list[str]:
  """The public names that no API page lists."""
  documented = documented_names(docs_dir)
  return [n for n in public_names() if documented_as(n, documented) is None]


def on_pre_build(config, **kwargs):
  del kwargs
  docs_dir = config["docs_dir"]
  documented = documented_names(docs_dir)
  public = set(public_names())
  for name in public_names():
    if documented_as(name, documented) is None:
      log.warning(
          "API reference: the public name %s is not documented. Add "
          "'::: %s' to the page of its topic in docs/%s/.", name, name, API_DIR
      )
  for name, page in documented.items():
    if name not in public:
      log.warning(
          "API reference: docs/%s lists %s, which is not in the __all__ of "
          "%s. Document public names only.", page, name, ", ".join(PUBLIC_MODULES)
      )


def _title(page: pathlib.Path) -> str:
  """The first level-one heading of a Markdown page, else its file name."""
  match = re.search(r"^# (.+)$", page.read_text(encoding="utf-8"), re.MULTILINE)
  return match.group(1).strip() if match else page.stem.replace("-", " ")


def _summary(name: str) -> str:
  doc = inspect.getdoc(resolve(name)) or ""
  line = doc.strip().splitlines()[0] if doc.strip() else ""
  line = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", line).replace("``", "`")
  return line.replace("|", "\\|")


def on_page_markdown(markdown, page, config, files, **kwargs):
  del files, kwargs
  if page.file.src_uri != f"{API_DIR}/index.md" or SUMMARY_MARKER not in markdown:
    return markdown
  documented = documented_names(config["docs_dir"])
  rows = ["| Name | Topic | Summary |", "| --- | --- | --- |"]
  for name in public_names():
    target = documented_as(name, documented)
    if target is None:
      continue
    page_uri = documented[target]
    topic = _title(pathlib.Path(config["docs_dir"]) / page_uri)
    link = pathlib.PurePosixPath(page_uri).name
    rows.append(
        f"| [`{name}`][{target}] | [{topic}]({link}) | {_summary(name)} |"
    )
  return markdown.replace(SUMMARY_MARKER, "\n".join(rows))
