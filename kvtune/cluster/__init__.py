"""Stage 2's live runs in parallel on a Ray cluster (`kvtune search --ray ADDRESS`).

slots.py: where a run ran and the test of a slow slot (no Ray); pool.py: the driver's side
(connect, submit a round per slot, cancel); rounds.py: what a Ray task runs on its node;
guard.py: the process that ends a task's servers when its worker dies. Ray is imported only
inside pool.py's and rounds.py's functions: without --ray nothing here loads it.
"""
