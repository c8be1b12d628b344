"""Convergence on real images: vit_micro trained on scikit-learn's handwritten digits (1,797 real
8x8 scans shipped inside the package, written out as 32-px JPEGs by `accel-prepare --digits`) on
each backend, evaluated after every epoch. Writes the per-epoch top-1 curves to
bench/results/<tag>.csv and .png, and the runs' numbers to <tag>.json.

The augmentation fits the data: digits are centred and not mirror-symmetric, so a mild crop
(--scale 0.7 1, --ratio 0.9 1.1) and no flip.

    python bench/convergence.py                      # 15 epochs, eager, compile, xla, jax
    python bench/convergence.py --epochs 6 --backends eager,jax --tag digits-short
    python bench/convergence.py --replot              # the picture again from <tag>.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel.cli.data.prepare import prepare_digits  # noqa: E402
from bench.compare_backends import launch_summary, write_result  # noqa: E402

BACKENDS = ("eager", "compile", "xla", "jax")
# Colours a backend keeps in every picture the project draws.
COLOURS = {"eager": "#1f77b4", "compile": "#2ca02c", "xla": "#d62728", "jax": "#9467bd"}
STYLES = ("--", "-.", ":")
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


def plot(path: Path, table: dict[str, list[float]], title: str, classes: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for order, (backend, values) in enumerate(table.items()):
        epochs = range(1, len(values) + 1)
        eager = backend == "eager"
        ax.plot(
            epochs,
            values,
            "-" if eager else STYLES[order % len(STYLES)],
            marker="o",
            ms=3,
            lw=4 if eager else 1.4,  # eager wide and beneath: the lines that agree with it show
            alpha=0.45 if eager else 1.0,
            zorder=1 if eager else 2,
            label=f"{backend} ({values[-1]:.3f})",
            color=COLOURS.get(backend),
        )
    ax.axhline(1 / classes, color="black", ls=":", lw=1)
    ax.text(1, 1 / classes, f" chance ({1 / classes:.2f})", va="bottom", fontsize=8)
    ax.set(xlabel="epoch", ylabel="validation top-1", ylim=(0, 1), title=title)
    ax.title.set_fontsize(9)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(title="backend (final top-1)", fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def title_of(record: dict) -> str:
    return (
        f"vit_micro on handwritten digits, {record['epochs']} epochs, one run of each backend\n"
        f"{record['device']}, {record['date'][:10]}; validation after every epoch"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tag", default="cpu-digits-convergence")
    p.add_argument("--replot", action="store_true", help="redraw <tag>.png from <tag>.json")
    args = p.parse_args()
    results = ROOT / "bench" / "results"
    if args.replot:
        record = json.loads((results / f"{args.tag}.json").read_text())
        plot(results / f"{args.tag}.png", record["top1_per_epoch"], title_of(record))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_digits(Path(tmp) / "digits")
        runs = train_curves(data, Path(tmp) / "runs", tuple(args.backends.split(",")), args.epochs)
    table = curves(runs)
    write_csv(results / f"{args.tag}.csv", table)
    record = {
        "dataset": "scikit-learn digits (UCI optical recognition), 1438 train / 359 val, 32 px",
        "flags": " ".join(FLAGS),
        "epochs": args.epochs,
        "top1_per_epoch": table,
        "final_top1": {b: s["eval_acc"] for b, s in runs.items()},
        # Speed is not what this run measures (short epochs, an evaluation after each); kept
        # with the part of the loop spent waiting for data, which says whether the loader set it.
        "images_per_sec": {b: s["images_per_sec"] for b, s in runs.items()},
        "data_wait_fraction": {b: s.get("data_wait_fraction") for b, s in runs.items()},
    }
    write_result(args.tag, record)
    record = json.loads((results / f"{args.tag}.json").read_text())  # with its date and device
    plot(results / f"{args.tag}.png", table, title_of(record))
    for backend, values in table.items():
        print(f"{backend:8s} final top-1 {values[-1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
