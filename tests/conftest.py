import os
import sys
from pathlib import Path

import pytest

# Backends run for real on the CPU: torch_xla through PJRT CPU, JAX on its CPU platform.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.backends.quiet import quiet_imports  # noqa: E402

try:
    with quiet_imports():
        import torch_xla
except ImportError:  # only where torch_xla cannot be installed (newer torch): see below
    torch_xla = None

if torch_xla is not None:
    # The XLA runtime must start before the first autograd backward of the process: the
    # autograd engine sizes its per-device queues then, and later XLA backwards fail. The suite
    # runs eager and xla tests in one process, so start it here, at collection.
    torch_xla.device()

from PIL import Image  # noqa: E402

from accel.data.prepare import prepare_mock_imagenet  # noqa: E402

pytest_plugins = ["tests.shared_runs"]

NO_XLA = "torch_xla is not installed: its last release (2.9) pairs only with torch 2.9"


NO_GPU = "no CUDA device is visible to torch"


def pytest_collection_modifyitems(config, items):
    """Tests marked `xla` need torch_xla. `make test` (CI) installs it and sets
    ACCEL_REQUIRE_XLA, so there a missing torch_xla fails the run instead of skipping them; on
    a newer torch (`make test-latest`) they are skipped, each with the reason. Tests marked
    `gpu` are skipped, with the reason, where no CUDA device is visible."""
    import torch

    no_gpu = not torch.cuda.is_available()
    if torch_xla is None and os.environ.get("ACCEL_REQUIRE_XLA"):
        raise pytest.UsageError(f"ACCEL_REQUIRE_XLA is set but {NO_XLA}")
    for item in items:
        if "xla" in item.keywords and torch_xla is None:
            item.add_marker(pytest.mark.skip(reason=NO_XLA))
        if "gpu" in item.keywords and no_gpu:
            item.add_marker(pytest.mark.skip(reason=NO_GPU))


@pytest.fixture(scope="module")
def one_white_image(tmp_path_factory):
    """Real JPEGs, one of them all white: the NaN-on-white model's batch with it is non-finite."""
    root = prepare_mock_imagenet(
        tmp_path_factory.mktemp("white") / "imagenet",
        classes=2,
        per_class=8,  # 16 images, batch 4: every image is in exactly one step per epoch
        val_per_class=1,
        size=40,
        progress=False,
    )
    target = next((root / "train").glob("*/*.JPEG"))
    Image.new("RGB", (40, 40), (255, 255, 255)).save(target, quality=100)
    return root
