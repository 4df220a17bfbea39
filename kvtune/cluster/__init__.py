"""kvtune on a Ray cluster: `kvtune search --ray ADDRESS` in parallel, and `kvtune run --ray` /
`kvtune calibrate --ray` with their servers started on the cluster (the flag: cli/ray.py).

slots.py: where a run ran and the test of a slow slot (no Ray); pool.py: the driver's side
(connect, submit a round per slot, stage 1's tasks or one task on one slot, cancel); rounds.py: what
a task runs on its node (a round of stage 2, a search's first start, a calibration session);
stage1.py: stage 1's trials as tasks sharing the study (`Stage1OnRay`, the runner search.flow
calls); guard.py: the process that ends a task's servers when its worker dies; target.py: the live
target whose servers start in tasks. Ray is imported only inside functions of pool.py, rounds.py
and stage1.py: without --ray nothing here loads it.
"""
