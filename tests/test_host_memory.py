"""The host tier's copies on CPU tensors (KVMover): a plan's saves run as one batch and
its loads as another, with the same result as running the records one by one in plan
order."""
from __future__ import annotations

import torch

from backend.core.host_memory import HostKVPool, KVMover
from backend.core.host_tier import HostLoad, HostSave
from backend.core.memory_pool import KVPool

LAYERS, HEADS, DIM = 2, 1, 2


def make(slots: int = 8, blocks: int = 8) -> KVMover:
    pool = KVPool(slots, LAYERS, HEADS, DIM, torch.float32, "cpu")
    for layer in range(LAYERS):  # slot s of layer l holds K = 100 l + s, V = -(100 l + s)
        values = torch.arange(slots + 1, dtype=torch.float32) + 100 * layer
        pool.k_buffer[layer].copy_(values[:, None, None].expand(-1, HEADS, DIM))
        pool.v_buffer[layer].copy_(-values[:, None, None].expand(-1, HEADS, DIM))
    host = HostKVPool(blocks, LAYERS, HEADS, DIM, torch.float32, pin=False)
    host.buffer.zero_()
    return KVMover(pool, host, torch.device("cpu"))


def k_of(mover: KVMover, slot: int) -> list[float]:
    return [mover.kv_pool.k_buffer[layer][slot, 0, 0].item() for layer in range(LAYERS)]


def test_a_plans_saves_and_loads_run_as_two_batches_with_plan_order_results():
    mover = make()
    mover.run([
        HostSave([1, 2], [0, 1]),
        HostSave([3], [5]),
        HostSave([4], [1]),  # block 1 given up and reused in the same plan: slot 4 wins
        HostLoad(7, [0, 5], [1, 3]),  # loads into the saved slots what was saved
    ])
    assert mover.copy_batches == 2 and mover.loads == 1
    host = mover.host_pool.buffer
    assert host[0, :, 0, 0, 0].tolist() == [1.0, 101.0]
    assert host[1, :, 0, 0, 0].tolist() == [4.0, 104.0]
    assert host[1, :, 1, 0, 0].tolist() == [-4.0, -104.0]
    assert k_of(mover, 1) == [1.0, 101.0] and k_of(mover, 3) == [3.0, 103.0]
    assert mover.finished_loads() == [7] and not mover.loads_pending
    assert mover.bytes_to_host == 3 * mover.token_bytes  # blocks 0, 1 and 5: what moved
    assert mover.bytes_to_device == 2 * mover.token_bytes


def test_loads_of_one_plan_are_reported_together_and_fill_their_own_slots():
    mover = make()
    mover.run([HostSave([1, 2, 3], [2, 3, 4])])
    mover.run([HostLoad(1, [2], [6]), HostLoad(2, [3, 4], [7, 8])])
    assert mover.finished_loads() == [1, 2]
    assert [k_of(mover, s)[1] for s in (6, 7, 8)] == [101.0, 102.0, 103.0]
