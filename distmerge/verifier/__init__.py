"""`distmerge verify`: compare a merged model with a reference, tensor by tensor (see run.py for the phases).

    sides.py    the merged model and the reference, listed from headers, read a block of elements at a time
    listing.py  rank 0 pairs the names (tied heads by the model family's traits)
    kinds.py    rank 0: which side is a finished model and which a checkpoint, and how each is read
    blocks.py   the figures block by block, the same whatever the pieces a tensor arrives in
    bounded.py  an encoded weight (merge --quantize) decoded block by block, judged by the bound its encoding
                guarantees (the quantize part's compare.py decodes it; Listing.encoding says which)
    compare.py  two finished models: each rank computes the figures of the merged files it owns
    stream.py   a side merged in memory: each target compared as its bytes arrive, or once built (sink.Sink)
    checkpoint.py, two_checkpoints.py, components.py   one side or both merged in memory, in merge's rounds
    logits.py   --logits: both models run in one process (the only import of transformers)
    report.py   the table, the verdict line, the JSON
    totals.py   the totals: names matched both ways, least cosine per kind of layer (the KINDS table)
    plot.py     --plot: a PNG of the figures by layer and kind (the only import of matplotlib)
    run.py      the phases (the command: cli.py over api.py)
"""

from distmerge.verifier.listing import VerifyOptions
from distmerge.verifier.run import VerifyResult, verify, verify_and_report

__all__ = ["VerifyOptions", "VerifyResult", "verify", "verify_and_report"]
