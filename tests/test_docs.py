"""Tests of the documentation: the built site and the guides' code.

The integration tier (the site build takes a minute): `make test` runs these,
`make test-fast` does not. The docstring examples run as doctests
(``--doctest-modules``, see pyproject.toml), and tests/test_docstrings.py checks
that every public name has one.

* The site builds with ``mkdocs build --strict`` (once per test session, shared
  by the xdist workers), every guide page is built and listed in the
  navigation, and the API pages hold every public name with its signature.
* Every fenced ``python`` block of every page in ``docs/`` runs: each page's
  blocks in order, in one fresh namespace. Blocks fenced with another language
  (``text``, ``bash``, ``pycon``, ``py`` ...) are shown but not run; fence code
  that cannot run here (a GPU, several processes) with ``py``. They run
  under strict dtype promotion (conftest.py), except the pages of
  ``STANDARD_PROMOTION_PAGES``.
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

# The pages (source files in docs/) that the site must contain and list in its
# navigation: the ten guide pages a newcomer follows in order (Getting started,
# one page per framework with the same sections, then the topics), the
# guarantees, and the contributors' architecture page.
GUIDE_PAGES = (
    "index.md",  # Getting started
    "optax.md",  # optax, Equinox and Haiku
    "linen.md",
    "nnx.md",
    "loss-scaling.md",
    "autocast.md",  # Policies and autocast
    "diagnostics.md",
    "migration.md",
    "faq.md",
    "benchmarks.md",
    "guarantees.md",
    "architecture.md",
)
# Pages still being written: checked like the others once they exist. Move
# them to GUIDE_PAGES (and into the nav of mkdocs.yml) when they land.
PENDING_PAGES: tuple[str, ...] = ()
# Pages whose code is user code that relies on standard dtype promotion.
STANDARD_PROMOTION_PAGES = {
    "migration.md": "jmp's README loop, unchanged, subtracts a float32 target "
                        "from a float16 prediction",
}
NOT_SOURCE = ("hooks", "scripts")  # folders of docs/ that hold no pages


# ---------------------------------------------------------------------------
# Building the site.


def _build(site: pathlib.Path) -> subprocess.CompletedProcess:
  # Not --quiet: it hides the warnings from --strict, which then passes.
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  return subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict",
       "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
  )


@pytest.fixture(scope="session")
def site(tmp_path_factory) -> pathlib.Path:
  """The site built strictly into a temporary folder, once per session."""
  for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
    if importlib.util.find_spec(module.split(".")[0]) is None or (
        "." in module and importlib.util.find_spec(module) is None):
      pytest.skip(f"{module} is not installed: pip install -e '.[docs]' (make test does)")
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  # Under xdist the workers share the parent of their temporary folders.
  root = tmp_path_factory.getbasetemp()
  if worker is not None:
    root = root.parent
  site_dir = root / "docs-site"
  log = root / "docs-site.log"
  with open(root / "docs-site.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not log.exists():
      result = _build(site_dir)
      log.write_text(f"{result.returncode}\n{result.stdout}\n{result.stderr}")
    returncode, _, output = log.read_text().partition("\n")
  if returncode != "0":
    pytest.fail("mkdocs build --strict failed:\n" + output, pytrace=False)
  return site_dir


class _Page(html.parser.HTMLParser):
  """Collects what the tests read from a built page.

  * ``nav_links``: the hrefs of the primary navigation;
  * ``h1``: the text of the first heading;
  * ``objects``: for each mkdocstrings object (a ``div.doc-object``), the id of
    its heading, its whole text and the text of its signature block.
  """

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.nav_links: list[str] = []
    self.h1 = ""
    self.objects: dict[str, dict[str, str]] = {}
    self._divs: list[dict | None] = []  # one entry per open <div>
    self._nav_depth = 0
    self._in_nav = False
    self._in_h1 = False

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    classes = (attrs.get("class") or "").split()
    if tag == "nav":
      self._nav_depth += 1
      if "md-nav--primary" in classes:
        self._in_nav = self._nav_depth
    if tag == "a" and self._in_nav and "md-nav__link" in classes:
      self.nav_links.append(attrs.get("href", ""))
    if tag == "h1" and not self.h1:
      self._in_h1 = True
    if tag == "div":
      entry = None
      if "doc-object" in classes:
        entry = {"id": None, "text": [], "signature": None}
      elif "doc-signature" in classes:
        entry = {"signature_of": self._current_object(), "text": []}
      self._divs.append(entry)
    if tag.startswith("h") and attrs.get("id") and "doc-heading" in classes:
      obj = self._current_object()
      if obj is not None and obj["id"] is None:
        obj["id"] = attrs["id"]

  def handle_endtag(self, tag):
    if tag == "nav":
      if self._in_nav == self._nav_depth:
        self._in_nav = False
      self._nav_depth -= 1
    if tag == "h1":
      self._in_h1 = False
    if tag == "div" and self._divs:
      entry = self._divs.pop()
      if entry is None:
        return
      if "signature_of" in entry:
        owner = entry["signature_of"]
        if owner is not None and owner["signature"] is None:
          owner["signature"] = "".join(entry["text"])
      elif entry["id"]:
        self.objects[entry["id"]] = {
            "text": "".join(entry["text"]),
            "signature": entry["signature"] or "",
        }

  def handle_data(self, data):
    if self._in_h1:
      self.h1 += data
    for entry in self._divs:
      if entry is not None:
        entry["text"].append(data)

  def _current_object(self):
    for entry in reversed(self._divs):
      if entry is not None and "id" in entry:
        return entry
    return None


def _parse(path: pathlib.Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8"))
  return page


def _built_path(site: pathlib.Path, source: str) -> pathlib.Path:
  """Where mkdocs writes the page built from ``docs/<source>``."""
  stem = source[: -len(".md")]
  if stem == "index" or stem.endswith("/index"):
    return site / stem.rpartition("index")[0] / "index.html"
  return site / stem / "index.html"


def _resolve(href: str, page_url: str) -> str:
  """The site path of a link found on the page at ``page_url``."""
  href = href.split("#")[0]
  path = posixpath.normpath(posixpath.join(posixpath.dirname(page_url), href))
  if path in ("", "."):
    return "index.html"
  return path if path.endswith(".html") else path + "/index.html"


# ---------------------------------------------------------------------------
# The built site.


def test_every_guide_page_is_built_and_in_the_navigation(site):
  home = _parse(site / "index.html")
  in_nav = {_resolve(href, "index.html") for href in home.nav_links}
  problems = []
  pending = [p for p in PENDING_PAGES if (DOCS / p).exists()]
  for source in GUIDE_PAGES + tuple(pending):
    if not (DOCS / source).exists():
      problems.append(f"docs/{source} does not exist")
      continue
    built = _built_path(site, source)
    if not built.exists():
      problems.append(f"docs/{source} was not built ({built} is missing)")
      continue
    if not _parse(built).h1.strip():
      problems.append(f"docs/{source} has no title (a '# Title' line)")
    if built.relative_to(site).as_posix() not in in_nav:
      problems.append(f"docs/{source} is not in the navigation of mkdocs.yml")
  for page in sorted((DOCS / api_coverage.API_DIR).glob("*.md")):
    source = page.relative_to(DOCS).as_posix()
    if _built_path(site, source).relative_to(site).as_posix() not in in_nav:
      problems.append(f"docs/{source} is not in the navigation of mkdocs.yml")
  assert not problems, "\n".join(problems)


def test_the_figure_of_the_loss_scaling_page_is_in_the_site(site):
  html = _built_path(site, "loss-scaling.md").read_text(encoding="utf-8")
  assert "images/scale_trajectory.png" in html
  assert (site / "images" / "scale_trajectory.png").stat().st_size > 10_000


def _api_objects(site: pathlib.Path) -> dict[str, dict[str, str]]:
  objects = {}
  for page in (site / api_coverage.API_DIR).rglob("index.html"):
    objects.update(_parse(page).objects)
  return objects


def _parameters(obj) -> list[str]:
  """The parameter names the reference must show for ``obj``."""
  if inspect.isclass(obj):
    if issubclass(obj, BaseException) or obj.__init__ is object.__init__:
      return list(getattr(obj, "_fields", ()))  # NamedTuple fields, if any
  try:
    signature = inspect.signature(obj)
  except (TypeError, ValueError):
    return []
  return [name for name in signature.parameters if name != "self"]


def test_every_public_name_is_in_the_api_reference_with_its_signature(site):
  documented = api_coverage.documented_names(DOCS)
  objects = _api_objects(site)
  problems = []
  for name in api_coverage.public_names():
    identifier = api_coverage.documented_as(name, documented)
    if identifier is None:
      problems.append(
          f"{name} is not documented: add '::: {name}' to its topic page in "
          f"docs/{api_coverage.API_DIR}/")
      continue
    if identifier not in objects:
      problems.append(f"{name}: no section with id {identifier!r} in the built API pages")
      continue
    section = objects[identifier]
    obj = api_coverage.resolve(name)
    short = identifier.rpartition(".")[2]
    if inspect.isclass(obj) and f"{identifier}.create" in objects:
      # Built by a `create` classmethod, as Flax's TrainState: that is the
      # signature users need.
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


# ---------------------------------------------------------------------------
# The fenced Python blocks of the guides.

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*)$")


def python_blocks(text: str) -> list[tuple[int, str]]:
  """The ``python`` fenced blocks of a Markdown text: (line number, code)."""
  blocks = []
  lines = text.splitlines()
  i = 0
  while i < len(lines):
    match = _FENCE.match(lines[i])
    if not match:
      i += 1
      continue
    indent, fence = match.group("indent"), match.group("fence")
    info = match.group("info").strip().lstrip("{").strip()
    language = re.split(r"[\s{}.]+", info)[0] if info else ""
    closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
    body, start, i = [], i + 1, i + 1
    while i < len(lines) and not closing.match(lines[i]):
      line = lines[i]
      body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
      i += 1
    i += 1
    if language == "python":
      blocks.append((start, "\n".join(body)))
  return blocks


def _pages() -> list[pathlib.Path]:
  """The guide pages, and the README, whose loop a newcomer runs first."""
  pages = sorted(DOCS.rglob("*.md"))
  return [ROOT / "README.md"] + [
      p for p in pages if p.relative_to(DOCS).parts[0] not in NOT_SOURCE]


def test_python_blocks_are_found():
  text = "a\n```python\nx = 1\n```\n\n```text\nnot run\n```\n  ```python\n  y = x\n  ```\n"
  assert python_blocks(text) == [(2, "x = 1"), (9, "y = x")]


def _pages_with_code() -> list:
  params = []
  for page in _pages():
    if not python_blocks(page.read_text(encoding="utf-8")):
      continue
    name = page.relative_to(DOCS if DOCS in page.parents else ROOT).as_posix()
    marks = []
    if name in STANDARD_PROMOTION_PAGES:
      marks = [pytest.mark.standard_promotion(reason=STANDARD_PROMOTION_PAGES[name])]
    params.append(pytest.param(page, id=name, marks=marks))
  return params


def test_the_standard_promotion_pages_exist():
  assert all((DOCS / name).exists() for name in STANDARD_PROMOTION_PAGES)


@pytest.mark.parametrize("page", _pages_with_code())
def test_the_python_blocks_of_each_page_run(page, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  # The page runs as a module of its own, as a reader's script would: classes
  # it defines (dataclasses, Linen modules) look their module up by name.
  module = types.ModuleType("__docs__")
  monkeypatch.setitem(sys.modules, "__docs__", module)
  namespace = module.__dict__
  source = page.relative_to(ROOT).as_posix()
  for line, code in python_blocks(page.read_text(encoding="utf-8")):
    # Line numbers in tracebacks point into the Markdown file; the page does
    # not inherit this file's `from __future__` imports.
    code = "\n" * (line) + code
    exec(compile(code, source, "exec", dont_inherit=True), namespace)  # pylint: disable=exec-used


def test_the_figure_script_runs(tmp_path, monkeypatch):
  # In this process (JAX is started already): the script's main(), which
  # `python docs/scripts/scale_trajectory.py --out ...` calls.
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("MPLBACKEND", "Agg")
  spec = importlib.util.spec_from_file_location(
      "scale_trajectory", DOCS / "scripts" / "scale_trajectory.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  out = tmp_path / "figure.png"
  try:
    script.main(["--out", str(out)])
  finally:
    script.plt.close("all")
  assert out.stat().st_size > 10_000
