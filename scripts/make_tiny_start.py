"""Build the tiny variant's starting checkpoint for the smoke GRPO run: a seeded random tiny model,
briefly trained by supervised next-token loss on a synthetic set. A share of its targets
(`--plain-share`) answer in an unrewarded form (`</think>N`, no `\\boxed{}`), the rest in the rewarded
one (`</think>\\boxed{N}`): the start knows the answers but gives them in the rewarded form only part of
the time, so GRPO has room to lift its reward on prompts it never trains on too. Writes
glmkit/assets/tiny_start (weights + config + the tiny tokenizer's files).

    python scripts/make_tiny_start.py [--data glmkit/assets/copy] [--steps 150] [--plain-share 0.7] [--lr 3e-3]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT / "glmkit" / "assets" / "copy"),
                        help="a folder with train.jsonl and test.jsonl")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--plain-share", type=float, default=0.7,
                        help="share of targets in the unrewarded form </think>N (0: all boxed)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "glmkit" / "assets" / "tiny_start"))
    args = parser.parse_args(argv)

    from glmkit.checkpoint import synth_checkpoint
    from glmkit.model import RolloutEngine, SamplingParams, TrainPath, load_model, save_model
    from glmkit.rl.data import format_response, load_prompts
    from glmkit.rl.rewards import score
    from glmkit.tokenizer import TINY_TOKENIZER, load_tokenizer

    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(None)
    train, _ = load_prompts(str(Path(args.data) / "train.jsonl"), tokenizer=tokenizer,
                            shuffle_seed=args.seed)
    test, _ = load_prompts(str(Path(args.data) / "test.jsonl"), tokenizer=tokenizer,
                           shuffle_seed=args.seed)
    start = synth_checkpoint("tiny", args.seed, Path(tempfile.mkdtemp()) / "random", progress=False)
    model = load_model(start)
    path = TrainPath(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed)
    for _ in tqdm(range(args.steps), desc="SFT", unit="step"):
        batch = [train[int(i)] for i in torch.randint(len(train), (args.batch,), generator=g)]
        seqs, masks = [], []
        for s in batch:
            plain = torch.rand((), generator=g) < args.plain_share
            text = f"</think>{s.label}{tokenizer.eos_token}" if plain else format_response(s.label, tokenizer.eos_token)
            response = tokenizer.encode(text, add_special_tokens=False)
            seqs.append(s.prompt_ids + response)
            masks.append([0] * (len(s.prompt_ids) - 1) + [1] * len(response) + [0])
        out = path.forward(seqs)
        mask = torch.tensor([m for ms in masks for m in ms], dtype=torch.float32)
        loss = -(out.logprobs * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    engine = RolloutEngine(model)
    eos = [tokenizer.eos_token_id]
    for temperature in (0.0, 1.0):
        done = engine.generate([s.prompt_ids for s in test[:64]],
                               SamplingParams(temperature=temperature, max_new_tokens=12, stop_token_ids=eos), seed=1)
        reward = sum(score("deepscaler", tokenizer.decode(c.tokens, skip_special_tokens=False), s.label)["score"]
                     for s, c in zip(test[:64], done)) / 64
        print(f"held-out reward at temperature {temperature}: {reward:.3f} (SFT loss {loss.item():.3f})")
    out = Path(args.out)
    save_model(model, out, overwrite=True)
    for f in Path(TINY_TOKENIZER).iterdir():  # the checkpoint carries its own tokenizer
        shutil.copy(f, out / f.name)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
