"""Every name distmerge writes in the output (a folder or an object-store prefix; output/store.py writes them).

    OUT/
      model.safetensors | model-0000i-of-0000n.safetensors   the model (each renamed from .NAME.partial)
      lora_adapter/adapter_model.safetensors, adapter_config.json   a LoRA run's adapter
      config.json, tokenizer*, generation_config.json, ...     finalize, rank 0
      distmerge.manifest.json                                   per file: tensors, bytes, sha256
      .distmerge/NAME.json                                      per finished file: --resume's record
      .distmerge/run.json                                       what shaped this run's output (resume.py)
      model.safetensors.index.json                              last: the commit marker
      .distmerge.lock                                           while a merge runs: its holder (lock.py)
"""

from __future__ import annotations

INDEX_NAME = "model.safetensors.index.json"
MANIFEST = "distmerge.manifest.json"
RECORDS = ".distmerge"
RUN_RECORD = f"{RECORDS}/run.json"
NODES_PROBE = f"{RECORDS}/nodes.probe"  # rank 0 writes it, every node must read it: the output is shared (nodes.py)
LOCK = ".distmerge.lock"  # beside the records, not among them: --overwrite removes the records folder
ADAPTER_DIR = "lora_adapter"
# Output files of the non-model groups (the model group is split by size, see model_file_names).
GROUP_FILES = {"adapter": f"{ADAPTER_DIR}/adapter_model.safetensors"}
# What an earlier merge left: finished files (--overwrite removes them, --resume keeps them for
# resume.py to judge) and half-written ones (always removed).
FINISHED = ("model.safetensors", "model-*-of-*.safetensors", *GROUP_FILES.values(),
            f"{ADAPTER_DIR}/adapter_config.json")
MODEL_FILES = FINISHED[:2]
PARTIAL = (".model*.partial", f"{ADAPTER_DIR}/.*.partial")


def model_file_names(count: int) -> list[str]:
    """Hugging Face's names: one file is model.safetensors, more are model-0000i-of-0000n.safetensors."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def partial_name(name: str) -> str:
    """Hidden, beside the final file: `sub/file` -> `sub/.file.partial`."""
    head, _, base = name.rpartition("/")
    return f"{head}/.{base}.partial" if head else f".{base}.partial"


def record_name(name: str) -> str:
    """One flat folder of records: `lora_adapter/adapter_model.safetensors` -> `.distmerge/lora_adapter--ad...json`."""
    return f"{RECORDS}/{name.replace('/', '--')}.json"
