"""`distmerge import`: a Hugging Face model written in a training layout (Megatron-LM torch_dist), the way back
from a merge. The same pipeline, sources and targets swapped:

    discover (rank 0)   the Hugging Face folder: config.json and the safetensors headers (discover.py); every
                        refusal made here, before the output is touched
    plan (every rank)   the family's table walked backwards (families/megatron/inverse.py), each Megatron tensor
                        cut into the chunks megatron-core saves (formats/megatron/dist_layout.py), the files given
                        owners by bytes (plan.py): the same plan on every rank, whatever their number
    write (makers)      each Megatron tensor made by one process, its chunks read as row ranges of the Hugging
                        Face tensors (a column split's rows once for all its TP chunks) and written as DCP blobs at
                        the places the plan gave them (read.py, place.py, write.py): each file created and committed
                        by its owner, written by every process that makes one of its tensors (into an object store,
                        whose uploads take each part from one process: by its owner alone, in file order)
    finalize (rank 0)   `.metadata`, metadata.json, common.pt (Megatron-LM's args), and last the iteration
                        tracker (finalize.py): no tracker, no finished import

The input and the output are merge's: a folder or an object store (`s3://bucket/prefix`), the one walked through
input/source.py's Source, the other written through output/store.py's Store, neither asked which it is.

run.py wires them under the output's lock (output/lock.py), as a merge does, once for every training layout: what
differs between Megatron-LM's and torchtitan's is declared in targets.py (the folder, the marker of a finished
import, the plan, the last files, the refusals of options), so no phase tests which one it writes; both read any
input. request.py holds what an import is asked for and answers (the command line and api.import_checkpoint build
the same). An input that is a training checkpoint is read in one pass (source.py): the merge engine discovers,
plans, exchanges and assembles its Hugging Face tensors, and hands each owner its units' tensors whole in memory
(sink.py) instead of writing safetensors; the owner cuts the target's chunks from them. `--to torchtitan` runs the
same phases with its own plan and finalize (torchtitan_plan.py, targets.py): the torchtitan table walked backwards
(families/torchtitan/inverse.py), each tensor one whole chunk, `step-0/.metadata` last. The pipeline split (--pp,
--vpp, uneven stages) that says which rank saves each layer is formats/megatron/pipeline.py's, megatron-core's own
formulas.
"""
