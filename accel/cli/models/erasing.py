"""Random erasing inside the model, after normalisation, as timm's prefetcher applies it on the
device: each sample's rectangles (drawn on the host, keyed by sample: data/augment.py) are filled
with zeros ('const', the mean colour), one normal value per channel ('rand') or per pixel
('pixel').

The normal values come from a counter-based hash of (sample seed, channel, pixel) in int32 ops,
not from a device generator: eager, torch.compile, torch_xla and JAX (through torchax) then fill
the same rectangles with the same values, and no generator state is carried or saved.
"""

from __future__ import annotations

import math

import torch

MODES = ("const", "rand", "pixel")
BOX = 6  # a rectangle: y0, y1, x0, x1 (empty where y0 == y1), the sample's seed, the mode


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """An unsigned (logical) right shift of int32 values, built from a shift of non-negative
    values only: torch_xla's right shift of a negative value rounds toward zero."""
    sign = (x < 0).to(torch.int32) * (1 << (31 - bits))
    return ((x & 0x7FFFFFFF) >> bits) + sign


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32) in int32 arithmetic: wrapping products and unsigned
    right shifts."""
    x = x ^ _shift_right(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shift_right(x, 15)
    x = x * -2073254261  # 0x846CA68B as a signed int32
    return x ^ _shift_right(x, 16)


def hash_normal(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Standard normal values, one per (seed, counter) pair (broadcast), by Box-Muller."""
    base = _mix(seeds * 1_000_003 + counters * 2)
    u1 = (_mix(base) & 0x7FFFFF).float().add(1.0) / 8388609.0  # in (0, 1]
    u2 = (_mix(base + 1) & 0x7FFFFF).float() / 8388608.0
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


def random_erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """x: normalised [B, C, H, W]; boxes: int32 [B, K, BOX]."""
    batch, channels, height, width = x.shape
    boxes = boxes.to(torch.int32)
    rows = torch.arange(height, device=x.device, dtype=torch.int32).view(1, 1, height, 1)
    cols = torch.arange(width, device=x.device, dtype=torch.int32).view(1, 1, 1, width)

    def side(i: int) -> torch.Tensor:  # [B, K, 1, 1]
        return boxes[:, :, i].view(batch, -1, 1, 1)

    inside = (rows >= side(0)) & (rows < side(1)) & (cols >= side(2)) & (cols < side(3))
    inside = inside.any(1, keepdim=True)  # [B, 1, H, W]
    seed = boxes[:, 0, 4].view(batch, 1, 1, 1)
    mode = boxes[:, 0, 5].view(batch, 1, 1, 1)
    channel = torch.arange(channels, device=x.device, dtype=torch.int32).view(1, channels, 1, 1)
    pixel = rows * width + cols
    per_pixel = hash_normal(seed, channel * (height * width) + pixel)
    per_channel = hash_normal(seed, channel * (height * width))
    fill = torch.where(mode == 2, per_pixel, torch.where(mode == 1, per_channel, 0.0))
    return torch.where(inside, fill.to(x.dtype), x)
