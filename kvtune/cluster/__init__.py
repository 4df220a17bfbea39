"""A search in parallel on a Ray cluster (`kvtune search --ray ADDRESS`).

slots.py: where a run ran and the test of a slow slot (no Ray); pool.py: the driver's side
(connect, submit a round per slot or stage 1's tasks, cancel); rounds.py: what a stage-2 task runs
on its node; stage1.py: stage 1's trials as tasks sharing the study (`Stage1OnRay`, the runner
search.flow calls); guard.py: the process that ends a task's servers when its worker dies;
target.py: the live target whose servers start in tasks. Ray is imported only inside functions of
pool.py, rounds.py and stage1.py: without --ray nothing here loads it.
"""
