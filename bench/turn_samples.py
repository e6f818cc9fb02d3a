"""What capture.turns costs in stored tokens, per published chat template.

A several-turn conversation trains every assistant turn. Where a template
renders an earlier turn in the history exactly as the target emitted it,
one sample holds them all (turns auto); where it does not (every reasoning
template drops an earlier turn's reasoning once a user asks again), each
turn needs a sample of its own, and its history is stored again in each
(turns each, what speculators and SpecForge's multi-turn expansion do for
every row). This prints, for the demo's prompts and answers made into
conversations of 1 to 4 turns, with and without reasoning, the samples and
tokens each setting stores and the ratios to auto, measured in one run
(docs/reasoning.md quotes them).

    .venv/bin/python -m bench.turn_samples [--rows 200]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.data.chat import resolve, stop_texts  # noqa: E402
from tasks.data.dataset import DEMO_DATASET, tokenize_row  # noqa: E402
from tests.published_templates import ALL, model_dir_for  # noqa: E402


def conversations(n: int, reasoning: bool) -> list[dict]:
    """Conversations of 1-4 turns made of consecutive demo conversations."""
    demo = [json.loads(line)["messages"] for line in DEMO_DATASET.read_text().splitlines()]
    rows, i = [], 0
    for k in range(n):
        turns = []
        for j in range(1 + k % 4):
            user, answer = demo[i % len(demo)][0]["content"], demo[i % len(demo)][1]["content"]
            i += 1
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer} | (
                {"reasoning_content": f"The user asks about: {user[:200]} I should answer plainly."}
                if reasoning else {})]
        rows.append({"messages": turns})
    return rows


def measure(tok, folder, rows: list[dict], turns: str, thinking: bool | None) -> tuple[int, int, int]:
    chat = resolve(tok, stop=stop_texts(tok, folder), date="2026-12-07", thinking=thinking, turns=turns)
    samples = [s for row in rows for s in tokenize_row(tok, row, None, chat)]
    return len(samples), sum(len(ids) for ids, _ in samples), sum(sum(m) for _, m in samples)


def main() -> None:
    from transformers import AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    args = parser.parse_args()
    print(f"{args.rows} conversations of 1-4 turns ({sum(1 + k % 4 for k in range(args.rows))} assistant turns), "
          f"the demo's prompts and answers\n")
    print("| template | answers | auto: samples, tokens, loss tokens | each | each / auto tokens | last: loss "
          "tokens / auto |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for target in ALL:
            folder = model_dir_for(target, Path(tmp) / target.name)
            tok = AutoTokenizer.from_pretrained(folder)
            for reasoning in ((False, True) if target.switch or target.name == "gpt-oss-120b" else (False,)):
                rows = conversations(args.rows, reasoning)
                thinking = True if reasoning and target.switch else None
                auto, each, last = (measure(tok, folder, rows, t, thinking) for t in ("auto", "each", "last"))
                print(f"| {target.name} | {'with reasoning' if reasoning else 'plain'} | {auto[0]}, {auto[1]:,}, "
                      f"{auto[2]:,} | {each[0]}, {each[1]:,}, {each[2]:,} | {each[1] / auto[1]:.2f}x | "
                      f"{last[2] / auto[2]:.2f}x |")


if __name__ == "__main__":
    main()
