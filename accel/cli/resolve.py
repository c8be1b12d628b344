"""From the command line's config to the one a run trains with: every option checked (ranges,
combinations, what the backend supports, the data and the model), then what was left open settled
once (backend, class count, run length, decode device, run name). Nothing here creates a file."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import torch

import accel
from accel.backends import Supports
from accel.checkpoint import read_meta
from accel.cli.checkpoints import latest_checkpoint, resume_mismatches, saved_config
from accel.cli.config import DEFAULT_EPOCHS, RunConfig, data_replicas, replace_path, validate
from accel.cli.data.augment import check_augment
from accel.cli.data.config import DataConfig
from accel.cli.data.folder import count_images
from accel.cli.data.loaders import folder_num_classes
from accel.cli.job import backend_config
from accel.cli.memory_check import check_memory
from accel.cli.models.factory import check_input_size, check_model_name, meta_model
from accel.cli.models.pretrained import fit, read_state_dict, source_of
from accel.cli.recipes import describe
from accel.cli.runs import check_free, latest_resumable, new_run_name
from accel.config import AccelError
from accel.distributed import hosts_joining


def check_data(cfg: RunConfig) -> int:
    """The class count, once the data is known to hold at least one global batch."""
    found = folder_num_classes(cfg.data)  # raises DatasetError for a missing or empty folder
    given = cfg.model.num_classes
    if found is not None and given is not None and given != found:
        raise AccelError(f"--num_classes {given} disagrees with the {found} class folders")
    classes = found if found is not None else given or 10
    if classes < 2:
        raise AccelError(f"{cfg.data.source} has {classes} class folder: training needs 2 or more")
    length = cfg.data.synthetic_length if found is None else count_images(cfg.data.source)
    if cfg.data.aug_repeats > 1 and length < data_replicas(cfg):
        raise AccelError(
            f"--aug_repeats: {length} training images cannot be spread over "
            f"{data_replicas(cfg)} data-parallel ranks"
        )
    needed = cfg.batch_size * data_replicas(cfg)
    if length < needed:
        raise AccelError(
            f"the training set holds {length} images, fewer than one global batch ({needed})"
        )
    return classes


@contextlib.contextmanager
def named_by(flags: str) -> Iterator[None]:
    """A library refusal inside, said as the flags that set what it refuses."""
    try:
        yield
    except AccelError as err:
        raise AccelError(f"{flags}: {err}") from None


def check_splits(cfg: RunConfig, settled: accel.Settled) -> None:
    """The mesh over every node's processes and the pipeline's micro-batches, checked by the
    library as prepare and the step will check them (Settled.mesh_line, accel.check_batch):
    refused here, before any process starts."""
    hosts, mesh = cfg.hosts, cfg.accel.mesh
    where = f" x --nnodes {hosts.nnodes}" if hosts.nnodes > 1 else ""
    with named_by(f"--nproc_per_node {mesh.devices}{where}"):
        settled.mesh_line(hosts.nnodes * mesh.devices)
    with named_by(f"--batch_size {cfg.batch_size}"):
        accel.check_batch(settled.config, cfg.batch_size)


def check_model(cfg: RunConfig, settled: accel.Settled) -> None:
    """--model, its input size, and what the layout cuts of it (the tensor split's layers, the
    pipeline's blocks, the split classifier), checked by the library on the model built on the
    meta device as prepare will check it on every rank: refused here, before any process
    starts. The library's word for the model is its --model name here."""
    check_model_name(cfg.model.name)
    check_input_size(cfg.model)
    mesh = cfg.accel.mesh
    if mesh.pp < 2 and mesh.tp < 2 and mesh.tp_head < 2:
        return
    try:
        accel.check_layout(meta_model(cfg.model), settled.config)
    except AccelError as err:
        raise AccelError(str(err).replace("the model ", f"{cfg.model.name} ")) from None


def mesh_notes(cfg: RunConfig, settled: accel.Settled) -> list[str]:
    """The model-parallel mesh, and the padding of a split classifier."""
    mesh = cfg.accel.mesh
    if max(mesh.tp, mesh.tp_head) == 1 and mesh.pp == 1:
        return []
    line = settled.mesh_line(cfg.hosts.nnodes * mesh.devices)
    if mesh.pp > 1:
        line += f", {mesh.pp_schedule} schedule, {mesh.pp_microbatches} micro-batches"
    if mesh.tp_head < 2:
        return [line]
    classes, size = cast(int, cfg.model.num_classes), mesh.tp_head  # settled by resolve()
    padded = -(-classes // size) * size
    if padded == classes:
        return [line]
    return [
        line,
        f"{classes} classes over tp {size}: the classifier is padded to {padded} rows, "
        f"the {padded - classes} padded classes masked out of the softmax",
    ]


def check_gpu_count(cfg: RunConfig, replicas: str) -> None:
    """One process a GPU: no more processes than visible GPUs."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    procs = cfg.accel.mesh.devices
    if replicas == "processes" and gpus and procs > gpus:
        raise AccelError(f"--nproc_per_node {procs} exceeds the {gpus} visible GPUs")


def resolve_decode_on(cfg: RunConfig, gpu_decoding: bool = True) -> tuple[str, str | None]:
    """Where JPEGs are decoded (--data_device), and a line to print where it falls back: on the
    GPU by default when training from a folder on one, where a GPU decoder works."""
    data = cfg.data
    if data.data_device == "cpu":
        return "workers", None
    if data.is_synthetic:
        reason = "--data synthetic has no JPEGs to decode"
    elif not gpu_decoding:
        reason = f"the {cfg.backend} backend does not take batches decoded on the GPU"
    elif not torch.cuda.is_available():
        reason = "no CUDA GPU is visible to torch"
    else:
        reason = None
    if reason and data.data_device == "gpu":
        raise AccelError(f"--data_device gpu: {reason}")
    if reason:
        return "workers", None
    from accel.cli.data.jpeg_decoders import decoding_error

    refused = decoding_error(torch.device("cuda"))
    if refused:
        return "workers", f"no GPU JPEG decoder ({refused}): JPEGs are decoded by the CPU workers"
    return "cuda", None


def resolve_run_name(cfg: RunConfig) -> str:
    """The run folder: given, the latest resumable run of this model and backend (--resume
    auto), or a new timestamp."""
    if cfg.run_name:
        return cfg.run_name
    parent = Path(cfg.output) / cfg.model.name / str(cfg.backend)
    latest = latest_resumable(parent) if cfg.resume == "auto" else None
    return latest.name if latest else new_run_name()


def check_resume(cfg: RunConfig) -> None:
    """The checkpoint to resume exists, is ours, and fits this job (the world size aside: a
    checkpoint loads at any, with a warning)."""
    if cfg.resume and cfg.resume != "auto" and not Path(cfg.resume).exists():
        raise AccelError(f"--resume: checkpoint not found: {cfg.resume}")
    path = cfg.resume if cfg.resume != "auto" else latest_checkpoint(cfg.run_dir())
    if not path:
        return
    meta = read_meta(Path(path))
    problems = resume_mismatches(saved_config(meta), cfg, 0, 0)
    if problems:
        raise AccelError(f"cannot resume from {path}: {'; '.join(problems)}")


IMAGE_AUGMENTATION = ("scale", "ratio", "hflip", "vflip", "color_jitter", "aa")


def augmentation_notes(cfg: RunConfig) -> list[str]:
    """Synthetic images are made at the input size, untransformed: the image augmentation
    flags given would do nothing there, and the user is told so."""
    default = DataConfig()
    given = [f"--{n}" for n in IMAGE_AUGMENTATION if getattr(cfg.data, n) != getattr(default, n)]
    if not (cfg.data.is_synthetic and given):
        return []
    return [
        f"--data synthetic: {', '.join(given)} act on image folders only "
        "(--reprob and mixup apply here)"
    ]


def check_start_weights(cfg: RunConfig) -> list[str]:
    """The --pretrained(_path) weights fit the model (names and shapes, checked on the meta
    device); what to tell the user of them."""
    model = cfg.model
    source = source_of(model.name, model.pretrained, model.pretrained_path)
    if source is None:
        return []
    _, fresh_head = fit(meta_model(model).model, read_state_dict(source), str(source))
    return [f"starting weights from {source}"] + ([fresh_head] if fresh_head else [])


def check_output(cfg: RunConfig) -> None:
    """The output folder can be made (no file in its way)."""
    for parent in (Path(cfg.output), *Path(cfg.output).parents):
        if parent.exists():
            if not parent.is_dir():
                raise AccelError(f"--output {cfg.output}: {parent} is a file, not a folder")
            return


def jax_hosts(cfg: RunConfig) -> RunConfig:
    """jax processes started as hosts that meet (docs/parallelism.md:
    accel.distributed.hosts_joining) are the nodes of one job, as with --nnodes: the global
    batch, the checkpoints' and the summary's, counts every process's share."""
    processes, place = hosts_joining()
    if cfg.backend != "jax" or cfg.hosts.nnodes > 1 or processes < 2:
        return cfg
    hosts = dataclasses.replace(cfg.hosts, nnodes=processes, node_rank=place)
    return dataclasses.replace(cfg, hosts=hosts)


def resolve(cfg: RunConfig, env: dict[str, str]) -> tuple[RunConfig, Supports, list[str]]:
    """The checked, settled config, what its backend runs, and what to tell the user of it. The
    backend's settings are checked by accel.settle, as a script's are by prepare."""
    validate(cfg)
    check_augment(cfg.data)
    backend, why = accel.resolve_backend(cfg.backend, env)
    cfg = jax_hosts(replace_path(cfg, "accel.backend", backend))
    notes = [f"backend {backend} ({why})"]
    settled = accel.settle(backend_config(cfg), env)
    supports = settled.supports
    # --data_device gpu hands the backend batches decoded on the CUDA device.
    if cfg.data.data_device == "gpu" and not supports.cuda_batches:
        raise AccelError(
            f"--data_device gpu is not supported by the {backend} backend (launch_single_task "
            "--backends shows what each backend runs)"
        )
    check_gpu_count(cfg, supports.replicas)
    check_splits(cfg, settled)
    check_model(cfg, settled)
    on_gpu = torch.cuda.is_available() and supports.cuda_batches
    check_memory(cfg, supports.replicas, on_gpu)
    classes = check_data(cfg)
    check_output(cfg)
    if cfg.steps is None and cfg.epochs is None:
        notes.append(
            f"no --steps or --epochs given: training {DEFAULT_EPOCHS} epoch of {cfg.data.source}"
        )
        cfg = dataclasses.replace(cfg, epochs=DEFAULT_EPOCHS)
    decode_on, fallback = resolve_decode_on(cfg, supports.cuda_batches)
    notes += [fallback] if fallback else []
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, num_classes=classes),
        data=dataclasses.replace(cfg.data, decode_on=decode_on),
    )
    notes += check_start_weights(cfg) + augmentation_notes(cfg)
    cfg = dataclasses.replace(cfg, run_name=resolve_run_name(cfg))
    check_free(cfg.run_dir())
    check_resume(cfg)
    return cfg, supports, describe(cfg) + notes + mesh_notes(cfg, settled)
