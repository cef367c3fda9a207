"""Rule tables shared by :class:`jaxmp.PathPolicy` and :class:`jaxmp.flax.ModulePolicy`.

A rule table maps keys (regular expressions on paths, or module classes) to
policies. This module validates such tables and answers the questions both
policy kinds ask of them.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.policy import Policy, get_policy


def is_floating_array(x: Any) -> bool:
  """True for a JAX or NumPy array (or scalar) of a floating dtype."""
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
      x.dtype, jnp.floating
  )


def check_pattern(owner: str, pattern: str) -> None:
  """Raises a ValueError naming ``owner`` if ``pattern`` is not a valid regex."""
  try:
    re.compile(pattern)
  except re.error as e:
    raise ValueError(
        f"{owner}: {pattern!r} is not a valid regular expression: {e}."
    ) from None


def rules_need_loss_scaling(
    rules: tuple[tuple[Any, Policy], ...], default: Policy | None
) -> bool:
  """True when any policy of ``rules`` or ``default`` needs loss scaling."""
  policies = [policy for _, policy in rules]
  if default is not None:
    policies.append(default)
  return any(policy.needs_loss_scaling for policy in policies)


def check_rules(
    owner: str,
    rules: Mapping[Any, Any] | Iterable[tuple[Any, Any]],
    check_key: Callable[[Any], None],
    *,
    key_word: str,
    key_description: str,
    key_repr: Callable[[Any], str] = repr,
) -> tuple[tuple[Any, Policy], ...]:
  """Validates ``{key: policy spec}`` rules; returns ``((key, Policy), ...)``.

  Shared by :class:`PathPolicy` and :class:`jaxmp.flax.ModulePolicy`: each key
  is checked by ``check_key``, given once, and each spec parsed by
  :func:`jaxmp.get_policy`; errors name ``owner`` and the offending key.
  """
  items = list(rules.items()) if isinstance(rules, Mapping) else list(rules)
  checked = []
  seen = set()
  for item in items:
    if not (isinstance(item, tuple) and len(item) == 2):
      raise TypeError(
          f"{owner} rules must be a dict {{{key_description}: policy}} or a "
          f"list of ({key_word}, policy) pairs; got the item {item!r}."
      )
    key, spec = item
    check_key(key)
    if key in seen:
      raise ValueError(
          f"{owner}: the {key_word} {key_repr(key)} is given twice; give each "
          f"{key_word} once."
      )
    seen.add(key)
    try:
      policy = get_policy(spec)
    except (ValueError, TypeError) as e:
      raise type(e)(f"{owner}, {key_word} {key_repr(key)}: {e}") from None
    checked.append((key, policy))
  return tuple(checked)


def default_io_policy(policy: Any) -> Policy:
  """The ``default`` of a rule-based policy, as the policy of inputs and outputs.

  Raises:
    ValueError: if ``policy.default`` is None.
  """
  if policy.default is None:
    raise ValueError(
        f"This {type(policy).__name__} needs a default policy: it is the policy "
        "of the model's inputs and outputs (and the loss). Pass default=... "
        "(e.g. 'mixed_bfloat16')."
    )
  return policy.default
