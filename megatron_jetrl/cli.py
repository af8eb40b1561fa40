"""``jetrl``: train | serve | launch | convert | plot | bench | mismatch. Each subcommand has --help."""
from __future__ import annotations

import argparse
import logging
import sys

from megatron_jetrl.config import preset_path


def cmd_train(args) -> int:
    from megatron_jetrl.config import ConfigError, load_config

    path = args.config or (preset_path(args.preset) if args.preset else None)
    overrides = list(args.overrides)
    if args.resume:
        overrides.append("checkpoint.resume=true")
    if args.overwrite:
        overrides.append("checkpoint.overwrite=true")
    if args.run_dir:
        overrides.append(f"logging.run_dir={args.run_dir}")
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    from megatron_jetrl.data.prompts import DataError
    from megatron_jetrl.distributed import destroy_distributed
    from megatron_jetrl.models.hf_io import CheckpointError
    from megatron_jetrl.rollout.sglang import ServerError
    from megatron_jetrl.train import train
    from megatron_jetrl.errors import RunComplete, TrainingError

    try:
        train(cfg)
    except RunComplete as e:
        print(str(e), file=sys.stderr)
        return 0
    except (ConfigError, CheckpointError, DataError, TrainingError) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    except ServerError as e:  # the rollout fleet: a refused server, or one that stayed down
        print(f"jetrl train: rollout server: {str(e).splitlines()[0]}", file=sys.stderr)
        return 3
    finally:  # process groups torn down before interpreter exit (a live gloo group can abort the exit)
        destroy_distributed()
    run_dir = cfg.logging.run_dir
    if args.plot:
        from megatron_jetrl.metrics.plot import plot_run

        print(f"curves: {plot_run(run_dir)}")
    print(f"run directory: {run_dir}")
    return 0


def cmd_serve(args) -> int:
    from megatron_jetrl.distributed import destroy_distributed
    from megatron_jetrl.rollout.server import serve

    try:
        return serve(args)
    finally:
        destroy_distributed()


def cmd_plot(args) -> int:
    from megatron_jetrl.metrics.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def cmd_eval(args) -> int:
    """Held-out metrics of a finished checkpoint (``eval/accuracy``, ``eval/pass@k``) with any precision mode, so the
    modes can be compared on the same prompts."""
    import json
    import shutil
    import tempfile

    from megatron_jetrl.config import ConfigError, load_config
    from megatron_jetrl.data.prompts import DataError
    from megatron_jetrl.distributed import destroy_distributed
    from megatron_jetrl.models.hf_io import CheckpointError
    from megatron_jetrl.trainer.checkpoint import read_model_config

    run_dir = tempfile.mkdtemp(prefix="jetrl-eval-")
    try:
        model = read_model_config(args.checkpoint)  # the checkpoint's own model description, None fields included
        shape = [f"model.{k}={json.dumps(v)}" for k, v in vars(model).items() if k != "hf_path"]  # (no RoPE scaling: null)
        cfg = load_config(args.config or (preset_path(args.preset) if args.preset else None), [
            *shape, f"checkpoint.load_path={args.checkpoint}", f"data.val_path={json.dumps(args.data)}", "steps=1",
            "algo.sft_warmup_steps=0", "eval.interval=1", f"logging.run_dir={run_dir}", "logging.tensorboard=false",
            *args.overrides])
        from megatron_jetrl.run import close, setup
        from megatron_jetrl.train import evaluate

        run = setup(cfg)
        try:
            m = evaluate(run, 0)
        finally:
            close(run)
    except (ConfigError, CheckpointError, DataError) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        destroy_distributed()
    m.update(checkpoint=args.checkpoint, prompts=len(run.val), mode=cfg.precision.mode)
    print(json.dumps(m))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(m, f, indent=1)
    return 0


