"""Structured outputs: JSON schemas, regular expressions, choices and grammars, enforced token by token.

- backend.py: what the engine needs of a grammar library (the small interface), and the error type;
- guidance.py: that interface over llguidance (the backend raypage uses, and why);
- manager.py: grammars compiled off the step loop and cached by their text, and each step's token
  bitmask for the rows under a grammar.

The scheduling core (engine/sched/grammar.py) holds a matcher per sequence; the workers apply the
step's bitmask to the logits (kernels/token_bitmask.py) before any sampling processor. Nothing here
imports torch.
"""
