"""Who a client is: the tenant, the role and the priority cap its API key grants (the key file's attributes)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagedserve_common.defaults import MAX_TENANT_CHARS

MIN_PRIORITY, MAX_PRIORITY = -2**31, 2**31 - 1  # a request's `priority` is 32 bits (lower runs first)
TENANT, GATEWAY, OPERATOR = "tenant", "gateway", "operator"
ROLES = (TENANT, GATEWAY, OPERATOR)
ATTRIBUTES = ("max-priority", "role")  # `WORD=VALUE` words that end a key file's line
KEY_LINE = "KEY [NAME] [max-priority=N] [role=tenant|gateway|operator]"


@dataclass(slots=True, frozen=True)
class Identity:
    """What a caller may do. NOTE: a tenant is an identity, not a header: only a gateway or an operator (trusted to
    have authenticated its users) names the tenant of a request by the tenant header; a tenant key's requests count
    for the key's name, whatever they send."""

    tenant: str = ""  # the key's name: whose service, prefix cache, request ids and sequences its requests are
    role: str = TENANT
    # NOTE: the most urgent `priority` its requests may ask (lower runs first): a request asking a lower one is
    # refused (PERMISSION_DENIED naming `priority`), so that urgency is granted by the operator, not claimed
    max_priority: int = 0

    @property
    def names_tenants(self) -> bool:
        """Whether the tenant header may name its requests' tenant (a gateway's users, an operator's tests)."""
        return self.role != TENANT

    @property
    def sees_all(self) -> bool:
        """Whether GetKVState shows it every tenant's sequences (else its requests' tenant's only)."""
        return self.role == OPERATOR


# NOTE: a server without API keys authenticates nobody: whoever reaches its port is the operator (a local
# single-user server, or one behind a gateway that authenticates). The tenant header then names tenants, and
# tenants are kept apart only as far as the callers are trusted to send their own.
NO_KEYS = Identity(role=OPERATOR, max_priority=MIN_PRIORITY)


def parse_identity(rest: str) -> Identity:
    """The Identity of a key file line's words after the key: `[NAME] [max-priority=N] [role=R]` (the attributes,
    `WORD=VALUE`, are the line's last words; the name is what comes before them, spaces included). Raises
    ValueError saying what is wrong (the caller names the file and the line; never the key)."""
    words = rest.split(" ")
    attrs: dict[str, str] = {}
    while words and "=" in words[-1]:
        attr, _, value = words.pop().partition("=")
        if attr not in ATTRIBUTES:
            raise ValueError(f"{KEY_LINE}: unknown attribute {attr[:40]!r} (the attributes: "
                             f"{', '.join(ATTRIBUTES)}; a name's last word may not hold `=`)")
        if attr in attrs:
            raise ValueError(f"{KEY_LINE}: {attr} is given twice")
        attrs[attr] = value
    name = " ".join(words).strip()
    if len(name) > MAX_TENANT_CHARS or not all(" " <= c <= "~" for c in name):
        raise ValueError(f"KEY [NAME]: the name is at most {MAX_TENANT_CHARS} visible ASCII characters (spaces "
                         f"included)")
    role = attrs.get("role", TENANT)
    if role not in ROLES:
        raise ValueError(f"{KEY_LINE}: role is one of {', '.join(ROLES)}, got {role[:40]!r}")
    default = MIN_PRIORITY if role == OPERATOR else 0  # NOTE: an operator is trusted with any urgency
    return Identity(name, role, _priority(attrs["max-priority"]) if "max-priority" in attrs else default)


def _priority(value: str) -> int:
    n = int(value) if re.fullmatch(r"-?[0-9]{1,10}", value) else None
    if n is None or not MIN_PRIORITY <= n <= MAX_PRIORITY:
        raise ValueError(f"{KEY_LINE}: max-priority is an integer in {MIN_PRIORITY}..{MAX_PRIORITY}, got "
                         f"{value[:40]!r}")
    return n
