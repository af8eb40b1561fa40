"""The benchmark harnesses run on CPU (the numbers they print there are not claims)."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_step_harness(tmp_path):
    out = subprocess.run([sys.executable, "-m", "megatron_jetrl.cli", "bench", "step", "--preset", "tiny", "--steps", "1",
                          "--warmup", "0", "--plot", str(tmp_path / "phases.png"), "--json", str(tmp_path / "rows.json"),
                          "rollout.prompts_per_step=2"], env=dict(os.environ, PYTHONPATH=REPO), cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.load(open(tmp_path / "rows.json"))
    assert [r["mode"] for r in rows] == ["bf16", "fp8_rollout", "jet"]
    for r in rows:
        assert abs(r["step"] - sum(r[p] for p in ("rollout", "logprob", "train", "weight_sync"))) < 1e-9
        assert 0 <= r["requant_handover_share"] < 1
    assert rows[0]["requant"] == 0 and rows[2]["requant"] > 0  # bf16 quantizes nothing
    assert "step speedup vs bf16" in out.stdout and os.path.getsize(tmp_path / "phases.png") > 10_000
