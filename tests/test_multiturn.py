"""Multi-turn rollouts on the KV cache (issue 46), on the tiny model: the trajectory's layout and mask, the
trainer's tokens and log-probs against the sampler's, decode after an observation against a fresh prefill,
single_turn against today's generate(), the token budget over all turns, and the masking math."""

from __future__ import annotations

import pytest
import torch

from schemas.configs import GenerationSpec, RewardSpec
from stages.environments.base import Observation, Turn
from stages.environments.single_turn import SingleTurn
from stages.math import rl
from stages.math.masking import predicted_token_mask, token_weights
from stages.modeling.logprobs import token_logprobs
from stages.rewards.verifiers import score
from stages.sampling import generation
from stages.sampling.multiturn import sample_trajectories
from stages.training.trajectories import trajectory_batch


def _row(i: int, words: str = "Say") -> dict:
    return {"id": f"p{i}", "messages": [{"role": "user", "content": f"{words} {'x' * (3 * i)}{i}."}], "answer": str(i),
            "task": "say", "verifier": "exact", "split": "train", "metadata": "{}"}


class Scripted:
    """Answers row `id`'s k-th turn with script[id][k] (a tool call) until the script runs out; keeps the turns."""

    name = "scripted"

    def __init__(self, script: dict[str, list[str]], stop: tuple[str, ...] = ()):
        self.script, self.stop, self.turns = script, stop, {}

    def start(self, row):
        left, seen = list(self.script[row["id"]]), self.turns.setdefault(row["id"], [])

        class Episode:
            def step(self, turn: Turn) -> Observation | None:
                seen.append(turn)
                return Observation(left.pop(0), tool_call=True) if left else None

        return Episode()

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return score(row, completion, RewardSpec(), num_tokens=num_tokens, rm_score=rm_score)


def _spans(mask: tuple[int, ...], start: int) -> list[tuple[int, int, int]]:
    """(value, begin, end) runs of mask[start:], as absolute indices."""
    runs, begin = [], start
    for i in range(start + 1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[begin]:
            runs.append((mask[begin], begin, i))
            begin = i
    return runs


def test_a_two_turn_trajectory_masks_exactly_the_sampled_tokens(tiny_model, tiny_tokenizer):
    """Prompt P tokens; turn 1 runs its budget of 4 tokens; the observation "<o>" is 3 tokens of the
    character tokenizer; turn 2 runs 4 more; the script is then done. So the sequence is P + 4 + 3 + 4 long,
    model_mask is [0]*P + [1]*4 + [0]*3 + [1]*4, and the loss mask over the trainer's (P + 10) predictions is
    model_mask[1:]: 1 at positions P-1..P+2 and P+6..P+9. An advantage of 0.5 weighs exactly those."""
    env = Scripted({"p1": ["<o>"]})
    (traj,), = sample_trajectories(tiny_model, tiny_tokenizer, [_row(1)], env, GenerationSpec(max_new_tokens=4,
                                   temperature=0.0), max_total_tokens=100)[0]
    p = traj.prompt_length
    assert p == len(tiny_tokenizer(generation.render_prompts(tiny_tokenizer, [_row(1)["messages"]])[0],
                                   add_special_tokens=False)["input_ids"])
    assert len(traj.token_ids) == p + 11 and traj.num_tokens == 11 and traj.sampled_tokens == 8
    assert traj.model_mask == (0,) * p + (1,) * 4 + (0,) * 3 + (1,) * 4
    assert list(traj.token_ids[p + 4 : p + 7]) == tiny_tokenizer("<o>", add_special_tokens=False)["input_ids"]
    assert (traj.turns, traj.tool_calls, traj.tool_errors, traj.finish_reason) == (2, 1, 0, "length")
    assert [t.finish_reason for t in env.turns["p1"]] == ["length", "length"]
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.model_mask, strict=True) if not m)
    assert all(lp < 0.0 for lp, m in zip(traj.logprobs, traj.model_mask, strict=True) if m)
    assert traj.transcript == traj.text[:4] + "<o>" + traj.text[4:]  # the scored text has no observation

    batch = trajectory_batch([traj], tiny_tokenizer.pad_token_id)
    expected = torch.zeros(1, p + 10)
    expected[0, p - 1 : p + 3] = 1
    expected[0, p + 6 : p + 10] = 1
    torch.testing.assert_close(batch["loss_mask"], expected)
    torch.testing.assert_close(token_weights(torch.tensor([0.5]), batch["loss_mask"]), 0.5 * expected)


