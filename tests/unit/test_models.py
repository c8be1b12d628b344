import os

import pytest
import torch

from accel.cli.models.factory import ModelConfig, UnknownModelError, check_model_name, create_model


@pytest.mark.parametrize("name", ["vit_micro", "swin_micro"])
@pytest.mark.parametrize("pool", ["token", "avg"])
def test_micro_models_take_uint8_and_give_logits(name, pool):
    model = create_model(ModelConfig(name, num_classes=7, pool=pool))
    images = torch.randint(0, 256, (2, *model.input_size), dtype=torch.uint8)
    logits = model(images)
    assert logits.shape == (2, 7)
    assert logits.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_avg_pool_removes_the_class_token():
    assert create_model(ModelConfig("vit_micro")).model.cls_token is not None
    assert create_model(ModelConfig("vit_micro", pool="avg")).model.cls_token is None


def test_normalisation_happens_inside_the_model():
    model = create_model(ModelConfig("vit_micro"))
    images = torch.randint(0, 256, (2, *model.input_size), dtype=torch.uint8)
    expected = model.model(
        (images.float() / 255 - torch.tensor(model.model.pretrained_cfg["mean"]).view(1, 3, 1, 1))
        / torch.tensor(model.model.pretrained_cfg["std"]).view(1, 3, 1, 1)
    )
    torch.testing.assert_close(model(images), expected, rtol=1e-4, atol=1e-5)


def test_unknown_model_names_close_matches():
    with pytest.raises(UnknownModelError, match="vit_micro"):
        check_model_name("vit_mirco")


def test_the_command_lines_fused_attention_stays_on_its_own_model():
    """Its Swin's window attention runs through scaled_dot_product_attention; a timm Swin the
    script builds afterwards keeps timm's default (plain ops), process-wide setting untouched."""
    import timm
    from timm.models.swin_transformer import WindowAttention

    def flags(model: torch.nn.Module) -> set[bool]:
        return {m.fused_attn for m in model.modules() if isinstance(m, WindowAttention)}

    ours = create_model(ModelConfig(name="swin_micro"))
    after = flags(timm.create_model("swin_tiny_patch4_window7_224", pretrained=False))
    assert flags(ours) == {True}
    # timm's default: its TIMM_FUSED_ATTN (1 unless set) takes window attention fused at 2
    assert after == {int(os.environ.get("TIMM_FUSED_ATTN", "1")) > 1}
