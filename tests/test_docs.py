"""Tests of the documentation (integration tier): the built site and the guides' code.

* The site builds with ``mkdocs build --strict`` (once per session, shared by the
  xdist workers); every guide page is built and in the navigation; the API pages
  hold every public name with its signature (docstring examples run as doctests).
* Every fenced ``python`` block of every page in ``docs/`` (and the README) runs:
  each page's blocks in order, in one fresh namespace, under strict promotion
  except ``STANDARD_PROMOTION_PAGES``. Other fences (``text``, ``bash``, ``py``
  ...) are shown but not run: fence code that cannot run here with ``py``.
"""

from __future__ import annotations

import fcntl
import html.parser
import importlib.util
import inspect
import os
import pathlib
import posixpath
import re
import subprocess
import sys
import types

import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS / "hooks"))
import api_coverage  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

# The pages the site must build and list in its navigation: the guide pages a
# newcomer follows in order, the guarantees, and the contributors' architecture page.
GUIDE_PAGES = ("index.md", "optax.md", "linen.md", "nnx.md", "loss-scaling.md", "autocast.md",
               "diagnostics.md", "migration.md", "faq.md", "benchmarks.md", "guarantees.md",
               "architecture.md")
# Pages whose code is user code that relies on standard dtype promotion.
STANDARD_PROMOTION_PAGES = {"migration.md": "jmp's README loop, unchanged, subtracts a "
                                            "float32 target from a float16 prediction"}
NOT_SOURCE = ("hooks", "scripts")  # folders of docs/ that hold no pages


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
  """The site built strictly into a temporary folder, once per session."""
  for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
    if importlib.util.find_spec(module.split(".")[0]) is None or (
        "." in module and importlib.util.find_spec(module) is None):
      pytest.skip(f"{module} is not installed: pip install -e '.[docs]' (make test does)")
  # Under xdist the workers share the parent of their temporary folders.
  root = tmp_path_factory.getbasetemp()
  root = root if os.environ.get("PYTEST_XDIST_WORKER") is None else root.parent
  log = root / "docs-site.log"
  with open(root / "docs-site.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not log.exists():  # (not --quiet: it hides the warnings of --strict, which then passes)
      result = subprocess.run(
          [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
           str(ROOT / "mkdocs.yml"), "--site-dir", str(root / "docs-site")],
          cwd=ROOT, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), capture_output=True,
          text=True, timeout=300)
      log.write_text(f"{result.returncode}\n{result.stdout}\n{result.stderr}")
    returncode, _, output = log.read_text().partition("\n")
  if returncode != "0":
    pytest.fail("mkdocs build --strict failed:\n" + output, pytrace=False)
  return root / "docs-site"


class _Page(html.parser.HTMLParser):
  """What the tests read from a built page: ``nav_links``, the hrefs of the primary navigation;
  ``h1``, the text of the first heading; ``objects``, for each mkdocstrings object (a ``div.doc-
  object``) by the id of its heading, its whole text and the text of its signature block."""

  def __init__(self, path: pathlib.Path):
    super().__init__(convert_charrefs=True)
    self.nav_links, self.h1, self.objects, self._in_h1 = [], "", {}, False
    self._divs: list[dict | None] = []  # one entry per open <div>
    self._navs: list[bool] = []  # per open <nav>: whether it is the primary one
    self.feed(path.read_text(encoding="utf-8"))

  def _object(self):
    return next((e for e in reversed(self._divs) if e is not None and "id" in e), None)

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    classes = (attrs.get("class") or "").split()
    if tag == "nav":
      self._navs.append("md-nav--primary" in classes)
    elif tag == "a" and any(self._navs) and "md-nav__link" in classes:
      self.nav_links.append(attrs.get("href", ""))
    elif tag == "h1" and not self.h1:
      self._in_h1 = True
    elif tag == "div":
      self._divs.append({"id": None, "text": [], "signature": None} if "doc-object" in classes
                        else {"signature_of": self._object(), "text": []}
                        if "doc-signature" in classes else None)
    if tag.startswith("h") and attrs.get("id") and "doc-heading" in classes:
      obj = self._object()
      if obj is not None and obj["id"] is None:
        obj["id"] = attrs["id"]

  def handle_endtag(self, tag):
    if tag == "nav" and self._navs:
      self._navs.pop()
    elif tag == "h1":
      self._in_h1 = False
    elif tag == "div" and self._divs:
      entry = self._divs.pop() or {"id": None}
      owner = entry.get("signature_of")
      if owner is not None and owner["signature"] is None:
        owner["signature"] = "".join(entry["text"])
      elif entry.get("id"):
        self.objects[entry["id"]] = {"text": "".join(entry["text"]),
                                     "signature": entry["signature"] or ""}

  def handle_data(self, data):
    if self._in_h1:
      self.h1 += data
    for entry in self._divs:
      if entry is not None:
        entry["text"].append(data)


def _built_path(site: pathlib.Path, source: str) -> pathlib.Path:
  """Where mkdocs writes the page built from ``docs/<source>``."""
  stem = source[: -len(".md")]
  if stem == "index" or stem.endswith("/index"):
    return site / stem.rpartition("index")[0] / "index.html"
  return site / stem / "index.html"


def _resolve(href: str, page_url: str) -> str:
  """The site path of a link found on the page at ``page_url``."""
  path = posixpath.normpath(posixpath.join(posixpath.dirname(page_url), href.split("#")[0]))
  if path in ("", "."):
    return "index.html"
  return path if path.endswith(".html") else path + "/index.html"


