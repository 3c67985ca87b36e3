"""Stand-in for the framework's train.py: reports its environment and arguments, writes its pid, logs
metric rows as the framework does, then waits --sleep seconds (so a test can stop it)."""

import argparse
import json
import os
import time

parser = argparse.ArgumentParser()
parser.add_argument("--num-rollout", type=int, default=2)
parser.add_argument("--sleep", type=float, default=0)
parser.add_argument("--pid-file")
args, rest = parser.parse_known_args()
if args.pid_file:
    with open(args.pid_file, "w") as f:
        f.write(str(os.getpid()))
print("TRAIN_ENV " + json.dumps(dict(os.environ), sort_keys=True), flush=True)
print("TRAIN_ARGS " + json.dumps(rest), flush=True)
for step in range(args.num_rollout):
    print(f"step {step}: {{'rollout/step': {step}, 'rollout/raw_reward': {0.5 + 0.1 * step}}}", flush=True)
time.sleep(args.sleep)
