"""Multi-turn rollouts on the model's KV cache: the model samples a turn, an environment answers, the
answer's tokens are appended and sampling continues from the cache (issue 46).

A trajectory is one token sequence, built as it is sampled and never re-tokenized: the prompt, the
first turn's sampled tokens, the observation's tokens (`tokenizer(text)` of the observation alone),
the next turn's, and so on. What the trainer scores is these ids (`Trajectory.token_ids`), so its
tokens are the sampler's byte for byte, and `Trajectory.model_mask` marks the sampled ones.

Per batch of prompts (`spec.batch_size` prompts x n samples, sorted by length and seeded per batch as
`generation.TransformersBackend` does, so `single_turn` samples generate()'s tokens):
1. `generation.prefill_prompts` prefills each prompt once (all but its last token);
2. `generation.decode_rows` samples a turn for every live row, until EOS, a stop string (`spec.stop`
   and the environment's, e.g. `</python>`) or the row's budget: min(spec.max_new_tokens, what is left
   of `max_total_tokens`, which counts every sampled and observation token after the prompt);
3. each row's episode gets its turn and answers with an observation or the end; rows that ended
   leave the batch and the cache (`batch_select_indices`);
4. the observation tokens of the rows that go on are right-aligned in one block and prefilled into the
   same cache (one decoder call over the new tokens only), then back to 2.

The layout that makes 2-4 one loop: the batch is a "virtual" sequence `ids`/`mask` [rows, W] whose
cache holds every column but the last (`decode_rows`' convention). A turn appends its [rows, steps]
tokens: a row that ended early has padding after its end, and the padding's cache columns (decode_rows
kept feeding finished rows) are masked out by `mask`, as are the left padding of the observation
block. Positions come from the mask's cumulative sum, so holes shift nothing: the cache after an
observation holds what a fresh prefill of the row's real tokens would hold (tested, greedy).

Log-probs: `decode_rows` gets a sampler (`_RecordingSampler`) that applies the warpers and the draw
itself and records the drawn token's log-prob under the model's own distribution (temperature 1, no
top-k/top-p), from the same logits the draw used: what one forward pass over the whole sequence gives
(`stages.modeling.logprobs.token_logprobs`), within fp32 rounding (tested).

Where this departs from `decode_rows` for one turn: finished rows are not dropped inside a turn
(`compact_share` infinite), since a row whose turn ended on `</python>` goes on after its observation
and must keep its cache; rows leave between turns, once their trajectory has ended.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.generation.stopping_criteria import StopStringCriteria

from schemas.configs import GenerationSpec
from schemas.errors import ConfigError, EnvironmentCodeError, ModelError
from stages.environments.base import Environment, Episode, Observation, Turn, TurnEnd, call_environment
from stages.modeling import models
from stages.runtime.seeds import seed_stream
from stages.sampling import lean_decode
from stages.sampling.completions import GenerationStats, render_prompts, row_prefills, stop_token_ids
from stages.sampling.kv_decode import LEAN_CACHE_LAYERS, decode_rows, prefill_prompts, supports_decode_rows
from stages.sampling.rows_first import rows_first_linears
from stages.sampling.sampler import sampling_processors


@dataclass(frozen=True)
class Trajectory:
    """One rollout: the exact token ids and which of them the model sampled.

    token_ids: prompt, then every turn's sampled tokens and every observation's tokens, in order.
    model_mask: 1 where token_ids[i] was sampled, 0 on prompt and observation tokens (same length).
    logprobs: the sampler's log-prob of token_ids[i] where model_mask is 1, else 0.0 (same length).
    text: the prefill and the model's turns (no observations): what `Environment.score` judges.
    transcript: the prefill and everything after the prompt, observations included, as decoded.
    finish_reason: "length" when the token budget ended it (the last turn, or no room for an
    observation and another turn), else "stop".
    """

    token_ids: tuple[int, ...]
    model_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_length: int
    text: str
    transcript: str
    turns: int
    tool_calls: int
    tool_errors: int
    finish_reason: str
    observations: tuple[str, ...] = ()  # the environment's answers as it wrote them, in order

    @property
    def num_tokens(self) -> int:
        """Tokens after the prompt (sampled and observation): what `max_total_tokens` bounds."""
        return len(self.token_ids) - self.prompt_length

    @property
    def sampled_tokens(self) -> int:
        return sum(self.model_mask)


@dataclass
class RolloutStats(GenerationStats):
    """`GenerationStats` (new_tokens: sampled tokens; seconds: the whole call) and where the time went besides
    decoding: observation_tokens appended and the seconds prefilling them into the cache, and the seconds between
    turns (the environment answering them, tool calls included, and its answers tokenized).
    `decode_tokens_per_s` leaves those two out."""

    turns: int = 0
    observation_tokens: int = 0
    observation_seconds: float = 0.0
    environment_seconds: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.seconds - self.observation_seconds - self.environment_seconds
        return self.new_tokens / decode if decode > 0 else 0.0


@dataclass
class TrajectoryRow:
    """A trajectory being built."""

    episode: Episode
    prefill: str
    ids: list[int]
    prompt_length: int
    mask: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    finish: str = ""
    observations: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.mask = [0] * len(self.ids)
        self.lps = [0.0] * len(self.ids)

    @property
    def used(self) -> int:
        return len(self.ids) - self.prompt_length

    def add(self, ids: list[int], sampled: bool, lps: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        self.lps += lps if lps is not None else [0.0] * len(ids)


class _RecordingSampler:
    """The draw `decode_rows` calls, recording each drawn token's log-prob under the raw logits.

    decode_rows runs with no warpers of its own: they run here, in its order (`sampling_processors`),
    before the draw (`BlockRaceSampler`, or argmax when greedy), so the tokens are those
    decode_rows would draw with the same warpers and sampler."""

    def __init__(self, warpers=(), sampler=None):
        self.warpers, self.sampler = list(warpers), sampler
        self.steps: list[torch.Tensor] = []

    def draw(self, scores: torch.Tensor, live: torch.Tensor | None = None, total: int | None = None) -> torch.Tensor:
        warped = scores
        for warp in self.warpers:
            warped = warp(None, warped)
        token = self.sampler.draw(warped, live, total) if self.sampler is not None else warped.argmax(-1)
        # log_softmax then gather: one fused kernel over the vocabulary (half the time of gather - logsumexp on CPU)
        self.steps.append(torch.log_softmax(scores.float(), dim=-1).gather(-1, token[:, None]).squeeze(-1))
        return token

    def logprobs(self) -> torch.Tensor:
        """(rows, steps) log-probs of the drawn tokens (padding after a row's end is meaningless)."""
        return torch.stack(self.steps, 1) if self.steps else torch.zeros(0, 0)


class _TurnStop:
    """The stop criterion of one turn for `decode_rows` (which calls it with every row: no row leaves
    the batch within a turn): a stop string in the turn's tokens, or the row's own token budget. Records,
    per row, the first step that ended it and why. Unlike generate()'s stop strings, which also match
    across the prompt's end (a prompt ending in "\n" stops a "\n\n" string at the first "\n"), a
    stop string here lies within the turn."""

    def __init__(self, width: int, budgets: torch.Tensor, strings: StopStringCriteria | None):
        self.width, self.budgets, self.strings = width, budgets, strings
        self.min_budget = int(budgets.min())
        self.length = torch.zeros_like(budgets)  # tokens of the turn when it ended (0: not ended here)
        self.by_string = torch.zeros_like(budgets, dtype=torch.bool)
        self.none = torch.zeros_like(budgets, dtype=torch.bool)

    def needed(self) -> bool:
        """Whether decode_rows needs this criterion: stop strings, or budgets that differ between rows (a
        budget shared by all is decode_rows' max_new_tokens; `_turn_ends` reads a row that ran it as "length")."""
        return self.strings is not None or self.min_budget != int(self.budgets.max())

    def __call__(self, seq: torch.Tensor, scores) -> torch.Tensor:
        new = seq.shape[1] - self.width
        # only the turn's own tokens: a stop string must not be completed by the prompt's or an observation's end
        string = self.strings(seq[:, self.width :], scores) if self.strings is not None else None
        hit = string
        if new >= self.min_budget:  # before that no row is at its budget: no tensor work per step
            budget = self.budgets <= new
            hit = budget if hit is None else hit | budget
        if hit is None:
            return self.none
        first = hit & (self.length == 0)
        if bool(first.any()):
            self.length[first] = new
            if string is not None:
                self.by_string |= first & string
        return hit


def _turn_ends(out: torch.Tensor, stop: _TurnStop, eos_ids: list[int]) -> list[tuple[int, TurnEnd]]:
    """(tokens, how it ended) of each row's turn in `out` [rows, steps]: its first EOS, else where `stop` ended
    it, whichever is first; a row neither ended ran its whole budget (the last step)."""
    steps = out.shape[1]
    is_eos = torch.isin(out, torch.tensor(eos_ids, device=out.device))
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, steps + 1).tolist()
    ends = []
    for e, s, by_string in zip(first_eos, stop.length.tolist(), stop.by_string.tolist(), strict=True):
        s = s or steps
        ends.append((e, "eos") if e <= s else (s, "stop" if by_string else "length"))
    return ends


