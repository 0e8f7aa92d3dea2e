"""The one exception type the protocol layer raises.

Every rejection of peer-supplied bytes ends here, naming the field or rule that
failed, so callers can count drops by reason and charge the sending peer.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A message, document or frame broke a protocol rule.

    ``rule`` is a short stable identifier (``"signature"``, ``"replay"``,
    ``"size"``, ``"field:<Message>.<name>"``, ...) suitable as a metrics label;
    ``detail`` is the human explanation.
    """

    def __init__(self, rule: str, detail: str = "") -> None:
        self.rule = rule
        self.detail = detail
        super().__init__(f"{rule}: {detail}" if detail else rule)


def rule_label(rule: str) -> str:
    """A rule identifier without its specifics: ``"field:Sample.completion"`` -> ``"field"``,
    ``"envelope.type"`` stays. Rule identifiers are hierarchical data (a label, then ``:``
    and specifics); metrics count by label, and this is the one place that reads them."""
    return rule.split(":", 1)[0]


def rule_family(rule: str) -> str:
    """The family of a rule: its label up to the first dot (``"envelope.type"`` -> ``"envelope"``);
    penalties default by family."""
    return rule_label(rule).split(".", 1)[0]
