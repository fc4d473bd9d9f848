"""A storage layout for KV-cache plugins: one row per sequence of a dense (layers, slots, capacity,
H_kv, D) buffer pair. The contiguous, dynamic and streaming caches use it; a plugin that keeps K/V
the same way mixes it in and plans each step's rows in prepare(). A cache that stores them in
another form (quantised, say) can plan with it too and use step.plan's `write_index` and `read_rows`
in its own write() and view()."""
from __future__ import annotations

import torch

from ablate.api.kv import PaddedKV
from ablate.api.step import StepInputs, device_tensor


class RowBuffers:
    """K/V in buffers `k` and `v` of shape (layers, slots, capacity, H_kv, D) that the subclass
    allocates; `plan_rows` (once per step, in prepare) says in step.plan where this step's tokens
    go and which rows attention reads; `write` and `view` are then the KVCache methods."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def plan_rows(self, slots: list[int], step: StepInputs, shifts: list[int]) -> None:
        """Sequence i of the step owns row slots[i]; its token at position p goes to index p - shifts[i].

        Planned on the host from the step's lists (one copy to the device, no sync) into step.plan:
        `write_index` (T,), where token t goes in the flattened (slots * capacity, ...) buffer, and
        `read_rows`, the rows attention reads: a slice (a free view) when the slots are consecutive.
        `storage` names the buffer: a captured decode graph holds its address, so a reallocation
        (the dynamic cache growing) is another graph."""
        cap = self.capacity
        index = [slot * cap + p - shift
                 for slot, shift, n, end in zip(slots, shifts, step.query_lens, step.context_lens)
                 for p in range(end - n, end)]
        device = step.input_ids.device
        step.plan["write_index"] = device_tensor(index, torch.long, device)                    # (T,)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        step.plan["read_rows"] = (slice(slots[0], slots[0] + len(slots)) if consecutive
                                  else device_tensor(slots, torch.long, device))               # (B,)
        step.plan["storage"] = (self.k.data_ptr(), tuple(self.k.shape))

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (T, H_kv, D) -> rows of the flattened (slots * capacity, H_kv, D) buffer; flatten, not
        # view(-1, ...): MLA's V has zero width, and -1 cannot be inferred from zero elements
        index = step.plan["write_index"]
        self.k[layer].flatten(0, 1).index_copy_(0, index, k)
        self.v[layer].flatten(0, 1).index_copy_(0, index, v)

    def view(self, layer: int, step: StepInputs) -> PaddedKV:
        rows = step.plan["read_rows"]
        return PaddedKV(self.k[layer][rows], self.v[layer][rows])   # (B, capacity, H_kv, D)
