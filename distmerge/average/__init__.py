"""`merge --input A --input B ... --average`: the weighted average of several checkpoints of one model, exactly
(docs/average.md).

    units.py   the setting (AverageOptions), and each input's family result joined into one: targets checked
               alike across the inputs before any byte is read, each unit's sources those of every input's unit
               for the same targets, its transform the `average` fold
    fold.py    the `average` fold: each input's own transform applied, its floating targets added in float64,
               in the order the inputs were given; integer and bool targets checked equal

The engine reads the inputs as one (engine/inputs.py) and assembles a fold's units one input at a time
(engine/fold.py).
"""
