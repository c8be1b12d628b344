from accel.cli.models.factory import (
    ImageClassifier,
    ModelConfig,
    ModelError,
    UnknownModelError,
    create_model,
)

__all__ = ["ImageClassifier", "ModelConfig", "ModelError", "UnknownModelError", "create_model"]
