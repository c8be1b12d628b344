"""How far the device's JPEG path is from the CPU workers' (PIL), split into its two parts: the
decode (nvJPEG or nvImageCodec against libjpeg-turbo, whole images) and the resize (torch's
antialiased resized_crop on the device against PIL's resize, the same decoded pixels, the same
box). Mean absolute difference in uint8 levels, per image size. Prints one JSON line.

    python bench/jpeg_decode_diff.py            # on a CUDA GPU: the device decoder accel picks
    python bench/jpeg_decode_diff.py --device cpu   # the harness (torchvision's CPU decoder)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torchvision.transforms.v2.functional as tvf  # noqa: E402
from PIL import Image  # noqa: E402

from accel.cli.data.jpeg_decoders import make_decoder  # noqa: E402
from accel.cli.data.prepare import prepare_mock_imagenet  # noqa: E402

RESAMPLING = {
    "bilinear": (Image.Resampling.BILINEAR, tvf.InterpolationMode.BILINEAR),
    "bicubic": (Image.Resampling.BICUBIC, tvf.InterpolationMode.BICUBIC),
}


def differences(files: list[Path], device: torch.device, out_size: int) -> dict:
    decoder = make_decoder(device)
    datas = [torch.from_numpy(np.fromfile(f, dtype=np.uint8)) for f in files]
    decoded = decoder(datas)
    decode, resize = [], {name: [] for name in RESAMPLING}
    for path, image in zip(files, decoded, strict=True):
        with Image.open(path) as img:
            reference = img.convert("RGB")
        pixels = torch.from_numpy(np.asarray(reference).copy()).permute(2, 0, 1)
        if image is not None:
            decode.append((image.cpu().float() - pixels.float()).abs().mean().item())
        w, h = reference.size
        box = (w // 8, h // 8, w - w // 8, h - h // 6)  # left, top, right, bottom
        for name, (pil_mode, torch_mode) in RESAMPLING.items():
            cpu = reference.resize((out_size, out_size), pil_mode, box=box, reducing_gap=None)
            dev = tvf.resized_crop(
                pixels.to(device), box[1], box[0], box[3] - box[1], box[2] - box[0],
                [out_size, out_size], torch_mode, antialias=True,
            )  # fmt: skip
            cpu_t = torch.from_numpy(np.asarray(cpu).copy()).permute(2, 0, 1).float()
            resize[name].append((dev.cpu().float() - cpu_t).abs().mean().item())
    return {
        "decoder": decoder.name,
        "decoded": len(decode),
        "decode_mean_abs": float(np.mean(decode)) if decode else None,
        "decode_max_image_mean_abs": float(np.max(decode)) if decode else None,
        **{f"resize_{name}_mean_abs": float(np.mean(v)) for name, v in resize.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", default="40,400", help="image sides of the mock JPEGs")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    record: dict = {"device": str(device)}
    with tempfile.TemporaryDirectory() as tmp:
        for size in map(int, args.sizes.split(",")):
            root = prepare_mock_imagenet(Path(tmp) / str(size), 3, 6, 0, size, progress=False)
            files = sorted(root.glob("train/*/*.jpg")) or sorted(root.glob("**/*.JPEG"))
            record[f"{size}px"] = differences(files, device, out_size=32 if size < 100 else 224)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
