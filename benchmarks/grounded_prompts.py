"""Input-grounded chat requests: the answer repeats or edits text given in the prompt.

The work prompt-lookup speculation is for (code edits, quoting a passage, reformatting data): much
of each answer is a run of tokens already in the prompt. Used by `benchmarks.spec_decode`.
"""

from __future__ import annotations

CODE = '''def merge_intervals(intervals):
    """Merge overlapping closed intervals given as (start, end) pairs."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''

CLASS = """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError(f"not enough {name}")
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
"""

PASSAGE = (
    "The river rises in the high moorland, where peat holds the rain like a sponge and lets it go "
    "slowly through the dry months. Below the moor it cuts a narrow valley through old slate, "
    "turning three mills that once ground the grain of every farm in the parish. At the market town "
    "it widens, slows, and is crossed by a stone bridge of seven arches, built after the flood of "
    "1771 carried the wooden one away."
)

CONFIG_JSON = (
    '{"service": "billing", "replicas": 3, "ports": [8080, 8443], "env": {"LOG_LEVEL": "info", '
    '"REGION": "eu-west-1"}, "limits": {"cpu": "500m", "memory": "256Mi"}, "owners": ["ana", "ravi"]}'
)

REQUESTS = [
    f"Repeat this Python function exactly as it is, inside a code block:\n\n```python\n{CODE}```",
    f"Rename the attribute `items` to `stock` in this class and show the whole class:\n\n```python\n{CLASS}```",
    f"Quote the following passage word for word, then say which river feature is mentioned last.\n\n{PASSAGE}",
    f"Rewrite this JSON with two-space indentation, one key per line:\n\n{CONFIG_JSON}",
    f"Add a docstring to every method of this class and return the full code:\n\n```python\n{CLASS}```",
    f"Copy this function and change `merged` to `result` everywhere:\n\n```python\n{CODE}```",
    f"Here is a paragraph:\n\n{PASSAGE}\n\nRepeat the paragraph, replacing 'river' with 'stream'.",
    f"Convert this JSON to YAML, keeping every key and value:\n\n{CONFIG_JSON}",
]
