"""The radix cache's invariants, checked by walking the whole tree (plain Python).

``RadixCache.check_integrity`` runs this (tests, benchmarks, and through
``Engine.check_integrity`` the ``debug: stats`` request); no step does. It sits apart
from ``radix_cache.py`` because it reads the other way round: the cache keeps running
totals and updates them node by node, this recounts everything from the nodes and
asserts the two agree, so every rule the operations must keep is written down in one
place:

    every node:    a non-empty edge; device slots and host blocks each one per token
                   or none, and at least one of the two; its parent lists it
    device nodes:  a subtree from the root (none below a host-only node)
    locks:         a node is locked at least as often as its children together
    loading:       on both tiers and locked until the load is done
    totals:        evictable_size, protected_size, host_size == the recount
    host blocks:   free + in the tree == every block, each once

The eviction candidates are checked against the nodes by ``TierMover.check_candidates``.
"""
from __future__ import annotations


def check_tree(cache) -> None:
    """Assert every invariant of ``cache`` (a ``RadixCache``); AssertionError names the
    first one broken."""
    evictable = protected = host = 0
    nodes = cache.nodes()
    cache.tiers.check_candidates(nodes)
    for node in nodes:
        n = len(node.key)
        assert n > 0, "empty edge"
        assert len(node.value) in (0, n) and len(node.host) in (0, n), "ragged edge"
        assert node.value or node.host, "a node with its KV nowhere"
        assert cache.host is not None or not node.host, "host blocks without a host tier"
        assert node.parent.children.get(node.key[0]) is node, "broken parent link"
        assert not node.value or node.parent is cache.root or node.parent.value, \
            "a device node under a host-only node"
        child_locks = sum(c.lock_ref for c in node.children.values())
        assert node.lock_ref >= child_locks, "child locked more than its parent"
        assert not node.loading or (node.value and node.host and node.lock_ref), \
            "a loading node must be on both tiers and locked"
        host += len(node.host)
        if not node.value:
            continue
        if node.lock_ref:
            protected += n
        else:
            evictable += n
    assert evictable == cache.evictable_size, f"evictable {evictable} != {cache.evictable_size}"
    assert protected == cache.protected_size, f"protected {protected} != {cache.protected_size}"
    assert host == cache.host_size, f"host {host} != {cache.host_size}"
    if cache.host is not None:
        every = sorted(cache.cached_host_blocks() + cache.host.free_blocks())
        assert every == list(range(cache.host.size)), "host block accounting broken"
