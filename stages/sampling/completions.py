"""What a generation backend returns, its interface, and the prompt and stop handling every backend shares.

Prompts are chat-templated with the assistant turn's header, then an optional prefill (text the
assistant turn starts with); a completion's text starts with that prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tqdm.auto import tqdm

from schemas.configs import GenerationSpec


@dataclass(frozen=True)
class Completion:
    text: str
    num_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] | None = None  # one per token in token_ids, when asked for


@dataclass
class GenerationStats:
    prompts: int = 0
    completions: int = 0
    new_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


class GenerationProgress:
    """The progress bar of one generate call, moving with the decode rather than per batch.

    It counts new tokens out of a budget of completions x max_new_tokens; a completion that ends before
    its budget gives the rest back (the total shrinks), so the bar ends at 100%, its rate is tokens/s and
    its ETA an upper bound. The postfix counts finished completions. A decode reports each step
    (`step`: integer additions; tqdm redraws at most every `mininterval` s); `batch_done` then sets the
    exact counts of the batch, so a backend that reports steps approximately (`_StepCounter`) is exact at
    every batch's end.
    """

    def __init__(self, completions: int, max_new_tokens: int, desc: str, enabled: bool = True):
        self.completions, self.max_new_tokens = completions, max_new_tokens
        self.ended = self.exact_tokens = self.exact_ended = 0
        self.bar = tqdm(total=completions * max_new_tokens, desc=desc, unit="tok", leave=False, disable=not enabled,
                        mininterval=0.5, postfix=f"0/{completions} done")

    def step(self, tokens: int, ended: int, steps_left: int) -> None:
        """A decode step added `tokens` and ended `ended` rows, each leaving `steps_left` tokens of budget unused."""
        if ended:
            self.ended += ended
            self.bar.total -= ended * steps_left
            self.bar.set_postfix_str(f"{self.ended}/{self.completions} done", refresh=False)
        self.bar.update(tokens)

    def batch_done(self, lengths: list[int]) -> None:
        """A batch's completions are in, of these lengths (in tokens)."""
        self.exact_tokens += sum(lengths)
        self.exact_ended += len(lengths)
        self.ended = self.exact_ended
        self.bar.total = self.exact_tokens + (self.completions - self.exact_ended) * self.max_new_tokens
        self.bar.n = self.exact_tokens
        self.bar.set_postfix_str(f"{self.ended}/{self.completions} done", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class GenerationBackend(Protocol):
    def generate(self, conversations: list[list[dict]], spec: GenerationSpec, n: int = 1, seed: int = 0,
                 logprobs: bool = False, desc: str = "generate", progress: bool = True,
                 prefills: list[str] | None = None) -> tuple[list[list[Completion]], GenerationStats]: ...


def row_prefills(conversations: list[list[dict]], spec: GenerationSpec, prefills: list[str] | None) -> list[str]:
    """Each conversation's prefill: `prefills[i]` when given (one per conversation: e.g. step_labels' step
    prefixes, all rolled out in one call), else `spec.prefill` for all."""
    if prefills is None:
        return [spec.prefill] * len(conversations)
    if len(prefills) != len(conversations):
        raise ValueError(f"prefills: {len(prefills)} for {len(conversations)} conversations (one each)")
    return list(prefills)


def render_prompts(tokenizer, conversations: list[list[dict]], prefill: str | list[str] = "",
                   tools: list[dict] | None = None) -> list[str]:
    """Chat-templated prompts ending with the assistant turn's header, then `prefill` (if any; a list: one per
    conversation). `tools`: JSON schemas the template may describe to the model (templates without tool
    support ignore them)."""
    prefills = [prefill] * len(conversations) if isinstance(prefill, str) else prefill
    extra = {"tools": tools} if tools else {}
    return [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True, **extra) + p
            for c, p in zip(conversations, prefills, strict=True)]


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    return sorted(i for i in ids if i is not None)


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """Text up to and including the earliest stop string, and whether one was found."""
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, False
    pos, stop = min(hits)
    return text[: pos + len(stop)], True



class CompletionStopStrings:
    """A stop-string criterion that fires only on stop strings inside the completion.

    transformers' StopStringCriteria matches the end of the whole sequence, prompt included: a ChatML prompt ends in
    a newline, so `stop: ["\\n\\n"]` ended every row at its first token when that token was a newline (a one-token
    completion, "length"). A match that ends at the newest token can reach into the prompt only while the
    completion has fewer characters than the stop string; during those first tokens a match is confirmed on the
    decoded completion. `width`: the prompt's width in the sequences the criterion is called with.
    """

    def __init__(self, tokenizer, stops: list[str], width: int):
        from transformers.generation.stopping_criteria import StopStringCriteria

        self.inner = StopStringCriteria(tokenizer, list(stops))
        self.tokenizer, self.stops, self.width = tokenizer, [s for s in stops if s], width
        self.horizon = max((len(s) for s in self.stops), default=0)  # characters

    def __call__(self, input_ids, scores=None, **kwargs):
        done = self.inner(input_ids, scores)
        if input_ids.shape[1] - self.width < self.horizon and bool(done.any()):
            for i in done.nonzero().flatten().tolist():
                text = self.tokenizer.decode(input_ids[i, self.width:].tolist(), skip_special_tokens=False)
                done[i] = any(s in text for s in self.stops)
        return done
