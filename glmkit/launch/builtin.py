"""The builtin backend: glmkit's own GRPO as Ray actors, submitted as a Ray job.

    python -m glmkit.launch.builtin --config-json '{...TrainConfig fields...}' [--rollout-actors R]
                                    [--trainers N] [--gpus]

The job's driver creates one placement group, PACK, as the recipe's framework does, of {CPU: 1}
bundles ({GPU: 1, CPU: 1} with --gpus). The trainer is GRPOTrainer itself with its rollout side
replaced by `RayRollout`: each rollout's prompts are split between the rollout actors. Two layouts:
- colocated (--trainers 0, the default): R bundles; rollout actor i on bundle i, the one trainer
  actor on bundle 0 beside rollout actor 0 (0.2 and 0.4 of the bundle's GPU, or of its CPU); after
  every update the trainable tensors go to every rollout actor through the object store, put once;
- separate (--trainers N >= 1): N + R bundles, trainer rank i alone on bundle i, rollout actor j alone
  on bundle N + j. All of them join one torch.distributed world (nccl with --gpus, gloo otherwise or
  when --bundle-gpu packs several bundles on one GPU;
  rendezvous at trainer 0's address) split into two groups: the N trainer ranks, a data-parallel
  trainer (`glmkit.rl.parallel`: rank 0 rolls out, every rank trains its share, gradients summed by
  all-reduce), and the weights-update group of trainer 0 and the rollout actors, over which trainer 0
  broadcasts the trainable tensors after every update (as the framework's
  `update_weights_from_distributed` does), never through the host's object store.
Every metric row is printed to the job's log as one `GLMKIT_METRICS {json}` line (and appended to the
trainer's metrics file), which `glmkit.launch.jobs.follow` turns back into rows. With one rollout
actor the run is the in-process run of the same config, row for row (to fp32 summation order when
trainers > 1). NVLink multicast stays off in every actor (the job's runtime env, and set again before
a group starts).
"""

from __future__ import annotations

import argparse
import json
import sys

from glmkit.inputs import ascii_float, ascii_int

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

    def join(self, master: str, world: int, rank: int, trainers: int, backend: str) -> str:
        _, self.update_group = join_world(master, world, rank, trainers, backend)
        return f"rollout rank {rank} of {world} ({backend})"

    def receive(self, announced: list) -> int:
        """The tensors trainer 0 broadcasts over the weights-update group, as announced [(name, dtype,
        shape)], loaded into this actor's model."""
        from glmkit.collectives import collective_device, receive_announced

        device = collective_device(self.update_group)
        return self.load(receive_announced(announced, device, self.update_group))


def join_world(master: str, world: int, rank: int, trainers: int, backend: str):
    """Join the run's torch.distributed world (trainer ranks 0..trainers-1, rollout actors after) ->
    (the trainers' group, the weights-update group of trainer 0 and the rollout actors); every member
    creates both groups, in this order, as torch requires."""
    import torch.distributed as dist

    from glmkit.collectives import init_group

    # GPU 0: the one Ray gave this actor
    init_group(backend, 0, init_method=f"tcp://{master}", world_size=world, rank=rank)
    trainer_group = dist.new_group(list(range(trainers)))
    update_group = dist.new_group([0, *range(trainers, world)])
    return trainer_group, update_group


