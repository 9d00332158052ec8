"""``dualvp verify --input FILE``: the usual checks on a user's saved logits.

A ``torch.save``'d dict and an ``.npz`` are written here, run through the
command at ``--tp 2`` (exit 0, the table names the file and its shape; the
deliberate fault ``DUALVP_TEST_FAULT=grad_tau`` making verify FAIL on the gradient
rows: tests/cross/test_checks_can_fail.py); a file with K targets per row
or a per-row temperature runs the extended op's check (torch and JAX against
the oracle); malformed files give an error that names what is wrong, before
any backend starts.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

from dualvp.tools import cli, verify  # noqa: E402

from ._cli import jax_in_process, run_verify  # noqa: E402


def _verify(*args, fault: str = ""):
    return run_verify(*args, "--no-compile", fault=fault)


def _saved(seed=0, lead=(2, 6), vocab=64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*lead, vocab, generator=g) * 3 + 8
    y = torch.randint(0, vocab, lead, generator=g)
    y.view(-1)[0] = -100  # a padding row, as a training run would save it
    k = torch.rand(*lead, vocab, generator=g) < 0.6
    return z, y, k


@pytest.mark.slow
def test_torch_save_file_passes_at_tp2(tmp_path, monkeypatch):
    jax_in_process(monkeypatch)  # the JAX child as a process: test_npz_file_passes_at_tp2
    z, y, k = _saved()
    path = tmp_path / "batch.pt"
    torch.save({"logits": z.to(torch.bfloat16), "target": y, "keep_mask": k}, path)
    proc = _verify("--input", str(path), "--tp", "2", "--temperature", "0.8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert f"input={path} W=2 T=12 V=64 dtype=bfloat16 temperature=0.8 mask=from file" in lines[0], lines[0]
    rows = [ln for ln in lines if ln.rstrip().endswith(("PASS", "FAIL"))]
    assert len(rows) == 12 and all(ln.rstrip().endswith("PASS") for ln in rows), proc.stdout
    assert {ln.split("  ")[0].strip() for ln in rows} == {"spec vs oracle", "torch vs oracle", "jax vs oracle",
                                                           "torch vs jax"}
    assert proc.stdout.rstrip().endswith("PASS: 12 checks within tolerance")


@pytest.mark.slow
def test_npz_file_passes_at_tp2(tmp_path):
    # (The same check failing under the deliberate fault: tests/cross/test_checks_can_fail.py::
    # test_verify_reports_the_fault; the JAX child and the comparison do not depend on where the logits
    # came from.)
    z, y, _ = _saved(seed=1)
    path = tmp_path / "batch.npz"
    np.savez(path, logits=z.numpy(), target=y.numpy())
    ok = _verify("--input", str(path), "--tp", "2", "--temperature", "0.5", "--backends", "jax")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "dtype=float32" in ok.stdout and "mask=none" in ok.stdout
    rows = [ln for ln in ok.stdout.splitlines() if ln.rstrip().endswith(("PASS", "FAIL"))]
    assert rows and {ln.split("  ")[0].strip() for ln in rows} == {"spec vs oracle", "jax vs oracle"}, ok.stdout


def test_load_input_reads_exactly_and_flattens(tmp_path):
    z, y, k = _saved(lead=(3, 2, 5), vocab=16)
    path = tmp_path / "b.pt"
    torch.save({"logits": z.to(torch.bfloat16), "target": y, "keep_mask": k, "other": torch.zeros(1)}, path)
    d = verify.load_input(str(path))
    assert d["dtype"] == "bfloat16"
    np.testing.assert_array_equal(d["logits"], z.to(torch.bfloat16).double().reshape(30, 16).numpy())
    np.testing.assert_array_equal(d["target"], y.reshape(30).numpy())
    np.testing.assert_array_equal(d["keep_mask"], k.reshape(30, 16).numpy())
    assert verify.load_input(str(path), max_rows=4)["logits"].shape == (4, 16)


def test_load_input_reads_keep_ids(tmp_path):
    z, y, k = _saved(lead=(3, 4), vocab=16)
    ids = torch.where(k, torch.arange(16), -1)  # [3, 4, 16]: the kept columns, -1 elsewhere
    path = _write(tmp_path, "npz", {"logits": z, "target": y, "keep_ids": ids})
    d = verify.load_input(path, max_rows=5)
    assert d["keep_mask"] is None and d["keep_ids"].shape == (5, 16) and d["keep_ids"].dtype == np.int64
    np.testing.assert_array_equal(d["keep_ids"], ids.reshape(12, 16)[:5].numpy())


@pytest.mark.slow
def test_keep_ids_file_passes_at_tp2(tmp_path, monkeypatch):
    """A saved ``keep_ids [T, K]``: every backend against the oracle of the mask made from the ids."""
    jax_in_process(monkeypatch)  # the JAX child as a process: test_npz_file_passes_at_tp2
    z, y, k = _saved(seed=2)
    ids = torch.where(k, torch.arange(64), -1)[..., :40].flip(-1)  # the kept ids below 40, padded with -1
    path = tmp_path / "ids.pt"
    torch.save({"logits": z, "target": y, "keep_ids": ids}, path)
    proc = _verify("--input", str(path), "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mask=keep_ids from file" in proc.stdout.splitlines()[0], proc.stdout
    assert proc.stdout.rstrip().endswith("PASS: 12 checks within tolerance"), proc.stdout


def _write(tmp_path, kind, obj):
    if kind == "npz":
        path = tmp_path / "x.npz"
        np.savez(path, **{n: (v.numpy() if isinstance(v, torch.Tensor) else v) for n, v in obj.items()})
    else:
        path = tmp_path / "x.pt"
        torch.save(obj, path)
    return str(path)


_Z = torch.zeros(4, 8)
_Y = torch.zeros(4, dtype=torch.int64)

BAD = [
    ("no logits", "pt", {"target": _Y}, "input:", "lacks the key"),
    ("no target", "npz", {"logits": _Z}, "input:", "lacks the key"),
    ("target shape", "pt", {"logits": _Z, "target": torch.zeros(5, dtype=torch.int64)}, "target:", "shape"),
    ("target float", "npz", {"logits": _Z, "target": torch.zeros(4)}, "target:", "integer"),
    ("logits int", "pt", {"logits": torch.zeros(4, 8, dtype=torch.int32), "target": _Y}, "logits:", "float"),
    ("logits 1-d", "pt", {"logits": torch.zeros(8), "target": torch.zeros((), dtype=torch.int64)}, "logits:", "[T, V]"),
    ("mask dtype", "pt", {"logits": _Z, "target": _Y, "keep_mask": torch.ones(4, 8)}, "keep_mask:", "bool"),
    ("mask shape", "npz", {"logits": _Z, "target": _Y, "keep_mask": torch.ones(4, 7, dtype=torch.bool)},
     "keep_mask:", "shape"),
    ("target range", "pt", {"logits": _Z, "target": torch.tensor([0, 1, 8, -3])}, "target:", "out-of-range"),
    ("empty", "pt", {"logits": torch.zeros(0, 8), "target": torch.zeros(0, dtype=torch.int64)}, "logits:", "row"),
    ("ids float", "pt", {"logits": _Z, "target": _Y, "keep_ids": torch.zeros(4, 2)}, "keep_ids:", "integer"),
    ("ids shape", "npz", {"logits": _Z, "target": _Y, "keep_ids": torch.zeros(3, 2, dtype=torch.int64)},
     "keep_ids:", "shape"),
    ("ids range", "pt", {"logits": _Z, "target": _Y, "keep_ids": torch.tensor([[0, 8]] * 4)}, "keep_ids:",
     "out-of-range"),
    ("ids and mask", "pt", {"logits": _Z, "target": _Y, "keep_mask": torch.ones(4, 8, dtype=torch.bool),
                            "keep_ids": torch.zeros(4, 2, dtype=torch.int64)}, "keep_ids:", "both"),
    ("K targets rows", "pt", {"logits": _Z, "target": torch.zeros(3, 2, dtype=torch.int64)}, "target:", "shape"),
    ("K targets zero", "npz", {"logits": _Z, "target": torch.zeros(4, 0, dtype=torch.int64)}, "target:", "shape"),
    ("K targets range", "pt", {"logits": _Z, "target": torch.tensor([[0, 8]] * 4)}, "target:", "out-of-range"),
    ("tau int", "pt", {"logits": _Z, "target": _Y, "temperature": torch.ones(4, dtype=torch.int32)},
     "temperature:", "float"),
    ("tau shape", "npz", {"logits": _Z, "target": _Y, "temperature": torch.ones(3)}, "temperature:", "shape"),
    ("tau zero", "pt", {"logits": _Z, "target": _Y, "temperature": torch.tensor([1.0, 0.0, 1.0, 1.0])},
     "temperature:", "> 0"),
    ("tau nan", "npz", {"logits": _Z, "target": _Y, "temperature": torch.tensor([1.0, float("nan"), 1.0, 1.0])},
     "temperature:", "> 0"),
]


@pytest.mark.parametrize("name,kind,obj,start,word", BAD, ids=[b[0] for b in BAD])
def test_malformed_file_names_the_problem(tmp_path, name, kind, obj, start, word):
    path = _write(tmp_path, kind, obj)
    with pytest.raises(ValueError) as info:
        verify.load_input(path)
    assert str(info.value).startswith(start) and word in str(info.value), str(info.value)


def test_unreadable_files(tmp_path):
    garbage = tmp_path / "g.pt"
    garbage.write_bytes(b"not a torch file")
    torch.save([torch.zeros(2, 2)], tmp_path / "list.pt")
    (tmp_path / "g.npz").write_bytes(b"PK\x03\x04 broken")
    for path, word in ((garbage, "torch.save"), (tmp_path / "list.pt", "dict"), (tmp_path / "g.npz", ".npz"),
                       (tmp_path / "missing.pt", "no such file")):
        with pytest.raises(ValueError) as info:
            verify.load_input(str(path))
        assert str(info.value).startswith("input:") and word in str(info.value), str(info.value)


def test_load_input_reads_k_targets_and_row_temperature(tmp_path):
    z, y, _ = _saved(seed=3)
    yk = torch.stack([y, (y + 1).clamp(min=0) % 64], -1)  # [2, 6, 2]
    tau = torch.rand(2, 6) + 0.5
    path = _write(tmp_path, "pt", {"logits": z, "target": yk, "temperature": tau})
    d = verify.load_input(path, max_rows=5)
    assert verify.uses_extended(d)
    assert d["target"].shape == (5, 2) and d["temperature"].shape == (5,)
    np.testing.assert_array_equal(d["target"], yk.reshape(12, 2)[:5].numpy())
    np.testing.assert_array_equal(d["temperature"], tau.reshape(-1)[:5].double().numpy())
    assert not verify.uses_extended(verify.load_input(_write(tmp_path, "npz", {"logits": z.numpy(),
                                                                                "target": y.numpy()})))


def test_extended_comparison_can_fail():
    # the rows verify prints for a file with K targets: a gradient off by 1e-3 relative fails them
    from dualvp.testing import extended as ext
    from dualvp.testing.metrics import tolerance
    from dualvp.tools import verify_ext

    prob = ext.make_ext(ext.ext_case("all_basic"))
    ref = ext.oracle_ext(prob)
    tol = lambda q: tolerance("float32", q)  # noqa: E731
    assert all(ok for *_, ok in verify_ext._rows("all_basic", ref, ref, tol))
    off = ref._replace(grad=ref.grad * (1 + 1e-3))
    assert [f for f, *_, ok in verify_ext._rows("all_basic", off, ref, tol) if not ok] == ["grad"]


@pytest.mark.slow
def test_k_targets_and_row_temperature_file_passes_at_tp2(tmp_path):
    """``target [..., K]`` and ``temperature [...]`` from a file: the extended op, torch and JAX, vs the oracle.

    The extended op's JAX child as a process (tests/tools/test_verify_ext.py runs it in this one)."""
    z, y, k = _saved(seed=2)
    yk = torch.stack([y, torch.randint(0, 64, y.shape)], -1)
    path = tmp_path / "ext.pt"
    torch.save({"logits": z.to(torch.bfloat16), "target": yk, "temperature": torch.rand(2, 6) + 0.5,
                "keep_mask": k}, path)
    proc = _verify("--input", str(path), "--tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "targets per row=2 temperature=per row (from file) mask=from file" in proc.stdout, proc.stdout
    rows = [ln for ln in proc.stdout.splitlines() if ln.rstrip().endswith(("PASS", "FAIL"))]
    assert len(rows) == 12 and all(ln.rstrip().endswith("PASS") for ln in rows), proc.stdout


def test_cli_exit_2_before_any_backend(tmp_path, capsys):
    path = _write(tmp_path, "pt", {"logits": torch.zeros(4, 10), "target": _Y})
    assert cli.main(["verify", "--input", path, "--tp", "4"]) == 2
    err = capsys.readouterr().err
    assert "tp: the vocabulary V = 10" in err and "--tp 4" in err
    path = _write(tmp_path, "pt", {"logits": _Z, "target": _Y, "keep_mask": torch.ones(4, 8, dtype=torch.bool)})
    assert cli.main(["verify", "--input", path, "--mask", "nucleus"]) == 2
    assert "mask:" in capsys.readouterr().err
    # K targets with keep_ids: the extended options take the mask form
    path = _write(tmp_path, "pt", {"logits": _Z, "target": torch.zeros(4, 2, dtype=torch.int64),
                                   "keep_ids": torch.zeros(4, 2, dtype=torch.int64)})
    assert cli.main(["verify", "--input", path]) == 2
    assert "keep_ids:" in capsys.readouterr().err
    path = _write(tmp_path, "pt", {"logits": torch.zeros(4, 10), "target": _Y, "temperature": torch.ones(4)})
    assert cli.main(["verify", "--input", path, "--tp", "4"]) == 2
    assert "tp: the vocabulary V = 10" in capsys.readouterr().err
