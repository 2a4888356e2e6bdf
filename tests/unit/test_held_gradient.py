"""parts/held_gradient.py: gradients held in host memory (offload_optimizer.step_in_backward)."""
from __future__ import annotations

import torch

from zerokit.parts.held_gradient import HeldGradient


def test_pieces_are_copied_gaps_zeroed_and_the_norm_exact():
    held = HeldGradient(10)
    held.add(torch.arange(1.0, 4.0), 2)   # [2, 5)
    held._buf.fill_(7.0)  # the buffer is not zeroed when allocated: garbage outside the pieces
    held._landed = []
    held._sq = 0.0
    held.add(torch.arange(1.0, 4.0), 2)   # [2, 5)
    held.add(torch.full((3,), -2.0), 7)   # [7, 10)
    want = torch.tensor([0, 0, 1, 2, 3, 0, 0, -2, -2, -2], dtype=torch.float32)
    assert torch.equal(held.values(), want)
    assert held.sq_norm() == float((want.double() ** 2).sum())
    buf = held._buf
    held.clear()
    assert held.sq_norm() == 0.0 and held.nbytes == 10 * 4  # the buffer stays the part's
    held.add(torch.ones(4), 6)
    assert held._buf.data_ptr() == buf.data_ptr()
    assert torch.equal(held.values(), torch.tensor([0.0] * 6 + [1.0] * 4))


def test_an_overlapping_piece_adds_and_the_norm_is_recounted():
    """Accumulation over micro-steps: a piece on elements already landed adds."""
    held = HeldGradient(4)
    held.add(torch.ones(4), 0)
    held.add(torch.ones(2), 1)
    assert torch.equal(held.values(), torch.tensor([1.0, 2.0, 2.0, 1.0]))
    assert held.sq_norm() == 10.0
    held.add(torch.ones(4), 0)  # after a settle: still adds
    assert torch.equal(held.values(), torch.tensor([2.0, 3.0, 3.0, 2.0]))
    assert held.sq_norm() == 26.0


def test_nothing_landed_since_clear_reads_zero():
    held = HeldGradient(3)
    held.add(torch.ones(3), 0)
    held.clear()
    assert torch.equal(held.values(), torch.zeros(3)) and held.sq_norm() == 0.0


def test_a_given_buffer_is_landed_in_without_a_zeroing_pass():
    """A host part's gradient record (parts/host.py): the layout's buffer, garbage from the last
    step, is where the pieces land; the first piece is copied (a -0.0 stays -0.0, where adding
    it to zeros gave +0.0), the rest zeroed only at settle."""
    buf = torch.full((6,), 9.0)
    held = HeldGradient(6, buffer=buf)
    held.add(torch.tensor([1.0, -0.0]), 1)
    assert torch.equal(buf[1:3], torch.tensor([1.0, -0.0])) and buf[0] == 9.0  # not zeroed yet
    got = held.values()
    assert got.data_ptr() == buf.data_ptr() and held.nbytes == 6 * 4
    assert torch.equal(got, torch.tensor([0.0, 1.0, -0.0, 0.0, 0.0, 0.0]))
    assert torch.signbit(got[2]) and held.sq_norm() == 1.0
    held.clear()
    held.add(torch.full((6,), 2.0), 0)
    assert torch.equal(buf, torch.full((6,), 2.0)) and held.sq_norm() == 24.0
