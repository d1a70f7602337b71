"""distmerge: merge sharded training checkpoints into Hugging Face safetensors, in parallel."""

__version__ = "0.1.0"
