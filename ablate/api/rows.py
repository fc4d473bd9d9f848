"""A storage layout for KV-cache plugins: one row per sequence of a dense (layers, slots, capacity,
H_kv, D) buffer pair. The contiguous, dynamic and streaming caches use it; a plugin that keeps K/V
the same way mixes it in and plans each step's rows in prepare(). A cache that stores them in
another form (quantised, say) can plan with it too and use `write_index` and `read_rows` in its own
write() and view()."""
from __future__ import annotations

import torch

from ablate.api.kv import PaddedKV
from ablate.api.step import StepInputs


class RowBuffers:
    """K/V in buffers `k` and `v` of shape (layers, slots, capacity, H_kv, D) that the subclass
    allocates; `plan_rows` (once per step, in prepare) says where this step's tokens go
    (`write_index`) and which rows attention reads (`read_rows`); `write` and `view` are then the
    KVCache methods."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def plan_rows(self, slots: list[int], step: StepInputs, shifts: list[int]) -> None:
        """Sequence i of the step owns row slots[i]; its token at position p goes to index p - shifts[i]."""
        device = step.positions.device
        num_new = torch.tensor(step.query_lens, device=device)
        slot_t = torch.tensor(slots, device=device)
        shift_t = torch.tensor(shifts, device=device).repeat_interleave(num_new)              # (T,)
        # token t of the step goes to index write_index[t] of the flattened (slots * capacity, ...) buffer
        self.write_index = slot_t.repeat_interleave(num_new) * self.capacity + step.positions - shift_t   # (T,)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        self.read_rows = slice(slots[0], slots[0] + len(slots)) if consecutive else slot_t   # free if consecutive

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> rows of the flattened (slots * capacity, H_kv, D) buffer; flatten, not
        # view(-1, ...): MLA's V has zero width, and -1 cannot be inferred from zero elements
        self.k[layer].flatten(0, 1).index_copy_(0, self.write_index, k)
        self.v[layer].flatten(0, 1).index_copy_(0, self.write_index, v)

    def view(self, layer: int, step: StepInputs) -> PaddedKV:
        return PaddedKV(self.k[layer][self.read_rows], self.v[layer][self.read_rows])   # (B, capacity, H_kv, D)
