"""One module per section of the chapter; each has `claims(evidence) -> list[Claim]`."""
from __future__ import annotations

from importlib import import_module

# section -> (its subject, the module computing its claims)
SECTIONS: dict[str, tuple[str, str]] = {
    "7.1": ("why inference is its own problem", "why_inference"),
    "7.2": ("recomputation without a cache", "recompute"),
    "7.3": ("what the KV cache costs in memory", "kv_memory"),
    "7.4": ("GPU utilisation and batching", "utilisation"),
    "7.5": ("speculative decoding", "speculative"),
    "7.6": ("the n x n attention matrix", "attention_memory"),
    "7.7": ("K/V heads: MHA, GQA, MQA, MLA", "kv_heads"),
}


def section_claims(section: str, evidence) -> list:
    """The claims of one section ("7.3")."""
    if section not in SECTIONS:
        raise ValueError(f"book.section={section!r}: the chapter's sections are {', '.join(SECTIONS)} (or all)")
    return import_module(f"{__name__}.{SECTIONS[section][1]}").claims(evidence)
