"""Pipeline parallelism: schedules as tick tables, layer layouts, and the shard_map engine.

`schedule.py` is plain data (testable without devices), `layout.py` maps layers to ranks,
`engine.py` runs a table over the `stage` mesh axis. Nothing here imports the model.
"""
