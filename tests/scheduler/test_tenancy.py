"""What tenants do not share (scheduler_svc.core.tenancy): request ids are per tenant, and the tenant salts the
prefix cache's block hashes, so a prompt hits only what its own tenant computed."""

import pytest

from scheduler_svc.core.tenancy import SEP, client_request_id, prefix_salt, scoped_request_id
from scheduler_svc.kv.manager import KVCacheManager
from scheduler_svc.routing import chain_hashes

BS = 8
PROMPT = list(range(100, 117))  # two full blocks and one token


def test_the_shared_tenants_ids_stay_as_sent_and_every_key_gives_back_the_clients_id():
    assert scoped_request_id("", "r1") == "r1"
    pairs = [("", "r1"), ("team-a", "r1"), ("team a", "r1"), ("", f"team-a{SEP}r1"), ("team-a", f"x{SEP}y"), ("", "")]
    keys = [scoped_request_id(t, r) for t, r in pairs]
    assert len(set(keys)) == len(keys)  # NOTE: an id holding SEP poses as no other tenant's key
    assert [client_request_id(k) for k in keys] == [r for _, r in pairs]


@pytest.mark.parametrize("a, b", [
    (("team-a", ""), ("team-b", "")), (("team-a", ""), ("", "")), (("", f"team-a{SEP}"), ("team-a", "")),
    (("team-a", "s"), ("team-a", "")), (("team a", "b"), ("team", "a b")),
])
def test_no_two_tenant_and_salt_pairs_share_a_salt(a, b):
    assert prefix_salt(*a) != prefix_salt(*b)


def test_the_shared_tenant_without_a_salt_hashes_as_before_and_sharing_drops_the_tenant():
    assert prefix_salt("", "") is None
    assert prefix_salt("team-a", "s", shared=True) == prefix_salt("team-b", "s", shared=True) == "s"
    assert prefix_salt("team-a", "", shared=True) is None


def test_a_prompt_hits_only_the_blocks_its_own_tenant_computed():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    salt_a, salt_b = prefix_salt("team-a", ""), prefix_salt("team-b", "")
    hit = mgr.find_prefix(PROMPT, salt_a)
    mgr.allocate("a", len(PROMPT), PROMPT, hit, salt_a)
    assert mgr.find_prefix(PROMPT, salt_a).num_tokens == 16  # the same tenant: both full blocks
    assert mgr.find_prefix(PROMPT, salt_b).num_tokens == 0  # another: nothing, not even the first block
    assert mgr.find_prefix(PROMPT, None).num_tokens == 0  # the shared tenant's unsalted chain
    # the router reads the same chains: another tenant's prompt never counts as held where it is cached
    assert chain_hashes(PROMPT, BS, salt_a)[0] != chain_hashes(PROMPT, BS, salt_b)[0]
