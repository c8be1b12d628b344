"""Starting weights: timm's own from the local cache (--pretrained), or a file (--pretrained_path):
a timm state dict (.safetensors, or .pth/.bin of plain tensors) or one of our one-file checkpoints.

Nothing is unpickled beyond tensors (safetensors, or torch.load(weights_only=True)), and nothing is
downloaded: --pretrained reads the file timm would have fetched, where timm keeps it. The state
goes through the model's own timm checkpoint filter (position-embedding resizing and the like),
then must fit the model's names and shapes exactly, the classifier excepted when the class count
differs: that head starts fresh.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import cast

import timm
import torch
from torch import nn

OUR_PREFIX = "model."  # the ImageClassifier wrapper's name for the timm model inside it


class PretrainedError(ValueError):
    """Weights that cannot start this model: one line, exit 2."""


def timm_cache_file(name: str) -> Path:
    """The local copy of timm's weights for `name`, where timm looks for it (the Hugging Face
    hub cache, then torch hub's checkpoints folder)."""
    import huggingface_hub

    pcfg = timm.models.get_pretrained_cfg(name)
    # timm's type also allows a (url, filename) pair, which none of its model configs uses.
    hub, url = (pcfg.hf_hub_id, cast("str | None", pcfg.url)) if pcfg else (None, None)
    if hub:
        for filename in ("model.safetensors", "pytorch_model.bin"):
            found = huggingface_hub.try_to_load_from_cache(hub.split("@")[0], filename)
            if isinstance(found, str):
                return Path(found)
    if url:
        found = Path(torch.hub.get_dir()) / "checkpoints" / Path(url).name
        if found.is_file():
            return found
    places = []
    if hub:
        places.append(f"{huggingface_hub.constants.HF_HUB_CACHE} (hub {hub})")
    if url:
        places.append(f"{Path(torch.hub.get_dir()) / 'checkpoints'} ({Path(url).name})")
    if not places:
        raise PretrainedError(f"--pretrained: timm has no weights for {name}")
    raise PretrainedError(
        f"--pretrained: no local copy of {name}'s weights; timm looks in {' and '.join(places)}. "
        "Fetch them once where a network is reachable, or give --pretrained_path FILE"
    )


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors by timm name from a weights file or one of our one-file checkpoints."""
    if path.is_dir():
        raise PretrainedError(
            f"--pretrained_path {path} is a sharded checkpoint folder: export it first "
            f"(accel-export {path} --out model.safetensors)"
        )
    if not path.is_file():
        raise PretrainedError(f"--pretrained_path: no file {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # pickled code, or not a torch file at all
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PretrainedError(
            f"--pretrained_path {path}: not a file of tensors ({first})"
        ) from None
    if isinstance(raw, dict) and isinstance(raw.get("state"), dict) and "model" in raw["state"]:
        return {k.removeprefix(OUR_PREFIX): v for k, v in raw["state"]["model"].items()}
    for key in ("state_dict", "model", "module"):  # timm's and common training checkpoints
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            raw = raw[key]
    if not isinstance(raw, dict) or not all(torch.is_tensor(v) for v in raw.values()):
        raise PretrainedError(f"--pretrained_path {path}: not a state dict of tensors")
    return raw


def _filtered(state: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The state through the model's own timm checkpoint filter, where its module has one."""
    filter_fn = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    return filter_fn(state, model) if filter_fn else state


def _head_keys(model: nn.Module) -> set[str]:
    heads = cast(dict, model.pretrained_cfg).get("classifier") or ()  # timm's, on its models
    heads = (heads,) if isinstance(heads, str) else heads
    return {f"{h}.{leaf}" for h in heads for leaf in ("weight", "bias")}


def fit(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> tuple[dict, str | None]:
    """The state the timm `model` loads, and a line where its classifier starts fresh; raises
    naming the first names or shapes that do not fit."""
    state = _filtered(state, model)
    want = model.state_dict()
    heads = _head_keys(model) & want.keys()
    note = None
    if any(k in state and state[k].shape != want[k].shape for k in heads):
        given = state[next(k for k in sorted(heads) if k.endswith("weight"))].shape[0]
        note = (
            f"{source}: a fresh classifier ({given} classes there, "
            f"{want[sorted(heads)[-1]].shape[0]} here)"
        )
        state = {k: v for k, v in state.items() if k not in heads}
    missing = [k for k in want if k not in state and not (note and k in heads)]
    extra = [k for k in state if k not in want]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs {tuple(want[k].shape)}"
        for k in state
        if k in want and state[k].shape != want[k].shape
    ]
    problems = [
        f"{what}: {', '.join(items[:3])}{' ...' if len(items) > 3 else ''}"
        for what, items in (("missing", missing), ("unexpected", extra), ("shapes", shapes))
        if items
    ]
    if problems:
        name = cast(dict, model.pretrained_cfg).get("architecture")
        raise PretrainedError(f"{source} does not fit {name}: {'; '.join(problems)}")
    return state, note


def source_of(name: str, pretrained: bool, path: str) -> Path | None:
    if path:
        return Path(path)
    return timm_cache_file(name) if pretrained else None


def load_pretrained(model: nn.Module, name: str, pretrained: bool, path: str) -> str | None:
    """Fill the timm `model` with its starting weights; returns the fresh-head line, if any."""
    source = source_of(name, pretrained, path)
    if source is None:
        return None
    state, note = fit(model, read_state_dict(source), str(source))
    model.load_state_dict(state, strict=False)  # fit() checked every name and shape
    return note
