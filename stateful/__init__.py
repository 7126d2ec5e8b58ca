"""Stateful suites: the kit fuzzing the bundled engines, collected by pytest in CI."""