def test_every_guide_page_is_built_and_in_the_navigation(site):
  in_nav = {_resolve(href, "index.html") for href in _Page(site / "index.html").nav_links}
  api_pages = [p.relative_to(DOCS).as_posix() for p in (DOCS / api_coverage.API_DIR).glob("*.md")]
  problems = []
  for source in GUIDE_PAGES + tuple(sorted(api_pages)):
    built = _built_path(site, source)
    if not (DOCS / source).exists() or not built.exists():
      problems.append(f"docs/{source} does not exist or was not built ({built} is missing)")
      continue
    if source in GUIDE_PAGES and not _Page(built).h1.strip():
      problems.append(f"docs/{source} has no title (a '# Title' line)")
    if built.relative_to(site).as_posix() not in in_nav:
      problems.append(f"docs/{source} is not in the navigation of mkdocs.yml")
  assert not problems, "\n".join(problems)


def test_the_figure_of_the_loss_scaling_page_is_in_the_site(site):
  assert "images/scale_trajectory.png" in _built_path(site, "loss-scaling.md").read_text("utf-8")
  assert (site / "images" / "scale_trajectory.png").stat().st_size > 10_000


def _parameters(obj) -> list[str]:
  """The parameter names the reference must show for ``obj``."""
  if inspect.isclass(obj):
    if issubclass(obj, BaseException) or obj.__init__ is object.__init__:
      return list(getattr(obj, "_fields", ()))  # NamedTuple fields, if any
  try:
    return [name for name in inspect.signature(obj).parameters if name != "self"]
  except (TypeError, ValueError):
    return []


def test_every_public_name_is_in_the_api_reference_with_its_signature(site):
  # (A public name that no API page lists fails the build: the api_coverage hook.)
  documented = api_coverage.documented_names(DOCS)
  objects = {}
  for page in (site / api_coverage.API_DIR).rglob("index.html"):
    objects.update(_Page(page).objects)
  problems = []
  for name in api_coverage.public_names():
    identifier = api_coverage.documented_as(name, documented)
    if identifier not in objects:
      problems.append(f"{name}: no section with id {identifier!r} in the built API pages")
      continue
    section, obj = objects[identifier], api_coverage.resolve(name)
    short = identifier.rpartition(".")[2]
    if inspect.isclass(obj) and f"{identifier}.create" in objects:
      # Built by a `create` classmethod, as Flax's TrainState: that is the signature users need.
      section, obj, short = objects[f"{identifier}.create"], obj.create, "create"
    callable_with_signature = inspect.isroutine(obj) or (
        inspect.isclass(obj) and not issubclass(obj, BaseException)
        and obj.__init__ is not object.__init__)
    if callable_with_signature and not re.search(
        rf"\b{re.escape(short)}\(", section["signature"]):
      problems.append(f"{name}: the reference shows no signature '{short}(...)'")
    words = set(re.findall(r"\w+", section["signature"] + " " + section["text"]))
    missing = [p for p in _parameters(obj) if p not in words]
    if missing:
      problems.append(f"{name}: the reference does not show the parameters {missing}")
  assert not problems, "\n".join(problems)


_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
  """The ``python`` fenced blocks of a Markdown text: (line number, code)."""
  blocks, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    match = _FENCE.match(lines[i])
    i += 1
    if not match:
      continue
    indent, fence = match.group("indent"), match.group("fence")
    info = match.group("info").strip().lstrip("{").strip()
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
    body, start = [], i
    while i < len(lines) and not closing.match(lines[i]):
      body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
      i += 1
    i += 1
    if info and re.split(r"[\s{}.]+", info)[0] == "python":
      blocks.append((start, "\n".join(body)))
  return blocks


def test_python_blocks_are_found_and_the_standard_promotion_pages_exist():
  text = "a\n```python\nx = 1\n```\n\n```text\nnot run\n```\n  ```python\n  y = x\n  ```\n"
  assert python_blocks(text) == [(2, "x = 1"), (9, "y = x")]
  assert all((DOCS / name).exists() for name in STANDARD_PROMOTION_PAGES)


def _pages_with_code() -> list:
  """The guide pages with code, and the README, whose loop a newcomer runs first."""
  params = []
  for page in [ROOT / "README.md"] + sorted(DOCS.rglob("*.md")):
    if page.parent != ROOT and page.relative_to(DOCS).parts[0] in NOT_SOURCE or not (
        python_blocks(page.read_text(encoding="utf-8"))):
      continue
    name = page.relative_to(DOCS if DOCS in page.parents else ROOT).as_posix()
    reason = STANDARD_PROMOTION_PAGES.get(name)
    marks = [pytest.mark.standard_promotion(reason=reason)] if reason else []
    params.append(pytest.param(page, id=name, marks=marks))
  return params


@pytest.mark.parametrize("page", _pages_with_code())
def test_the_python_blocks_of_each_page_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # The page runs as a module of its own, as a reader's script would: classes
  # it defines (dataclasses, Linen modules) look their module up by name.
  module = types.ModuleType("__docs__")
  monkeypatch.setitem(sys.modules, "__docs__", module)
  for line, code in python_blocks(page.read_text(encoding="utf-8")):
    # Line numbers in tracebacks point into the Markdown file; the page does
    # not inherit this file's `from __future__` imports.
    code = compile("\n" * line + code, page.relative_to(ROOT).as_posix(), "exec", dont_inherit=True)
    exec(code, module.__dict__)  # pylint: disable=exec-used


def test_the_figure_script_runs(tmp_path, monkeypatch):
  # In this process (JAX is started already): the script's main(), which
  # `python docs/scripts/scale_trajectory.py --out ...` calls.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  spec = importlib.util.spec_from_file_location(
      "scale_trajectory", DOCS / "scripts" / "scale_trajectory.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  try:
    script.main(["--out", str(tmp_path / "figure.png")])
  finally:
    script.plt.close("all")
  assert (tmp_path / "figure.png").stat().st_size > 10_000
