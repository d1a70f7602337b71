"""`distmerge watch`: a run is a stream of checkpoints. Each finished step under RUN is merged into OUT/<rel> by the
merge itself, once (the command: front/cli.py over api.watch; the loop: passes.py).

    markers.py  how each trainer marks a save finished (verl, Megatron-LM, DeepSpeed, HF Trainer, torchtitan, DCP):
                a table, one row per trainer
    steps.py    rank 0: the step folders under RUN, finished or not, and the checkpoints each holds (the formats'
                own detection)
    choose.py   --steps: all, latest, every:K, N,M
    done.py     rank 0: whether OUT/<rel> is already this merge (its index and run.json), read without planning
    step.py     one checkpoint merged (engine.run.merge, --resume), a held lock left to its holder, the upload
    outcome.py  a step's outcome in a pass, and the watch's result
    summary.py  rank 0: the table per pass, the last line
    passes.py   the passes: rank 0 decides and broadcasts, every rank merges; the poll; SIGTERM
"""
