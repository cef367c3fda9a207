"""The rule table shared by :class:`jaxmp.PathPolicy` and :class:`jaxmp.flax.ModulePolicy`.

A :class:`RuleTable` maps keys (regular expressions on paths, module classes)
to policies, in the order given, with a default policy and a choice of how
overlaps resolve. It validates the rules once, at construction, and answers
the one question both policy kinds ask: which rule covers this leaf or module?
The policy kinds say only how a key *hits* what they look at (``re.search`` on
a leaf's path; a class or a name for a module); the errors for ambiguous and
unmatched lookups have one wording.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping

from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import check_bool


def module_path(path: Iterable[Any]) -> str:
  """The path of a module, as the rules match it: its names joined with ``/``.

  ``path`` is a path of ``nnx.iter_modules`` (attribute names and list
  indices); the root module's is ``""``.

  >>> module_path(("blocks", 0, "mlp"))
  'blocks/0/mlp'
  """
  return "/".join(str(p) for p in path)


def check_pattern(owner: str, pattern: Any) -> None:
  """Raises unless ``pattern`` is a valid regular-expression string.

  Raises:
    TypeError: if ``pattern`` is not a string.
    ValueError: if it does not compile.
  """
  if not isinstance(pattern, str):
    raise TypeError(
        f"{owner}: a pattern must be a regular-expression string, got "
        f"{pattern!r} of type {type(pattern).__name__}."
    )
  try:
    re.compile(pattern)
  except re.error as e:
    raise ValueError(
        f"{owner}: {pattern!r} is not a valid regular expression: {e}."
    ) from None


@dataclasses.dataclass(frozen=True)
class RuleTable:
  """Rules ``key -> Policy`` in priority order, a default and the overlap rule.

  Frozen and hashable (the keys are strings or classes), so the policies that
  hold one are static arguments of ``jax.jit``. Build it with
  :func:`rule_table`.

  Attributes:
    owner: the policy kind, which starts every error message.
    rules: ``((key, Policy), ...)`` in the order given.
    default: the policy of what no rule covers, or ``None``.
    first_match: when several rules hit, the first wins instead of an error.
    key_repr: how a key is written in messages.
    exclusive_hint: how to make overlapping keys exclusive, for the message.
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
    rules = self.rules if rules is None else rules
    return ", ".join(self.key_repr(key) for key, _ in rules) or "(none)"

  def match(
      self, subject: str, hits: Callable[[Any], bool]
  ) -> tuple[Any, Policy] | None:
    """Returns the rule ``(key, policy)`` whose key hits, or ``None``.

    Args:
      subject: what is looked up, for the message (``"the path 'a/b'"``).
      hits: whether a key covers the subject.

    Raises:
      ValueError: if several rules hit and ``first_match`` is false.
    """
    matches = [(key, policy) for key, policy in self.rules if hits(key)]
    if not matches:
      return None
    if len(matches) > 1 and not self.first_match:
      raise ValueError(
          f"{self.owner}: {subject} matches several rules: "
          f"{self.keys_text(matches)}. Make the rules exclusive"
          f"{self.exclusive_hint}, or pass first_match=True to let the first "
          "matching rule (in the order given) win."
      )
    return matches[0]

  def policy_for(self, subject: str, hits: Callable[[Any], bool]) -> Policy:
    """Returns the policy of the rule that hits, else ``default``.

    Raises:
      ValueError: if several rules hit (without ``first_match``), or none
        does and there is no default.
    """
    matched = self.match(subject, hits)
    if matched is not None:
      return matched[1]
    if self.default is None:
      raise ValueError(
          f"{self.owner}: no rule matches {subject} and there is no default "
          f"policy. The rules are: {self.keys_text()}. Add a rule for it, or "
          "pass default=... (e.g. 'float32')."
      )
    return self.default

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any policy of the table (default included) needs loss scaling."""
    policies = [policy for _, policy in self.rules]
    if self.default is not None:
      policies.append(self.default)
    return any(policy.needs_loss_scaling for policy in policies)

  @property
  def io_policy(self) -> Policy:
    """The default, as the policy of a model's inputs and outputs.

    Raises:
      ValueError: if there is no default.
    """
    if self.default is None:
      raise ValueError(
          f"This {self.owner} needs a default policy: it is the policy of the "
          "model's inputs and outputs (and the loss). Pass default=... (e.g. "
          "'mixed_bfloat16')."
      )
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

  Each key is checked by ``check_key`` and may be given once; each policy
  spec and ``default`` (``None`` allowed) are parsed by
  :func:`jaxmp.get_policy`; errors name ``owner`` and the offending key.

  Raises:
    TypeError: if ``rules`` is not a mapping or a sequence of pairs, if
      ``first_match`` is not a bool, or from ``check_key``.
    ValueError: for a key given twice, a policy ``get_policy`` does not
      understand, or from ``check_key``.
  """
  shape = (f"{owner} rules must be a dict {{{key_description}: policy}} or a "
           f"list of ({key_description}, policy) pairs")
  if isinstance(rules, (str, bytes)) or not isinstance(rules, (Mapping, Iterable)):
    raise TypeError(
        f"{shape}; got {rules!r} of type {type(rules).__name__}. For one policy "
        "everywhere, use the policy itself (jaxmp.get_policy(...))."
    )
  items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
  checked = []
  seen = []
  for item in items:
    if not (isinstance(item, tuple) and len(item) == 2):
      raise TypeError(f"{shape}; got the item {item!r}.")
    key, spec = item
    check_key(key)
    if key in seen:
      raise ValueError(
          f"{owner}: the rule {key_repr(key)} is given twice; give each "
          f"{key_description} once."
      )
    seen.append(key)
    try:
      policy = get_policy(spec)
    except (ValueError, TypeError) as e:
      raise type(e)(f"{owner}, rule {key_repr(key)}: {e}") from None
    checked.append((key, policy))
  if default is not None:
    try:
      default = get_policy(default)
    except (ValueError, TypeError) as e:
      raise type(e)(f"{owner}, default: {e}") from None
  return RuleTable(
      owner=owner,
      rules=tuple(checked),
      default=default,
      first_match=check_bool(owner, "first_match", first_match),
      key_repr=key_repr,
      exclusive_hint=exclusive_hint,
  )


class RuleTablePolicy:
  """What a policy built on a :class:`RuleTable` (in ``self.table``) exposes.

  Shared by :class:`jaxmp.PathPolicy` and :class:`jaxmp.flax.ModulePolicy`.
  """

  table: RuleTable

  @property
  def rules(self) -> tuple[tuple[Any, Policy], ...]:
    """The ``(key, Policy)`` rules, in the order given."""
    return self.table.rules

  @property
  def default(self) -> Policy | None:
    """The policy of what no rule covers (or ``None``)."""
    return self.table.default

  @property
  def first_match(self) -> bool:
    """Whether overlaps resolve by the order of the rules."""
    return self.table.first_match

  @property
  def needs_loss_scaling(self) -> bool:
    """True when any of the policies (default included) needs loss scaling."""
    return self.table.needs_loss_scaling

  @property
  def io_policy(self) -> Policy:
    """The policy of the model's inputs and outputs: ``default``.

    Raises:
      ValueError: if there is no default.
    """
    return self.table.io_policy
