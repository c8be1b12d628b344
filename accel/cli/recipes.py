"""--recipe: the published hyper-parameters of a training recipe, under any option given
explicitly. The learning rate is the paper's base rate scaled linearly with the global batch, by
the base batch that paper (or its official code) scales from, unless --lr is given.

Sources (docs/training.md cites them too):
- swin_tiny_in1k: Liu et al., "Swin Transformer", ICCV 2021, Appendix A2.1, and the official
  configs/swin/swin_tiny_patch4_window7_224.yaml; lr 5e-4 per 512 images (main.py's rule).
- deit_base_in1k: Touvron et al., "Training data-efficient image transformers", ICML 2021,
  Table 9; lr 5e-4 per 512 images (the paper's rule, lr = 0.0005 x batch / 512).
- vit_finetune: He et al., "Masked Autoencoders Are Scalable Vision Learners", CVPR 2022,
  Table 9 (end-to-end fine-tuning of ViT-B); lr 5e-4 per 256 images (its blr rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accel.cli.config import RunConfig, from_dict, get_path, global_batch, set_nested


@dataclass(frozen=True)
class Recipe:
    source: str
    base_lr: float
    base_batch: int  # the linear rule: lr = base_lr x global batch / base_batch
    values: dict[str, Any]  # dotted config path -> value


_REGULARISED = {
    "data.aa": "rand-m9-mstd0.5-inc1",
    "data.reprob": 0.25,
    "data.remode": "pixel",
    "data.mixup.mixup_alpha": 0.8,
    "data.mixup.cutmix_alpha": 1.0,
    "data.label_smoothing": 0.1,
    "data.train_interpolation": "bicubic",
    "optim.weight_decay": 0.05,
}

RECIPES = {
    "swin_tiny_in1k": Recipe(
        source="Swin Transformer (Liu et al., ICCV 2021), official swin_tiny config",
        base_lr=5e-4,
        base_batch=512,
        values={
            **_REGULARISED,
            "model.name": "swin_tiny_patch4_window7_224",
            "model.drop_path_rate": 0.2,
            "data.color_jitter": 0.4,
            "epochs": 300,
            "optim.warmup_epochs": 20.0,
            "optim.min_lr": 5e-6,
            "accel.step.clip_grad": 5.0,
        },
    ),
    "deit_base_in1k": Recipe(
        source="DeiT (Touvron et al., ICML 2021), Table 9",
        base_lr=5e-4,
        base_batch=512,
        values={
            **_REGULARISED,
            "model.name": "deit_base_patch16_224",
            "model.drop_path_rate": 0.1,
            "data.color_jitter": 0.3,
            "data.aug_repeats": 3,
            "epochs": 300,
            "optim.warmup_epochs": 5.0,
            "optim.min_lr": 1e-5,
            "accel.step.clip_grad": 0.0,
            "optim.model_ema": True,
            "optim.model_ema_decay": 0.99996,
        },
    ),
    "vit_finetune": Recipe(
        source="MAE (He et al., CVPR 2022), Table 9, ViT-B end-to-end fine-tuning",
        base_lr=5e-4,
        base_batch=256,
        values={
            **_REGULARISED,
            "model.name": "vit_base_patch16_224",
            "model.pretrained": True,
            "model.drop_path_rate": 0.1,
            "optim.betas": (0.9, 0.999),
            "optim.layer_decay": 0.65,
            "epochs": 100,
            "optim.warmup_epochs": 5.0,
            "optim.min_lr": 1e-6,
            "accel.step.clip_grad": 0.0,
        },
    ),
}


def _given(nested: dict, dotted: str) -> bool:
    for key in dotted.split("."):
        if not isinstance(nested, dict) or key not in nested:
            return False
        nested = nested[key]
    return True


def apply_recipe(nested: dict) -> dict:
    """The parsed options (only those given, nested) with the recipe's values beneath them, and
    the learning rate scaled to the global batch unless --lr was given."""
    name = nested.get("recipe", "")
    if not name:
        return nested
    recipe = RECIPES[name]
    lr_given = _given(nested, "optim.lr")
    if _given(nested, "steps"):  # --steps sets the length: the recipe's epochs step aside
        nested.setdefault("epochs", None)
    for dotted, value in recipe.values.items():
        set_nested(nested, dotted, value, keep=True)  # an option given explicitly wins
    if not lr_given:
        batch = global_batch(from_dict(RunConfig, nested))
        set_nested(nested, "optim.lr", recipe.base_lr * batch / recipe.base_batch)
    return nested


def describe(cfg: RunConfig) -> list[str]:
    """What the recipe resolved to, for the first lines of the log."""
    if not cfg.recipe:
        return []
    recipe = RECIPES[cfg.recipe]
    values = ", ".join(
        f"{path.rsplit('.', 1)[-1]} {get_path(cfg, path)}" for path in sorted(recipe.values)
    )
    rule = (
        f"lr {cfg.optim.lr:g} (linear rule: {recipe.base_lr:g} x global batch "
        f"{global_batch(cfg)} / {recipe.base_batch}, unless --lr is given)"
    )
    return [f"recipe {cfg.recipe} ({recipe.source}): {rule}", f"recipe values: {values}"]
