"""distmerge: merge sharded training checkpoints into Hugging Face safetensors, in parallel.

    distmerge.merge(input, output, **options) -> MergeResult
    distmerge.verify(merged, reference, **options) -> VerifyResult

(distmerge/api.py, docs/api.md). Imported on first use: `import distmerge` alone loads no torch.
"""

__version__ = "0.1.0"
__all__ = ["merge", "verify"]


def __getattr__(name: str):
    if name == "merge":
        from distmerge.api import merge

        return merge
    if name == "verify":  # the package, which takes the call (distmerge/verify/__init__.py says why)
        import importlib
        import random

        state = random.getstate()  # importing rich draws from it (api.as_found): a job's random stays as it was
        try:
            return importlib.import_module("distmerge.verify")
        finally:
            random.setstate(state)
    raise AttributeError(f"module 'distmerge' has no attribute {name!r}")
