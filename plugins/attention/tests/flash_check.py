"""Run by test_flash.py in a fresh interpreter, so that TRITON_INTERPRET is read exactly as the test
sets it (triton reads it once, at import). Prints one JSON line:
{"triton_available": bool, "arms": {arm: {"same_tokens": bool, "backend": str, "kinds": [str]}},
 "graphs": {arm: {"same_tokens": bool, "disabled": str | None, "replays": int}}, "warnings": [str]}

Each arm serves the same ragged requests as the naive baseline (greedy) on the `tiny` model: the
`none` cache (packed K/V: the varlen kernel), and a contiguous cache under continuous batching with
chunked prefill (decode steps: the decode kernel; prefill chunks after a prefix: the varlen kernel
on gathered keys); and the `mla-tiny` model on the `none` cache (MLA's explicit path, width 32) and
on a contiguous cache (decode: the absorbed path, queries over the cached latents with V = K); and a
paged cache of 4-token blocks (decode: the paged decode kernel on the block tables).

`graphs`: the arms with a cache once more under emulated CUDA graphs (ablate.engine.graphs, emulate=True:
a replay runs on the captured step's lists, as a real graph would), so that a decode path reading a
per-step list is caught as a divergence that turns the arm's graphs off.
"""
from __future__ import annotations

import json
import warnings

import torch

from ablate.api.context import EngineConfig
from ablate.api.plugin import Slot
from ablate.api.sequence import Request
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.graphs import DecodeGraphs, why_not_capturable
from ablate.engine.registry import default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

ARMS = {   # arm -> (model preset, arm spec)
    "none-cache": ("tiny", {"attention": "flash"}),
    "contiguous-chunked": ("tiny", {"attention": "flash", "kv_cache": "contiguous",
                                    "scheduler": {"name": "continuous", "chunked_prefill": True, "prefill_chunk": 4}}),
    "mla-none-cache": ("mla-tiny", {"attention": "flash"}),
    "mla-contiguous": ("mla-tiny", {"attention": "flash", "kv_cache": "contiguous"}),
    "paged": ("tiny", {"attention": "flash", "kv_cache": {"name": "paged", "block_size": 4}}),
}
GRAPHED = ("contiguous-chunked", "paged")   # arms run again with their decode steps replayed from graphs
PROMPTS = [(5, 3), (9, 2), (3, 4)]       # (prompt tokens, new tokens)


def main() -> None:
    import ablate_kernels
    torch.set_num_threads(1)
    registry = default_registry()
    models = {name: LlamaModel.random(preset(name)) for name in ("tiny", "mla-tiny")}
    gen = torch.Generator().manual_seed(0)
    requests = [Request(i, tuple(torch.randint(0, 256, (p,), generator=gen).tolist()), n)
                for i, (p, n) in enumerate(PROMPTS)]

    def run(model, spec, graphed=False):
        arm = resolve_arm("check", spec, baseline_configs(registry), registry)
        built = build_arm(arm, model, EngineConfig(max_num_seqs=2), 16, registry)
        runner = built.engine.runner
        if graphed:
            runner.graphs = DecodeGraphs(runner.device, why_not_capturable(runner.kv_cache, runner.attention),
                                         compute_dtype=next(model.parameters()).dtype, emulate=True)
        tokens = [s.output_token_ids for s in built.engine.run(requests)]
        return tokens, built.plugins[Slot.ATTENTION], runner.graphs

    baselines = {name: run(model, {})[0] for name, model in models.items()}
    result = {"triton_available": ablate_kernels.triton_available("cpu"), "arms": {}, "warnings": []}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, (model_name, spec) in ARMS.items():
            tokens, attention, _ = run(models[model_name], spec)
            result["arms"][name] = {"same_tokens": tokens == baselines[model_name], "backend": attention.backend,
                                    "kinds": sorted(attention.ran)}
        result["graphs"] = {}
        for name in GRAPHED:
            model_name, spec = ARMS[name]
            tokens, _, graphs = run(models[model_name], spec, graphed=True)
            result["graphs"][name] = {"same_tokens": tokens == baselines[model_name], "disabled": graphs.disabled,
                                      "replays": graphs.num_replays}
    result["warnings"] = [str(w.message) for w in caught if w.category.__name__ == "FlashFallbackWarning"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
