"""What tenants do not share: request ids are scoped per tenant, and prefix-cache hits stay within a tenant.

NOTE: both are keys made of the tenant and what the client sent, joined by SEP. A tenant name is visible ASCII
(" ".."~", frontend.api), so it never holds SEP: the first SEP of a key ends its tenant, and two different
(tenant, value) pairs never make the same key, whatever the client's value holds.
"""

from __future__ import annotations

SEP = "\x1f"  # ASCII's unit separator: never in a tenant name


def scoped_request_id(tenant: str, request_id: str) -> str:
    """The engine's key of a request: the client's `request_id` within its `tenant`. Two tenants may both run "r1"
    (a duplicate is refused within a tenant only, so a 409 says nothing of another tenant's ids). NOTE: the shared
    tenant's ids stay as sent (logs, tests and tools that know them), unless one holds SEP (then it is scoped too,
    so that it cannot pose as another tenant's key)."""
    if not tenant and SEP not in request_id:
        return request_id
    return f"{tenant}{SEP}{request_id}"


def client_request_id(key: str) -> str:
    """The id the client sent, of an engine key made by scoped_request_id."""
    return key.partition(SEP)[2] if SEP in key else key


def prefix_salt(tenant: str, cache_salt: str, shared: bool = False) -> str | None:
    """The salt of a request's prefix-cache chain (it joins the first block's hash, as vLLM's cache_salt does):
    the tenant and the client's cache_salt, so that a prompt hits only blocks its own tenant computed (a hit, seen
    in usage's cached tokens or in the timing, would tell one tenant another's prompt). `shared`
    (--shared-prefix-cache): the cache_salt alone, as before tenants were kept apart. None: no salt (the shared
    tenant without a cache_salt: its hashes are those of an unsalted prompt)."""
    if shared:
        return cache_salt or None
    if not tenant and not cache_salt:
        return None
    return f"{tenant}{SEP}{cache_salt}"
