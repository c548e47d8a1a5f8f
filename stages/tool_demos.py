"""`tool_demos` stage: a cold start for the python tool, written from the task generator's gold answers.

For every prompt whose question holds an arithmetic expression (reasoning-gym `products`: "Solve the
following multiplication: 1663 * 5242. …", `basic_arithmetic`: "Calculate -1515 * -61."), one
demonstration in the R1 format with the tool call inside the thinking:

    <think>
    This needs exact arithmetic, so I will compute it with Python.
    <python>
    print(1663 * 5242)
    </python><output>            <- the observation, exactly as the python environment writes it
    8717446
    </output>
    </think>
    <answer>8717446</answer>

The program runs in the sandbox (`stages.rewards.sandbox`, the python environment's per-call limits) and
the demonstration is kept only when its answer, the printed output, is right by the row's verifier and
the model's text (without the observation) is well formed: every demonstration was checked by running it.
The call sits inside `<think>` so that the model's text of a tool trajectory stays
`<think>…</think><answer>…</answer>`: the format reward and the eval's format rate then do not punish
tool use. `sft` trains on the model's spans only (`training.sequences.tokenize_completion`).

Why demonstrations rather than rejection sampling with the python environment (issue 46 asks which):
a 135M model almost never writes a `<python>` block on its own, so sampling it with the tool and keeping
the right answers would keep nearly nothing, and what it kept would mostly be answers found without the
tool. The gold answer is known, so a trace that computes it with code can be written and checked.

`with_tool: false` writes the no-tool arm of a comparison: the same prompts (kept by the same check),
answered `<think>I need to compute EXPR.</think><answer>GOLD</answer>`.
"""

from __future__ import annotations

import ast
import json
import re
from concurrent.futures import ThreadPoolExecutor

from schemas.configs import ToolDemosConfig
from schemas.datasets import from_rows
from schemas.errors import SchemaError
from stages.base import Input, Output, StageContext, write_dataset
from stages.environments.python_tool import CALL_CLOSE, CALL_OPEN, PythonTool, observation_text
from stages.rewards.answers import gold_completion
from stages.rewards.sandbox import SandboxResult, run_program
from stages.rewards.verifiers import score

VERSION = "1"  # history: CHANGELOG.md
CONFIG = ToolDemosConfig
INPUTS = {"prompts": "prompts"}
OUTPUTS = {"data": "sft"}
SANDBOX_WORKERS = 8  # programs run at once (each in its own sandbox; mostly waiting on a subprocess)

_CANDIDATE = re.compile(r"[-+*/()\d\s.]*\d[-+*/()\d\s.]*")
_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub,
          ast.UAdd)


def _is_arithmetic(text: str) -> bool:
    """Numbers joined by + - * / (and signs, parentheses), with at least one operation."""
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    nodes = list(ast.walk(tree))
    return (all(isinstance(n, _NODES) for n in nodes) and any(isinstance(n, ast.BinOp) for n in nodes)
            and all(isinstance(n.value, int | float) for n in nodes if isinstance(n, ast.Constant)))


def arithmetic_expression(question: str) -> str | None:
    """The longest arithmetic expression in `question` (a sentence's full stop and an `=` left out), or None.

    >>> arithmetic_expression("Solve the following multiplication: 1663 * 5242. Give only the result.")
    '1663 * 5242'
    >>> arithmetic_expression("Calculate ( 241 * -468 ).")
    '( 241 * -468 )'
    >>> arithmetic_expression("What is 12?") is None
    True
    """
    found = [m.group().strip().rstrip(".").strip() for m in _CANDIDATE.finditer(question)]
    found = [f for f in found if _is_arithmetic(f)]
    return max(found, key=len) if found else None


def tool_demonstration(think: str, program: str, observation: str, printed: str) -> tuple[str, str]:
    """(transcript, the model's text): the demonstration with and without its observation.

    >>> tool_demonstration("T", "print(2 * 3)", "<output>\\n6\\n</output>\\n", "6")[0]
    '<think>\\nT\\n<python>\\nprint(2 * 3)\\n</python><output>\\n6\\n</output>\\n</think>\\n<answer>6</answer>'
    """
    call = f"<think>\n{think}\n{CALL_OPEN}\n{program}\n{CALL_CLOSE}"
    answer = f"</think>\n<answer>{printed}</answer>"
    return call + observation + answer, call + answer


def demonstration(row: dict, expression: str, result: SandboxResult, cfg: ToolDemosConfig,
                  tool: PythonTool) -> str | None:
    """The assistant turn for `row`, or None when the run failed or its printed answer is not right."""
    if result.status != "ok":
        return None
    printed = result.stdout.strip()
    transcript, text = tool_demonstration(cfg.think, f"print({expression})",
                                          observation_text(result, tool.max_output_chars, tool.timeout_s), printed)
    verdict = score(row, text)
    if verdict.correct is not True or not verdict.format_ok:
        return None
    if cfg.with_tool:
        return transcript
    return gold_completion(row["answer"], cfg.think_no_tool.format(expression=expression))


def run(cfg: ToolDemosConfig, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    prompts = [r for r in inputs["prompts"].table("prompts").to_pylist() if r["split"] == cfg.split][: cfg.max_prompts]
    if not prompts:
        raise SchemaError(f"{inputs['prompts'].label}: no prompts with split={cfg.split!r}")
    tool = PythonTool(limits=cfg.sandbox, timeout_s=cfg.timeout_s, max_output_chars=cfg.max_output_chars)
    found = [(row, arithmetic_expression(row["messages"][-1]["content"])) for row in prompts]
    found = [(row, expr) for row, expr in found if expr is not None and row["answer"] is not None]
    with ThreadPoolExecutor(SANDBOX_WORKERS) as pool:
        results = list(pool.map(lambda f: run_program(f"print({f[1]})", "", tool.call_limits()), found))
    rows = []
    for (row, expr), result in zip(found, results, strict=True):
        content = demonstration(row, expr, result, cfg, tool)
        if content is None:
            continue
        rows.append({"id": row["id"], "messages": row["messages"] + [{"role": "assistant", "content": content}],
                     "source": "tool_demos",
                     "metadata": json.dumps({"prompt_id": row["id"], "task": row["task"], "expression": expr,
                                             "with_tool": cfg.with_tool}, sort_keys=True)})
    metrics = {"prompts": float(len(prompts)), "with_expression": float(len(found)), "kept": float(len(rows)),
               "kept_rate": len(rows) / len(prompts),
               "program_errors": float(sum(r.status != "ok" for r in results))}
    ctx.log_metrics(metrics)
    ctx.log.info("tool_demos: %d of %d prompts kept (%d with an expression)", len(rows), len(prompts), len(found))
    return {"data": write_dataset(ctx, "data", from_rows(rows, "sft"), "sft", metrics)}
