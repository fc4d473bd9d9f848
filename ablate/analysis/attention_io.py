"""Bytes prefill attention moves between main memory (HBM, DRAM) and the chip (SRAM, caches).

One sequence of n tokens attends to itself (causal prefill): H query heads, H_kv K/V heads, head
dim D, e bytes per element of Q, K, V and O, scores in fp32 (4 bytes). Q and O hold n H D e bytes
each, K and V n H_kv D e each.

Materialised (attention=naive, and SDPA's math backend): the (H, n, n) scores go through memory,
once per elementwise pass over them, and the (n, n) boolean mask is read once per head:

    bytes = |Q| + |K| + |V| + |O| + passes x 4 H n^2 + H n^2

ablate's naive attention makes 8 passes: Q K^T writes the scores (1); the 1/sqrt(D) scaling reads
and writes them (2); masked_fill reads and writes them (2); softmax reads and writes them (2, its
max and sum reductions fused into one read); P V reads them (1). SDPA's math backend scales Q before
the product instead, so 6. The peak memory is two score matrices (a pass's input and output),
8 H n^2 bytes: 4x per doubling of n.

Tiled (FlashAttention-2's forward, Dao 2023; attention=flash, SDPA's flash / efficient / cuDNN
backends): scores stay on chip. Each query head splits its n queries into T = ceil(n / B_M) tiles;
a tile reads its Q rows once, streams every K and V row it may see and writes its O rows once.
Causal: tile i sees min(n, (i + 1) B_M) keys, so

    bytes = |Q| + |O| + H x 2 D e x sum_{i < T} min(n, (i + 1) B_M)

K and V are read per query head (the kernels run one program per query head and query tile; GQA
shares K/V in memory, not in these reads), and none of the repeats is assumed to hit a cache, so
this is an upper bound for the tiled kernels. It grows as n^2 / B_M against the materialised
n^2, and peak memory is only Q, K, V, O: 2x per doubling of n.

Tile heights B_M: the Triton kernel (ablate_kernels) uses 128 for 16-bit inputs with D <= 128
and 64 otherwise (fp32, or D > 128); PyTorch's CPU flash kernel uses 256 queries for n >= 768, 64
for n >= 192 and 32 below; its CUDA flash kernel 128.
"""
from __future__ import annotations

from dataclasses import dataclass

NAIVE_SCORE_PASSES = 8          # ablate's naive attention (see above)
SDPA_MATH_SCORE_PASSES = 6      # SDPA's math backend


@dataclass(frozen=True)
class AttentionShape:
    seq_len: int          # n: queries = keys (prefill of one sequence)
    n_heads: int          # H
    n_kv_heads: int       # H_kv
    head_dim: int         # D
    element_bytes: int    # e: bytes per element of Q, K, V and O

    def __post_init__(self) -> None:
        for name in ("seq_len", "n_heads", "n_kv_heads", "head_dim", "element_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AttentionShape.{name} must be positive, got {getattr(self, name)}")

    @property
    def q_bytes(self) -> int:
        return self.seq_len * self.n_heads * self.head_dim * self.element_bytes

    @property
    def kv_bytes(self) -> int:
        """|K| + |V|."""
        return 2 * self.seq_len * self.n_kv_heads * self.head_dim * self.element_bytes


def materialised_bytes(shape: AttentionShape, passes: int = NAIVE_SCORE_PASSES) -> int:
    """|Q| + |K| + |V| + |O| + passes x 4 H n^2 + H n^2 (the mask)."""
    n2h = shape.seq_len**2 * shape.n_heads
    return 2 * shape.q_bytes + shape.kv_bytes + passes * 4 * n2h + n2h


def tiled_bytes(shape: AttentionShape, block_m: int, causal: bool = True) -> int:
    """|Q| + |O| + H x 2 D e x (keys each query tile streams)."""
    n = shape.seq_len
    num_tiles = -(-n // block_m)
    visible = sum(min(n, (i + 1) * block_m) for i in range(num_tiles)) if causal else num_tiles * n
    return 2 * shape.q_bytes + shape.n_heads * 2 * shape.head_dim * shape.element_bytes * visible


def triton_flash_block_m(head_dim: int, element_bytes: int) -> int:
    return 128 if element_bytes == 2 and head_dim <= 128 else 64


def sdpa_flash_block_m(seq_len: int, device_type: str) -> int:
    if device_type == "cuda":
        return 128
    return 256 if seq_len >= 768 else 64 if seq_len >= 192 else 32


# SDPA backends (torch.nn.attention.SDPBackend names, lower case) that tile instead of materialising
TILED_SDPA_BACKENDS = frozenset({"flash_attention", "efficient_attention", "cudnn_attention"})


def sdpa_bytes(backend: str, shape: AttentionShape, device_type: str) -> int:
    """What SDPA moves with the backend it picked: tiled, or materialised (6 passes) for math."""
    if backend in TILED_SDPA_BACKENDS:
        return tiled_bytes(shape, sdpa_flash_block_m(shape.seq_len, device_type))
    return materialised_bytes(shape, SDPA_MATH_SCORE_PASSES)
