"""Memory-centric tiling: layers split into tiles that ZeRO-3 gathers one at a time.

    layer = zerokit.zero.TiledLinear(8192, 8192, in_splits=4, out_splits=4)
    table = zerokit.zero.TiledEmbedding(1_000_000, 1024, num_tiles=64)

Each tile is a submodule marked as a tile, so the wrap policy makes it a unit of its own (see
[Note: tiles] in units/wrap.py): at stage 3 a layer larger than the gather budget
(stage3_max_live_parameters) runs tile by tile, each gathered before its use and released after.

TiledLinear is DeepSpeed's (deepspeed.runtime.zero.tiling): the same arguments, tile layout and
state-dict names (`linears.{out}.{in}.weight`), numerically nn.Linear up to the order of the
partial sums. TiledEmbedding goes beyond DeepSpeed: the table is split by rows, and a forward
calls only the tiles holding looked-up rows, so at stage 3 the others are neither gathered nor
given a gradient. See [Note: tiles across ranks] for what ranks looking up different rows agree on.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from zerokit.units.wrap import TILE_ATTR


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """CSR-style bounds [0, b1, ..., num_items] of `num_parts` near-equal parts, the larger parts
    first: DeepSpeed's deepspeed.runtime.utils.partition_uniform, so tiles match DeepSpeed's."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, residual = divmod(num_items, num_parts)
    return [p * size + min(p, residual) for p in range(num_parts + 1)]


def _check_splits(name: str, splits: int, features: int, what: str) -> None:
    if not isinstance(splits, int) or not 1 <= splits <= features:
        raise RuntimeError(f"{name}={splits!r} must be an integer in [1, {what}={features}]")


def _mark_tile(module: nn.Module) -> nn.Module:
    setattr(module, TILE_ATTR, True)
    return module


class TiledLinear(nn.Module):
    """A replacement for nn.Linear whose weight is split into out_splits x in_splits tiles.

    Arguments are DeepSpeed's:
    - in_features, out_features, bias: as nn.Linear.
    - in_splits / out_splits: tiles along the input / output dimension, each in [1, features].
    - input_is_already_split: forward gets a sequence of in_splits input chunks, not one tensor.
    - combine_out_splits: False returns the list of out_splits outputs instead of their concat.
    - linear_cls: builds each tile (`linear_cls(in, out, bias=..., **kwargs)`), nn.Linear default.
    - init_linear: an nn.Linear whose weights are copied in (copy_params_from).
    - kwargs: passed to linear_cls (device, dtype ...).
    Only the last tile of each output row has a bias (the partial sums of a row share one).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, in_splits: int = 1,
                 out_splits: int = 1, input_is_already_split: bool = False,
                 combine_out_splits: bool = True, linear_cls: type = nn.Linear,
                 init_linear: nn.Module | None = None, **kwargs: Any):
        super().__init__()
        _check_splits("in_splits", in_splits, in_features, "in_features")
        _check_splits("out_splits", out_splits, out_features, "out_features")
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = partition_uniform(in_features, in_splits)
        self.out_parts = partition_uniform(out_features, out_splits)
        self.linears = nn.ModuleList()
        for o in range(out_splits):
            row = nn.ModuleList()
            for i in range(in_splits):
                row.append(_mark_tile(linear_cls(self.in_parts[i + 1] - self.in_parts[i],
                                                 self.out_parts[o + 1] - self.out_parts[o],
                                                 bias=bias and i == in_splits - 1, **kwargs)))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits > 1 and not self.input_is_already_split:
            sizes = [b - a for a, b in zip(self.in_parts, self.in_parts[1:])]
            inputs = self._split_global_input(input_, sizes)
        elif self.in_splits > 1:
            inputs = input_
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear(in_splits={self.in_splits}, input_is_already_split="
                                 f"True) got {len(inputs)} input chunks")
        else:
            inputs = [input_]
        outputs = [None] * self.out_splits
        for o in range(self.out_splits):  # tile by tile: each tile's unit is gathered in turn
            for i in range(self.in_splits):
                outputs[o] = self._reduce_local_output(i, o, outputs[o], self.linears[o][i](inputs[i]))
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: torch.Tensor, split_sizes: list[int]) -> tuple:
        """The input's last dimension in the tiles' chunks (subclasses: other input types)."""
        return torch.split(input_, split_sizes, dim=-1)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Sum the partial products of one output row (subclasses: other output types)."""
        # A clone, not the tile's output itself: the output views the tile's gathered weights'
        # autograd graph, and DeepSpeed found in-place use of such views breaks autograd.
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list) -> Any:
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy the weight and bias of an nn.Linear of the same shape into the tiles.

        At ZeRO-3 a collective: every rank must call it, and rank 0's values are kept (as
        DeepSpeed's). `other` may itself be partitioned: it is gathered to read.
        """
        from zerokit.zero import GatheredParameters

        expected = (self.out_features, self.in_features)
        weight, bias = getattr(other, "weight", None), getattr(other, "bias", None)
        if weight is None or tuple(weight.shape) != expected:
            raise ValueError(f"copy_params_from: expected a weight of shape {expected}, got "
                             f"{None if weight is None else tuple(weight.shape)}")
        if self.use_bias != (bias is not None) or (bias is not None and bias.shape != (self.out_features,)):
            raise ValueError(f"copy_params_from: this layer has bias={self.use_bias} "
                             f"({self.out_features},); the source's bias is "
                             f"{None if bias is None else tuple(bias.shape)}")
        with GatheredParameters([p for p in (weight, bias) if p is not None]):
            for o, (r0, r1) in enumerate(zip(self.out_parts, self.out_parts[1:])):
                for i, (c0, c1) in enumerate(zip(self.in_parts, self.in_parts[1:])):
                    tile = self.linears[o][i]
                    with GatheredParameters(list(tile.parameters()), modifier_rank=0):
                        tile.weight.copy_(weight[r0:r1, c0:c1])
                        if tile.bias is not None:
                            tile.bias.copy_(bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """TiledLinear over a linear_cls that returns (output, bias), as Megatron-LM's layers do."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        old_tensor, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        tensor = super()._reduce_local_output(in_id, out_id, old_tensor, tensor)
        return tensor, (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs: list) -> Any:
        tensor = super()._combine_output_splits([t for t, _ in outputs])
        biases = [b for _, b in outputs if b is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)


