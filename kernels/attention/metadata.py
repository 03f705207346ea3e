"""What an attention backend needs to know about one step's batch."""

from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass
class AttentionMetadata:
    """Layout of a flattened batch of sequences over the paged KV cache.

    Tokens of sequence i are query rows query_start_loc[i]:query_start_loc[i+1]. Its first
    seq_lens[i] - query_len tokens are already in the cache (the context), the rest are computed
    now. The first `num_decodes` sequences have exactly one query token each, sorted by seq_len, longest
    first (the model runner orders them so), which lets a backend batch runs of similar length.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    block_table: torch.Tensor  # [num_seqs, max_blocks] int64: physical block of each logical block
    seq_lens: torch.Tensor  # [num_seqs] int64: context + new tokens
    query_start_loc: list[int]  # num_seqs + 1 offsets into the token rows
    seq_lens_list: list[int]  # seq_lens on the host, for per-sequence loops
    num_decodes: int
    block_size: int
    query_start_loc_device: torch.Tensor | None = None  # [num_seqs + 1] int32, on the device

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def query_len(self, index: int) -> int:
        return self.query_start_loc[index + 1] - self.query_start_loc[index]

    @functools.cached_property
    def query_start_loc_tensor(self) -> torch.Tensor:
        """query_start_loc as an int32 tensor on the batch's device, for kernels that read it there:
        the model runner's copy (`query_start_loc_device`, sent with the step's other inputs), else
        made on first use; shared by every layer of the step."""
        if self.query_start_loc_device is not None:
            return self.query_start_loc_device
        return torch.tensor(self.query_start_loc, dtype=torch.int32, device=self.seq_lens.device)

    @functools.cached_property
    def shared_decode_blocks(self) -> int:
        """How many leading blocks every decode row's table holds in common (a prompt prefix shared
        through the prefix cache), short of each row's last token; 0 for fewer than two decodes.
        Made on first use and shared by every layer of the step."""
        decodes = self.num_decodes
        limit = (min(self.seq_lens_list[:decodes], default=1) - 1) // self.block_size
        if decodes < 2 or limit < 1:
            return 0
        table = self.block_table[:decodes, :limit]
        return int((table == table[:1]).all(0).cumprod(0).sum())
