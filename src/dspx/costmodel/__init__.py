"""Timing model of the board (issue 26): machine profiles and estimates (COST-SPEC.md)."""
