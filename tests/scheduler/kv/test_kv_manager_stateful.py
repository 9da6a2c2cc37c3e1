"""Hypothesis state machine over the KV block manager, checked against a model of KV memory."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler_svc.kv.manager import KVCacheManager, block_tokens

BS = 8
NUM_BLOCKS = 12
BASES = [[1] * 24, list(range(24)), [5, 6] * 12]  # shared prefixes, so that lookups hit


class KVManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS)
        self.memory: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, slot) -> what its KV depends on
        # NOTE: a slot's K/V depends on its token AND every token before it, so the model stores the prefix.
        self.tokens: dict[str, list[int]] = {}  # request -> all its known tokens
        self.prompt_len: dict[str, int] = {}
        self.next_id = 0

    # -- helpers ------------------------------------------------------------------------------------------
    def _write(self, rid: str, start: int, end: int) -> None:
        """The worker writes the KV of positions [start, end) of `rid` through its block table."""
        table = self.mgr.block_table(rid)
        for pos in range(start, end):
            block, slot = table[pos // BS], pos % BS
            for other in self.tokens:
                if other == rid or other not in self.mgr:
                    continue
                other_table, n_other = self.mgr.block_table(other), self.mgr.num_tokens(other)
                for j, b in enumerate(other_table):
                    if b == block:
                        # copy-on-write: nobody else may read the slot we overwrite
                        assert min(BS, n_other - j * BS) <= slot, (rid, other, block, slot)
            self.memory[(block, slot)] = tuple(self.tokens[rid][:pos + 1])

    def _grow(self, rid: str, num_tokens: int, hit=None) -> None:
        old = self.mgr.num_tokens(rid) if rid in self.mgr else (hit.num_tokens if hit else 0)
        before = (self.mgr.block_table(rid), self.mgr.num_tokens(rid)) if rid in self.mgr else None
        alloc = self.mgr.allocate(rid, num_tokens, self.tokens[rid], hit)
        if alloc is None:
            assert before == ((self.mgr.block_table(rid), self.mgr.num_tokens(rid)) if rid in self.mgr else None)
            return
        for src, dst in alloc.copies:
            for slot in range(BS):
                if (src, slot) in self.memory:
                    self.memory[(dst, slot)] = self.memory[(src, slot)]
        self._write(rid, old, num_tokens)

    def _live(self) -> list[str]:
        return sorted(r for r in self.tokens if r in self.mgr)

    # -- rules --------------------------------------------------------------------------------------------
    @rule(base=st.sampled_from(BASES), cut=st.integers(0, 24), tail=st.lists(st.integers(0, 9), max_size=12),
          chunk=st.integers(1, 40))
    def admit(self, base, cut, tail, chunk):
        prompt = base[:cut] + tail
        if not prompt:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.mgr.find_prefix(prompt)
        assert hit.num_tokens < len(prompt)
        for i, b in enumerate(hit.block_ids):  # a hit is exactly the prompt's tokens
            assert [self.memory[(b, s)] for s in range(BS)] == [tuple(prompt[:p + 1]) for p in range(i * BS, (i + 1) * BS)]
        self.tokens[rid] = list(prompt)
        self.prompt_len[rid] = len(prompt)
        self._grow(rid, min(len(prompt), hit.num_tokens + chunk), hit)
        if rid not in self.mgr:
            del self.tokens[rid]

    @precondition(lambda self: self._live())
    @rule(data=st.data(), chunk=st.integers(1, 20))
    def prefill_more(self, data, chunk):
        rid = data.draw(st.sampled_from(self._live()))
        n = self.mgr.num_tokens(rid)
        if n < self.prompt_len[rid]:
            self._grow(rid, min(self.prompt_len[rid], n + chunk))

    @precondition(lambda self: self._live())
    @rule(data=st.data(), token=st.integers(0, 9))
    def decode(self, data, token):
        rid = data.draw(st.sampled_from(self._live()))
        n = self.mgr.num_tokens(rid)
        if n < len(self.tokens[rid]):
            return  # still prefilling
        self.tokens[rid].append(token)
        self._grow(rid, n + 1)
        if self.mgr.num_tokens(rid) == n:
            self.tokens[rid].pop()  # no block free: the scheduler would wait or preempt

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live()))
        if self.mgr.num_tokens(parent) < len(self.tokens[parent]):
            return  # forks happen after the prompt is computed
        child = f"r{self.next_id}"
        self.next_id += 1
        self.mgr.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.prompt_len[child] = self.prompt_len[parent]

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(self._live()))
        self.mgr.free(rid)
        del self.tokens[rid]

    # -- invariants ---------------------------------------------------------------------------------------
    @invariant()
    def every_block_is_free_xor_referenced(self):
        pool = self.mgr.pool
        free, evictable = set(pool._free), set(pool._evictable)
        assert not free & evictable
        assert len(pool._free) == len(free)
        for b in range(NUM_BLOCKS):
            assert (b in free or b in evictable) == (pool.ref_cnt[b] == 0)
            assert pool.ref_cnt[b] >= 0
        assert all(pool.block_key[b] is not None for b in evictable)
        assert all(pool.block_key[b] is None for b in free)

    @invariant()
    def ref_counts_equal_table_references(self):
        counts = [0] * NUM_BLOCKS
        for rid in self._live():
            for b in self.mgr.block_table(rid):
                counts[b] += 1
        assert counts == self.mgr.pool.ref_cnt

    @invariant()
    def cached_keys_name_the_tokens_their_block_holds(self):
        for (parent, key_tokens), b in self.mgr.pool.cached_items():
            assert self.mgr.pool.block_key[b] == (parent, key_tokens)
            assert block_tokens([self.memory[(b, s)][-1] for s in range(BS)], 0, BS) == key_tokens

    @invariant()
    def every_table_reads_back_its_tokens(self):
        for rid in self._live():
            table, n = self.mgr.block_table(rid), self.mgr.num_tokens(rid)
            assert len(table) == -(-n // BS)
            toks = self.tokens[rid]
            assert [self.memory[(table[p // BS], p % BS)] for p in range(n)] == [tuple(toks[:p + 1]) for p in range(n)]

    def teardown(self):
        for rid in self._live():
            self.mgr.free(rid)
        pool = self.mgr.pool
        assert pool.num_free_blocks == NUM_BLOCKS and pool.ref_cnt == [0] * NUM_BLOCKS


KVManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_kv_manager_state_machine = KVManagerMachine.TestCase
