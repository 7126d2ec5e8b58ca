"""The Hypothesis side: the state machine that draws steps, the replay minimiser, the
settings profiles and the one adapter over Hypothesis internals."""
