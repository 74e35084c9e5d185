"""VisionTower: the Qwen3.5 / 3.6 / 3.8 vision encoder, packed patches in, merged text-width embeddings out.

Input rows are flattened patches (channels x temporal_patch_size x patch x patch values, the
processor's order) of one or more images / videos packed back to back, each item's patches in
merge-block order: the spatial_merge_size^2 patches of one merged token are consecutive.

    patch embedding (the Conv3d as one matmul) + learned position grid resampled to (h, w)
    -> depth x [LayerNorm -> MHA with 2-D axial RoPE, attention within one frame
                -> LayerNorm -> MLP]
    -> merger: LayerNorm, fold each merge unit into one row, fc1 -> GELU -> fc2

Parameter names and shapes are the checkpoint's with `model.visual.` removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.models.vision_config import VisionConfig

GridTHW = tuple[int, int, int]  # an item's patch grid: frames / temporal_patch_size, rows, columns


def grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[GridTHW]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def merged_tokens(grid: GridTHW, spatial_merge_size: int) -> int:
    """Embeddings (placeholder tokens) the tower emits for one item."""
    t, h, w = grid
    return t * h * w // spatial_merge_size**2


@dataclass(frozen=True)
class AttentionGroup:
    """Attention segments of one length, run as one batched SDPA call."""

    length: int  # patches per segment (one frame's h * w)
    count: int
    rows: torch.Tensor | None  # [count, length] row indices; None: the segments tile every row in order


@dataclass(frozen=True)
class VisionLayout:
    """What every block shares for one call: positions, rotary tables, attention segments."""

    grids: list[GridTHW]
    position_embeddings: torch.Tensor  # [N, hidden], in the tower's dtype
    cos: torch.Tensor  # [N, head_dim] fp32
    sin: torch.Tensor  # [N, head_dim] fp32
    attention_groups: list[AttentionGroup]


def merge_block_coordinates(h: int, w: int, merge: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of each patch of one frame, in merge-block order."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)

    def reorder(grid: torch.Tensor) -> torch.Tensor:
        return grid.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).reshape(-1)

    return reorder(rows), reorder(cols)


def attention_groups(grids: Sequence[GridTHW], device: torch.device) -> list[AttentionGroup]:
    """One segment per frame, grouped by length: a video's frames (or same-sized images) share one
    SDPA call with no mask, so the GPU runs its flash kernel; distinct sizes cost one call each."""
    starts_by_length: dict[int, list[int]] = {}
    offset = 0
    for t, h, w in grids:
        for _ in range(t):
            starts_by_length.setdefault(h * w, []).append(offset)
            offset += h * w
    if len(starts_by_length) == 1:
        ((length, starts),) = starts_by_length.items()
        return [AttentionGroup(length, len(starts), None)]
    groups = []
    for length, starts in starts_by_length.items():
        rows = torch.tensor(starts, device=device)[:, None] + torch.arange(length, device=device)[None, :]
        groups.append(AttentionGroup(length, len(starts), rows))
    return groups


def axial_inverse_frequencies(config: VisionConfig) -> torch.Tensor:
    """head_dim / 4 frequencies, shared by the h and w axes: each axis rotates half a head."""
    axis_dim = config.head_dim // 2
    exponents = torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim
    return 1.0 / config.rope_theta**exponents


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        num_rows = x.shape[0]
        q, k, v = self.qkv(x).view(num_rows, 3, self.num_heads, self.head_dim).unbind(1)
        # The rotation runs in fp32 (as the reference does), so bf16 q/k round once, after it.
        cos, sin = layout.cos[:, None, :], layout.sin[:, None, :]
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        groups = layout.attention_groups
        if len(groups) == 1 and groups[0].rows is None:
            count, length = groups[0].count, groups[0].length
            segments = [t.view(count, length, self.num_heads, self.head_dim) for t in (q, k, v)]
            out = self._attend(*segments).reshape(num_rows, -1)
        else:
            out = torch.empty_like(q)
            for group in groups:
                out[group.rows] = self._attend(q[group.rows], k[group.rows], v[group.rows])
        return self.proj(out.reshape(num_rows, -1))

    @staticmethod
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[segments, length, heads, head_dim] each -> the same shape, attention within each segment."""
        attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return attended.transpose(1, 2)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.approximate = "tanh" if config.hidden_act == "gelu_pytorch_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate=self.approximate))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, x: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), layout)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """The checkpoint's Conv3d (kernel = stride = one patch) kept in its stored shape, applied as
    the equivalent matmul over flattened patches."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = nn.Conv3d(config.in_channels, config.hidden_size, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.merged_size = config.hidden_size * config.merge_unit
        self.norm = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size, bias=True)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        merged = self.norm(x).view(-1, self.merged_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(config) for _ in range(config.depth)])
        self.merger = PatchMerger(config)

    def layout(self, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> VisionLayout:
        grids = grid_list(grid_thw)
        merge = self.config.spatial_merge_size
        device = self.pos_embed.weight.device
        side = self.config.position_grid_side
        # The learned grid resampled bilinearly (corners aligned) to each distinct (h, w), in fp32.
        table = self.pos_embed.weight.float().t().reshape(1, -1, side, side)
        pos_parts, row_parts, col_parts = [], [], []
        resampled: dict[tuple[int, int], torch.Tensor] = {}
        for t, h, w in grids:
            if t < 1 or h % merge or w % merge or h < merge or w < merge:
                raise ValueError(f"grid (t={t}, h={h}, w={w}): h and w must be positive multiples of {merge}")
            rows, cols = merge_block_coordinates(h, w, merge, device)
            if (h, w) not in resampled:
                grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
                resampled[h, w] = grid[:, rows, cols].t()
            pos_parts.append(resampled[h, w].repeat(t, 1))
            row_parts.append(rows.repeat(t))
            col_parts.append(cols.repeat(t))
        rows, cols = torch.cat(row_parts).float(), torch.cat(col_parts).float()
        # Computed per call rather than kept as a buffer, which .to(bfloat16) would round.
        inv_freq = axial_inverse_frequencies(self.config).to(device)
        angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
        angles = torch.cat((angles, angles), dim=-1)
        return VisionLayout(
            grids=grids,
            position_embeddings=torch.cat(pos_parts).to(self.pos_embed.weight.dtype),
            cos=angles.cos(),
            sin=angles.sin(),
            attention_groups=attention_groups(grids, device),
        )

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """patches [N, patch_dim] (any float dtype; cast to the tower's), grid_thw [items, 3]
        (t, h, w) with sum(t * h * w) == N -> [N / spatial_merge_size^2, out_hidden_size] in the
        tower's dtype, items in input order (item i's rows: merged_tokens(grid_i) of them)."""
        layout = self.layout(grid_thw)
        expected = sum(t * h * w for t, h, w in layout.grids)
        if patches.dim() != 2 or patches.shape != (expected, self.config.patch_dim):
            raise ValueError(
                f"patches of shape {tuple(patches.shape)}; grids {layout.grids} need ({expected}, {self.config.patch_dim})"
            )
        x = self.patch_embed(patches) + layout.position_embeddings
        for block in self.blocks:
            x = block(x, layout)
        return self.merger(x)
