"""parts/held_gradient.py: gradients held only while in use (offload_optimizer.step_in_backward)."""
from __future__ import annotations

import threading
import time

import torch

from zerokit.parts.held_gradient import GradientPool, HeldGradient


def test_pieces_are_copied_gaps_zeroed_and_the_norm_exact():
    pool = GradientPool(64, 1)
    held = HeldGradient(10)
    held.pool = pool
    pool_buf = None
    # a buffer from the pool is not zeroed: fill what it lends with garbage first
    g = pool.take(HeldGradient(64))
    g.fill_(7.0)
    pool._holders.clear()
    pool._free.append(g)
    held.add(torch.arange(1.0, 4.0), 2)   # [2, 5)
    held.add(torch.full((3,), -2.0), 7)   # [7, 10)
    want = torch.tensor([0, 0, 1, 2, 3, 0, 0, -2, -2, -2], dtype=torch.float32)
    assert torch.equal(held.values(), want)
    assert held.sq_norm() == float((want.double() ** 2).sum())
    pool_buf = held._buf
    held.release()
    assert held.nbytes == 0 and held.sq_norm() == float((want.double() ** 2).sum())  # kept until clear
    held.clear()
    assert held.sq_norm() == 0.0
    # the pool's buffer comes back and is lent again, not a new one
    again = HeldGradient(10)
    again.pool = pool
    again.add(torch.ones(10), 0)
    assert again._buf.data_ptr() == pool_buf.data_ptr()
    assert torch.equal(again.values(), torch.ones(10))


def test_an_overlapping_piece_adds_and_the_norm_is_recounted():
    held = HeldGradient(4)
    held.add(torch.ones(4), 0)
    held.add(torch.ones(2), 1)
    assert torch.equal(held.values(), torch.tensor([1.0, 2.0, 2.0, 1.0]))
    assert held.sq_norm() == 10.0


def test_with_no_buffer_free_and_nothing_to_wait_for_a_gradient_gets_its_own():
    pool = GradientPool(8, 1)
    a, b = HeldGradient(8), HeldGradient(8)
    a.pool = b.pool = pool
    a.add(torch.ones(8), 0)  # takes the pool's only buffer; not offered (waits for step())
    b.add(torch.ones(8), 0)  # nothing will free one: its own, at once
    assert pool.nbytes == 2 * 8 * 4
    b.release()
    a.release()
    assert pool.nbytes == 8 * 4 and len(pool._free) == 1


def test_a_gradient_waits_for_an_offered_one_to_be_stepped():
    pool = GradientPool(8, 1)
    a, b = HeldGradient(8), HeldGradient(8)
    a.pool = b.pool = pool
    a.add(torch.ones(8), 0)
    a.offered = True  # a worker will step it and release it

    def worker():
        time.sleep(0.3)
        a.release()

    t = threading.Thread(target=worker)
    start = time.perf_counter()
    t.start()
    b.add(torch.ones(8), 0)
    waited = time.perf_counter() - start
    t.join()
    assert waited >= 0.25, waited
    assert pool.nbytes == 8 * 4  # the same buffer, no second one
