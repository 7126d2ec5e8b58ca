"""The semantics of contract v1, without Hypothesis: the reference model, concrete steps,
output checks, faults at the boundary, the twin oracle and the driver that runs a step."""
