"""Pure math: losses, advantages, KL estimators, schedules and statistics.

Tensors (or numbers) in, tensors out: no models, no files, no processes. Each function is small and
tested against hand-computed numbers. May import: torch, numpy, `schemas` (constants only).
"""
