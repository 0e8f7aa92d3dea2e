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
