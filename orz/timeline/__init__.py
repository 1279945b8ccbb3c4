"""The run's timeline: every party's spans (the trainer's phases, each worker's passes, each
engine's busy time, the weight sync, reward and environment calls, checkpoints) on one clock,
written as `output_dir/timeline.json` in Chrome's trace event format (Perfetto opens it as it is).

    record.py    what a process records: spans, counters and instants on its own clock (`RECORDER`)
    trace.py     the file: the trainer's writer (clock offsets, a cap per iteration) and a reader
    figures.py   goodput and MFU of an iteration, from its spans (pure)
    picture.py   timeline.png: a Gantt chart of the last iterations
"""
