"""Property-based: put/get/lookup/delete against a model of the store, through a live server."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvcache_client import KVCacheClient
from kvcache_core.format import decode_block
from tests.conftest import ServerThread, raw_block

pytestmark = pytest.mark.timeout(300)

KEYS = [bytes([i]) * 16 for i in range(12)]
NAMESPACES = ["alpha", "beta"]
keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=8)
ns_st = st.sampled_from(NAMESPACES)
payload_st = st.binary(min_size=0, max_size=2048)


def make_machine(client: KVCacheClient, capacity_bytes: int | None):
    """A state machine; with a capacity, blocks may be evicted, so the model is an upper bound."""

    class Store(RuleBasedStateMachine):
        @initialize()
        def reset(self) -> None:
            for ns in NAMESPACES:
                client.delete(ns, KEYS)
            self.model: dict[tuple[str, bytes], bytes] = {}

        @rule(ns=ns_st, keys=keys_st, payloads=st.lists(payload_st, min_size=8, max_size=8))
        def put(self, ns: str, keys: list[bytes], payloads: list[bytes]) -> None:
            items = [(k, raw_block(k, p)) for k, p in zip(keys, payloads, strict=False)]
            result = client.put_many(ns, items)
            assert result.stored + result.rejected == len(items)
            for k, p in zip(keys, payloads, strict=False):
                self.model[(ns, k)] = p

        @rule(ns=ns_st, keys=keys_st, prefix_only=st.booleans())
        def get(self, ns: str, keys: list[bytes], prefix_only: bool) -> None:
            got = client.get_many(ns, keys, prefix_only=prefix_only)
            assert len(got) == len(keys)
            missed = False
            for k, block in zip(keys, got, strict=True):
                if prefix_only and missed:
                    assert block is None
                    continue
                if block is None:
                    missed = True
                    if capacity_bytes is None:
                        assert (ns, k) not in self.model
                else:
                    # Never wrong bytes: whatever comes back is the last thing stored under the key.
                    assert bytes(decode_block(block, verify=False)[1]) == self.model[(ns, k)]

        @rule(ns=ns_st, keys=keys_st)
        def lookup(self, ns: str, keys: list[bytes]) -> None:
            n = client.lookup(ns, keys).prefix_length
            expected = 0
            for k in keys:
                if (ns, k) not in self.model:
                    break
                expected += 1
            if capacity_bytes is None:
                assert n == expected
            else:
                assert n <= expected

        @rule(ns=ns_st, keys=keys_st)
        def delete(self, ns: str, keys: list[bytes]) -> None:
            deleted = client.delete(ns, keys)
            present = {k for k in keys if (ns, k) in self.model}
            if capacity_bytes is None:
                assert deleted == len(present)
            else:
                assert deleted <= len(present)
            for k in present:
                del self.model[(ns, k)]

        @invariant()
        def within_capacity(self) -> None:
            if capacity_bytes is not None:
                ram = client.stats().tier("ram")
                assert ram.used_bytes <= capacity_bytes

    return Store


@pytest.mark.parametrize("capacity_bytes", [None, 8 * 1024], ids=["roomy", "evicting"])
def test_store_matches_model(make_server, capacity_bytes: int | None) -> None:
    server: ServerThread = make_server(ram={"capacity_bytes": capacity_bytes or (64 << 20)})
    with KVCacheClient(server.target, timeout_s=10) as client:
        machine = make_machine(client, capacity_bytes)
        machine.TestCase.settings = settings(
            max_examples=40,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        machine.TestCase().runTest()
