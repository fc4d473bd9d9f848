"""Real checkpoints: GGUF files, Hugging Face directories, and the GGUF a pip package ships."""
from ablate.checkpoints.loader import checkpoint_path, load_model, load_tokenizer

__all__ = ["checkpoint_path", "load_model", "load_tokenizer"]
