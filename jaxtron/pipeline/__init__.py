"""Pipeline parallelism: schedules as tick tables, layer splits, and the shard_map engine.

`ticks.py` is the tick table, plain data testable without devices, and `schedules.py` /
`zero_bubble.py` fill it (training tables and evaluation's forward-only one); `table_check.py`
checks any table, `timeline.py` walks it with jobs at their real lengths. `layer_split.py` maps
layers to ranks and splits the embedding and head evenly over them. `engine.py` runs a table
over the `stage` mesh axis (`program.py` the set-up, `jobs.py` each tick's work), sending each
end only to the ranks that use it. Nothing here imports the model.
"""
