"""The persistent batch's device rows against the scheduler's whole lists, kept apart here; the
staging buffers and the packing of a step's results into one copy.

Sequences come and go (rows reused), grow new blocks and have blocks replaced (copy-on-write); after
every change each live sequence's device block-table row and sampling settings must read what a
from-scratch build out of its full block list and its SamplingParams gives.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from engine.outputs import NewSequenceData
from engine.sampling_params import SamplingParams
from engine.transfers import StagedBuffer, pack, unpack
from engine.worker.input_batch import InputBatch

VOCAB = 50
SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.3, top_k=-1, presence_penalty=0.5, frequency_penalty=-0.2),
    SamplingParams(repetition_penalty=1.4, top_k=500),
]


def expected_settings(params: SamplingParams) -> list[float]:
    """The row as the sampler should read it, straight from the request's fields."""
    top_k = VOCAB if params.top_k in (0, -1) or params.top_k > VOCAB else params.top_k
    return [
        params.temperature,
        params.top_p,
        params.min_p,
        params.presence_penalty,
        params.frequency_penalty,
        params.repetition_penalty,
        top_k,
    ]


def test_device_rows_follow_the_scheduler_through_adds_removals_and_growth():
    rng = random.Random(7)
    batch = InputBatch(max_num_seqs=6, max_blocks_per_seq=12, vocab_size=VOCAB, device=torch.device("cpu"))
    blocks: dict[str, list[int]] = {}  # the scheduler's view: each live sequence's whole block list
    params: dict[str, SamplingParams] = {}
    next_block = 0
    for step in range(300):
        live = list(blocks)
        action = rng.random()
        if len(live) < 6 and (not live or action < 0.3):
            seq_id = f"s{step}"
            count = rng.randint(1, 4)
            blocks[seq_id] = list(range(next_block, next_block + count))
            next_block += count
            params[seq_id] = rng.choice(SETTINGS)
            batch.add(NewSequenceData(seq_id, [1, 2, 3], [], params[seq_id], blocks[seq_id], 0))
        elif action < 0.45:
            seq_id = rng.choice(live)
            batch.remove(seq_id)
            del blocks[seq_id], params[seq_id]
        else:
            seq_id = rng.choice(live)
            table = blocks[seq_id]
            # Append up to two blocks, sometimes replacing the last one first (copy-on-write).
            start = len(table) - 1 if rng.random() < 0.3 else len(table)
            count = min(rng.randint(0, 2) + (len(table) - start), 12 - start)
            table[start:] = list(range(next_block, next_block + count))
            next_block += count
            batch.set_blocks(batch.seqs[seq_id], start, table[start:])
        for seq_id, table in blocks.items():
            row = batch.seqs[seq_id].row
            assert batch.device_block_table[row, : len(table)].tolist() == table
        rows = torch.tensor([batch.seqs[seq_id].row for seq_id in blocks], dtype=torch.int64)
        values = batch.sampling_values(rows)
        got = torch.cat((values.floats, values.top_k.unsqueeze(1).float()), dim=1).tolist()
        want = [expected_settings(params[seq_id]) for seq_id in blocks]
        assert np.allclose(got, want), (got, want)


def test_a_staged_buffer_regrows_for_a_step_past_its_size():
    buffer = StagedBuffer((4,), torch.int64, torch.device("cpu"))
    assert buffer.put(np.array([1, 2, 3])).tolist() == [1, 2, 3]
    assert buffer.put(np.arange(10)).tolist() == list(range(10))
    assert buffer.put(np.array([5])).tolist() == [5]


def test_a_steps_results_pack_into_one_vector_and_back_exactly():
    ids = torch.tensor([0, 49151, 2**40 + 3], dtype=torch.int64)
    logprobs = torch.tensor([[-0.0, -1e-30, float("-inf")], [-3.25, -88.5, -1e-7]], dtype=torch.float32)
    ranks = torch.tensor([1, 7], dtype=torch.int64)
    restored = unpack(pack([ids, logprobs, ranks]), [ids, logprobs, ranks])
    for before, after in zip((ids, logprobs, ranks), restored, strict=True):
        assert after.dtype == before.dtype and torch.equal(after, before)
