"""Stand-in for the recipe's LoRA launcher: commands prepare, train, full-train."""

import shlex
import sys

from _stand_in import VALUES, BOOLS, parse, run

FIELDS = [f for f in (*VALUES, *BOOLS) if f not in (
    "cluster_backend", "namespace", "ckpt_dir", "train_offload_dir", "force", "ci_run", "check_weight_update_equal",
    "enable_r3")]

if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command not in ("prepare", "train", "full-train"):
        sys.exit(f"no such command {command!r}")
    args = parse(rest, FIELDS)
    if command == "prepare":
        print("prepare: nothing to download here", flush=True)
        sys.exit(0)
    words = ["--hf-checkpoint", args.hf_checkpoint or f"/root/models/{args.model_name}"]
    if args.use_r3 is not False:
        words.append("--use-rollout-routing-replay")
    words += shlex.split(args.extra_args or "")
    sys.exit(run(args, words))
