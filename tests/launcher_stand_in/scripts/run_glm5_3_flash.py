"""Stand-in for the recipe's full launcher: a single-command CLI, run without a command word."""

import shlex
import sys

from _stand_in import VALUES, BOOLS, parse, run

FIELDS = [f for f in (*VALUES, *BOOLS) if f not in (
    "task", "tensor_model_parallel_size", "lora_rank", "lora_alpha", "lora_dropout", "target_modules",
    "rollout_batch_size", "n_samples_per_prompt", "global_batch_size", "rollout_temperature",
    "rollout_num_gpus_per_engine", "sglang_mem_fraction_static", "sglang_lora_backend", "lr",
    "lora_base_cpu_backup", "experts_shared_outer_loras", "check_lora_weight_equal", "use_r3", "enable_wandb")]

if __name__ == "__main__":
    args = parse(sys.argv[1:], FIELDS)
    words = ["--hf-checkpoint", args.hf_checkpoint or f"/root/models/{args.model_name}"]
    words += ["--num-rollout", args.num_rollout or "5"]
    if args.enable_r3:
        words.append("--use-rollout-routing-replay")
    words += shlex.split(args.extra_args or "")
    sys.exit(run(args, words))