def cmd_convert(args) -> int:
    import torch

    from checkpoint_converters.convert import hf_to_megatron, megatron_to_hf
    from megatron_jetrl.config import ConfigError
    from megatron_jetrl.models.hf_io import CheckpointError

    try:
        if args.direction == "hf-to-megatron":
            out = hf_to_megatron(args.src, args.out, args.overrides,
                                 {"bf16": torch.bfloat16, "fp32": torch.float32}[args.params_dtype],
                                 overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite)
        else:
            out = megatron_to_hf(args.src, args.out, args.dtype, args.tokenizer, parallel_overrides=args.overrides,
                                 overwrite=args.overwrite, allow_nonfinite=args.allow_nonfinite)
    except (ConfigError, CheckpointError, FileNotFoundError) as e:
        print(str(e).splitlines()[0], file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="jetrl", description="Unified-precision FP8 RL post-training (Jet-RL)")
    sub = ap.add_subparsers(dest="cmd", required=True)

    t = sub.add_parser("train", help="run RL training (rollout, reward, train, weight hand-over)",
                       description="Run RL training. Config: --preset NAME (examples/configs/NAME.yaml) or "
                                   "--config FILE, then key.sub=value overrides, e.g. precision.mode=bf16.")
    t.add_argument("--preset", help="preset name in examples/configs (e.g. tiny)")
    t.add_argument("--config", help="YAML config file")
    t.add_argument("--run-dir", help="run directory (logging.run_dir)")
    t.add_argument("--resume", action="store_true", help="resume from the newest intact checkpoint in the run directory")
    t.add_argument("--overwrite", action="store_true",
                   help="start a fresh run in a run directory that holds another run, deleting its checkpoints and metrics")
    t.add_argument("--plot", action="store_true", help="write curves.png into the run directory at the end")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    t.set_defaults(fn=cmd_train)

    e = sub.add_parser("eval", help="held-out accuracy / pass@k of a checkpoint (any precision mode)",
                       description="Evaluate a checkpoint (jetrl train's or convert hf-to-megatron's) on a prompt file: "
                                   "eval/accuracy (greedy), eval/pass@k with eval.n_samples=k; precision.mode=bf16|"
                                   "fp8_rollout|jet picks the rollout precision. The model shape is the checkpoint's.")
    e.add_argument("checkpoint", help="megatron checkpoint directory (e.g. RUN/checkpoints/step_N)")
    e.add_argument("--data", required=True, nargs="+", help="held-out .jsonl/.parquet file(s) (data.prompt_key/answer_key)")
    e.add_argument("--preset", help="preset for the other settings (e.g. tiny)")
    e.add_argument("--config", help="YAML config for the other settings")
    e.add_argument("--out", help="also write the metrics to this JSON file")
    e.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. precision.mode=bf16 eval.n_samples=8")
    e.set_defaults(fn=cmd_eval)

    c = sub.add_parser("convert", help="HF <-> Megatron (torch_dist) checkpoints, BF16 or block FP8",
                       description="hf-to-megatron SRC(HF dir) OUT [parallel.*=N ...] (run under torchrun for a "
                                   "multi-rank layout) | megatron-to-hf SRC(checkpoint dir) OUT [--dtype bf16|fp8]")
    c.add_argument("direction", choices=["hf-to-megatron", "megatron-to-hf"])
    c.add_argument("src", help="HF directory or megatron checkpoint directory")
    c.add_argument("out", help="output directory (written as OUT.tmp, renamed when complete)")
    c.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16", help="megatron-to-hf: output format")
    c.add_argument("--params-dtype", choices=["bf16", "fp32"], default="bf16", help="hf-to-megatron: stored dtype")
    c.add_argument("--tokenizer", help="megatron-to-hf: copy tokenizer files from this directory")
    c.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT (never one holding SRC)")
    c.add_argument("--allow-nonfinite", action="store_true", help="convert weights that hold NaN/inf")
    c.add_argument("overrides", nargs="*", help="layout to run the conversion in (under torchrun): "
                                                "parallel.tensor_parallel=2 parallel.pipeline_parallel=2 ...")
    c.set_defaults(fn=cmd_convert)

    sv = sub.add_parser("serve", help="the in-process engine behind SGLang's HTTP endpoints (a rollout worker)",
                        description="Serve an HF directory (BF16, or block FP8 with quantization_config) over "
                                    "SGLang's RL endpoints: /generate, /update_weights_from_{disk,tensor,distributed}, "
                                    "/release_memory_occupation, ... Binds 127.0.0.1 unless --host is given.")
    from megatron_jetrl.rollout.server import add_serve_args

    add_serve_args(sv)
    sv.set_defaults(fn=cmd_serve)

    p = sub.add_parser("plot", help="PNG curves of a run's metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", help="output PNG (default RUN_DIR/curves.png)")
    p.set_defaults(fn=cmd_plot)

    b = sub.add_parser("bench", help="benchmarks that print FP8/BF16 ratios measured in one run (GPU)")
    b.add_argument("what", choices=["linear", "sync", "train", "step", "rollout"],
                   help="linear: FP8 block linear vs BF16; sync: weight gather+export, BF16 vs FP8; "
                        "train: one RL training phase, bf16 vs jet; step: full RL steps per phase, "
                        "bf16 vs fp8_rollout vs jet; rollout: in-process generation speed per mode")
    b.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (see jetrl bench linear --help)")

    la = sub.add_parser("launch", help="plan and run a cluster job: layout, SGLang fleet, memory, per-node commands")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="see jetrl launch --help")

    m = sub.add_parser("mismatch", help="train-rollout mismatch per precision mode, side by side")
    m.add_argument("rest", nargs=argparse.REMAINDER, help="see jetrl mismatch --help")

    argv = sys.argv[1:] if argv is None else list(argv)
    # bench/mismatch own their options: hand everything after the subcommand to them
    if argv[:1] == ["launch"]:
        from megatron_jetrl.launch import main as launch_main

        return launch_main(argv[1:])
    benches = (["linear"], ["sync"], ["train"], ["step"], ["rollout"])
    if argv[:1] == ["mismatch"] or (argv[:1] == ["bench"] and argv[1:2] in benches):
        import importlib

        logging.basicConfig(level=logging.WARNING)
        name = "mismatch" if argv[0] == "mismatch" else argv[1]
        importlib.import_module(f"megatron_jetrl.bench.{name}").main(argv[1 if argv[0] == "mismatch" else 2:])
        return 0
    args, extra = ap.parse_known_args(argv)
    if extra:  # key=value overrides may come after options too (argparse ends a positional list at the first option)
        if not hasattr(args, "overrides") or any(x.startswith("-") or "=" not in x for x in extra):
            ap.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("megatron", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    return args.fn(args)


if __name__ == "__main__":  # dist_checkpointing's writer process re-imports __main__: keep the guard
    sys.exit(main())
