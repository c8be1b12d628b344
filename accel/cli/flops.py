"""Training FLOPs per image and model FLOPs utilisation (MFU)."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from accel.cli.models.factory import ModelConfig, create_model

# Dense bf16 peak of common accelerators, TFLOP/s (vendor datasheets, without sparsity).
PEAK_BF16_TFLOPS = {
    "H100 SXM": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H200": 989.0,
    "A100": 312.0,
    "V100": 125.0,  # fp16 tensor cores: V100 has no bf16
    "L4": 121.0,
}


def train_flops_per_image(cfg: ModelConfig) -> float:
    """Forward FLOPs of one image, x3 for forward plus backward (the usual estimate). Counted on
    the meta device: no weights to initialise and nothing computed (a tenth of the time for a
    ViT-B), and attention counted as its two matmuls, which the counter misses in the CPU's
    fused attention kernel."""
    with torch.device("meta"):
        model = create_model(cfg)
    images = torch.zeros((1, *model.input_size), dtype=torch.uint8, device="meta")
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(images)
    return 3.0 * counter.get_total_flops()


def peak_tflops(device_name: str, override: float | None = None) -> float | None:
    """Peak bf16 TFLOP/s of `device_name` (e.g. 'NVIDIA H100 80GB HBM3'), or None if unknown."""
    if override:
        return override
    name = device_name.upper()
    if "H100" in name:
        variant = "PCIe" if "PCIE" in name else "NVL" if "NVL" in name else "SXM"
        return PEAK_BF16_TFLOPS[f"H100 {variant}"]
    for key, value in PEAK_BF16_TFLOPS.items():
        if key.split()[0].upper() in name:
            return value
    return None


def mfu(
    images_per_sec: float, flops_per_image: float, peak: float | None, devices: int
) -> float | None:
    if not peak or images_per_sec <= 0:
        return None
    return images_per_sec * flops_per_image / (peak * 1e12 * devices)


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
