"""ablate: measure what each LLM-inference technique buys, alone and in combination.

Importing ablate changes nothing in the process's environment: the variables the CLI sets at its
start, and why, are in ablate/process_env.py."""
