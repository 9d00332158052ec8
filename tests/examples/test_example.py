"""examples/grpo_tiny.py, run small: GRPO on a DTensor vocab-parallel LM head over 2 gloo ranks.

One subprocess (the example spawns its own 2 ranks), eager kernels
(compilation is tested elsewhere), 16 steps at a learning rate of 8e-3 (the
example's default 3e-3 needs ~24 to show the same rise). The run must

* pass every audit: the op's log-prob, entropy and logits gradient on the
  training micro-batch against ``dualvp_jax`` and the float64 oracle, within
  ``dualvp.testing.TOLERANCES`` (the example exits 1 otherwise);
* learn: with the fixed seed the reward (fraction of multiples of 8, 1/8 for
  a uniform policy) rises well above its start, which needs the log-prob and
  entropy gradients of the op to reach the model through DTensor autograd;
* write the plot.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor")
pytest.importorskip("jax")
pytest.importorskip("matplotlib")

_ROOT = Path(__file__).resolve().parents[2]
_STEPS = 16


@pytest.mark.slow
def test_grpo_tiny_learns_and_audits(tmp_path):
    out_json, out_png = tmp_path / "history.json", tmp_path / "example.png"
    env = dict(os.environ, DUALVP_COMPILE="0")
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run(
        [sys.executable, str(_ROOT / "examples" / "grpo_tiny.py"), "--steps", str(_STEPS), "--lr", "8e-3",
         "--audit-every", "8", "--plot", str(out_png), "--json", str(out_json)],
        env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    hist = json.loads(out_json.read_text())["history"]
    assert [h["step"] for h in hist] == list(range(1, _STEPS + 1))

    audits = [h["audit"] for h in hist if "audit" in h]
    assert len(audits) == 3  # steps 1, 8, 16
    for a in audits:
        assert a["ok"], a
        # float32 against float32 / float64: a few ulps, far below what any
        # wrong formula, temperature or shard offset would give.
        assert max(v for k, v in a.items() if k != "ok") < 1e-5, a

    first = sum(h["reward"] for h in hist[:5]) / 5
    last = sum(h["reward"] for h in hist[-5:]) / 5
    assert first < 0.25, first  # starts near the uniform policy's 1/8
    assert last > first + 0.3, (first, last)
    assert hist[-1]["entropy"] < hist[0]["entropy"]  # the policy sharpened

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "audit vs dualvp_jax" in proc.stdout and "reward" in proc.stdout


@pytest.mark.slow  # the example module imports torch.distributed.tensor
def test_grpo_tiny_writes_no_tracked_file_by_default(capsys, monkeypatch):
    # the chart goes to an ignored folder unless --plot names the README's docs/example.png. The example's
    # parser in this process (its imports are this test process's: torch, dualvp_torch; XLA_FLAGS is
    # already set by tests/conftest.py); the example as a process: test_grpo_tiny_learns_and_audits.
    spec = importlib.util.spec_from_file_location("grpo_tiny_example", _ROOT / "examples" / "grpo_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as info:
        mod.parse_args(["--help"])
    assert info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "default bench-results/grpo_tiny.png" in help_text, help_text
    assert mod.parse_args([]).plot == os.path.join("bench-results", "grpo_tiny.png")
    p = subprocess.run(["git", "check-ignore", "-q", "bench-results/grpo_tiny.png"], cwd=str(_ROOT))
    if p.returncode == 128:
        pytest.skip("not a git checkout")
    assert p.returncode == 0