class TiledEmbedding(nn.Module):
    """nn.Embedding whose table is split by rows into `num_tiles` tiles (tiles.{t}.weight).

    A forward calls only the tiles that hold looked-up rows: at stage 3 the other tiles are not
    gathered, and backward produces gradients only for the tiles called. padding_idx as
    nn.Embedding's (that row starts at zero and gets no gradient).

    [Note: tiles across ranks]
    Gathering a tile is a collective, so at world > 1 every rank must call the same tiles in the
    same order, and every called tile must get a gradient on every rank (a unit is reduced when
    its gradients are all in, so ranks must agree on which units that happens to). Each forward
    therefore takes the union of the tiles the ranks need (one all-reduce of num_tiles flags) and
    calls each in ascending order, with an empty lookup on a rank that needs none of its rows:
    its output has no rows, and its gradient is zero. Tiles no rank needs stay sharded.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, num_tiles: int = 1,
                 padding_idx: int | None = None, device: Any = None, dtype: Any = None,
                 init_embedding: nn.Module | None = None):
        super().__init__()
        _check_splits("num_tiles", num_tiles, num_embeddings, "num_embeddings")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} must be within [-{num_embeddings}, "
                                 f"{num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.num_tiles = num_tiles
        self.row_parts = partition_uniform(num_embeddings, num_tiles)
        self.tiles = nn.ModuleList()
        for lo, hi in zip(self.row_parts, self.row_parts[1:]):
            local_pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
            self.tiles.append(_mark_tile(nn.Embedding(hi - lo, embedding_dim, padding_idx=local_pad,
                                                      device=device, dtype=dtype)))
        if init_embedding is not None:
            self.copy_params_from(init_embedding)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        flat = input.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"TiledEmbedding: indices must be in [0, {self.num_embeddings}); got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        bounds = torch.tensor(self.row_parts[1:-1], dtype=flat.dtype, device=flat.device)
        tile_of = torch.bucketize(flat, bounds, right=True)  # (n,) the tile holding each row
        needed = torch.zeros(self.num_tiles, dtype=torch.int64, device=flat.device)
        needed[tile_of] = 1
        rows, positions = [], []
        for t in self._agreed_tiles(needed):
            at = (tile_of == t).nonzero().view(-1)
            rows.append(self.tiles[t](flat[at] - self.row_parts[t]))  # (n_t, dim)
            positions.append(at)
        if not rows:  # no lookups on any rank
            weight = self.tiles[0].weight
            return torch.empty(*input.shape, self.embedding_dim, dtype=weight.dtype, device=weight.device)
        by_tile = torch.cat(rows)  # (n, dim), rows grouped by tile
        order = torch.argsort(torch.cat(positions))  # where each lookup's row sits in by_tile
        return by_tile.index_select(0, order).view(*input.shape, self.embedding_dim)

    def _agreed_tiles(self, needed: torch.Tensor) -> list[int]:
        """The tiles some rank needs, ascending (see [Note: tiles across ranks])."""
        from zerokit.units.registry import unit_of

        unit = unit_of(self.tiles[0].weight)
        if unit is not None and unit.comm.world_size > 1:
            import torch.distributed as dist

            needed = needed.to(unit.comm.device)
            unit.comm.all_reduce_(needed, "TiledEmbedding tiles looked up", op=dist.ReduceOp.MAX)
        return needed.nonzero().view(-1).tolist()

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy an nn.Embedding's table into the tiles (at ZeRO-3 a collective; rank 0's kept)."""
        from zerokit.zero import GatheredParameters

        weight = getattr(other, "weight", None)
        expected = (self.num_embeddings, self.embedding_dim)
        if weight is None or tuple(weight.shape) != expected:
            raise ValueError(f"copy_params_from: expected a weight of shape {expected}, got "
                             f"{None if weight is None else tuple(weight.shape)}")
        with GatheredParameters(weight):
            for tile, lo, hi in zip(self.tiles, self.row_parts, self.row_parts[1:]):
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[lo:hi])

    def extra_repr(self) -> str:
        pad = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, num_tiles={self.num_tiles}{pad}"


__all__ = ["TiledEmbedding", "TiledLinear", "TiledLinearReturnBias", "partition_uniform"]
