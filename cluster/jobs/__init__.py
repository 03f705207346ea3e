"""Ray jobs: entrypoints meant for `ray job submit -- python -m cluster.jobs.<name>`."""