def _append_observations(model, ids: torch.Tensor, mask: torch.Tensor, cache, observations: list[list[int]],
                         pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends each row's observation tokens (right-aligned in one block) to the virtual sequence and prefills
    them into `cache`: the virtual sequence's last column and all of the block but its last column, one decoder
    call. Returns the new (ids, mask), whose cache is again every column but the last."""
    width = max(len(o) for o in observations)
    block = ids.new_full((ids.shape[0], width), pad_id)
    block_mask = torch.zeros_like(block)
    for r, obs in enumerate(observations):
        block[r, width - len(obs):] = torch.tensor(obs, dtype=block.dtype)
        block_mask[r, width - len(obs):] = 1
    ids, mask = torch.cat([ids, block], 1), torch.cat([mask, block_mask], 1)
    feed, feed_mask = ids[:, -width - 1 : -1], mask[:, :-1]
    positions = (feed_mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
    decoder = model.get_decoder()
    decoder(input_ids=feed, attention_mask=feed_mask, position_ids=positions, use_cache=True,
            **{models.cache_name(decoder): cache})  # appends to `cache` in place
    return ids, mask


def _check_cache(cache) -> None:
    if not lean_decode.takes_cache(cache, LEAN_CACHE_LAYERS):
        raise ModelError(f"multi-turn rollouts append to a full-attention KV cache in place (a DynamicCache of "
                         f"{', '.join(t.__name__ for t in LEAN_CACHE_LAYERS)} layers); this model's is "
                         f"{type(cache).__name__} ({sorted({type(x).__name__ for x in getattr(cache, 'layers', [])})})")


def step_episodes(rows: list[TrajectoryRow], live: list[int], out: torch.Tensor, lps: torch.Tensor,
                   ends: list[tuple[int, TurnEnd]], tokenizer, max_total_tokens: int, env_name: str, workers: int
                   ) -> tuple[list[int], list[list[int]]]:
    """Records each live row's turn, hands it to its episode (`workers` episodes at a time, in threads), and
    returns the batch positions of the rows that go on with their observations' tokens (the others'
    trajectories are finished)."""
    out_rows, lp_rows = out.tolist(), lps.tolist()
    turn_ids = [out_rows[r][:n] for r, (n, _) in enumerate(ends)]
    texts = tokenizer.batch_decode(turn_ids, skip_special_tokens=True)
    turns = []
    for r, t in enumerate(live):
        row, (n, end) = rows[t], ends[r]
        row.add(turn_ids[r], sampled=True, lps=lp_rows[r][:n])
        row.texts.append(texts[r])
        turns.append(Turn(texts[r], tuple(turn_ids[r]), end, len(row.texts) - 1))
    episodes = [rows[t].episode for t in live]

    def step(episode: Episode, turn: Turn) -> Observation | None:  # an exception in it: one line naming env_name
        return call_environment(env_name, "step", lambda: episode.step(turn))

    if workers > 1 and len(live) > 1:  # tool calls (sandbox runs: mostly waiting on a subprocess) side by side
        with ThreadPoolExecutor(min(workers, len(live))) as pool:
            replies = list(pool.map(step, episodes, turns))
    else:
        replies = [step(e, turn) for e, turn in zip(episodes, turns, strict=True)]
    answers = []
    for r, (obs, turn) in enumerate(zip(replies, turns, strict=True)):
        if obs is None:
            rows[live[r]].finish = "length" if turn.finish_reason == "length" else "stop"
        else:
            answers.append((r, obs))
    # each observation tokenized alone (one call for the batch): never joined to text before or after it
    tokenized = tokenizer([o.text for _, o in answers], add_special_tokens=False)["input_ids"] if answers else []
    keep, observations = [], []
    for (r, obs), obs_ids in zip(answers, tokenized, strict=True):
        row = rows[live[r]]
        if not obs_ids:
            raise EnvironmentCodeError(f"environment {env_name!r}: step() returned an observation without text "
                                       f"({obs.text!r}); return None to end the trajectory")
        if row.used + len(obs_ids) >= max_total_tokens:  # no room for the observation and another turn
            row.finish = "length"
            continue
        row.add(obs_ids, sampled=False)
        row.tool_calls += obs.tool_call  # calls whose output the model reads
        row.tool_errors += obs.tool_error
        row.observations.append(obs.text)
        keep.append(r)
        observations.append(obs_ids)
    return keep, observations


def _rollout_batch(model, tokenizer, enc, rows: list[TrajectoryRow], env: Environment, spec: GenerationSpec,
                   n: int, max_total_tokens: int, stats: RolloutStats) -> None:
    """Rolls out the trajectories `rows` (the n samples of prompt i of the left-padded batch `enc` at
    rows[i * n : (i + 1) * n]) to their ends."""
    eos_ids = stop_token_ids(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    device = enc["input_ids"].device
    ids, mask, cache = prefill_prompts(model, enc["input_ids"], enc["attention_mask"], n, max_total_tokens,
                                       pad_id=pad_id)
    if cache is None:  # one-token prompts: decode_rows' first step fills an empty cache
        cache = DynamicCache(config=model.config)
    else:
        _check_cache(cache)
    procs = list(sampling_processors(spec.temperature, spec.top_k, spec.top_p)) if spec.temperature > 0 else []
    stops = [*spec.stop, *env.stop]
    strings = StopStringCriteria(tokenizer, stops) if stops else None
    live = list(range(len(rows)))
    while live:
        budgets = torch.tensor([min(spec.max_new_tokens, max_total_tokens - rows[t].used) for t in live], device=device)
        stop = _TurnStop(ids.shape[1], budgets, strings)
        sampler = _RecordingSampler(procs[:-1], procs[-1] if procs else None)
        out = decode_rows(model, ids, mask, cache, int(budgets.max()), eos_ids, pad_id, sampler=sampler,
                          stop=stop if stop.needed() else None, compact_share=float("inf"))
        ends = _turn_ends(out, stop, eos_ids)
        real = torch.arange(out.shape[1], device=device)[None, :] < torch.tensor([e for e, _ in ends], device=device)[:, None]
        ids, mask = torch.cat([ids, out], 1), torch.cat([mask, real.to(mask.dtype)], 1)
        t0 = time.perf_counter()
        keep, observations = step_episodes(rows, live, out, sampler.logprobs(), ends, tokenizer, max_total_tokens,
                                            env.name, getattr(env, "step_workers", 1))
        stats.environment_seconds += time.perf_counter() - t0
        if not keep:
            return
        if len(keep) < len(live):
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            ids, mask, live = ids[index], mask[index], [live[r] for r in keep]
        t0 = time.perf_counter()
        ids, mask = _append_observations(model, ids, mask, cache, observations, pad_id)
        stats.observation_seconds += time.perf_counter() - t0
        stats.observation_tokens += sum(len(o) for o in observations)


def finished_trajectory(row: TrajectoryRow, tokenizer) -> Trajectory:
    transcript = tokenizer.decode(row.ids[row.prompt_length:], skip_special_tokens=True)
    return Trajectory(tuple(row.ids), tuple(row.mask), tuple(row.lps), row.prompt_length,
                      row.prefill + "".join(row.texts), row.prefill + transcript, len(row.texts), row.tool_calls,
                      row.tool_errors, row.finish, tuple(row.observations))


_ASSISTANT_MARK, _TOOL_MARK = "R1FLOW-ASSISTANT-TURN", "R1FLOW-TOOL-OUTPUT"


def chat_tool_turn(tokenizer) -> tuple[str, str]:
    """The text a model's chat template puts before and after a tool message's content, when the tool message
    follows an assistant turn that ended with the model's end-of-turn token and the next assistant turn follows it:
    `before` starts right after that token (the model sampled it), `after` ends with the next assistant header.
    So prompt + turn + EOS + before + output + after is what the template renders for the conversation with the
    tool message and the generation prompt. A ConfigError for a template that renders no tool message (it refuses
    the role or drops it) or whose assistant turn does not end with an end-of-turn token."""
    what = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'this tokenizer'}"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ASSISTANT_MARK},
                    {"role": "tool", "content": _TOOL_MARK}]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template that raises on the role (strict user/assistant alternation)
        raise ConfigError(f"environment syntax chat_template: {what} refuses a tool message ({type(e).__name__}: "
                          f"{e}); use syntax: tags") from None
    if _TOOL_MARK not in text or _ASSISTANT_MARK not in text:
        raise ConfigError(f"environment syntax chat_template: {what} renders no tool message; use syntax: tags")
    between = text[text.index(_ASSISTANT_MARK) + len(_ASSISTANT_MARK) : text.index(_TOOL_MARK)]
    ends = [tokenizer.decode([i]) for i in stop_token_ids(tokenizer)]
    end = next((e for e in ends if e and between.startswith(e)), None)
    if end is None:
        raise ConfigError(f"environment syntax chat_template: in {what} an assistant turn does not end with the "
                          f"model's end-of-turn token ({', '.join(map(repr, ends))}), so a sampled turn cannot end "
                          f"where the template's does; use syntax: tags")
    return between[len(end):], text[text.index(_TOOL_MARK) + len(_TOOL_MARK) :]


def bind_environment(env: Environment, tokenizer) -> Environment:
    """`env` ready for this tokenizer: one that writes its observations as the chat template's tool messages
    (`uses_chat_template`) gets the template's text around them (`chat_tool_turn`)."""
    if getattr(env, "uses_chat_template", False):
        return env.with_tool_turn(chat_tool_turn(tokenizer))
    return env


