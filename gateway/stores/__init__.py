"""Bounded stores of finished answers (stored chat completions, Responses): in memory, written
through to a SQLite file (`--store`) so that they outlive a restart."""
