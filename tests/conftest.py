import os
import sys
from pathlib import Path

# Backends run for real on the CPU: torch_xla through PJRT CPU, JAX on its CPU platform.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The XLA runtime must start before the first autograd backward of the process: the autograd
# engine sizes its per-device queues then, and later XLA backwards fail. The suite runs eager and
# xla tests in one process, so start it here, at collection.
import torch_xla  # noqa: E402

torch_xla.device()
