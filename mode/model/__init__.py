from mode.model.lm import LM, LMOutput, build_model

__all__ = ["LM", "LMOutput", "build_model"]
