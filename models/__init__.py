from models.factory import ImageClassifier, ModelConfig, UnknownModelError, create_model

__all__ = ["ImageClassifier", "ModelConfig", "UnknownModelError", "create_model"]
