"""What runs a scheduled step: the executor protocol, the sim executor and its cost model, the torch executor."""
