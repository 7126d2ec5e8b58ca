"""One run and what it leaves: the runner, traces, regression tests, reports and replay."""
