"""Convergence on real images: vit_micro trained on scikit-learn's handwritten digits (1,797 real
8x8 scans shipped inside the package, written out as 32-px JPEGs by `accel-prepare --digits`) on
each backend, evaluated after every epoch. Writes the per-epoch top-1 curves to
bench/results/<tag>.csv and .png, and the runs' numbers to <tag>.json.

The augmentation fits the data: digits are centred and not mirror-symmetric, so a mild crop
(--scale 0.7 1, --ratio 0.9 1.1) and no flip.

    python bench/convergence.py                      # 15 epochs, eager, compile, xla, jax
    python bench/convergence.py --epochs 6 --backends eager,jax --tag digits-short
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.data.prepare import prepare_digits  # noqa: E402
from bench.compare_backends import launch_summary, write_result  # noqa: E402

BACKENDS = ("eager", "compile", "xla", "jax")
# Colours a backend keeps in every picture the project draws.
COLOURS = {"eager": "#1f77b4", "compile": "#2ca02c", "xla": "#d62728", "jax": "#9467bd"}
FLAGS = (
    "--model", "vit_micro", "--pool", "avg", "--batch_size", "32", "--workers", "2",
    "--lr", "2e-3", "--warmup_epochs", "1", "--scale", "0.7", "1", "--ratio", "0.9", "1.1",
    "--hflip", "0", "--eval_every", "1", "--log_every", "50",
)  # fmt: skip


def train_curves(data: Path, out: Path, backends: tuple[str, ...], epochs: int) -> dict:
    """{backend: summary} of each backend's run, in its own process."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    runs = {}
    for backend in backends:
        flags = [*FLAGS, "--data", str(data), "--epochs", str(epochs), "--backend", backend]
        summary = launch_summary(flags, out, backend)
        if summary is None:
            raise RuntimeError(f"the {backend} run failed")
        runs[backend] = summary
    return runs


def curves(runs: dict) -> dict[str, list[float]]:
    """Per-epoch top-1 of each run (the last from its final evaluation)."""
    return {b: [e["eval_acc"] for e in s["evals"]] for b, s in runs.items()}


def write_csv(path: Path, table: dict[str, list[float]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["epoch", *table])
        for epoch, row in enumerate(zip(*table.values(), strict=True), start=1):
            writer.writerow([epoch, *(f"{v:.4f}" for v in row)])


def plot(path: Path, table: dict[str, list[float]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for backend, values in table.items():
        epochs = range(1, len(values) + 1)
        ax.plot(epochs, values, marker="o", ms=3, label=backend, color=COLOURS.get(backend))
    ax.set(xlabel="epoch", ylabel="validation top-1", ylim=(0, 1), title=title)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(title="backend")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tag", default="cpu-digits-convergence")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_digits(Path(tmp) / "digits")
        runs = train_curves(data, Path(tmp) / "runs", tuple(args.backends.split(",")), args.epochs)
    table = curves(runs)
    results = ROOT / "bench" / "results"
    write_csv(results / f"{args.tag}.csv", table)
    title = f"vit_micro on handwritten digits, {args.epochs} epochs"
    plot(results / f"{args.tag}.png", table, title)
    record = {
        "dataset": "scikit-learn digits (UCI optical recognition), 1438 train / 359 val, 32 px",
        "flags": " ".join(FLAGS),
        "epochs": args.epochs,
        "top1_per_epoch": table,
        "final_top1": {b: s["eval_acc"] for b, s in runs.items()},
        "images_per_sec": {b: s["images_per_sec"] for b, s in runs.items()},
    }
    write_result(args.tag, record)
    for backend, values in table.items():
        print(f"{backend:8s} final top-1 {values[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
