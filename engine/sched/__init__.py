"""The device-free scheduling core: requests, the block pool, the KV cache manager, the scheduler,
the step plan, the output builder and beam bookkeeping.

Nothing here imports torch or worker code (an import-linter contract in pyproject.toml), so the
scheduler's tests run in milliseconds and the engine core process never loads the model's stack to
plan a step.
"""
