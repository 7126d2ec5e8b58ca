"""Steps run at the same time: lanes of steps against one engine, and the check that
some sequential order of what they answered is one the reference model accepts."""