SCRIPT = {"p0": [], "p1": ["<output>7</output>", "<o>"], "p2": ["<output>\n12345\n</output>\n"],
          "p3": ["ab", "abc", "abcd"]}


@pytest.fixture()
def trajectories(tiny_model, tiny_tokenizer):
    """Sampled (temperature 1) trajectories of 4 prompts of different lengths, 2 samples each, in batches of 3 prompts:
    rows end at turns 1, 2, 3 and 4 (or at EOS), with observations of different lengths."""
    rows = [_row(i) for i in range(4)]
    spec = GenerationSpec(max_new_tokens=6, temperature=1.0, batch_size=3)
    out, stats = sample_trajectories(tiny_model, tiny_tokenizer, rows, Scripted(SCRIPT), spec, n=2, seed=5,
                                     max_total_tokens=200)
    return rows, [t for ts in out for t in ts], stats


def test_the_trainers_tokens_are_the_samplers_and_one_forward_pass_gives_its_logprobs(tiny_model, tiny_tokenizer,
                                                                                       trajectories):
    rows, trajs, stats = trajectories
    assert sorted({t.turns for t in trajs}) == [1, 2, 3, 4]  # rows left the batch at different turns
    assert stats.new_tokens == sum(t.sampled_tokens for t in trajs) and stats.completions == 8
    for t in trajs:  # every observation's tokens are its text tokenized alone, appended as they are
        observations = [(b, e) for v, b, e in _spans(t.model_mask, t.prompt_length) if v == 0]
        pid = next(r["id"] for r in rows if r["messages"][0]["content"] in tiny_tokenizer.decode(
            t.token_ids[: t.prompt_length]))
        assert [list(t.token_ids[b:e]) for b, e in observations] == [
            tiny_tokenizer(o, add_special_tokens=False)["input_ids"] for o in SCRIPT[pid][: t.turns - 1]]
    batch = trajectory_batch(trajs, tiny_tokenizer.pad_token_id)
    for i, t in enumerate(trajs):  # byte for byte: the trainer reads the sampler's ids, never text
        assert batch["input_ids"][i, : len(t.token_ids)].tolist() == list(t.token_ids)
        assert int(batch["attention_mask"][i].sum()) == len(t.token_ids)
    with torch.no_grad():
        logp, _ = token_logprobs(tiny_model.eval(), batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"].bool()
    assert int(mask.sum()) == sum(t.sampled_tokens for t in trajs)
    torch.testing.assert_close(logp[mask], batch["sampler_logprobs"][mask], rtol=1e-5, atol=1e-5)
    assert (batch["sampler_logprobs"][~mask] == 0).all()


def test_greedy_decode_after_an_observation_equals_a_fresh_prefill_of_the_whole_sequence(tiny_model, tiny_tokenizer):
    """Rows of different prompt lengths, observation lengths and turn counts in one batch (holes in the mask,
    rows leaving the cache): every turn after an observation is what greedy generate() gives from the row's
    whole sequence so far, prefilled fresh without padding."""
    rows = [_row(i) for i in range(4)]
    spec = GenerationSpec(max_new_tokens=5, temperature=0.0, batch_size=4)
    out, _ = sample_trajectories(tiny_model, tiny_tokenizer, rows, Scripted(SCRIPT), spec, max_total_tokens=200)
    eos = generation.stop_token_ids(tiny_tokenizer)
    checked = 0
    for (t,) in out:
        for value, begin, end in _spans(t.model_mask, t.prompt_length):
            if value == 1 and begin > t.prompt_length:
                prefix = torch.tensor([t.token_ids[:begin]])
                fresh = tiny_model.generate(prefix, attention_mask=torch.ones_like(prefix), do_sample=False,
                                            max_new_tokens=end - begin, eos_token_id=eos,
                                            pad_token_id=tiny_tokenizer.pad_token_id)[0, begin:].tolist()
                assert fresh == list(t.token_ids[begin:end])
                checked += 1
    assert checked == 1 + 2 + 3  # p1, p2, p3's turns after an observation (p0's script is empty)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_single_turn_samples_what_generate_samples(tiny_model, tiny_tokenizer, temperature):
    """single_turn goes through the same prefill, decode loop, sampler and seeds as generate(): the same tokens,
    text and finish reason (a stop string included)."""
    rows = [_row(i) for i in range(5)]
    spec = GenerationSpec(max_new_tokens=10, temperature=temperature, batch_size=4, stop=["xq"])
    ref, _ = generation.generate(tiny_model, tiny_tokenizer, [r["messages"] for r in rows], spec, n=2, seed=3,
                                 progress=False)
    got, _ = sample_trajectories(tiny_model, tiny_tokenizer, rows, SingleTurn(), spec, n=2, seed=3)
    for comps, trajs in zip(ref, got, strict=True):
        for c, t in zip(comps, trajs, strict=True):
            assert list(c.token_ids) == list(t.token_ids[t.prompt_length :]) and t.turns == 1
            assert (c.text, c.finish_reason) == (t.text, t.finish_reason)


def test_max_total_tokens_counts_every_turn_and_observation(tiny_model, tiny_tokenizer):
    """Turns of at most 4 tokens, observations of 3, 15 tokens in all: 4 + 3 + 4 + 3 = 14, so the third turn
    may sample 1 token (15); its observation no longer fits, and the trajectory ends there at 15 tokens."""
    env = Scripted({"p1": ["<o>"] * 10})
    (traj,), = sample_trajectories(tiny_model, tiny_tokenizer, [_row(1)], env, GenerationSpec(max_new_tokens=4,
                                   temperature=0.0), max_total_tokens=15)[0]
    assert traj.num_tokens == 15 and traj.turns == 3 and traj.tool_calls == 2 and traj.finish_reason == "length"
    assert traj.model_mask[traj.prompt_length :] == (1,) * 4 + (0,) * 3 + (1,) * 4 + (0,) * 3 + (1,)


def test_an_environments_stop_string_ends_the_turn(tiny_model, tiny_tokenizer):
    """The stop string is the first two characters greedy decoding writes, so the first turn ends after exactly
    two tokens (one character each), as "stop"; the next turn starts after the observation."""
    spec = GenerationSpec(max_new_tokens=6, temperature=0.0)
    (plain,), = sample_trajectories(tiny_model, tiny_tokenizer, [_row(2)], SingleTurn(), spec)[0]
    stop = plain.text[:2]
    env = Scripted({"p2": ["<o>"]}, stop=(stop,))
    (traj,), = sample_trajectories(tiny_model, tiny_tokenizer, [_row(2)], env, spec, max_total_tokens=50)[0]
    first = env.turns["p2"][0]
    assert (first.text, first.finish_reason, len(first.token_ids)) == (stop, "stop", 2)
    assert traj.model_mask[traj.prompt_length : traj.prompt_length + 5] == (1, 1, 0, 0, 0)


def test_predicted_token_mask_and_weights_by_hand():
    """model_mask [p p s s o s] -> the 5 predictions' mask [0 1 1 0 1] (position t predicts token t+1);
    advantages (2, -1) over two such rows -> weights [0 2 2 0 2] and [0 -1 -1 0 -1]."""
    model_mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 0, 1, 1, 0, 1]])
    mask = predicted_token_mask(model_mask)
    torch.testing.assert_close(mask, torch.tensor([[0.0, 1, 1, 0, 1], [0, 1, 1, 0, 1]]))
    torch.testing.assert_close(token_weights(torch.tensor([2.0, -1.0]), mask),
                               torch.tensor([[0.0, 2, 2, 0, 2], [0, -1, -1, 0, -1]]))


