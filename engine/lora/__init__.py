"""LoRA adapters on one base model: PEFT folders read and checked (peft_files.py), a host LRU cache
and device slots on each worker (worker_slots.py), and the batched products each projection adds
for the adapters of its rows (layers.py, over kernels/lora.py)."""
