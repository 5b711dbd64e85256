"""Executors: how the engine core reaches its workers (one in this process today; one per rank
in other processes or on a Ray cluster later, behind the same interface)."""
