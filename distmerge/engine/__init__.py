"""The merge's phases, in the order they run: discover (distmerge.input) -> prepare/plan -> spread ->
exchange -> assemble -> write (sink, through distmerge.output) -> finalize; resume keeps the run record
that --resume reads. run.py drives them.
"""
