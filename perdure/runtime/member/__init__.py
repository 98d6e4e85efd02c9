"""A member's side of a run, beside its replica's math (``runtime/replica/``): what a worker
does around the step. One concern a file: the epoch it runs (``epoch.py``), checkpoints
(``saves.py``), metrics and evaluations (``metrics.py``, ``evaluate.py``), heartbeats and
the fence (``heartbeat.py``), state transfer at an epoch's start (``transfer.py``,
``copy_overlap.py``), its replica group (``shard_group.py``), the faults it applies
to itself (``wchaos.py``) and its CPU priority (``priority.py``). ``runtime/worker.py``
composes them into the worker's loop.
"""
