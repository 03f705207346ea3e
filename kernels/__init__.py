"""Attention and KV-cache operations, each with a pure-torch reference.

Note: this top-level package shares its name with Hugging Face's `kernels` hub package, which
transformers probes for; it deliberately defines nothing that probe could mistake for that package
(tests/model/test_transformers_coexistence.py keeps that true).
"""
