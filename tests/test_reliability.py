"""What a user owns is never deleted or overwritten without a flag, a non-finite value never reaches a
checkpoint, and bad input stops with one line before anything is written."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from megatron_jetrl.config import ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO)


def _jetrl(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", *map(str, args)], env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def _train(run_dir, *extra):
    return _jetrl("train", "--preset", "tiny", "--run-dir", run_dir, "algo.sft_warmup_steps=1",
                  "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4", *extra)


def _last_line(out) -> str:
    return out.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny run of 3 steps with a checkpoint after each."""
    run = tmp_path_factory.mktemp("rel") / "run"
    out = _train(run, "steps=2", "checkpoint.save_interval=1")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


# ---------------------------------------------------------------------------------------------- convert


def test_convert_never_deletes_the_source_or_a_full_directory(trained, tmp_path):
    """``convert megatron-to-hf RUN/checkpoints/step_2 RUN`` used to replace RUN (the source with it)."""
    ckpt = trained / "checkpoints" / "step_2"
    before = sorted(os.listdir(trained))
    out = _jetrl("convert", "megatron-to-hf", ckpt, trained)
    assert out.returncode == 2 and "contains the source" in _last_line(out)
    assert sorted(os.listdir(trained)) == before and os.path.isfile(ckpt / "metadata.json")
    out = _jetrl("convert", "megatron-to-hf", ckpt, ckpt / "hf")
    assert out.returncode == 2 and "is inside the source" in _last_line(out)
    full = tmp_path / "mine"
    full.mkdir()
    (full / "notes.txt").write_text("keep me")
    out = _jetrl("convert", "megatron-to-hf", ckpt, full)
    assert out.returncode == 2 and "--overwrite" in _last_line(out) and (full / "notes.txt").read_text() == "keep me"
    # options may come before the layout overrides (README order), and --overwrite replaces
    out = _jetrl("convert", "megatron-to-hf", ckpt, full, "--dtype", "fp8", "--overwrite", "parallel.tensor_parallel=1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert not (full / "notes.txt").exists() and (full / "config.json").is_file()


def test_convert_refuses_non_finite_weights_and_damaged_files(trained, tmp_path, megatron_single):
    from safetensors.torch import load_file, save_file

    from checkpoint_converters.convert import hf_to_megatron, megatron_to_hf
    from megatron_jetrl.models.hf_io import CheckpointError

    hf = tmp_path / "hf"
    megatron_to_hf(str(trained / "checkpoints" / "step_2"), str(hf), "bf16")
    shard = next(p for p in hf.iterdir() if p.suffix == ".safetensors")
    tensors = load_file(shard)
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone().fill_(float("nan"))
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match=r"1 weight tensors hold NaN/inf .*--allow-nonfinite"):
        hf_to_megatron(str(hf), str(tmp_path / "mc"))
    assert not (tmp_path / "mc").exists() and not (tmp_path / "mc.tmp").exists()
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="cannot be read"):
        hf_to_megatron(str(hf), str(tmp_path / "mc"))
    import shutil

    ckpt = tmp_path / "step"
    shutil.copytree(trained / "checkpoints" / "step_2", ckpt)
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(shard.read_bytes()[:64])  # torch's CheckpointException derives from BaseException
    with pytest.raises(CheckpointError, match="cannot be loaded .*truncated or damaged"):
        megatron_to_hf(str(ckpt), str(tmp_path / "hf2"), "bf16")
    assert not (tmp_path / "hf2").exists()


# ------------------------------------------------------------------------------------- run directories


def test_resume_and_fresh_runs_check_the_run_directory(trained, tmp_path):
    out = _train(tmp_path / "empty", "steps=1", "--resume")
    assert out.returncode == 2 and "checkpoint.resume: no intact checkpoint" in _last_line(out)
    assert not (tmp_path / "empty").exists()  # nothing written
    before = (trained / "metrics.jsonl").read_text()
    out = _train(trained, "steps=2", "seed=7")  # a fresh run (another seed) in a used directory
    assert out.returncode == 2 and "holds another run" in _last_line(out) and "--overwrite" in _last_line(out)
    out = _train(trained, "steps=3", "seed=7", "--resume")
    assert out.returncode == 2 and _last_line(out).startswith("config error: seed: the run in")
    assert (trained / "metrics.jsonl").read_text() == before


