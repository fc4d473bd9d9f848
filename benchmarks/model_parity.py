"""Every architecture ablate reads, against transformers on the same random weights: the parity table,
then the speed of each beside transformers' generate.

    .venv/bin/python benchmarks/model_parity.py [--kinds qwen3 mixtral ...] [--speed] [--batch 1 8] [--out DIR]

Parity, per kind of ablate.testing.hf_models (a small random model transformers builds offline, saved
and loaded by ablate):
- logits: max |ablate - transformers| over a 24-token prompt, and that over the spread (standard
  deviation) of transformers' logits, the scale the tests' 1e-3 bound is read against;
- greedy: 32 greedy tokens through ablate's engine with each built-in KV cache, against
  transformers' generate: the share of positions that agree (1.0: identical text);
- perplexity: ablate's over transformers' on 128 tokens transformers samples itself (teacher forced;
  1.0 = the same predictions).

--speed: each kind again, wider (hidden 512, 4 layers, vocab 8192), through `python -m ablate
+experiment=vs_hf` at each --batch: ablate (contiguous cache, SDPA) and transformers' generate
loading the same directory, interleaved round by round, each batch size a process of its own. The
table gives tok/s, transformers' time over ablate's per round (geometric mean, 95% t-interval; above
1: ablate is faster), their token agreement, and each run's status (noisy: the CPU was contended).
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()       # before torch loads, as the CLI does

import argparse
import math
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.checkpoints import load_model
from ablate.engine.registry import default_registry
from ablate.measure.quality import sequence_logits
from ablate.model.config import ModelConfig
from ablate.testing.hf_models import KINDS, SMALL, build_hf, save_hf
from ablate.testing.scenarios import build

REPO = Path(__file__).resolve().parent.parent
CACHES = {"none": "none", "contiguous": "contiguous", "paged": {"name": "paged", "block_size": 4},
          "dynamic": {"name": "dynamic", "initial_tokens": 4}}
PROMPT, NEW_TOKENS, PPL_TOKENS = 24, 32, 128
WIDE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, vocab_size=8192, max_position_embeddings=512)


def parity(kind: str, directory: Path) -> dict:
    hf = build_hf(kind)
    save_hf(hf, directory, sharded=False)
    model = load_model(ModelConfig(name=kind, init="pretrained", path=str(directory)))
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0].float()                           # (T, V)
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, PROMPT:].tolist()
        torch.manual_seed(2)
        text = hf.generate(torch.tensor([prompt[:8]]), max_new_tokens=PPL_TOKENS - 8, min_new_tokens=PPL_TOKENS - 8,
                           do_sample=True, top_k=0)[0].tolist()                          # transformers' own text
        hf_nll = torch.nn.functional.cross_entropy(hf(torch.tensor([text])).logits[0, :-1].float(), torch.tensor(text[1:]))
    diff = (sequence_logits(model, prompt) - theirs).abs().max().item()
    ours_nll = torch.nn.functional.cross_entropy(sequence_logits(model, text)[:-1], torch.tensor(text[1:]))
    row = {"kind": kind, "model_type": hf.config.model_type, "max |logit diff|": diff,
           "diff / logit spread": diff / theirs.std().item(),
           "ppl ratio": math.exp(ours_nll.item() - hf_nll.item())}
    registry = default_registry()
    for name, cache in CACHES.items():
        request = Request(0, tuple(prompt), NEW_TOKENS, SamplingParams(), ())
        built = build(registry, {"kv_cache": cache}, model, EngineConfig(max_num_seqs=1), PROMPT + NEW_TOKENS)
        try:
            (seq,) = built.engine.run([request])
        finally:
            built.close()
        row[f"greedy {name}"] = sum(a == b for a, b in zip(seq.output_token_ids, expected)) / NEW_TOKENS
    return row


def wide(kind: str) -> dict:
    """WIDE for `kind`, its K/V heads as many as its query heads where the kind is multi-head (DeepSeek's MLA)."""
    kv_heads = KINDS[kind][2].get("num_key_value_heads", SMALL["num_key_value_heads"])
    return WIDE | ({"num_key_value_heads": WIDE["num_attention_heads"]} if kv_heads == SMALL["num_attention_heads"] else {})


def speed(kind: str, directory: Path, batch: int, results: Path, repeats: int) -> dict:
    save_hf(build_hf(kind, **wide(kind)), directory, sharded=False)
    name = f"vs_hf_{kind}_b{batch}"
    command = [sys.executable, "-m", "ablate", "+experiment=vs_hf", f"model.path={directory}",
               f"engine.max_num_seqs={batch}", f"workload.num_requests={2 * batch}", f"experiment.repeats={repeats}",
               f"experiment.name={name}", f"results_dir={results}", "redo=true", "wandb.mode=disabled",
               f"hydra.run.dir={results}/hydra/{name}"]
    print("$", shlex.join(command), flush=True)
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    (summary,) = sorted((results / name).glob("*/summary.csv"))
    rows = pd.read_csv(summary).set_index("arm")
    ours, theirs = rows.loc["ablate"], rows.loc["hf"]
    # the hf arm's speedup over ablate, inverted: how many times faster ablate is; a noisy or degraded
    # arm has no speedup, only its time ratio, shown with its status beside it
    claimed = theirs.status == "ok"
    ratio = [theirs.get(f"{'speedup' if claimed else 'time_ratio'}{end}", math.nan) for end in ("", "_ci_high", "_ci_low")]
    return {"kind": kind, "batch": batch, "ablate tok/s": ours.output_throughput_tok_s,
            "hf tok/s": theirs.output_throughput_tok_s, "ablate faster x": 1 / ratio[0], "CI low": 1 / ratio[1],
            "CI high": 1 / ratio[2], "agreement": theirs.token_agreement, "status": theirs.status}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--speed", action="store_true", help="also time each kind against transformers")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="where the tables and runs go (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="model_parity-"))
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame([parity(kind, out / "parity" / kind) for kind in args.kinds])
    print(table.to_markdown(index=False, floatfmt=".3g"), flush=True)
    table.to_csv(out / "parity.csv", index=False)
    if args.speed:
        times = pd.DataFrame([speed(kind, out / "wide" / kind, batch, out / "runs", args.repeats)
                              for kind in args.kinds for batch in args.batch])
        print(times.to_markdown(index=False, floatfmt=".3g"))
        times.to_csv(out / "speed.csv", index=False)
    print(f"tables and runs: {out}")


if __name__ == "__main__":
    main()
