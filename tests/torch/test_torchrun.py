"""The ops under ``torchrun`` as users launch them across nodes: 2 agents x 2 processes, c10d rendezvous.

Two ``torchrun`` agents (simulated nodes) on 127.0.0.1 rendezvous through
c10d on a free port; each starts 2 workers of ``_torchrun_worker.py`` (gloo,
env://, a 20 s process-group timeout). One launch runs every case of
``_torchrun_worker.torchrun_cases`` against the float64 oracle (TP=4 over the
world group and over ``new_group``; TP=2 x DP=2 both ways; DTensor on a
``(dp, tp)`` mesh; the fused op at W=4 and W=2) and the mistakes that must
raise the same error on every rank; then the test ``kill -9``'s one worker
while all four call the op in a loop: the survivors raise, both agents exit,
every worker process is gone within 10 s. Each worker first runs ``dualvp
verify`` (the command's entry point, in the worker: it joins the launcher's
group and destroys it before the cases' group is made; one launch instead of
a second one of 2 agents and 4 workers): PASS on every rank.

Every subprocess is bounded (agents in their own session, killed as a group
on timeout), so the test cannot hang.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from dualvp_torch.testing import free_port  # noqa: E402

slow = pytest.mark.slow  # torchrun agents and 4 worker processes per launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "tests", "torch", "_torchrun_worker.py")
LAUNCH_TIMEOUT = 240.0  # seconds for a launch's agents (start-up on a loaded 2-core machine included)
KILL_BOUND = 10.0  # seconds from the kill until every process of the launch is gone


def _env() -> dict:
    env = dict(os.environ, DUALVP_COMPILE="0", OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def _start_agents(port: int, *program: str) -> list:
    """Two torchrun agents (each: 2 workers running ``program``), each in its own session."""
    agents = []
    for n in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=dualvp{port}",
               "--max-restarts=0", "--monitor-interval=0.2", "--local-addr=127.0.0.1", *program]
        agents.append(subprocess.Popen(cmd, cwd=ROOT, env=dict(_env(), AGENT_TAG=str(n)), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return agents


def _finish(agents: list, timeout: float) -> list:
    """``(returncode, output)`` of each agent; the whole session of any agent still running is killed."""
    deadline = time.monotonic() + timeout
    outs = []
    for a in agents:
        try:
            out, _ = a.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(a.pid, signal.SIGKILL)
            out, _ = a.communicate(timeout=30)
            out += "\n[test: agent killed at its timeout]"
        outs.append((a.returncode, out))
    return outs


def _kill_sessions(agents: list) -> None:
    for a in agents:
        if a.poll() is None:
            try:
                os.killpg(a.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, already dead and waiting to be reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _read(path: str):
    with open(path) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The launch of the worker: per-rank case results, the kill's timings, the agents' outputs."""
    out = str(tmp_path_factory.mktemp("torchrun"))
    agents = _start_agents(free_port(), WORKER, out)
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        names = [os.path.join(out, f"{k}{r}") for k in ("rank", "pid") for r in range(4)]
        while not all(os.path.exists(n + (".json" if "rank" in os.path.basename(n) else "")) for n in names):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                _kill_sessions(agents)
                res = _finish(agents, 30)
                pytest.fail(f"the launch did not reach its kill phase: {[o[-3000:] for _, o in res]}")
            time.sleep(0.2)
        ranks = [_read(os.path.join(out, f"rank{r}.json")) for r in range(4)]
        pids = [_read(os.path.join(out, f"pid{r}")) for r in range(4)]
        time.sleep(1.0)  # every worker inside its loop of calls
        victim = 1  # its agent also hosts a survivor, and the other agent hosts two
        t_kill = time.time()
        os.kill(pids[victim], signal.SIGKILL)
        res = _finish(agents, 60)
        t_agents = time.time() - t_kill
        gone_after = None
        while gone_after is None and time.time() - t_kill < 60:
            if not any(_alive(p) for p in pids):
                gone_after = time.time() - t_kill
            time.sleep(0.05)
    finally:
        _kill_sessions(agents)
    faults = {r: _read(os.path.join(out, f"fault{r}.json")) for r in range(4)
              if os.path.exists(os.path.join(out, f"fault{r}.json"))}
    return dict(ranks=ranks, t_kill=t_kill, t_agents=t_agents, gone_after=gone_after, agents=res, faults=faults,
                victim=victim)


