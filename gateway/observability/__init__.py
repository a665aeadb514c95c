"""Metrics, the pool's gauges, history and the admin routes."""
