"""Static Hopper (sm_90) figures of dualvp's Triton kernels, compiled on a machine without a GPU.

Triton lowers a kernel to PTX and assembles it with the ``ptxas`` its wheel
ships; ``cuobjdump`` (also in the wheel) gives the SASS and resource usage.
:func:`hopper_target` makes this process look like one with an sm_90 GPU to
the code that launches kernels, so the repository's *own host code* chooses
blocks, warps, grids and the runtime specialisation (dtypes, 16-divisibility of
pointers and integers, ``== 1`` integers) exactly as it would on the GPU, and
every ``kernel[grid](...)`` only compiles (no kernel runs, outputs stay
uninitialised):

- Triton's active driver is a stand-in answering ``GPUTarget("cuda", 90, 32)``;
  ``JITFunction.__getitem__`` returns a compile-only launcher that records
  each launch (:class:`Launch`: kernel, grid, constexprs, compiled artefacts);
- every torch tensor reports ``device == cuda:0`` (its data stays on the CPU:
  ``torch.empty`` of a goal-size tensor touches no page), torch's factories
  and ``Tensor.to`` map ``device="cuda"`` arguments to the CPU, and ``torch.cuda`` answers
  as one device with ``sms`` multiprocessors; ``torch.compile`` returns the
  function itself (host stages run eagerly); ``torch.mm``/``torch.addmm``
  (cuBLAS on the GPU) return uninitialised results of their shape and are
  recorded in ``launches.matmuls``.

Drivers: :func:`drive_logits` calls ``dualvp_torch.logprob_entropy(...,
impl="triton", validate=False)`` and its backward; :func:`drive_fused` calls
``dualvp_torch.linear_logprob_entropy(..., impl="triton")`` and its backward.
:func:`drive_kl` calls ``dualvp_torch.kl_divergence(..., impl="triton")``
and its backward. All use only the public API, so they follow whatever
kernels and launch parameters the host code picks. :func:`analyse` reads one launch's figures:
registers, spills, shared memory, CTAs per SM, the global access widths and
SASS instruction mix of its loop bodies, float64 instructions, atomics,
memory barriers, 64-bit integer division.

Run it in a process of its own without ``TRITON_INTERPRET`` (Triton reads it
when kernels are defined). Nothing in the op imports this module.
Users: ``tests/torch/test_hopper_compile.py``, ``benchmarks/static_report.py``.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import os
import re
import struct
import subprocess
import tempfile
import time

__all__ = ["Launch", "hopper_target", "drive_logits", "drive_logits_ext", "drive_fused", "drive_kl", "analyse",
           "cuobjdump_sass", "sass_listings", "sass_loops", "LOGITS_MODES", "EXT_LOGITS_MODES", "FUSED_MODES",
           "KL_MODES"]

#: logits op modes: name -> (with_entropy, keep mask)
LOGITS_MODES = {"lp": (False, False), "lp+ent": (True, False), "lp+ent+keep": (True, True)}
#: the extended logits op's modes (K = 4 targets per row, a temperature per row, sum p^2): name -> (with_entropy,
#: keep mask, with_sum_p2)
EXT_LOGITS_MODES = {"k4+tau": (True, False, False), "k4+tau+p2": (True, False, True),
                    "k4+tau+p2+keep": (True, True, True), "k4+keep": (False, True, False)}
#: fused op modes: name -> (with_entropy, keep mask, hidden grad, weight grad)
FUSED_MODES = {"lp": (False, False, True, True), "lp+ent": (True, False, True, True),
               "lp+ent+keep": (True, True, True, True), "lp+ent,frozen-w": (True, False, True, False),
               "lp+ent,frozen-h": (True, False, False, True)}
#: KL op modes: name -> (row_mask, ref_logits grad)
KL_MODES = {"kl": (False, False), "kl+mask": (True, False), "kl+mask,ref-grad": (True, True)}


_FACTORIES = ("empty", "zeros", "ones", "full", "empty_strided", "tensor", "as_tensor", "arange", "empty_like",
              "zeros_like", "ones_like", "full_like", "rand", "randn", "randint", "eye", "scalar_tensor")
_NEW_METHODS = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor", "new_empty_strided")


@dataclasses.dataclass
class Launch:
    """One ``kernel[grid](...)`` call made under :func:`hopper_target` (compiled, not run)."""

    label: str
    kernel: str
    grid: tuple
    constexprs: dict
    compiled: object  # triton's CompiledKernel
    compile_s: float


def _no_compile(fn=None, **kwargs):
    return fn if fn is not None else (lambda f: f)


class _Launches(list):
    """The recorded :class:`Launch` list; ``label[0]`` names the launches that follow."""

    def __init__(self):
        super().__init__()
        self.label = ["?"]
        self.matmuls: list = []  # (label, m, n, k, operand dtype): torch matmuls (cuBLAS on the GPU), not run


@contextlib.contextmanager
def hopper_target(capability: int = 90, sms: int = 132):
    """Within the block, launches compile for ``cuda`` ``capability`` and are recorded; yields the list."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("hopper_target: TRITON_INTERPRET is set; run in a process without it")
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit as _jit
    from triton.runtime.driver import driver as _drv

    launches = _Launches()
    label = launches.label

    class _Driver:
        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def is_active(self):
            return True

        def get_active_torch_device(self):
            return torch.device("cpu")

    def _getitem(self, grid):
        def launch(*args, **kwargs):
            t0 = time.perf_counter()
            g = grid(kwargs) if callable(grid) else grid
            kern = self.run(*args, grid=g, warmup=True, **kwargs)
            if hasattr(kern, "result"):
                kern = kern.result()
            consts = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
            launches.append(Launch(label[0], self.fn.__name__, tuple(g), consts, kern, time.perf_counter() - t0))
            return kern
        return launch

    cuda = torch.device("cuda", 0)
    cpu = torch.device("cpu")

    def _cpu(d):
        if isinstance(d, torch.device) and d.type == "cuda" or isinstance(d, str) and d.startswith("cuda"):
            return cpu
        if isinstance(d, int) and not isinstance(d, bool):
            return cpu
        return d

    def _factory(f):
        def wrapped(*args, **kwargs):
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return f(*args, **kwargs)
        return wrapped

    def _to(self, *args, **kwargs):
        args = tuple(_cpu(a) if isinstance(a, (torch.device, str)) else a for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return saved_to(self, *args, **kwargs)

    def _mm(a, b, *args, out_dtype=None, out=None, **kwargs):
        launches.matmuls.append((label[0], a.shape[0], b.shape[1], a.shape[1], a.dtype))
        if out is not None:
            return out
        return saved_empty((a.shape[0], b.shape[1]), dtype=out_dtype or a.dtype)

    def _addmm(c, a, b, *args, out_dtype=None, out=None, **kwargs):
        return _mm(a, b, out_dtype=out_dtype or c.dtype, out=out)

    saved_empty = torch.empty
    saved_to = torch.Tensor.to
    factories = [n for n in _FACTORIES if hasattr(torch, n)]
    methods = [n for n in _NEW_METHODS if hasattr(torch.Tensor, n)]

    class _Props:
        multi_processor_count = sms
        name = f"sm_{capability} stand-in"
        major, minor = divmod(capability, 10)
        total_memory = 80 << 30

    saved = dict(
        mm=torch.mm, addmm=torch.addmm,
        driver=getattr(_drv, "_active", None),
        factories={n: getattr(torch, n) for n in factories},
        methods={n: getattr(torch.Tensor, n) for n in methods},
        getitem=_jit.JITFunction.__getitem__,
        cuda={n: getattr(torch.cuda, n) for n in ("is_available", "get_device_properties", "current_device",
                                                  "device_count", "current_stream", "synchronize")},
    )
    _drv.set_active(_Driver())
    _jit.JITFunction.__getitem__ = _getitem
    torch.Tensor.device = property(lambda self: cuda)
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_properties = lambda *a, **k: _Props()
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    for n, f in saved["factories"].items():
        setattr(torch, n, _factory(f))
    for n, f in saved["methods"].items():
        setattr(torch.Tensor, n, _factory(f))
    torch.Tensor.to = _to
    torch.mm, torch.addmm = _mm, _addmm
    torch.Tensor.cuda = lambda self, *a, **k: self
    saved["compile"] = torch.compile
    torch.compile = _no_compile  # host stages compiled from here on run eagerly (no inductor, no CUDA RNG)
    try:
        yield launches
    finally:
        for n in ("to", "cuda", "device", "is_cuda"):  # back to the C attributes inherited from TensorBase
            if n in torch.Tensor.__dict__:
                delattr(torch.Tensor, n)
        for n, f in saved["factories"].items():
            setattr(torch, n, f)
        for n, f in saved["methods"].items():
            setattr(torch.Tensor, n, f)
        _jit.JITFunction.__getitem__ = saved["getitem"]
        for n, f in saved["cuda"].items():
            setattr(torch.cuda, n, f)
        _drv._active = saved["driver"]
        torch.compile = saved["compile"]
        torch.mm, torch.addmm = saved["mm"], saved["addmm"]


def _set_label(launches, text):
    launches.label[0] = text


def drive_logits(launches, T: int, V: int, dtype: str, mode: str, temperature: float = 0.7) -> None:
    """Forward + backward of ``logprob_entropy(impl="triton", validate=False)`` on ``[T, V]`` logits (W = 1)."""
    import torch

    import dualvp_torch

    ent, keep = LOGITS_MODES[mode]
    dt = getattr(torch, dtype)
    z = torch.empty((T, V), dtype=dt).requires_grad_(True)
    y = torch.zeros((T,), dtype=torch.int64)
    km = torch.empty((T, V), dtype=torch.bool) if keep else None  # (values unread: nothing runs)
    _set_label(launches, f"logits {T}x{V} {dtype} {mode}")
    lp, h = dualvp_torch.logprob_entropy(z, y, keep_mask=km, temperature=temperature, with_entropy=ent,
                                         validate=False, impl="triton")
    loss = lp.sum() if h is None else lp.sum() + h.sum()
    loss.backward()


def drive_logits_ext(launches, T: int, V: int, dtype: str, mode: str) -> None:
    """Forward + backward of the extended ``logprob_entropy(multi_target=True, impl="triton", validate=False)``
    with 4 targets per row and a temperature tensor on ``[T, V]`` logits (W = 1); :data:`EXT_LOGITS_MODES`."""
    import torch

    import dualvp_torch

    ent, keep, p2 = EXT_LOGITS_MODES[mode]
    dt = getattr(torch, dtype)
    z = torch.empty((T, V), dtype=dt).requires_grad_(True)
    y = torch.zeros((T, 4), dtype=torch.int64)
    km = torch.zeros((T, V), dtype=torch.bool) if keep else None
    tau = torch.full((T,), 0.7, dtype=torch.float32)
    _set_label(launches, f"logits-ext {T}x{V} {dtype} {mode}")
    out = dualvp_torch.logprob_entropy(z, y, keep_mask=km, temperature=tau, with_entropy=ent, validate=False,
                                       impl="triton", multi_target=True, with_sum_p2=p2)
    loss = out[0].sum()
    for o in out[1:]:
        if o is not None:
            loss = loss + o.sum()
    loss.backward()


def drive_fused(launches, T: int, H: int, V: int, dtype: str, mode: str, temperature: float = 0.7,
                allow_tf32: bool = False) -> None:
    """Forward + backward of ``linear_logprob_entropy(impl="triton")`` with ``h [T, H]``, ``W [V, H]`` (W = 1)."""
    import torch

    import dualvp_torch

    ent, keep, gh, gw = FUSED_MODES[mode]
    dt = getattr(torch, dtype)
    h = torch.empty((T, H), dtype=dt).requires_grad_(gh)
    w = torch.empty((V, H), dtype=dt).requires_grad_(gw)
    y = torch.zeros((T,), dtype=torch.int64)
    km = torch.empty((T, V), dtype=torch.bool) if keep else None
    _set_label(launches, f"fused {T}x{H}x{V} {dtype} {mode}")
    lp, en = dualvp_torch.linear_logprob_entropy(h, w, y, keep_mask=km, temperature=temperature,
                                                 with_entropy=ent, validate=False, impl="triton",
                                                 allow_tf32=allow_tf32)
    loss = lp.sum() if en is None else lp.sum() + en.sum()
    loss.backward()


def drive_kl(launches, T: int, V: int, dtype: str, mode: str, temperature: float = 0.7) -> None:
    """Forward + backward of ``kl_divergence(impl="triton", validate=False)`` on two ``[T, V]`` logits (W = 1)."""
    import torch

    import dualvp_torch

    masked, ref_grad = KL_MODES[mode]
    dt = getattr(torch, dtype)
    z = torch.empty((T, V), dtype=dt).requires_grad_(True)
    r = torch.empty((T, V), dtype=dt).requires_grad_(ref_grad)
    m = torch.ones((T,), dtype=torch.bool) if masked else None
    _set_label(launches, f"kl {T}x{V} {dtype} {mode}")
    kl = dualvp_torch.kl_divergence(z, r, row_mask=m, temperature=temperature, validate=False, impl="triton")
    kl.sum().backward()


# --- reading the compiled artefacts ---------------------------------------------------------------------

_SASS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_F64 = ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX", "DSET")


def _bin(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _ptxas() -> str:
    """The ptxas Triton itself assembles sm_90 code with (3.9 ships a newer one as "ptxas-blackwell")."""
    from triton.backends.nvidia import compiler

    return compiler.get_ptxas(90).path


def _tool(args, data: bytes | str, suffix: str) -> subprocess.CompletedProcess:
    mode = "wb" if isinstance(data, bytes) else "w"
    with tempfile.NamedTemporaryFile(suffix=suffix, delete=False, mode=mode) as f:
        f.write(data)
        path = f.name
    try:
        return subprocess.run([*args, path], capture_output=True, text=True, check=False)
    finally:
        os.unlink(path)


def cuobjdump_sass(cubin: bytes) -> str:
    """``cuobjdump -sass`` of one cubin (one process: ~0.5 s of start-up; many kernels: :func:`sass_listings`)."""
    return _tool([_bin("cuobjdump"), "-sass"], cubin, ".cubin").stdout


#: opcodes whose last operand is a program-counter-relative target, printed as an absolute address
_PC_RELATIVE = ("BRA", "BSSY", "CALL", "RET", "BRX", "JMX", "SSY", "PBK", "PCNT", "CAL")


def _code_sections(cubin: bytes) -> list:
    """The executable ``.text.*`` sections of an ELF64 cubin, in file order."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]  # the section-name string table's file offset
    out = []
    for name, _type, _flags, _addr, offset, size in heads:
        if cubin[names + name:cubin.index(b"\0", names + name)].startswith(b".text."):
            out.append(cubin[offset:offset + size])
    return out


def sass_listings(cubins, arch: str = "SM90a") -> list:
    """``cuobjdump -sass``-form listings of many single-function cubins, from one disassembler process.

    ``cuobjdump`` and ``nvdisasm`` spend ~0.5 s starting, whatever the size
    of the cubin: one call per kernel made most of the Hopper test's time.
    Here the code sections are disassembled together as one raw instruction
    binary (``nvdisasm -b``: fixed 16-byte instructions, branches relative to
    the program counter), and each kernel's part is rebased to address 0, as
    ``cuobjdump`` prints a one-function cubin: instruction addresses and
    branch targets. A cubin with several functions gets ``cuobjdump``'s own
    listing. ``tests/torch/test_hopper_compile.py`` checks one kernel against
    ``cuobjdump -sass``.
    """
    cubins = list(cubins)
    out = [None] * len(cubins)
    blob, spans = bytearray(), []
    for i, cubin in enumerate(cubins):
        code = _code_sections(cubin)
        if len(code) != 1 or len(code[0]) % 16:
            out[i] = cuobjdump_sass(cubin)
            continue
        spans.append((i, len(blob)))  # (cubin, offset of its code in the blob)
        blob += code[0]
    if spans:
        text = _tool([_bin("nvdisasm"), "-b", arch], bytes(blob), ".bin").stdout
        lines = collections.defaultdict(list)
        starts = [lo for _, lo in spans]
        for line in text.splitlines():
            m = _SASS.search(line)
            if not m:
                continue
            addr = int(m.group(1), 16)
            i, lo = spans[bisect.bisect_right(starts, addr) - 1]
            rest = m.group(4)
            if m.group(3).split(".")[0] in _PC_RELATIVE:  # the target, printed absolute in the blob
                rest = re.sub(r"0x([0-9a-f]+)\s*$", lambda t: f"0x{int(t.group(1), 16) - lo:x}", rest)
            lines[i].append(f"        /*{addr - lo:04x}*/ {m.group(2) or ''}{m.group(3)}{rest};")
        for i, _ in spans:
            out[i] = "\n".join(lines[i]) + "\n"
    return out


def sass_instructions(sass: str) -> list:
    """``[(address, opcode, operands)]`` of a ``cuobjdump -sass`` listing."""
    return [(int(m.group(1), 16), m.group(3), m.group(4).strip()) for m in map(_SASS.search, sass.splitlines())
            if m]


def sass_loops(ins) -> list:
    """``[(start, end)]`` address ranges of the loop bodies (backward branches), innermost-first order kept."""
    out = []
    for addr, op, args in ins:
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", args)
            if m and int(m.group(1), 16) < addr:
                out.append((int(m.group(1), 16), addr))
    return out


def _klass(op: str) -> str:
    base = op.split(".")[0]
    if base in _F64 or (base in ("F2F", "I2F", "F2I") and "64" in op and "F64" in op) or op.startswith(
            ("MUFU.RCP64", "MUFU.RSQ64")):
        return "f64"
    if base in ("LDG", "STG", "LDGSTS", "REDG", "ATOMG", "RED", "ATOM"):
        return "global"
    if base in ("HGMMA", "WGMMA", "HMMA"):
        return "mma"
    return base


def _width(op: str) -> int:
    """Bytes per thread of a global access opcode (LDG.E.128 -> 16, ...)."""
    for tok, n in ((".128", 16), (".64", 8), (".U8", 1), (".S8", 1), (".U16", 2), (".S16", 2), (".16", 2)):
        if tok in op:
            return n
    if "F32x4" in op or "x4" in op:
        return 16
    if "F32x2" in op or "x2" in op:
        return 8
    return 4


def _mma_flop(op: str) -> int:
    m = re.search(r"(\d+)x(\d+)x(\d+)", op)
    return 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3)) if m else 0


def loop_figures(ins, lo: int, hi: int) -> dict:
    """Instruction classes, global access widths, atomics, barriers and MMA FLOP (per warpgroup) in ``[lo, hi]``."""
    c = collections.Counter()
    widths = collections.Counter()
    for addr, op, args in ins:
        if not lo <= addr <= hi:
            continue
        c["total"] += 1
        k = _klass(op)
        c[k] += 1
        if k == "global":
            base = op.split(".")[0]
            kind = "atomic" if base in ("REDG", "ATOMG", "RED", "ATOM") else "load" if base in ("LDG", "LDGSTS") \
                else "store"
            widths[(kind, _width(op))] += 1
            c[kind] += 1
        if op.startswith("MEMBAR"):
            c["membar"] += 1
            if not op.endswith(".CTA"):  # .GPU / .SYS: waits for the memory system (a fence per atomic)
                c["membar_gpu"] += 1
        if op.split(".")[0] in ("STL", "LDL"):
            c["local"] += 1
        if k == "mma":
            c["mma_flop"] += _mma_flop(op)
    return dict(counts=c, widths=widths)


def analyse(launch: Launch, rerun_ptxas: bool = False, sass: str | None = None) -> dict:
    """Static figures of one compiled launch (see the module docstring).

    Spills are read from the compiled cubin (``cuobjdump -res-usage``: local
    memory bytes per thread; ``STL``/``LDL`` in the SASS). ``rerun_ptxas``
    also assembles the PTX again with ``ptxas -v`` (its log, informative: it
    may not use the exact options of Triton's own call). ``sass``: the
    kernel's listing if the caller has it (:func:`sass_listings`), else
    ``cuobjdump -sass`` here.
    """
    kern = launch.compiled
    md = kern.metadata
    cubin = kern.asm["cubin"]
    res = _tool([_bin("cuobjdump"), "-res-usage"], cubin, ".cubin").stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    reg, stack, shared_static, local = map(int, m.groups()) if m else (None,) * 4
    if sass is None:
        sass = cuobjdump_sass(cubin)
    ptx = kern.asm["ptx"]
    ptxas, spill = "", None
    if rerun_ptxas:  # informative: the options of Triton's own ptxas call may differ (3.9 adds --regAllocOptLevel)
        arch = re.search(r"\.target\s+(sm_\w+)", ptx)
        ptxas = _tool([_ptxas(), "-v", "-lineinfo", f"--gpu-name={arch.group(1) if arch else 'sm_90a'}", "-o",
                       os.devnull], ptx, ".ptx").stderr
        spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", ptxas))
    ins = sass_instructions(sass)
    loops = sass_loops(ins)
    whole = loop_figures(ins, 0, 1 << 62)
    # the streaming loop: the longest loop body (None: a loop-free kernel, whose whole body is one tile)
    main = max(loops, key=lambda r: r[1] - r[0]) if loops else None
    body = loop_figures(ins, *main) if main else whole
    warps = md.num_warps
    threads = 32 * warps
    regs8 = -(-reg // 8) * 8 if reg else 0
    smem = md.shared + (shared_static or 0)
    by_regs = 65536 // max(1, regs8 * threads) if reg else 0
    by_smem = (228 << 10) // smem if smem else 32
    ctas = min(2048 // threads, by_regs, by_smem, 32)
    return dict(
        kernel=launch.kernel, label=launch.label, grid=launch.grid, constexprs=launch.constexprs,
        warps=warps, stages=getattr(md, "num_stages", None), registers=reg, stack=stack, local=local,
        spill_bytes=local, ptxas_rerun_spill_bytes=spill,
        ptxas=" ".join(ln.strip() for ln in ptxas.splitlines() if "Used" in ln or "spill" in ln),
        shared=smem, ctas_per_sm=ctas, loops=len(loops), has_loop=main is not None,
        loop=body, whole=whole, each_loop=[loop_figures(ins, lo, hi) for lo, hi in loops],
        div64=bool(re.search(r"\b(div|rem)\.[su]64", ptx)),
        acq_rel_atomics=len(re.findall(r"\batom\.[\w.]*acq_rel", ptx)),
        ptx_atomics=len(re.findall(r"\b(?:atom|red)\.global", ptx)),
        membar=whole["counts"]["membar"], membar_gpu=whole["counts"]["membar_gpu"],
        local_accesses=whole["counts"]["local"], compile_s=launch.compile_s,
    )