class RayRollout:
    """GRPOTrainer's rollout side over rollout actors (same generate / load as LocalRollout). With an
    `update_group` (trainer 0 and the actors), load broadcasts the tensors over it."""

    def __init__(self, actors: list, names: list[str], update_group=None):
        self.actors, self.names, self.update_group = actors, names, update_group

    def _get(self, calls):
        """calls: [(actor name, object ref)] -> their results; a dead actor is named."""
        import ray

        try:
            return ray.get([ref for _, ref in calls])
        except ray.exceptions.RayActorError as err:
            dead = [name for name, ref in calls if _failed(ref)]
            raise RuntimeError(f"rollout actor(s) died: {', '.join(dead) or 'unknown'} ({type(err).__name__}: "
                               f"{str(err).splitlines()[0]})") from err

    def bind(self, policy) -> None:
        """Nothing to keep: the actors load the checkpoint themselves and receive tensors by `load`."""

    def generate(self, prompt_ids, params, seed: int):
        from glmkit.rl.parallel import share

        # actor 0 samples with the rollout's own seed (one actor = the in-process run); the others
        # with seeds far from any other rollout's (the trainer's seeds step by 1 per rollout)
        calls = [(name, actor.generate.remote(part, params, seed + i * ACTOR_SEED_STRIDE))
                 for i, (name, actor) in enumerate(zip(self.names, self.actors))
                 if (part := share(prompt_ids, i, len(self.actors)))]
        return [c for part in self._get(calls) for c in part]

    def load(self, tensors: dict):
        import ray

        if self.update_group is None:
            ref = ray.put({name: t.detach().cpu() for name, t in tensors.items()})
            self._get([(name, actor.load.remote(ref)) for name, actor in zip(self.names, self.actors)])
            return
        from glmkit.collectives import announce, collective_device, send_announced

        ordered, announced = announce(tensors, collective_device(self.update_group))
        calls = [(name, actor.receive.remote(announced)) for name, actor in zip(self.names, self.actors)]
        send_announced(ordered, self.update_group)
        self._get(calls)


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
    """A trainer actor: GRPOTrainer with a RayRollout (rank 0; a data-parallel rank > 0 has no rollout
    side); rank 0 prints every metric row to the job's log. `start` builds it, after joining the
    world when the trainers are separate."""

    def __init__(self, fields: dict, actors: list, names: list[str]):
        self.fields, self.actors, self.names = fields, actors, names

    def address(self) -> str:
        """host:port for the world's rendezvous: this actor's node address and a port free there."""
        import ray

        from glmkit.launch.cluster import free_port

        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def start(self, master: str | None = None, world: int = 0, rank: int = 0, trainers: int = 0,
              backend: str = "gloo") -> str:
        from glmkit.rl.loop import GRPOTrainer
        from glmkit.rl.parallel import DataParallel

        dp, update_group = None, None
        if master is not None:
            trainer_group, update_group = join_world(master, world, rank, trainers, backend)
            dp = DataParallel(trainer_group) if trainers > 1 else None
        rollout = RayRollout(self.actors, self.names, update_group) if rank == 0 else None
        self.trainer = GRPOTrainer(_config(self.fields), rollout=rollout, dp=dp)
        self.trainer.sync()  # the actors loaded the checkpoint: give them this trainer's starting adapters too
        return f"trainer rank {rank}"

    def run(self) -> int:
        rows = self.trainer.run(on_metrics=lambda row: print(METRICS_PREFIX + json.dumps(row, allow_nan=False),
                                                             flush=True))
        return len(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="glmkit's GRPO as Ray actors (a Ray job's entrypoint)")
    parser.add_argument("--config-json", required=True, help="TrainConfig fields as a JSON object")
    parser.add_argument("--rollout-actors", type=ascii_int, default=1)
    parser.add_argument("--trainers", type=ascii_int, default=0,
                        help="0: one trainer colocated with rollout actor 0; N: N data-parallel trainer ranks on "
                             "bundles of their own, weights to the rollout actors over a process group")
    parser.add_argument("--gpus", action="store_true", help="bundles and actor shares are GPUs")
    parser.add_argument("--bundle-gpu", type=ascii_float, default=1.0,
                        help="with --gpus, the GPU a bundle holds: 1 (default) or a fraction, so that several bundles "
                             "share one GPU (the separate layout tried on a one-GPU host); the world then runs over "
                             "gloo, as NCCL takes one rank per GPU")
    args = parser.parse_args(argv)
    fields = json.loads(args.config_json)
    if not isinstance(fields, dict):
        raise SystemExit("--config-json must be a JSON object of TrainConfig fields")
    fields["progress"] = False
    if args.rollout_actors < 1:
        raise SystemExit(f"--rollout-actors must be >= 1, got {args.rollout_actors}")
    if args.trainers < 0:
        raise SystemExit(f"--trainers must be >= 0, got {args.trainers}")
    if not 0 < args.bundle_gpu <= 1:
        raise SystemExit(f"--bundle-gpu must be in (0, 1], got {args.bundle_gpu}")
    if args.bundle_gpu < 1 and not args.gpus:
        raise SystemExit("--bundle-gpu is a GPU fraction: it needs --gpus")

    from glmkit.collectives import NO_MULTICAST

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(logging_level="ERROR")
    n, separate = args.rollout_actors, args.trainers
    bundle = {"CPU": 1, "GPU": args.bundle_gpu} if args.gpus else {"CPU": 1}
    pg = placement_group([dict(bundle) for _ in range(separate + n)], strategy="PACK", name="glmkit-grpo")
    ray.get(pg.ready(), timeout=600)

    def share(fraction, index):
        resources = {"num_gpus": fraction * args.bundle_gpu, "num_cpus": 0} if args.gpus else {"num_cpus": fraction}
        # NVLink multicast off in every actor, whichever cluster and job runtime env they start in
        return dict(**resources, runtime_env={"env_vars": dict(NO_MULTICAST)},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index))

    names = [f"glmkit-rollout-{i}" for i in range(n)]
    rollout_cls, trainer_cls = ray.remote(RolloutWorker), ray.remote(TrainerWorker)
    if not separate:
        actors = [rollout_cls.options(name=names[i], **share(ROLLOUT_SHARE, i)).remote(fields) for i in range(n)]
        trainers = [trainer_cls.options(name="glmkit-trainer", **share(TRAINER_SHARE, 0)).remote(fields, actors, names)]
        starts = [trainers[0].start.remote()]
    else:  # the world's rendezvous and the starts follow, inside the try below
        actors = [rollout_cls.options(name=names[i], **share(1.0, separate + i)).remote(fields) for i in range(n)]
        trainers = [trainer_cls.options(name=f"glmkit-trainer-{r}", **share(1.0, r)).remote(fields, actors, names)
                    for r in range(separate)]
    try:
        if separate:
            world, backend = separate + n, "nccl" if args.gpus and args.bundle_gpu == 1 else "gloo"
            master = ray.get(trainers[0].address.remote())
            starts = [t.start.remote(master, world, r, separate, backend) for r, t in enumerate(trainers)]
            starts += [a.join.remote(master, world, separate + i, separate, backend) for i, a in enumerate(actors)]
        ray.get(starts)
        rows = ray.get([t.run.remote() for t in trainers])[0]
    except ray.exceptions.RayActorError as err:
        print(f"an actor of the run died: {str(err).splitlines()[0]}", file=sys.stderr, flush=True)
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
