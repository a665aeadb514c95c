"""The `orchard` command line (gateway, runner, serve, demo-model)."""
