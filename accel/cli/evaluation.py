"""Evaluation of a training run: loss, top-1 and top-5 on the validation split, of the live
weights and (with --model_ema) of their EMA, at the end and every --eval_every epochs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from accel.cli.config import RunConfig
from accel.cli.data.loaders import build_eval_loader
from accel.cli.models.factory import input_size
from accel.cli.task import classifier_metrics, summarise
from accel.engine import Engine

EMA_SUFFIX = "_ema"


def evaluate_classifier(engine: Engine, loader: Iterable[dict], ema: bool = False) -> dict:
    """eval_loss, eval_acc, eval_acc5 and eval_images over an evaluation loader's masked,
    padded batches: the public API's evaluation with the command line's metric; one path."""
    batches = ((b["images"], b["labels"], b["mask"]) for b in loader)
    return summarise(engine.evaluate(batches, classifier_metrics, ema=ema))


class Evaluator:
    """The run's evaluation passes over the validation split, each rank reading its share."""

    def __init__(self, cfg: RunConfig, engine: Engine, host_batch: int, tracker: Any):
        """`tracker`: what records the images the loader's workers skip (its `track`)."""
        self.cfg, self.engine, self.track = cfg, engine, tracker.track
        shard = (engine.rank, engine.data_ranks)
        image_size = input_size(cfg.model)[-1]
        classes = cast(int, cfg.model.num_classes)  # settled by resolve()
        self.args = (cfg.data, image_size, host_batch, shard, cfg.seed, classes)

    def _pass(self, ema: bool) -> dict[str, float]:
        loader = build_eval_loader(*self.args)
        return evaluate_classifier(self.engine, self.track(loader), ema)

    def __call__(self) -> dict[str, float]:
        """eval_loss, eval_acc, eval_acc5, eval_images, and their _ema twins where kept."""
        results = self._pass(ema=False)
        if self.cfg.optim.model_ema:
            ema = self._pass(ema=True)
            results |= {k + EMA_SUFFIX: v for k, v in ema.items() if k != "eval_images"}
        return results
