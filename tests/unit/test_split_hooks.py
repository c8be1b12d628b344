"""What the pipeline and the split classifier need of a model and a loss comes as hooks any model
can give (accel.parallel's `Pipelined`, `HasClassifier`; accel.losses' `SoftTargetBatches`,
`ClassificationBatches`); the command line's model and loss give them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.cli.models import ModelConfig, create_model
from accel.cli.task import classifier_loss, classifier_metrics
from accel.losses import (
    ClassificationBatches,
    ClassificationSums,
    SoftTargetBatches,
    SoftTargetLoss,
    soft_target_loss,
)
from accel.parallel import fsdp, pipeline, tp_head
from accel.parallel.materialize import named_tensors


def meta_vit() -> nn.Module:
    with torch.device("meta"):
        return create_model(ModelConfig("vit_micro"))


def test_the_command_line_model_gives_the_hooks_of_the_split_layouts():
    model = meta_vit()
    stem, vit = pipeline.pipeline_parts(model)
    assert stem is model.input_norm and vit is model.model
    assert tp_head.linear_classifier(model) is model.model.head
    assert fsdp.transformer_blocks(model) == list(model.model.blocks)
    assert model.classifier_parameters() == list(model.model.head.parameters())


def test_a_stage_keeps_the_whole_models_names_the_first_with_the_normalisation():
    model = meta_vit()
    whole = dict(named_tensors(model))
    depth = len(model.model.blocks)
    first = pipeline.ViTStage(model, range(0, 1), first=True, last=False)
    last = pipeline.ViTStage(model, range(1, depth), first=False, last=True)
    names = [set(dict(named_tensors(s))) for s in (first, last)]
    assert names[0] <= set(whole) and names[1] <= set(whole)
    assert "input_norm.mean" in names[0] and "input_norm.mean" not in names[1]
    assert "model.head.weight" in names[1] and "model.head.weight" not in names[0]


def test_a_model_without_the_hooks_is_refused_naming_what_it_must_give():
    plain = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"pp= cuts a model that gives pipeline_parts\(\)"):
        pipeline.pipeline_parts(plain)
    with pytest.raises(ValueError, match=r"tp_head= splits the linear classifier .*get_classifier"):
        tp_head.linear_classifier(plain)


@pytest.mark.parametrize(
    ("model", "mesh", "says"),
    [
        ("plain", {"pp": 2}, r"^pp= cuts a model that gives pipeline_parts\(\)"),
        ("vit", {"pp": 4}, r"^pp=4 \(1f1b\) needs 4 stages, the model has 2 blocks$"),
        ("vit", {"pp": 2, "pp_schedule": "interleaved"}, "needs 4 stages"),
        ("plain", {"tp_head": 2}, r"^tp_head= splits the linear classifier"),
        ("vit", {"tp": 3}, "not divisible by 3"),
    ],
)
def test_what_a_layout_cuts_is_checked_once_before_anything_is_built(model, mesh, says):
    """prepare's one check of the model (accel/checks.py) refuses, in one line, what a layout
    would find missing only while cutting the model: the backends check none of it."""
    from accel.checks import check_layout
    from accel.config import AccelError, BackendConfig, MeshConfig

    given = meta_vit() if model == "vit" else nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(AccelError, match=says):
        check_layout(given, BackendConfig("eager", mesh=MeshConfig(**mesh)))
    assert check_layout(meta_vit(), BackendConfig("eager", mesh=MeshConfig(pp=2, tp_head=2))) == {}


def test_the_command_line_loss_and_metric_declare_what_they_compute():
    assert isinstance(classifier_loss, SoftTargetLoss)
    assert isinstance(classifier_metrics, ClassificationSums)
    logits, targets = torch.randn(3, 5), torch.softmax(torch.randn(3, 5), -1)
    loss = classifier_loss(lambda x: x, (logits, targets))
    torch.testing.assert_close(loss, soft_target_loss(logits, targets))


class TargetsFirst:
    """A user's own soft-target loss over batches (targets, inputs): it says where its batch
    holds what the split layouts compute their own way."""

    def soft_target_parts(self, batch):
        targets, inputs = batch
        return inputs, targets, ()

    def __call__(self, model, batch):
        inputs, targets, _ = self.soft_target_parts(batch)
        return soft_target_loss(model(inputs), targets)


def test_a_loss_of_any_class_that_says_where_its_batch_holds_its_parts_is_a_split_loss():
    assert isinstance(classifier_loss, SoftTargetBatches)
    assert isinstance(classifier_metrics, ClassificationBatches)
    assert isinstance(TargetsFirst(), SoftTargetBatches)
    assert not isinstance(lambda model, batch: model(batch[0]).sum(), SoftTargetBatches)
    assert not isinstance(TargetsFirst(), ClassificationBatches)
    logits, targets = torch.randn(3, 5), torch.softmax(torch.randn(3, 5), -1)
    inputs, parts_targets, extras = TargetsFirst().soft_target_parts((targets, logits))
    assert inputs is logits and parts_targets is targets and extras == ()
    torch.testing.assert_close(
        TargetsFirst()(lambda x: x, (targets, logits)),
        classifier_loss(lambda x: x, (logits, targets)),
    )
    mask = torch.tensor([True, True, False])
    labels = targets.argmax(-1)
    assert classifier_metrics.classification_parts((logits, labels, mask))[2] is mask