def test_observation_tokens_get_no_gradient_kl_or_entropy(tiny_model, tiny_tokenizer, trajectories):
    """Through the model and the existing policy loss and KL: d loss / d logp is 0 at every position that
    predicts a prompt or observation token, and not 0 at the sampled ones; the entropy term averages sampled
    positions only (an observation position's entropy changes nothing)."""
    _, trajs, _ = trajectories
    batch = trajectory_batch(trajs, tiny_tokenizer.pad_token_id)
    mask = batch["loss_mask"]
    assert (mask == 0).sum() > 0 and (predicted_token_mask(torch.ones(1, 3)) == 1).all()
    logp, entropy = token_logprobs(tiny_model.train(), batch["input_ids"], batch["attention_mask"], with_entropy=True)
    logp.retain_grad()
    advantages = rl.group_advantages(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.5, 0.0]])).reshape(-1)
    old = batch["sampler_logprobs"]
    ref = old - 0.1  # a reference that disagrees everywhere, observation positions included
    per_token, _ = rl.policy_loss(logp, old, advantages, mask)
    loss = rl.aggregate(per_token, mask) + 0.04 * rl.aggregate(rl.kl_k3(logp, ref), mask)
    loss.backward()
    assert (logp.grad[mask == 0] == 0).all()
    moved = advantages[:, None].expand_as(mask)[mask.bool()] != 0
    assert (logp.grad[mask.bool()][moved] != 0).all()
    bonus = rl.aggregate(entropy, mask)
    assert torch.equal(bonus, rl.aggregate(torch.where(mask.bool(), entropy, torch.full_like(entropy, 1e3)), mask))


