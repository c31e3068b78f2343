"""The project's own deterministic causal LM: `build_model`, `model_path`."""

from belayer.model.build import ModelBuildError, build_model, model_path

__all__ = ["ModelBuildError", "build_model", "model_path"]
