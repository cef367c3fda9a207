"""The rule table shared by :class:`jaxmp.PathPolicy` and :class:`jaxmp.flax.ModulePolicy`.

Rules map keys (path patterns, module classes) to policies, in the order
given, with a default and a choice of how overlaps resolve. The table
validates them once and answers which rule covers a leaf or module; the
policy kinds say only how a key *hits*, and the errors have one wording.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping

from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import check_bool


def module_path(path: Iterable[Any]) -> str:
  """The path of a module (``nnx.iter_modules`` names and indices) joined with ``/``.

  >>> module_path(("blocks", 0, "mlp"))
  'blocks/0/mlp'
  """
  return "/".join(str(p) for p in path)


def check_pattern(owner: str, pattern: Any) -> None:
  """Raises ``TypeError`` unless ``pattern`` is a string, ``ValueError`` unless it compiles."""
  if not isinstance(pattern, str):
    raise TypeError(
        f"{owner}: a pattern must be a regular-expression string, got "
        f"{pattern!r} of type {type(pattern).__name__}.")
  try:
    re.compile(pattern)
  except re.error as e:
    raise ValueError(f"{owner}: {pattern!r} is not a valid regular expression: {e}.") from None


@dataclasses.dataclass(frozen=True)
class RuleTable:
  """Rules ``((key, Policy), ...)`` in priority order, a default (or ``None``) and ``first_match``.

  Frozen and hashable, so the policies holding one are static arguments of
  ``jax.jit``. ``owner`` starts every message, ``key_repr`` writes a key
  there and ``exclusive_hint`` says how to make overlapping keys exclusive.
  Build it with :func:`rule_table`.
  """

  owner: str
  rules: tuple[tuple[Any, Policy], ...]
  default: Policy | None
  first_match: bool
  key_repr: Callable[[Any], str] = dataclasses.field(
      default=repr, compare=False, repr=False)
  exclusive_hint: str = dataclasses.field(default="", compare=False, repr=False)

  def keys_text(self, rules: Iterable[tuple[Any, Policy]] | None = None) -> str:
    """The keys of ``rules`` (default: all), written for a message."""
    return ", ".join(self.key_repr(k) for k, _ in (
        self.rules if rules is None else rules)) or "(none)"

  def match(self, subject: str, hits: Callable[[Any], bool]) -> tuple[Any, Policy] | None:
    """The rule whose key ``hits`` the subject (``"the path 'a/b'"``), or ``None``.

    Raises ``ValueError`` if several hit and ``first_match`` is false.
    """
    matches = [(key, policy) for key, policy in self.rules if hits(key)]
    if len(matches) > 1 and not self.first_match:
      raise ValueError(
          f"{self.owner}: {subject} matches several rules: "
          f"{self.keys_text(matches)}. Make the rules exclusive"
          f"{self.exclusive_hint}, or pass first_match=True to let the first "
          "matching rule (in the order given) win.")
    return matches[0] if matches else None

  def policy_for(self, subject: str, hits: Callable[[Any], bool]) -> Policy:
    """The policy of the rule that hits, else ``default``; raises if neither."""
    matched = self.match(subject, hits)
    if matched is not None:
      return matched[1]
    if self.default is None:
      raise ValueError(
          f"{self.owner}: no rule matches {subject} and there is no default "
          f"policy. The rules are: {self.keys_text()}. Add a rule for it, or "
          "pass default=... (e.g. 'float32').")
    return self.default

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any policy of the table (default included) needs loss scaling."""
    return any(p.needs_loss_scaling for _, p in (*self.rules, (None, self.default)) if p)

  @property
  def io_policy(self) -> Policy:
    """The default, the policy of a model's inputs and outputs; raises without one."""
    if self.default is None:
      raise ValueError(
          f"This {self.owner} needs a default policy: it is the policy of the "
          "model's inputs and outputs (and the loss). Pass default=... (e.g. "
          "'mixed_bfloat16').")
    return self.default

  def __str__(self) -> str:
    rules = ", ".join(f"{self.key_repr(key)}: {policy}" for key, policy in self.rules)
    return f"{{{rules}}}, default={self.default}, first_match={self.first_match}"


def rule_table(
    owner: str,
    rules: Mapping[Any, Any] | Iterable[tuple[Any, Any]],
    default: Any,
    first_match: Any,
    *,
    check_key: Callable[[Any], None],
    key_description: str,
    key_repr: Callable[[Any], str] = repr,
    exclusive_hint: str = "",
) -> RuleTable:
  """Validates ``{key: policy spec}`` rules and builds their :class:`RuleTable`.

  Each key is checked by ``check_key`` and may be given once; the policy
  specs and ``default`` (``None`` allowed) go through :func:`jaxmp.get_policy`,
  whose errors are prefixed with ``owner`` and the key.
  """
  shape = (f"{owner} rules must be a dict {{{key_description}: policy}} or a "
           f"list of ({key_description}, policy) pairs")
  if isinstance(rules, (str, bytes)) or not isinstance(rules, (Mapping, Iterable)):
    raise TypeError(
        f"{shape}; got {rules!r} of type {type(rules).__name__}. For one policy "
        "everywhere, use the policy itself (jaxmp.get_policy(...)).")

  def parse(where, spec):
    try:
      return get_policy(spec)
    except (ValueError, TypeError) as e:
      raise type(e)(f"{owner}, {where}: {e}") from None

  checked = {}
  for item in list(rules.items()) if isinstance(rules, Mapping) else list(rules):
    if not (isinstance(item, tuple) and len(item) == 2):
      raise TypeError(f"{shape}; got the item {item!r}.")
    key, spec = item
    check_key(key)
    if key in checked:
      raise ValueError(
          f"{owner}: the rule {key_repr(key)} is given twice; give each "
          f"{key_description} once.")
    checked[key] = parse(f"rule {key_repr(key)}", spec)
  return RuleTable(
      owner=owner, rules=tuple(checked.items()),
      default=None if default is None else parse("default", default),
      first_match=check_bool(owner, "first_match", first_match),
      key_repr=key_repr, exclusive_hint=exclusive_hint)


class RuleTablePolicy:
  """The members a policy built on a :class:`RuleTable` (``self.table``) exposes."""

  table: RuleTable
  rules = property(lambda self: self.table.rules,
                   doc="The ``(key, Policy)`` rules, in the order given.")
  default = property(lambda self: self.table.default,
                     doc="The policy of what no rule covers (or ``None``).")
  first_match = property(lambda self: self.table.first_match,
                         doc="Whether overlaps resolve by the order of the rules.")
  needs_loss_scaling = property(
      lambda self: self.table.needs_loss_scaling,
      doc="True when any of the policies (default included) needs loss scaling.")
  io_policy = property(
      lambda self: self.table.io_policy,
      doc="The policy of the model's inputs and outputs: ``default`` (raises without one).")
