"""The layout of docs/architecture.md: imports go one way, and _src is private."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxmp"
# Tests of private mechanics, which may import jaxmp._src.
PRIVATE_MECHANICS_TESTS = {
    "test_inplace_select.py",
    "test_jaxpr.py",
    "test_path_policy.py",
    "test_deepspeed.py",
    "test_architecture.py",
}
# Benchmarks that measure alternatives to an internal piece of jaxmp, which
# they swap in: (folder, file name).
PRIVATE_EXPERIMENTS = {
    ("benchmarks", "check_forms.py"):
        "swaps the finiteness check inside jaxmp.loss_scaling for the forms it measures",
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  if parts[-1] == "__init__":
    parts = parts[:-1]
  return ".".join(parts)


def _jaxmp_imports(path: pathlib.Path) -> set[str]:
  """The jaxmp modules that a file imports, at any depth of its code.

  ``from jaxmp._src.flax import nnx`` imports the module ``jaxmp._src.flax.nnx``.
  """
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.startswith("jaxmp"):
        for alias in node.names:
          module = f"{node.module}.{alias.name}"
          is_module = ROOT.joinpath(*module.split(".")).with_suffix(".py").exists()
          found.add(module if is_module else node.module)
    elif isinstance(node, ast.Import):
      found.update(a.name for a in node.names if a.name.startswith("jaxmp"))
  return found


def _src_graph() -> dict[str, set[str]]:
  graph = {}
  for path in sorted((PACKAGE / "_src").rglob("*.py")):
    if path.name != "__init__.py":
      graph[_module_name(path)] = {
          m for m in _jaxmp_imports(path) if m.startswith("jaxmp._src")}
  return graph


def _page_order() -> list[tuple[str, set[str]]]:
  """The import-direction block of docs/architecture.md: (module, its imports)."""
  page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
  block = page.split("```text\n", 1)[1].split("```", 1)[0]
  order = []
  for line in block.splitlines():
    text = line.split("(", 1)[0]
    if not line.startswith(" "):
      name, _, text = text.partition("->")
      order.append(("jaxmp._src." + name.strip().replace("/", "."), set()))
    order[-1][1].update("jaxmp._src." + m.strip().replace("/", ".")
                        for m in text.split(",") if m.strip())
  return order


def test_imports_go_one_way_as_the_architecture_page_draws_them():
  # No cycle and no climb back up: every import of a private module, at any
  # depth of its code (a function's too), goes to a module drawn above it,
  # and the page draws exactly the imports each module makes.
  graph, order = _src_graph(), _page_order()
  assert sorted(name for name, _ in order) == sorted(graph)
  above = set()
  for name, drawn in order:
    assert graph[name] <= above, f"{name} imports {graph[name] - above} from below"
    assert graph[name] == drawn, f"{name}: the page draws {drawn}, the code {graph[name]}"
    above.add(name)


def test_private_modules_never_import_the_public_packages():
  # The public __init__ files import _src; the other way round is a cycle.
  for name, imports in _src_graph().items():
    path = PACKAGE.parent / (name.replace(".", "/") + ".py")
    if not path.exists():
      path = PACKAGE.parent / name.replace(".", "/") / "__init__.py"
    public = {m for m in _jaxmp_imports(path) if not m.startswith("jaxmp._src")}
    assert not public, f"{name} imports {public}"


def test_only_flax_modules_import_flax():
  for path in (PACKAGE / "_src").rglob("*.py"):
    if "flax" in path.relative_to(PACKAGE / "_src").parts:
      continue
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith(("flax", "orbax")), path
      elif isinstance(node, ast.Import):
        assert not any(a.name.startswith(("flax", "orbax")) for a in node.names), path


def test_only_the_jaxpr_module_touches_jax_internals():
  internal = ("jax.extend", "jax._src", "jax.interpreters")
  for path in PACKAGE.rglob("*.py"):
    if path == PACKAGE / "_src" / "jaxpr.py":
      continue
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith(internal), path
      elif isinstance(node, ast.Import):
        assert not any(a.name.startswith(internal) for a in node.names), path


def test_only_the_public_packages_declare_all():
  for path in (PACKAGE / "_src").rglob("*.py"):
    assert "__all__" not in path.read_text(encoding="utf-8"), path


@pytest.mark.parametrize("folder", ["tests", "examples", "benchmarks", "docs"])
def test_users_code_does_not_import_private_modules(folder):
  offenders = []
  for path in (ROOT / folder).rglob("*.py"):
    if folder == "tests" and path.name in PRIVATE_MECHANICS_TESTS:
      continue
    if (folder, path.name) in PRIVATE_EXPERIMENTS:
      continue
    if any(m.startswith("jaxmp._src") for m in _jaxmp_imports(path)):
      offenders.append(str(path.relative_to(ROOT)))
  for path in (ROOT / folder).rglob("*.md"):
    if "jaxmp._src" in path.read_text(encoding="utf-8") and path.name != "architecture.md":
      offenders.append(str(path.relative_to(ROOT)))
  assert not offenders


def test_every_private_module_is_on_the_architecture_page():
  page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
  for path in (PACKAGE / "_src").rglob("*.py"):
    if path.name == "__init__.py":
      continue
    rel = path.relative_to(PACKAGE).as_posix()
    assert f"`{rel}`" in page, f"{rel} is missing from docs/architecture.md"
