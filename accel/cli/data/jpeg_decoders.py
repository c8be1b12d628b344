"""Decoders of a batch of JPEG files' bytes on a device, for device_decode.py.

On a CUDA GPU, NVIDIA's nvImageCodec where it is installed (`pip install 'accel[cuda]'`): the
library kept for it (DALI's decoder, nvJPEG underneath), batched. Otherwise torchvision's
`decode_jpeg`, which uses nvJPEG on a GPU too but is deprecated from torchvision 0.29 (superseded
by TorchCodec, whose image decoding runs on the CPU): kept for older installs, and as the stand-in
the tests run on the CPU device.
"""

from __future__ import annotations

import io
import warnings
from typing import Protocol

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg


class JpegDecoder(Protocol):
    name: str

    def __call__(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """uint8 RGB CHW images on the device, None for each file the decoder refused."""


class TorchvisionDecoder:
    name = "torchvision"

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The batch in one call; where it fails as a whole, each file alone."""
        if not datas:
            return []
        # torchvision 0.29 warns at every decode that its decoding is deprecated: the module's
        # docstring says so once instead.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deprecated.*", category=UserWarning)
            try:
                return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=self.device))
            except RuntimeError:
                pass
            return [self._one(data) for data in datas]

    def _one(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:
            return None


class NvImageCodecDecoder:
    name = "nvimgcodec"

    def __init__(self, device: torch.device):
        from nvidia import nvimgcodec

        self.device = device
        self.decoder = nvimgcodec.Decoder(device_id=device.index or 0)

    def __call__(self, datas: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if not datas:
            return []
        images = self.decoder.decode([data.numpy() for data in datas])  # None where it failed
        return [
            None if image is None else torch.as_tensor(image, device=self.device).permute(2, 0, 1)
            for image in images
        ]


def nvimgcodec_installed() -> bool:
    try:
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


def make_decoder(device: torch.device) -> JpegDecoder:
    if device.type == "cuda" and nvimgcodec_installed():
        return NvImageCodecDecoder(device)
    return TorchvisionDecoder(device)


def decoding_error(device: torch.device) -> str | None:
    """Why JPEGs cannot be decoded on `device` (one line), or None: decodes a small one there."""
    encoded = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(encoded, format="JPEG")
    sample = torch.frombuffer(bytearray(encoded.getvalue()), dtype=torch.uint8)
    try:
        (image,) = make_decoder(device)([sample])
    except (RuntimeError, OSError, ImportError) as err:  # no decoder in this build, or no start
        return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return None if image is not None else "the decoder refused a valid JPEG"
