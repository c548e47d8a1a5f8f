"""`reference_logprobs` stage: the reference model's log-probs of every preference completion.

Computed once per (model, dataset, max_length) and cached as a `ref_logprobs` dataset, so a
`preference_optimization` run with another beta or loss re-uses it and never loads the reference
model. The tokenization and forward pass are preference_optimization's own (`tokenize`,
`completion_logprobs`), so the numbers are exactly what that stage would compute in-line; it
checks the token counts against its own before using them.
"""

from __future__ import annotations

import time

from schemas.configs import ReferenceLogprobsConfig
from schemas.datasets import from_rows
from stages.base import Input, Output, StageContext, seed_everything, write_dataset
from stages.modeling.prefix_sharing import score_examples
from stages.training.optim import resolve_precision
from stages.training.pairs import examples_from, tokenize

VERSION = "2"  # history: CHANGELOG.md
CONFIG = ReferenceLogprobsConfig
INPUTS = {"model": "model", "preferences": "preferences|unpaired"}
OUTPUTS = {"logprobs": "ref_logprobs"}


def run(cfg: ReferenceLogprobsConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    examples = examples_from(inputs["preferences"], include_kl=cfg.include_kl)  # validates before loading
    seed_everything(ctx.seed)
    model, tokenizer = inputs["model"].load_model()  # an adapter artifact loads with its adapter active
    model = model.to(ctx.device).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokenized = [tokenize(tokenizer, e.messages, e.completion, cfg.max_length) for e in examples]
    t0 = time.perf_counter()
    logps = score_examples(model, tokenized, pad_id, ctx.device, cfg.batch_size,
                           resolve_precision(cfg.precision, ctx.device))
    seconds = time.perf_counter() - t0
    rows = [{"id": e.id, "role": e.role, "logp": lp, "tokens": n_c}
            for e, lp, (_, n_c) in zip(examples, logps, tokenized, strict=True)]
    metrics = {"completions": float(len(rows)), "sequences_per_s": len(rows) / seconds if seconds else 0.0,
               "mean_logp": sum(logps) / len(logps), "max_length": float(cfg.max_length)}
    ctx.log_metrics(metrics)
    return {"logprobs": write_dataset(ctx, "logprobs", from_rows(rows, "ref_logprobs"), "ref_logprobs", metrics)}
