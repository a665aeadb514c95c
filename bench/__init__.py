"""Benchmarks (`just bench [scenario ...]`): scripts that start what they need and print tables."""
