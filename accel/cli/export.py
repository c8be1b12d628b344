"""accel-export: a checkpoint (a run's file or a sharded folder) as one file, offline.

    accel-export runs/vit_micro/eager/RUN/checkpoints/step_00000100.dcp --out model.safetensors
    accel-export .../step_00000100.dcp --out whole.pt     # a one-file checkpoint, resumable

`.safetensors`: the model's weights under timm's own names, which
`timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=...))` loads; written
tensor by tensor as they are read, so a sharded model never sits in memory whole.
`.pt`: the ordinary one-file checkpoint (weights, optimizer state, loop state and config), which
every backend and layout resumes; it is assembled in memory, as torch.save writes it whole.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from accel.checkpoint import FORMAT, CheckpointError, read_meta, section_tensors, write_file

PREFIX = "model."  # the ImageClassifier wrapper's name for the timm model inside it
SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.bool: "BOOL",
    torch.uint8: "U8",
}


def timm_name(key: str, section: str) -> str:
    """'model.model.blocks.0.attn.qkv.weight' -> 'blocks.0.attn.qkv.weight'."""
    return key[len(section) + 1 :].removeprefix(PREFIX)


def write_safetensors(out: Path, named: list[tuple[str, torch.Tensor]], meta: dict) -> None:
    """The safetensors format written one tensor at a time (the library's own writers take
    every tensor at once): an 8-byte header length, a JSON header of names, dtypes, shapes and
    byte offsets, then the raw bytes in header order."""
    header: dict[str, dict[str, Any]]
    header, offset = {"__metadata__": {k: str(v) for k, v in meta.items()}}, 0
    for name, tensor in named:
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(out, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for _, tensor in named:
            f.write(tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def export_weights(path: Path, out: Path, section: str = "model") -> int:
    """The timm state dict of a checkpoint's model (or its EMA) as safetensors."""
    meta = read_meta(path)
    model = json.loads(meta["config"])["model"]["name"]
    named = [(timm_name(k, section), t) for k, t in section_tensors(path, section)]
    if not named:
        raise CheckpointError(f"{path} holds no '{section}' weights")
    write_safetensors(out, named, {"model": model, "source": path, "step": meta["loop"]["step"]})
    return len(named)


def export_checkpoint(path: Path, out: Path) -> int:
    """The one-file checkpoint of a (sharded) checkpoint."""
    meta = read_meta(path)
    state: dict = {}
    for section in ("model", "optim", "ema", "scaler"):
        for key, tensor in section_tensors(path, section):
            node = state
            parts = key.split(".")
            head, *rest = parts
            node = node.setdefault(head, {})
            # Parameter names keep their dots: 'optim.<name>.exp_avg' splits at the last one.
            if head == "optim":
                name, leaf = ".".join(rest[:-1]), rest[-1]
                node.setdefault(name, {})[leaf] = tensor
            else:
                node[".".join(rest)] = tensor
    if "rng" not in meta:  # a folder keeps each rank's generator states under rng.rank<r>
        ranks: dict[int, dict] = {}
        for key, tensor in section_tensors(path, "rng"):
            _, rank, name = key.split(".", 2)
            ranks.setdefault(int(rank.removeprefix("rank")), {})[name] = tensor
        meta["rng"] = [ranks[r] for r in sorted(ranks)]
    write_file(out, {"format": FORMAT, "meta": meta, "state": state})
    return sum(len(v) for v in state.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="accel-export", description=__doc__, allow_abbrev=False)
    p.add_argument("checkpoint", type=Path, help="a step_N.pt file or step_N.dcp folder")
    p.add_argument("--out", type=Path, required=True, help=".safetensors (timm) or .pt")
    p.add_argument("--ema", action="store_true", help="the EMA weights (.safetensors)")
    args = p.parse_args(argv)
    try:
        if args.out.suffix == ".safetensors":
            count = export_weights(args.checkpoint, args.out, "ema" if args.ema else "model")
        elif args.out.suffix == ".pt" and not args.ema:
            count = export_checkpoint(args.checkpoint, args.out)
        else:
            raise CheckpointError("--out ends in .safetensors (timm weights) or .pt (--ema: none)")
    except (CheckpointError, OSError) as err:
        print(f"accel-export: error: {err}", file=sys.stderr)
        return 2
    print(f"accel-export: {count} tensors written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