@torch.no_grad()
def sample_trajectories(model, tokenizer, prompt_rows: Sequence[Mapping[str, Any]], env: Environment,
                        spec: GenerationSpec, n: int = 1, seed: int = 0, max_total_tokens: int | None = None,
                        autocast_dtype: torch.dtype | None = None, prefills: list[str] | None = None
                        ) -> tuple[list[list[Trajectory]], RolloutStats]:
    """n trajectories per `prompts` row (in input order) with `env`, and the sampling stats (`RolloutStats`).

    `spec`: temperature / top-k / top-p, `max_new_tokens` (per turn), `stop` (besides the environment's),
    `batch_size` (prompts per batch), `prefill` (or `prefills`, one per row: step_labels' step prefixes).
    `max_total_tokens` (default spec.max_new_tokens) bounds each trajectory's tokens after the prompt, observations
    included. `autocast_dtype` as `generation.generate`.
    """
    if not supports_decode_rows(model):
        raise ModelError(f"multi-turn rollouts run r1flow's decode loop; {type(model).__name__} does not take it "
                         f"(a causal LM with get_decoder() and logits_to_keep)")
    max_total_tokens = max_total_tokens or spec.max_new_tokens
    env, prefills, texts = rollout_prompts(tokenizer, prompt_rows, env, spec, prefills)
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = [order[i : i + spec.batch_size] for i in range(0, len(order), spec.batch_size)]
    results: list[list[Trajectory]] = [[] for _ in texts]
    was_training, t0 = model.training, time.perf_counter()
    stats = RolloutStats(prompts=len(texts), completions=len(texts) * n)
    model.eval()
    device = next(model.parameters()).device
    tokenizer.padding_side = "left"
    try:
        for b, idx in enumerate(batches):
            enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"], strict=True)]
            rows = [r for i, p in zip(idx, prompt_ids, strict=True)
                    for r in start_rows(env, prompt_rows[i], prefills[i], p, n)]
            torch.manual_seed(seed_stream(seed, "generate_batch", b))  # generate()'s stream: single_turn samples its tokens
            # None leaves the caller's autocast state alone (as generation's backend does)
            precision = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
                         else contextlib.nullcontext())
            with rows_first_linears(model), precision:
                _rollout_batch(model, tokenizer, enc, rows, env, spec, n, max_total_tokens, stats)
            for j, row in enumerate(rows):
                results[idx[j // n]].append(finished_trajectory(row, tokenizer))
    finally:
        model.train(was_training)
    return results, finish_stats(stats, results, t0)


def rollout_prompts(tokenizer, prompt_rows: Sequence[Mapping[str, Any]], env: Environment, spec: GenerationSpec,
                    prefills: list[str] | None) -> tuple[Environment, list[str], list[str]]:
    """What a multi-turn sampler starts from (r1flow's loop here, vLLM's `VLLMBackend.trajectories`): the environment
    bound to the tokenizer, each row's prefill, and its prompt text as the chat template renders it with the tools."""
    env = bind_environment(env, tokenizer)
    conversations = [list(r["messages"]) for r in prompt_rows]
    prefills = row_prefills(conversations, spec, prefills)
    return env, prefills, render_prompts(tokenizer, conversations, prefills, tools=getattr(env, "tools", None))


def start_rows(env: Environment, prompt_row: Mapping[str, Any], prefill: str, prompt_ids: list[int],
               n: int) -> list[TrajectoryRow]:
    """The n trajectories of one prompt, each with its own episode of `env` started."""
    return [TrajectoryRow(call_environment(env.name, "start", lambda: env.start(prompt_row)), prefill, list(prompt_ids),
                          len(prompt_ids)) for _ in range(n)]


def finish_stats(stats: RolloutStats, results: list[list[Trajectory]], t0: float) -> RolloutStats:
    """`stats` with the sampled tokens and turns of `results`, and the seconds since `t0`."""
    stats.new_tokens = sum(t.sampled_tokens for ts in results for t in ts)
    stats.turns = sum(t.turns for ts in results for t in ts)
    stats.seconds = time.perf_counter() - t0
    return stats
