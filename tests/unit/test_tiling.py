"""TiledLinear / TiledEmbedding on their own (zerokit/tiling.py): nn.Linear's and nn.Embedding's
numbers forward and backward, DeepSpeed's layout and names, and the units the wrap policy forms."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zerokit.units.wrap import group_parameters, select_modules
from zerokit.zero import TiledEmbedding, TiledLinear

TOL = dict(rtol=1e-6, atol=1e-6)


def _stitched_weight(layer: TiledLinear) -> torch.Tensor:
    return torch.cat([torch.cat([t.weight for t in row], dim=1) for row in layer.linears], dim=0)


def _stitched_weight_grad(layer: TiledLinear) -> torch.Tensor:
    return torch.cat([torch.cat([t.weight.grad for t in row], dim=1) for row in layer.linears], dim=0)


@pytest.mark.parametrize("in_splits,out_splits,bias", [(1, 1, True), (3, 2, True), (2, 5, False),
                                                       (13, 7, True)])
def test_tiled_linear_equals_linear_forward_and_backward(in_splits, out_splits, bias) -> None:
    torch.manual_seed(0)
    ref = nn.Linear(13, 7, bias=bias)
    tiled = TiledLinear(13, 7, bias=bias, in_splits=in_splits, out_splits=out_splits, init_linear=ref)
    assert len(list(tiled.parameters())) == in_splits * out_splits + (out_splits if bias else 0)
    torch.testing.assert_close(_stitched_weight(tiled), ref.weight, rtol=0, atol=0)
    x = torch.randn(4, 3, 13)
    xr, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(4, 3, 7)
    out_ref, out = ref(xr), tiled(xt)
    torch.testing.assert_close(out, out_ref, **TOL)
    out_ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(xt.grad, xr.grad, **TOL)
    torch.testing.assert_close(_stitched_weight_grad(tiled), ref.weight.grad, **TOL)
    if bias:
        got = torch.cat([row[-1].bias.grad for row in tiled.linears])
        torch.testing.assert_close(got, ref.bias.grad, **TOL)


def test_tiled_linear_split_input_and_uncombined_outputs() -> None:
    torch.manual_seed(0)
    ref = nn.Linear(10, 6)
    tiled = TiledLinear(10, 6, in_splits=3, out_splits=2, input_is_already_split=True,
                        combine_out_splits=False, init_linear=ref)
    assert tiled.in_parts == [0, 4, 7, 10] and tiled.out_parts == [0, 3, 6]  # DeepSpeed's bounds
    x = torch.randn(5, 10)
    outs = tiled(torch.split(x, [4, 3, 3], dim=-1))
    assert isinstance(outs, list) and len(outs) == 2
    torch.testing.assert_close(torch.cat(outs, -1), ref(x), **TOL)
    with pytest.raises(ValueError, match="in_splits=3.*got 2 input chunks"):
        tiled(torch.split(x, [4, 6], dim=-1))


def test_tiled_linear_state_dict_names_are_deepspeeds() -> None:
    tiled = TiledLinear(8, 4, in_splits=2, out_splits=2)
    assert list(tiled.state_dict()) == ["linears.0.0.weight", "linears.0.1.weight", "linears.0.1.bias",
                                        "linears.1.0.weight", "linears.1.1.weight", "linears.1.1.bias"]


def test_tiled_linear_bad_arguments_are_named() -> None:
    with pytest.raises(RuntimeError, match=r"in_splits=9 must be an integer in \[1, in_features=8\]"):
        TiledLinear(8, 4, in_splits=9)
    with pytest.raises(RuntimeError, match=r"out_splits=0 must be an integer in \[1, out_features=4\]"):
        TiledLinear(8, 4, out_splits=0)
    with pytest.raises(ValueError, match=r"expected a weight of shape \(4, 8\), got \(8, 4\)"):
        TiledLinear(8, 4).copy_params_from(nn.Linear(4, 8))
    with pytest.raises(ValueError, match="bias=False"):
        TiledLinear(8, 4, bias=False).copy_params_from(nn.Linear(8, 4))


@pytest.mark.parametrize("padding_idx", [None, 7, -2])
def test_tiled_embedding_equals_embedding_and_only_looked_up_tiles_get_gradients(padding_idx) -> None:
    torch.manual_seed(0)
    ref = nn.Embedding(20, 6, padding_idx=padding_idx)
    tiled = TiledEmbedding(20, 6, num_tiles=4, padding_idx=padding_idx, init_embedding=ref)
    assert tiled.row_parts == [0, 5, 10, 15, 20]
    torch.testing.assert_close(torch.cat([t.weight for t in tiled.tiles]), ref.weight, rtol=0, atol=0)
    idx = torch.tensor([[7, 2, 7, 19], [3, 7, 18, 0], [19, 19, 2, 7]])  # tiles 0, 1 and 3; not 2
    g = torch.randn(3, 4, 6)
    out_ref, out = ref(idx), tiled(idx)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)  # a lookup copies: exact
    out_ref.backward(g)
    out.backward(g)
    assert tiled.tiles[2].weight.grad is None  # not looked up: no gradient at all
    grads = torch.cat([t.weight.grad if t.weight.grad is not None else torch.zeros_like(t.weight)
                       for t in tiled.tiles])
    torch.testing.assert_close(grads, ref.weight.grad, **TOL)
    if padding_idx is not None:
        assert not grads[padding_idx % 20].any() and not tiled.tiles[(padding_idx % 20) // 5].weight[
            (padding_idx % 20) % 5].any()


def test_tiled_embedding_out_of_range_index_is_named() -> None:
    with pytest.raises(IndexError, match=r"indices must be in \[0, 20\); got \[0, 20\]"):
        TiledEmbedding(20, 4, 2)(torch.tensor([0, 20]))


def test_each_tile_is_a_unit_even_inside_a_wrapped_block() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.proj = TiledLinear(8, 8, in_splits=2, out_splits=2)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = TiledEmbedding(30, 8, 3)
            self.blocks = nn.ModuleList([Block()])
            self.head = nn.Linear(8, 3)

    model = Model()
    groups = group_parameters(model, select_modules(model, None),
                              {id(p): 0 for p in model.parameters()})
    units = {name: [fqn for fqn, _ in params] for name, _, _, _, params in groups}
    assert list(units) == ["emb.tiles.0", "emb.tiles.1", "emb.tiles.2", "blocks.0",
                           "blocks.0.proj.linears.0.0", "blocks.0.proj.linears.0.1",
                           "blocks.0.proj.linears.1.0", "blocks.0.proj.linears.1.1", "<root>"]
    assert units["blocks.0"] == ["blocks.0.norm.weight", "blocks.0.norm.bias"]
    assert units["blocks.0.proj.linears.0.1"] == ["blocks.0.proj.linears.0.1.weight",
                                                  "blocks.0.proj.linears.0.1.bias"]
    assert units["<root>"] == ["head.weight", "head.bias"]
    # A class policy around the block keeps the tiles as units too.
    groups = group_parameters(model, select_modules(model, [Block]), {id(p): 0 for p in model.parameters()})
    assert [g[0] for g in groups][:2] == ["emb.tiles.0", "emb.tiles.1"]
    assert "blocks.0.proj.linears.1.1" in [g[0] for g in groups]
