"""Environments: what a trajectory talks to between the model's turns (issue 46).

An `Environment` starts an `Episode` from a `prompts` row; the episode receives each model turn
(`Turn`: its text and token ids) and answers with an `Observation` (text appended to the sequence as
tokens) or None (the trajectory ends); the environment scores the finished trajectory with the row's
verifier. Built in (`registry.ENVIRONMENTS`): `single_turn` (one turn, scored as every sampling stage
scores a completion) and `python` (code blocks run in the sandbox, their output the next
observation). A user environment is a Python file (`registry.load_environment_file`).

Beneath the stages and the sampler: no models, no tensors. May import: `schemas`, `stages.rewards`.
"""