def test_resume_skips_a_damaged_newest_checkpoint(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    step2 = run / "checkpoints" / "step_2"
    victim = next(p for p in step2.iterdir() if p.suffix == ".distcp")
    victim.write_bytes(victim.read_bytes()[:100])  # truncated shard
    out = _train(run, "steps=3", "checkpoint.save_interval=1", "--resume")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipping checkpoint" in out.stderr and "step_2" in out.stderr
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # step 2 redone from step 1's checkpoint, then the evaluation after the last


# ----------------------------------------------------------------------------------------------- NaN


def test_non_finite_gradients_skip_the_update(tmp_path, megatron_single):
    from megatron_jetrl.train import close, setup

    run = setup(load_config(os.path.join(REPO, "examples/configs/tiny.yaml"),
                            [f"logging.run_dir={tmp_path}", "rollout.prompts_per_step=2"]))
    try:
        actor = run.actor
        before = [p.detach().clone() for p in actor.module.parameters()]
        for buf in actor.model.buffers:
            buf.grad_data.normal_()
            buf.grad_data[0] = float("nan")
        out = actor._optimizer_step()
        assert out["update_ok"] == 0.0 and out["skipped_steps"] == 1.0 and actor.skipped_in_a_row == 1
        assert all(torch.equal(a, p) for a, p in zip(before, actor.module.parameters()))
        for buf in actor.model.buffers:
            buf.grad_data.normal_()
        out = actor._optimizer_step()
        assert out["update_ok"] == 1.0 and out["skipped_steps"] == 1.0 and actor.skipped_in_a_row == 0
        assert not all(torch.equal(a, p) for a, p in zip(before, actor.module.parameters()))
    finally:
        close(run)


def test_resume_checks_the_checksums_with_every_rank(tmp_path):
    """Each rank of a resumed job reads a share of the checkpoint's files for their CRC-32s (one rank reading a 70B
    checkpoint alone outlasts the process group's start-up timeout); a change only another rank's share holds still
    makes every rank fall back to the same older checkpoint."""
    from megatron_jetrl.trainer.checkpoint import CHECKSUMS_FILE, checkpoint_problem, file_checksums
    from tests.dist import run_workers
    from tests.workers import newest_intact_worker

    root = tmp_path / "checkpoints"
    for step in (1, 2):
        d = root / f"step_{step}"
        d.mkdir(parents=True)
        for name in ("a.distcp", "b.distcp", "c.distcp", "loop_state.json"):
            (d / name).write_bytes(bytes([step]) * 64)
        (d / CHECKSUMS_FILE).write_text(json.dumps(file_checksums(str(d))))
    (root / "latest").write_text("step_2\n")
    victim = root / "step_2" / "b.distcp"  # the second file in order: the second of two ranks' share
    victim.write_bytes(b"\x00" + victim.read_bytes()[1:])  # same size, another CRC-32
    assert checkpoint_problem(str(root / "step_2"), share=(0, 2)) is None
    assert "b.distcp changed" in checkpoint_problem(str(root / "step_2"), share=(1, 2))
    assert run_workers(newest_intact_worker, 2, str(root)) == [str(root / "step_1")] * 2


def test_diverging_run_stops_and_keeps_a_finite_latest_checkpoint(tmp_path):
    run = tmp_path / "run"
    out = _train(run, "steps=6", "algo.lr=1e30", "algo.grad_clip=0", "algo.sft_lr=0.001", "checkpoint.save_interval=1")
    from megatron_jetrl.trainer.checkpoint import checkpoint_problem

    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "not finite" in _last_line(out) or "updates in a row skipped" in _last_line(out), _last_line(out)
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest in ("step_0", "step_1") and checkpoint_problem(str(run / "checkpoints" / latest)) is None
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) < 7  # stopped early


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("override,message", [
    ("algo.lr=.inf", "algo.lr: inf is not finite"),
    ("algo.sft_warmup_steps=-1", "algo.sft_warmup_steps: must be >= 0"),
    ("checkpoint.save_interval=-2", "checkpoint.save_interval: must be >= 0"),
    ("algo.clip_eps_low=-0.1", "algo.clip_eps_low: must be >= 0"),
    ("algo.grad_clip=-1", "algo.grad_clip: must be >= 0"),
    ("algo.lr=[1", "algo.lr: '[1' is not a valid YAML value"),
    ("data.reward=nosuch", "data.reward: unknown reward 'nosuch'"),
])
def test_bad_values_are_refused_with_one_line(override, message, tmp_path):
    if override.startswith("data.reward"):
        out = _train(tmp_path / "run", "steps=1", override)
        assert out.returncode == 2 and message in _last_line(out)
        assert not (tmp_path / "run").exists()  # refused before the run directory was written
        return
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".inf", "inf")):
        load_config(None, [override])


