"""The paged cache's groups of layers (vLLM's KV-cache groups): layers that share one block table.

Every layer of a group has the same sliding window (or none), so one table per sequence and group
says which blocks hold its keys, and a windowed group can give back the blocks before its window
while a full group keeps its own. Groups have equal sizes, g = the gcd of the number of layers of each
window, so that one pool of (g, num_blocks, block_size, H_kv, D) serves them all: block b holds g
layers' slots of whichever group claimed it, and no byte of it is left unused (Gemma 2, windowed and
full layers alternating: g = n_layers / 2, two groups; Gemma 3, five windowed to one full: g = the
number of full layers, six groups; Mistral, every layer windowed, and Llama, none: one group).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ablate.api import KVSpec


@dataclass(frozen=True)
class LayerGroup:
    window: int | None        # the layers' sliding window; None: they read every position
    layers: tuple[int, ...]

    def blocks_per_seq(self, spec: KVSpec, block_size: int) -> int:
        """The most blocks one sequence holds in this group at once. A windowed group holds the
        positions from the window of a step's first query to its last token, R = window - 1 + the most
        tokens a step feeds (KVSpec.ring_rows), which straddle at most ceil(R / block_size) + 1 blocks."""
        every = -(-spec.max_seq_len // block_size)
        if self.window is None:
            return every
        rows = self.window - 1 + (spec.max_step_tokens or spec.max_seq_len)
        return min(every, -(-rows // block_size) + 1)


def layer_groups(spec: KVSpec, free_outside_windows: bool = True) -> list[LayerGroup]:
    """The groups of `spec`'s layers, by window, each of g layers (the module's docstring). A window that
    saves nothing (a step may feed the whole sequence: KVSpec.ring_rows is None) counts as none, and
    free_outside_windows=False (prefix caching) makes one group of every layer, keeping every block."""
    def window(layer: int) -> int | None:
        return spec.windows[layer] if spec.ring_rows(layer) is not None else None

    if not free_outside_windows:
        return [LayerGroup(None, tuple(range(spec.num_layers)))]
    by_window: dict[int | None, list[int]] = {}
    for layer in range(spec.num_layers):
        by_window.setdefault(window(layer), []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values()))
    return [LayerGroup(w, tuple(layers[i:i + size])) for w, layers in by_window.items()
            for i in range(0, len(layers), size)]
