"""What the tests run on every rank of a :class:`~peerdcp.harness.launch.RankPool` (picklable functions that
return plain data), one module per mechanism; ``collective`` holds the timeouts of the collective baselines and
``properties`` the hypothesis-driven cases."""