class CodeEveryTurn:
    """The python environment, fed a fixed program for each of the tiny model's turns (a random model writes no
    code): the sandbox's output comes back as observation tokens, the calls of a batch run side by side."""

    def __init__(self, programs: dict[str, str], **options):
        from stages.environments.python_tool import PythonTool

        self.env = PythonTool(**options)
        self.name, self.stop, self.step_workers, self.programs = "python", self.env.stop, 4, programs

    def turn(self, program: str, turn: Turn) -> Turn:
        """The turn the environment is shown in place of the model's: the program in r1flow's tags."""
        return Turn(f"<python>{program}</python>", turn.token_ids, "stop", turn.index)

    def start(self, row):
        inner, program, fake = self.env.start(row), self.programs[row["id"]], self.turn

        class Episode:
            def step(self, turn: Turn) -> Observation | None:
                return inner.step(fake(program, turn))

        return Episode()

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return self.env.score(row, completion, num_tokens, rm_score)


def test_the_python_environment_answers_turns_with_sandbox_output_as_tokens(tiny_model, tiny_tokenizer):
    rows = [_row(i) for i in range(3)]
    env = CodeEveryTurn({"p0": "print(6 * 7)", "p1": "raise ValueError('boom')", "p2": "print('z' * 40)"},
                        max_turns=3, max_output_chars=10)
    out, stats = sample_trajectories(tiny_model, tiny_tokenizer, rows, env, GenerationSpec(max_new_tokens=3,
                                     temperature=0.0), max_total_tokens=400)
    for (t,), (calls, errors) in zip(out, [(2, 0), (2, 2), (2, 0)], strict=True):
        assert (t.turns, t.tool_calls, t.tool_errors) == (3, calls, errors)
    first_obs = [(b, e) for v, b, e in _spans(out[0][0].model_mask, out[0][0].prompt_length) if v == 0][0]
    assert tiny_tokenizer.decode(out[0][0].token_ids[first_obs[0] : first_obs[1]]) == "<output>\n42\n</output>\n"
    assert "<output>\nzzzzzzzzzz\n[... 30 more characters]\n</output>\n" in out[2][0].transcript
    assert "ValueError: boom" not in out[1][0].text and "Traceback" in out[1][0].transcript
    assert stats.turns == 9 and stats.observation_tokens == sum(t.num_tokens - t.sampled_tokens for (t,) in out)


