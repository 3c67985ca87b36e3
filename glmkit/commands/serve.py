"""`glmkit serve`: the rollout engine behind SGLang's native HTTP API."""

from __future__ import annotations

from pathlib import Path

from glmkit.commands.args import (DTYPES, DEVICES, _backends, _backend_arguments, _finite_positive, _positive, _integer,
                                  _seed, _non_negative)


def cmd_serve(args) -> int:
    from glmkit.serve.server import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for root in args.allow_updates_from:
        if not Path(root).is_dir():
            raise FileNotFoundError(f"--allow-updates-from {root}: not a directory")
    if args.max_context < 2:
        raise ValueError(f"--max-context must be >= 2, got {args.max_context}")
    serve(args.checkpoint, args.host, args.port, args.device, args.dtype, _backends(args), args.tokenizer,
          args.max_batch_size, args.allow_updates_from, on_ready=lambda line: print(line, flush=True),
          max_context=args.max_context, prefill_chunk=args.prefill_chunk, max_body=args.max_body_bytes,
          max_weights_body=args.max_weights_body_bytes, body_timeout_s=args.body_timeout_s,
          header_timeout_s=args.header_timeout_s, max_connections=args.max_connections,
          served_model_name=args.served_model_name, enable_memory_saver=args.enable_memory_saver,
          seed=args.random_seed, base_gpu_id=args.base_gpu_id, max_prefill_tokens=args.max_prefill_tokens)
    return 0


def add_commands(sub) -> None:
    """Register this group's commands on the CLI's subparsers."""
    p = sub.add_parser("serve", help="the rollout engine behind SGLang's native HTTP API (/generate, /health, ...)")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=_integer, default=30000, help="0 picks a free port (printed)")
    p.add_argument("--device", default="cpu", choices=DEVICES)
    p.add_argument("--dtype", choices=list(DTYPES), help="default: the checkpoint's")
    p.add_argument("--tokenizer", help="tokenizer directory for text inputs (default: the checkpoint's own files)")
    p.add_argument("--max-batch-size", type=_positive, default=64, help="most inputs batched into one engine call")
    p.add_argument("--max-context", type=_integer, default=65536,
                   help="most prompt + new tokens of one request (larger ones are refused with 400)")
    p.add_argument("--prefill-chunk", type=_positive, metavar="TOKENS",
                   help="prefill joining prompts at most TOKENS a decode step (default: whole prompts at once)")
    p.add_argument("--max-prefill-tokens", type=_positive, default=16384, metavar="TOKENS",
                   help="most prompt tokens prefilled in one forward (SGLang's option; a longer single prompt "
                        "runs alone); teacher-forced log-probs are computed in pieces either way")
    p.add_argument("--allow-updates-from", action="append", default=[], metavar="DIR",
                   help="/update_weights_from_disk may read directories under DIR (repeatable; default: none)")
    p.add_argument("--max-body-bytes", type=_positive, default=64 << 20,
                   help="largest request body accepted (larger ones get 413; default 64 MiB, ~9M token ids)")
    p.add_argument("--max-weights-body-bytes", type=_positive, default=1 << 30,
                   help="largest /update_weights_from_tensor body (safetensors blobs in base64; default 1 GiB)")
    p.add_argument("--body-timeout-s", type=_finite_positive, default=60.0, metavar="SECONDS",
                   help="answer 408 and close when a request body sends nothing for this long (default 60)")
    p.add_argument("--header-timeout-s", type=_finite_positive, default=10.0, metavar="SECONDS",
                   help="answer 408 and close when a request's headers have not all arrived this long after its "
                        "first byte (or the connection's opening; default 10)")
    p.add_argument("--max-connections", type=_positive, default=2048,
                   help="most connections open at once; more are answered 503 and closed (default 2048, lowered "
                        "to what the descriptor limit allows)")
    p.add_argument("--served-model-name", help="the name /v1/models and /server_info report (default: the checkpoint)")
    p.add_argument("--enable-memory-saver", action="store_true",
                   help="report SGLang's memory saver as on in /server_info (the framework compares it with its "
                        "--offload-rollout); glmkit keeps its memory either way")
    p.add_argument("--random-seed", type=_seed, default=0, help="seeds requests that give no sampling_seed")
    p.add_argument("--base-gpu-id", type=_non_negative, default=0,
                   help="the base_gpu_id /server_info reports (the framework compares it for an external engine)")
    _backend_arguments(p)
    p.set_defaults(func=cmd_serve)
