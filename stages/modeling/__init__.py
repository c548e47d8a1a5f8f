"""Models: loading and saving causal LMs and LoRA adapters (`models`), log-probabilities with
packing and shared prefixes (`logprobs`), and scalar heads on a causal LM: reward models, critics
and their scorers (`heads`).

May import: `schemas`, `stages.math`, `stages.runtime`.
"""
