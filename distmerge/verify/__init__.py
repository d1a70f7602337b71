"""`distmerge verify`: compare a merged model with a reference, tensor by tensor (see run.py for the phases).

    sides.py    the merged model and the reference, listed from headers, read one tensor at a time
    listing.py  rank 0 pairs the names (tied heads by the model family's traits)
    compare.py  each rank computes the figures of the merged files it owns
    logits.py   --logits: both models run in one process (the only import of transformers)
    report.py   the table, the verdict line, the JSON
    totals.py   the totals: names matched both ways, least cosine per kind of layer (the KINDS table)
    plot.py     --plot: a PNG of the figures by layer and kind (the only import of matplotlib)
    run.py      the phases and the command
"""

from distmerge.verify.listing import VerifyOptions
from distmerge.verify.run import VerifyResult, run_verify, verify, verify_and_report

__all__ = ["VerifyOptions", "VerifyResult", "run_verify", "verify", "verify_and_report"]