OK_CASES = ["tp4_world", "tp4_new_group", "tp2_within_dp2_across", "tp2_across_dp2_within", "dtensor_dp2_tp2",
            "fused_w4", "fused_w2", "fused_w2_sequence_parallel", "after_mistakes"]


@slow
def test_launch_layout(launch):
    ranks = launch["ranks"]
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2, 3]
    # an agent's workers hold contiguous global ranks: the "within a node" groups of the worker
    for r in ranks:
        assert int(r["RANK"]) == 2 * int(r["GROUP_RANK"]) + int(r["LOCAL_RANK"]), r


@slow
@pytest.mark.parametrize("name", OK_CASES)
def test_case_matches_the_oracle(launch, name):
    for r in launch["ranks"]:
        assert r["cases"][name] == ["ok", []], (r["RANK"], r["cases"][name])


@slow
@pytest.mark.parametrize("name,kind,start", [
    ("target_differs", "ValueError", "target: differs across the process group's ranks"),
    ("target_differs_fused", "ValueError", "target: differs across the process group's ranks"),
    ("dp_group_for_tp", "ValueError", "target: differs across the process group's ranks"),
    ("dp_group_for_tp_fused", "ValueError", "target: differs across the process group's ranks"),
    ("rows_differ", "RuntimeError", "dualvp: ranks of the group disagree on T"),
])
def test_mistake_raises_the_same_error_on_every_rank(launch, name, kind, start):
    seen = [tuple(r["cases"][name]) for r in launch["ranks"]]
    assert {s[0] for s in seen} == {kind}, seen
    # one message per group: the world group (4 ranks) or each of the two DP groups
    assert all(s[1].startswith(start) for s in seen), seen
    assert len({s[1] for s in seen}) <= (2 if name.startswith("dp_group") else 1), seen


@slow
def test_killed_worker_survivors_raise_and_everything_exits(launch):
    survivors = [r for r in range(4) if r != launch["victim"]]
    print(f"kill -9 of rank {launch['victim']}: survivors raised after "
          f"{[round(launch['faults'][r]['time'] - launch['t_kill'], 2) for r in sorted(launch['faults'])]} s, "
          f"agents exited after {launch['t_agents']:.2f} s, all workers gone after {launch['gone_after']} s")
    # Every survivor that raised did so with the dead peer's error, within the bound, and at least one raised.
    # A survivor may instead be stopped by its agent (torchrun tears down a node's worker group once one of its
    # workers exits) before its own call fails: it leaves no fault record, and "no hang" is then the bound on
    # every process being gone (CI saw rank 3 stopped so, 1.5 s after the kill, its neighbour rank 2 having raised).
    raised = sorted(launch["faults"])
    assert raised and set(raised) <= set(survivors), launch["faults"]
    for r in raised:
        f = launch["faults"][r]
        assert f["type"] == "RuntimeError", f
        assert f["time"] - launch["t_kill"] < KILL_BOUND, f
    assert all(rc not in (0, None) for rc, _ in launch["agents"]), [rc for rc, _ in launch["agents"]]
    assert launch["t_agents"] < KILL_BOUND, launch["t_agents"]
    assert launch["gone_after"] is not None and launch["gone_after"] < KILL_BOUND, launch["gone_after"]


@slow
def test_verify_under_torchrun_passes_on_every_rank(launch):
    for r in launch["ranks"]:
        assert r["verify_rc"] == 0, r["verify_out"][-4000:]
        assert f"dualvp verify [rank {r['RANK']}/4]: PASS" in r["verify_out"], r["verify_out"][-4000:]


