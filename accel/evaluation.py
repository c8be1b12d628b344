"""Evaluation of a training run: loss, top-1 and top-5 on the validation split, of the live
weights and (with --model_ema) of their EMA, at the end and every --eval_every epochs."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from accel.backends import Backend
from accel.config import RunConfig
from accel.data.loaders import build_eval_loader

EMA_SUFFIX = "_ema"


class Evaluator:
    def __init__(
        self,
        cfg: RunConfig,
        backend: Backend,
        image_size: int,
        host_batch: int,
        shard: tuple[int, int],
        track: Callable[[Iterable[dict]], Iterator[dict]],
    ):
        self.cfg, self.backend, self.track = cfg, backend, track
        self.args = (cfg.data, image_size, host_batch, shard, cfg.seed, cfg.model.num_classes)

    def _pass(self, ema: bool) -> dict[str, float]:
        loader = build_eval_loader(*self.args)
        return self.backend.evaluate(self.track(loader), ema=ema)

    def __call__(self) -> dict[str, float]:
        """eval_loss, eval_acc, eval_acc5, eval_images, and their _ema twins where kept."""
        results = self._pass(ema=False)
        if self.cfg.optim.model_ema:
            ema = self._pass(ema=True)
            results |= {k + EMA_SUFFIX: v for k, v in ema.items() if k != "eval_images"}
        return results
