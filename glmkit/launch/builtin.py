"""The builtin backend: glmkit's own GRPO as Ray actors, submitted as a Ray job.

    python -m glmkit.launch.builtin --config-json '{...TrainConfig fields...}' [--rollout-actors N] [--gpus]

The job's driver creates one placement group of N {CPU: 1} bundles ({GPU: 1, CPU: 1} with --gpus),
PACK, as the recipe's framework does; rollout actor i sits on bundle i and the trainer actor on
bundle 0 beside rollout actor 0 (colocated: 0.2 and 0.4 of the bundle's GPU, or of its CPU). The
trainer is GRPOTrainer itself with its rollout side replaced by `RayRollout`: each rollout's prompts
are split between the actors, and after every update the trainable tensors (the adapters, with
LoRA) go to every actor through the object store, put once. Every metric row is printed to the
job's log as one `GLMKIT_METRICS {json}` line (and appended to the trainer's metrics file), which
`glmkit.launch.jobs.follow` turns back into rows. With one rollout actor the run is the in-process
run of the same config, row for row.
"""

from __future__ import annotations

import argparse
import json
import sys

METRICS_PREFIX = "GLMKIT_METRICS "
DONE_PREFIX = "GLMKIT_DONE "
ROLLOUT_SHARE, TRAINER_SHARE = 0.2, 0.4   # of a bundle's GPU (or CPU), as the framework colocates
ACTOR_SEED_STRIDE = 7_919_000_003


def _config(fields: dict):
    from glmkit.rl.loop import TrainConfig

    return TrainConfig(**fields)


class RolloutWorker:
    """A rollout actor: its own model (the checkpoint, with the same LoRA layout), a LocalRollout."""

    def __init__(self, fields: dict):
        from glmkit.model import load_model
        from glmkit.rl import lora
        from glmkit.rl.loop import LocalRollout

        cfg = _config(fields).resolved()
        import torch

        model = load_model(cfg.checkpoint, getattr(torch, cfg.dtype), cfg.device)
        if cfg.lora_rank:
            lora.apply_lora(model, lora.select(model, cfg.target_modules, cfg.exclude_modules),
                            cfg.lora_rank, cfg.lora_alpha)
        self.side = LocalRollout(model, cfg.backends)

    def generate(self, prompt_ids, params, seed: int):
        return self.side.generate(prompt_ids, params, seed)

    def load(self, tensors: dict):
        self.side.load(tensors)
        return len(tensors)


class RayRollout:
    """GRPOTrainer's rollout side over rollout actors (same generate / load as LocalRollout)."""

    def __init__(self, actors: list, names: list[str]):
        self.actors, self.names = actors, names

    def _get(self, calls):
        """calls: [(actor name, object ref)] -> their results; a dead actor is named."""
        import ray

        try:
            return ray.get([ref for _, ref in calls])
        except ray.exceptions.RayActorError as err:
            dead = [name for name, ref in calls if _failed(ref)]
            raise RuntimeError(f"rollout actor(s) died: {', '.join(dead) or 'unknown'} ({type(err).__name__}: "
                               f"{str(err).splitlines()[0]})") from err

    def generate(self, prompt_ids, params, seed: int):
        n = len(self.actors)
        bounds = [round(i * len(prompt_ids) / n) for i in range(n + 1)]
        # actor 0 samples with the rollout's own seed (one actor = the in-process run); the others
        # with seeds far from any other rollout's (the trainer's seeds step by 1 per rollout)
        calls = [(name, actor.generate.remote(prompt_ids[a:b], params, seed + i * ACTOR_SEED_STRIDE))
                 for i, (name, actor, a, b) in enumerate(zip(self.names, self.actors, bounds, bounds[1:])) if b > a]
        return [c for part in self._get(calls) for c in part]

    def load(self, tensors: dict):
        import ray

        ref = ray.put({name: t.detach().cpu() for name, t in tensors.items()})
        self._get([(name, actor.load.remote(ref)) for name, actor in zip(self.names, self.actors)])


def _failed(ref) -> bool:
    import ray

    try:
        ray.get(ref, timeout=0)
        return False
    except ray.exceptions.GetTimeoutError:
        return False
    except Exception:
        return True


class TrainerWorker:
    """The trainer actor: GRPOTrainer with a RayRollout; prints every metric row to the job's log."""

    def __init__(self, fields: dict, actors: list, names: list[str]):
        from glmkit.rl.loop import GRPOTrainer

        self.trainer = GRPOTrainer(_config(fields), rollout=RayRollout(actors, names))
        self.trainer.sync()  # the actors loaded the checkpoint: give them this trainer's starting adapters too

    def run(self) -> int:
        rows = self.trainer.run(on_metrics=lambda row: print(METRICS_PREFIX + json.dumps(row, allow_nan=False),
                                                             flush=True))
        return len(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="glmkit's GRPO as Ray actors (a Ray job's entrypoint)")
    parser.add_argument("--config-json", required=True, help="TrainConfig fields as a JSON object")
    parser.add_argument("--rollout-actors", type=int, default=1)
    parser.add_argument("--gpus", action="store_true", help="bundles and actor shares are GPUs")
    args = parser.parse_args(argv)
    fields = json.loads(args.config_json)
    if not isinstance(fields, dict):
        raise SystemExit("--config-json must be a JSON object of TrainConfig fields")
    fields["progress"] = False
    if args.rollout_actors < 1:
        raise SystemExit(f"--rollout-actors must be >= 1, got {args.rollout_actors}")

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(logging_level="ERROR")
    n = args.rollout_actors
    bundle = {"CPU": 1, "GPU": 1} if args.gpus else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK", name="glmkit-grpo")
    ray.get(pg.ready(), timeout=600)

    def share(fraction, index):
        resources = {"num_gpus": fraction, "num_cpus": 0} if args.gpus else {"num_cpus": fraction}
        return dict(**resources, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index))

    names = [f"glmkit-rollout-{i}" for i in range(n)]
    rollout_cls = ray.remote(RolloutWorker)
    actors = [rollout_cls.options(name=names[i], **share(ROLLOUT_SHARE, i)).remote(fields) for i in range(n)]
    trainer = ray.remote(TrainerWorker).options(name="glmkit-trainer", **share(TRAINER_SHARE, 0)).remote(
        fields, actors, names)
    try:
        rows = ray.get(trainer.run.remote())
    except ray.exceptions.RayActorError as err:
        print(f"the trainer actor glmkit-trainer died: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
        return 1
    except ray.exceptions.RayTaskError as err:
        print(f"the run failed in the trainer actor: {str(err.cause) if err.cause else err}", file=sys.stderr,
              flush=True)
        return 1
    finally:
        remove_placement_group(pg)
    print(DONE_PREFIX + json.dumps({"rows": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
