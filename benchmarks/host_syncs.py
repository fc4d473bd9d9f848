"""Host syncs per decode step and per layer, for every built-in arm (ablate/testing/syncs.py).

    python benchmarks/host_syncs.py

A sync is a call that makes the host wait for the device (on a GPU): the clock's synchronisations,
.tolist()/.item()/bool(tensor)/nonzero()/.cpu(), repeat_interleave without its output size. They
are counted on the CPU, where the calls are the same, over the tiny random model serving 3 requests;
"per layer" is the most in any layer but the first of a decode step.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse

import pandas as pd
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
from ablate.engine.registry import default_registry
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.testing.syncs import BUILT_IN_ARMS, MAX_SYNCS_PER_DECODE_STEP, count_syncs, summary


def requests() -> list[Request]:
    gen = torch.Generator().manual_seed(0)
    return [Request(i, tuple(torch.randint(0, 256, (n,), generator=gen).tolist()), k, SamplingParams(), ())
            for i, (n, k) in enumerate([(5, 6), (9, 4), (12, 8)])]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    registry, model = default_registry(), LlamaModel.random(preset("tiny"))
    rows = []
    for name, (spec, per_draft) in BUILT_IN_ARMS.items():
        arm = resolve_arm(name, spec, baseline_configs(registry), registry)
        built = build_arm(arm, model, EngineConfig(max_num_seqs=8), 64, registry)
        found = summary(count_syncs(built, requests()))
        rows.append({"arm": name, "decode steps": found["decode_steps"], "syncs / step (max)": found["max_per_step"],
                     "bound": MAX_SYNCS_PER_DECODE_STEP + per_draft, "syncs / layer (max)": found["max_per_layer"],
                     "host copies / step (max)": found["max_host_copies_per_step"],
                     "calls in decode steps": ", ".join(f"{k} {v}" for k, v in sorted(found["calls"].items()))})
    print(pd.DataFrame(rows).to_markdown(index=False))


if __name__ == "__main__":
    main()
