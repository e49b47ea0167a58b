"""Pipeline parallelism: schedules as tick tables, layer layouts, and the shard_map engine.

`schedule.py` is plain data (testable without devices): training tables and evaluation's
forward-only table. `layout.py` maps layers to ranks and splits the embedding and head evenly
over them. `engine.py` runs a table over the `stage` mesh axis, sending each end only to the
ranks that use it. Nothing here imports the model.
"""
