"""Outside engines as arms: Hugging Face transformers, llama.cpp, ... serving the same workload as
ablate's own engine, interleaved with its arms round by round and measured the same way.

    contract.py   what an outside engine implements (OutsideEngine) and how it is configured
    timeline.py   the per-request times it reports, read by the same metrics as ablate's Recorder
    batches.py    the driver for engines that serve one batch at a time (arrivals, batch limits)
    discovery.py  discovery through the `ablate.engines` entry points; a missing one is a skip
    arms.py       an arm of any engine resolved: ablate's own (ablate.engine.arm) or an outside one's
    runs.py       one outside arm measured once, as ablate.experiment.arm_run measures its own
    serving.py    one serving timed where the engine runs (its timeline, wall time, memory)
    worker.py     the worker process an engine runs in, so that its crash fails its arm only
    hf.py         transformers' generate (dynamic / static cache, prompt lookup)
    llamacpp.py   llama-cpp-python on the GGUF (as shipped, or rewritten in F32 / F16)
"""
