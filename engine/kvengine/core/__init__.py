"""The scheduler's side: requests, the block pool and its hash-to-block map, the KV managers, the scheduler, memory sizing."""
