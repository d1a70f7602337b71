"""The front ends: what a person runs. Each is a thin layer over distmerge.api.

    cli.py       `distmerge merge|verify|inspect|test` (python -m distmerge, torchrun -m distmerge)
    verl_cli.py  verl's own `legacy_model_merger` command line, translated
    hub.py       --hf_upload_path: the merged folder uploaded to the Hub (the `hub` extra)
    inspect.py   `distmerge inspect`: what a checkpoint holds, without merging it
"""