# --- the chat_template syntax -----------------------------------------------------------------------------------

def test_chat_tool_turn_makes_a_rollout_read_as_the_template_renders_the_conversation(tiny_tokenizer):
    from stages.sampling.completions import render_prompts
    from stages.sampling.multiturn import chat_tool_turn

    before, after = chat_tool_turn(tiny_tokenizer)
    assert (before, after) == ("\n<|im_start|>tool\n", "<|im_end|>\n<|im_start|>assistant\n")  # ChatML, by hand
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    turn = "```python\nprint(6 * 7)\n```"
    rollout = render_prompts(tiny_tokenizer, [user])[0] + turn + "<|im_end|>" + before + "42" + after
    assert rollout == tiny_tokenizer.apply_chat_template(
        [*user, {"role": "assistant", "content": turn}, {"role": "tool", "content": "42"}], tokenize=False,
        add_generation_prompt=True)


def test_chat_tool_turn_refuses_templates_without_a_tool_message(tiny_tokenizer):
    import copy

    from schemas.errors import ConfigError
    from stages.sampling.multiturn import chat_tool_turn

    tok = copy.deepcopy(tiny_tokenizer)
    strict = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
              "{{ raise_exception('roles are user and assistant') }}{% endif %}"
              "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}")
    tok.chat_template = strict
    with pytest.raises(ConfigError, match="refuses a tool message.*roles are user and assistant"):
        chat_tool_turn(tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ '<|im_start|>' + m['role'] + '\\n' "
                         "+ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}")
    with pytest.raises(ConfigError, match="renders no tool message"):
        chat_tool_turn(tok)
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    with pytest.raises(ConfigError, match="does not end with the model's end-of-turn token"):
        chat_tool_turn(tok)


class TemplateCalls(CodeEveryTurn):
    """CodeEveryTurn in the chat_template syntax: each turn is read as a fenced call that ended with EOS."""

    def __init__(self, programs, **options):
        super().__init__(programs, syntax="chat_template", **options)
        self.uses_chat_template, self.tools = True, self.env.tools

    def with_tool_turn(self, tool_turn):
        self.env = self.env.with_tool_turn(tool_turn)
        return self

    def turn(self, program: str, turn: Turn) -> Turn:
        return Turn(f"```python\n{program}\n```", turn.token_ids, "eos", turn.index)


def test_a_chat_template_rollout_appends_the_templates_tool_message_as_tokens(tiny_model, tiny_tokenizer):
    env = TemplateCalls({"p0": "print(6 * 7)"}, max_turns=2)
    ((t,),), _ = sample_trajectories(tiny_model, tiny_tokenizer, [_row(0)], env, GenerationSpec(max_new_tokens=3,
                                    temperature=0.0), max_total_tokens=200)
    assert (t.turns, t.tool_calls, t.tool_errors) == (2, 1, 0)
    (_, b, e), = [s for s in _spans(t.model_mask, t.prompt_length) if s[0] == 0]
    assert tiny_tokenizer.decode(t.token_ids[b:e]) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    assert t.token_ids[b:e] == tuple(tiny_tokenizer("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n",
                                                    add_special_tokens=False)["input_ids"])
