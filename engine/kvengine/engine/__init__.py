"""The loop: LLMEngine, its clock, the engine-core process and the frontend's client, the step outputs."""
