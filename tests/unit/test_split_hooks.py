"""What the pipeline and the split classifier need of a model and a loss comes as hooks any model
can give (accel.parallel's `Pipelined`, `HasClassifier`; accel.logits' `FromLogits`); the command
line's model, loss and metric give them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.backends.base import final_layer_parameters
from accel.cli.models import ModelConfig, create_model
from accel.cli.task import classifier_loss, classifier_metrics
from accel.logits import FromLogits
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
    assert final_layer_parameters(model) == list(model.model.head.parameters())


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


class TargetsFirst:
    """A user's own loss over batches (targets, inputs) of class labels: it says where its
    batch holds what the split layouts compute their own way."""

    def logits_parts(self, batch):
        targets, inputs = batch
        return (inputs,), (targets,)

    def from_logits(self, logits, labels):
        return nn.functional.cross_entropy(logits, labels)

    def from_shards(self, shards, labels):
        return shards.cross_entropy(labels).mean()

    def __call__(self, model, batch):
        args, targets = self.logits_parts(batch)
        return self.from_logits(model(*args), *targets)


def test_a_loss_or_metric_of_any_class_that_computes_from_logits_is_a_split_one():
    assert isinstance(classifier_loss, FromLogits)
    assert isinstance(classifier_metrics, FromLogits)
    assert isinstance(TargetsFirst(), FromLogits)
    assert not isinstance(lambda model, batch: model(batch[0]).sum(), FromLogits)
    logits, targets = torch.randn(3, 5), torch.softmax(torch.randn(3, 5), -1)
    assert classifier_loss.logits_parts((logits, targets)) == ((logits,), (targets,))
    rects = torch.zeros(3, 4)
    assert classifier_loss.logits_parts((logits, targets, rects))[0] == (logits, rects)
    hard = torch.eye(5)[targets.argmax(-1)]
    torch.testing.assert_close(
        TargetsFirst()(lambda x: x, (targets.argmax(-1), logits)),
        classifier_loss(lambda x: x, (logits, hard)),
    )


def test_the_metric_of_no_rows_gives_its_names_with_zeros():
    """A pipeline's stages without the logits add these to the last stage's sums."""
    labels, mask = torch.tensor([1, 0]), torch.tensor([True, False])
    sums = classifier_metrics(lambda x: x, (torch.tensor([[0.0, 1.0], [1.0, 0.0]]), labels, mask))
    none = classifier_metrics.from_logits(torch.zeros(0, 1), labels[:0], mask[:0])
    assert list(none) == list(sums) and all(float(v) == 0.0 for v in none.values())
    assert float(sums["correct"]) == 1.0 and float(sums["count"]) == 1.0