def test_float_values_as_yaml_writes_them(tmp_path):
    assert load_config(None, ["algo.lr=1e-5"]).algo.lr == 1e-5  # YAML 1.1 reads 1e-5 as a string
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  lr: [1e-5\n")
    with pytest.raises(ConfigError, match=r"--config: .*bad.yaml is not valid YAML at line \d+"):
        load_config(str(bad))


@pytest.mark.parametrize("case", ["not-utf8", "number-row", "tokenizer", "tp-2", "positions"])
def test_bad_input_stops_before_the_run_directory_is_written(case, tmp_path, megatron_single):
    """``setup()`` (what ``jetrl train`` runs; the CLI prints these errors as their one line, exit 2)."""
    from megatron_jetrl.train import setup

    data = tmp_path / "data.jsonl"
    extra, message = {
        "not-utf8": (["data.path=" + str(data)], "is not UTF-8 (byte 0xff at column 1)"),
        "number-row": (["data.path=" + str(data)], "row 2 of"),
        "tokenizer": (["data.path=" + str(data)], "data: prompt 1: builtin tokenizer: character 'é'"),
        "tp-2": (["parallel.tensor_parallel=2"], "parallel.tensor_parallel: 1 process(es) are not divisible"),
        "positions": (["rollout.max_new_tokens=80"], "rollout.max_new_tokens: the longest prompt"),
    }[case]
    data.write_bytes({"not-utf8": b'\xff{"prompt": "1+1=", "answer": "2"}\n',
                      "number-row": b'{"prompt": "1+1=", "answer": "2"}\n5\n',
                      "tokenizer": '{"prompt": "1+1=é", "answer": "2"}\n'.encode()}.get(case, b""))
    cfg = load_config(os.path.join(REPO, "examples/configs/tiny.yaml"), [f"logging.run_dir={tmp_path / 'run'}", *extra])
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        setup(cfg)
    assert len(str(e.value).splitlines()) == 1 and not (tmp_path / "run").exists()


def test_small_shared_files_are_replaced_whole_with_their_mode(tmp_path, monkeypatch):
    """The files other processes read (here the servers' admin key file and a checkpoint's ``latest``) are replaced by
    a rename: a reader keeps the file it opened, a private file gets its mode whatever it replaces, and a write that
    fails leaves the old file and no temporary one."""
    from megatron_jetrl.files import write_atomic
    from megatron_jetrl.rollout.sglang import write_admin_key_file

    key_file = tmp_path / "admin" / "sglang_servers.yaml"
    write_admin_key_file(str(key_file), "old-key")
    os.chmod(key_file, 0o644)  # as a copy or an earlier tool may leave it
    with open(key_file) as reader:  # a server reading the file while the next run rewrites it
        write_admin_key_file(str(key_file), "new-key")
        assert "old-key" in reader.read()  # the reader's file was replaced, not truncated under it
    assert "new-key" in key_file.read_text() and (key_file.stat().st_mode & 0o777) == 0o600

    latest = tmp_path / "latest"
    write_atomic(str(latest), "step_3\n")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError, match="No space left"):
        write_atomic(str(latest), "step_4\n")
    assert latest.read_text() == "step_3\n"  # the old file whole
    assert sorted(os.listdir(tmp_path)) == ["admin", "latest"]  # and no temporary file left