# --- fast: the launcher detection and the verdict of `dualvp verify` under a launcher -------------


def test_launched_needs_every_launcher_variable():
    from dualvp.tools import verify

    env = {"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert verify.launched(env)
    for k in env:
        assert not verify.launched({n: v for n, v in env.items() if n != k})


def _verdicts(table, capsys):
    """Each rank's (exit status, last line) of the verdict from the same gathered ``table``."""
    import argparse

    from dualvp.testing import cases
    from dualvp.tools import verify

    prob = cases.make(cases.Case(name="v", lead=(4,), vocab=8, worlds=(2,), dtype="float32"))
    args = argparse.Namespace(mask="none", seed=0)
    seen = []
    for rank in range(len(table)):
        rc = verify._launched_verdict(table, rank, len(table), 2, args, prob)
        seen.append((rc, capsys.readouterr().out.strip().splitlines()[-1]))
    return seen


def test_launched_verdict_is_the_same_on_every_rank(capsys):
    good = [("logprob", 1e-6, 1e-7, True), ("entropy", 1e-7, 1e-6, True), ("grad", 1e-7, 1e-5, True)]
    bad = good[:2] + [("grad", 0.3, 0.9, False)]
    seen = _verdicts([(good, None, "a")] * 4, capsys)
    assert [rc for rc, _ in seen] == [0] * 4
    assert [line for _, line in seen] == [f"dualvp verify [rank {r}/4]: PASS: 3 quantities within tolerance on all "
                                          "4 ranks (TP 2 x DP 2)" for r in range(4)]
    seen = _verdicts([(good, None, "a"), (good, None, "a"), (bad, None, "b"), (bad, None, "b")], capsys)
    assert [rc for rc, _ in seen] == [1] * 4
    assert len({line.split(": ", 1)[1] for _, line in seen}) == 1 and "FAIL: grad" in seen[0][1], seen
    seen = _verdicts([(good, None, "a"), (None, "ValueError: target: ...", ""), (good, None, "b"),
                      (good, None, "b")], capsys)
    assert [rc for rc, _ in seen] == [1] * 4
    assert all(line.endswith("FAIL: rank 1: ValueError: target: ...") for _, line in seen), seen
    # TP groups are ranks {0, 1} and {2, 3}: rank 3 holds other merged values than rank 2
    seen = _verdicts([(good, None, "a"), (good, None, "a"), (good, None, "b"), (good, None, "c")], capsys)
    assert [rc for rc, _ in seen] == [1] * 4
    assert all("FAIL: the ranks of TP group(s) [1] hold different" in line for _, line in seen), seen


@pytest.mark.parametrize("argv,env,exit_by", [
    (["verify"], {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "_exit"),
    (["verify"], {}, "sys.exit"),
    (["bench"], {"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}, "sys.exit"),
])
def test_console_main_exit_under_a_launcher(monkeypatch, argv, env, exit_by):
    # `python -m dualvp verify` as a launcher's worker leaves by os._exit with main's status once its
    # output is flushed (the interpreter's teardown aborted on a loaded CI machine: dualvp.tools.cli);
    # anything else by sys.exit. The launched run itself: test_verify_under_torchrun_passes_on_every_rank.
    from dualvp.tools import cli

    class Exited(BaseException):
        pass

    def exit_with(how):
        def leave(rc):
            raise Exited(how, rc)
        return leave

    flushed = []
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["dualvp", *argv])
    monkeypatch.setattr(cli, "main", lambda a: 3 if a == argv else -1)
    monkeypatch.setattr(os, "_exit", exit_with("_exit"))
    monkeypatch.setattr(sys, "exit", exit_with("sys.exit"))
    monkeypatch.setattr(sys.stdout, "flush", lambda: flushed.append("out"))
    monkeypatch.setattr(sys.stderr, "flush", lambda: flushed.append("err"))
    with pytest.raises(Exited) as e:
        cli.console_main()
    assert e.value.args == (exit_by, 3)
    assert flushed == (["out", "err"] if exit_by == "_exit" else [])
