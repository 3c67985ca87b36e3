"""Write a synthetic arithmetic prompt set for the tiny variant's smoke GRPO run, in the DAPO-Math-17k
row format, to glmkit/assets/<task>/{train,test}.jsonl.

    python scripts/make_arith_dataset.py [--task arith] [--max-operand 20] [--train-rows 3000] [--test-problems 82] [--seed 0]
    python scripts/make_arith_dataset.py --task copy --max-operand 999 --train-rows 900 --test-problems 100

`arith`: problems `a+b=` and `a-b=` with 0 <= a, b <= max-operand (882 distinct problems at 20).
`copy`: problems `a+0=` with 0 <= a <= max-operand, whose answer repeats the prompt's number: what the
tiny model learns there carries over to numbers it never saw (the tiny preset's set). A seeded
set of `--test-problems` is held out as test.jsonl (each once); train.jsonl holds every other problem
once, topped up to `--train-rows` rows by seeded draws from them (so most appear about 4 times), and the
two files never share a problem. Every row carries
`"source": "synthetic"` (jsonl has no header to say so). Re-running with the same flags writes
identical files.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "synthetic"


def all_problems(max_operand: int, task: str = "arith") -> list[tuple[str, str]]:
    """(prompt text, answer) for every a+b and a-b with operands in [0, max_operand] (arith), or every
    a+0 (copy)."""
    if task == "copy":
        return [(f"{a}+0=", str(a)) for a in range(max_operand + 1)]
    problems = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            problems.append((f"{a}+{b}=", str(a + b)))
            problems.append((f"{a}-{b}=", str(a - b)))
    return problems


def row(problem: tuple[str, str]) -> dict:
    text, answer = problem
    return {"prompt": [{"role": "user", "content": text}], "label": answer, "source": SOURCE}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def split(problems, test_problems: int, train_rows: int, seed: int):
    rng = random.Random(seed)
    shuffled = list(problems)
    rng.shuffle(shuffled)
    test, pool = shuffled[:test_problems], shuffled[test_problems:]
    if not pool:
        raise ValueError("no problems left for training; lower --test-problems or raise --max-operand")
    # every training problem at least once, then seeded draws up to the row count
    train = pool[:train_rows] + [rng.choice(pool) for _ in range(train_rows - len(pool))]
    rng.shuffle(train)
    return train, test


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=("arith", "copy"), default="arith")
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--train-rows", type=int, default=3000)
    parser.add_argument("--test-problems", type=int, default=82)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="default: glmkit/assets/<task>")
    args = parser.parse_args(argv)

    train, test = split(all_problems(args.max_operand, args.task), args.test_problems, args.train_rows, args.seed)
    out = Path(args.out or ROOT / "glmkit" / "assets" / args.task)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", [row(p) for p in train])
    write_jsonl(out / "test.jsonl", [row(p) for p in test])
    size = sum((out / f).stat().st_size for f in ("train.jsonl", "test.jsonl"))
    print(f"wrote {out}: {len(train)} train rows ({len(set(train))} distinct problems), "
          f"{len(test)} test problems, {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
