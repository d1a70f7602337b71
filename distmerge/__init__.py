"""distmerge: merge sharded training checkpoints into Hugging Face safetensors, in parallel.

    distmerge.merge(input, output, *, format="auto", dtype="keep", ...) -> MergeResult
    distmerge.verify(merged, reference, *, atol=None, ...) -> VerifyResult
    distmerge.watch(input, output, *, once=False, ...) -> WatchResult
    distmerge.import_checkpoint(input, output, *, to="megatron", tp=1, pp=1, ...) -> ImportResult

(distmerge/api.py, docs/api.md). Imported on first use: `import distmerge` alone loads no torch. The package that
does the verifying is distmerge.verifier, the one that watches distmerge.watcher, so these names are only ever the
functions.
"""

__version__ = "0.1.0"
__all__ = ["merge", "verify", "watch", "import_checkpoint"]


def __getattr__(name: str):
    if name in __all__:
        import random

        state = random.getstate()  # importing rich draws from it (api.as_found): a job's random stays as it was
        try:
            from distmerge import api
        finally:
            random.setstate(state)
        return getattr(api, name)
    raise AttributeError(f"module 'distmerge' has no attribute {name!r}")
