"""A KV cache of the kit's own whose view is its storage itself, for checking attention plugins.

The project's caches often hand attention a copy (a gather of blocks, rows picked by index), and an
attention that edits K or V in place (scaling K by 1/sqrt(D) to save a multiply, say) then only
edits the copy: nothing shows. This cache moves the step's sequences to its first rows in batch
order before the step (prepare), so the view is always a slice of its storage, never a copy, and it
keeps a shadow of everything written: after every step the storage must still equal the shadow.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ablate.api.context import BuildContext
from ablate.api.kv import PaddedKV
from ablate.api.kv_cache import KVCache
from ablate.api.plugin import PluginConfig
from ablate.api.rows import RowBuffers
from ablate.api.sequence import Sequence
from ablate.api.step import StepInputs


@dataclass
class StorageViewConfig(PluginConfig):
    name: str = "kit_storage_view"


class StorageViewKVCache(RowBuffers, KVCache):
    name = "kit_storage_view"
    config_class = StorageViewConfig

    def __init__(self, config: StorageViewConfig, ctx: BuildContext) -> None:
        super().__init__(config, ctx)
        s = self.spec
        shape = (s.num_layers, s.max_num_seqs, s.max_seq_len, s.n_kv_heads)
        self.k = torch.zeros(*shape, s.k_head_dim, dtype=s.dtype, device=s.device)
        self.v = torch.zeros(*shape, s.v_head_dim, dtype=s.dtype, device=s.device)
        self.shadow_k, self.shadow_v = self.k.clone(), self.v.clone()
        self.slot_of: dict[int, int] = {}
        self.edited: str | None = None      # the first in-place edit of the storage found

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.spec.bytes_per_token          # the storage and its shadow

    def reserve(self, seq: Sequence, num_tokens: int) -> bool:
        if seq.seq_id in self.slot_of:
            return num_tokens <= self.capacity
        free = sorted(set(range(self.k.shape[1])) - set(self.slot_of.values()))
        if not free:
            return False
        self.slot_of[seq.seq_id] = free[0]
        return True

    def free(self, seq: Sequence) -> None:
        del self.slot_of[seq.seq_id]

    def bytes_reserved(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.shadow_k, self.shadow_v))

    def prepare(self, step: StepInputs) -> None:
        self._check_unedited()
        # the step's sequences to rows 0 .. B-1 in batch order, the others after them
        first = [self.slot_of[s.seq_id] for s in step.seqs]
        order = first + [r for r in range(self.k.shape[1]) if r not in first]
        index = torch.tensor(order, device=self.k.device)
        for name in ("k", "v", "shadow_k", "shadow_v"):
            setattr(self, name, getattr(self, name).index_select(1, index))
        moved_to = {old: new for new, old in enumerate(order)}
        self.slot_of = {seq_id: moved_to[slot] for seq_id, slot in self.slot_of.items()}
        self.plan_rows(list(range(step.num_seqs)), step, [0] * step.num_seqs)

    def write(self, layer: int, step: StepInputs, k: torch.Tensor, v: torch.Tensor) -> None:
        super().write(layer, step, k, v)
        index = step.plan["write_index"]
        self.shadow_k[layer].flatten(0, 1).index_copy_(0, index, k)
        self.shadow_v[layer].flatten(0, 1).index_copy_(0, index, v)

    def view(self, layer: int, step: StepInputs) -> PaddedKV:
        return super().view(layer, step)            # read_rows is slice(0, B): a view of the storage

    def keep(self, seq: Sequence, num_tokens: int) -> None:
        self._check_unedited()          # after the step's last layer: every attention call has run

    def _check_unedited(self) -> None:
        if self.edited is not None:
            return
        for name, stored, shadow in (("K", self.k, self.shadow_k), ("V", self.v, self.shadow_v)):
            changed = (stored != shadow).flatten(2).any(-1)                  # (layers, slots)
            if bool(changed.any()):
                layer, row = (int(i) for i in changed.nonzero()[0])
                self.edited = f"{name} of layer {layer} (cache row {row}) changed after it was written"
                return
