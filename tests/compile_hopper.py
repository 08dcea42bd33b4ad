"""Compile every kernel the NSA layer launches for a Hopper GPU (sm_90) on a machine without one, and print each
compiled variant with its shared memory. The CPU tests run the kernels in Triton's interpreter, which skips what only
a real compile reads (the code after a `return` inside a constexpr `if`, layouts, Gluon's Hopper ops); this catches
those before a GPU does. tests/test_nsa_kernels.py runs it in its own process:

    python tests/compile_hopper.py

Launches compile and do not run: outputs hold whatever torch.empty gave, which no launcher reads back (the kernels
need no host sync). Exits non-zero if a kernel fails to compile, needs more shared memory than a Hopper block has
(or, for block selection, other than its launcher reckons), or is never launched here."""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: compile, do not interpret
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HOPPER_SMEM = 227 * 1024  # shared memory one block may take on sm_90


class HopperWithoutGPU:
    """The parts of Triton's active driver that compiling asks for, answering as one sm_90 device."""
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, device=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
    def get_benchmarker(self): return None


compiled = {}  # (kernel name, its tensors' dtypes, constexpr values) -> shared bytes
select_off = set()  # _select_kernel variants whose shared memory is not what the launcher's _select_smem says


def compile_only(kernel, grid):
    """kernel[grid](...) compiles kernel for these arguments (Triton's warmup) instead of launching it."""
    def launch(*args, **kwargs):
        k = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        dtypes = tuple(sorted({str(a.dtype)[6:] for a in args if isinstance(a, torch.Tensor)}))
        constexprs = tuple(sorted((n, v) for n, v in kwargs.items() if isinstance(v, (int, bool))))
        compiled[kernel.__name__, dtypes, constexprs] = k.metadata.shared
        if kernel.__name__ == "_select_kernel":  # its launcher picks stages by _select_smem
            size = nk._select_smem(*(kwargs[n] for n in ("BT", "BG", "BKC", "BD", "NP", "num_stages")),
                                   args[0].element_size())
            if size != k.metadata.shared:
                select_off.add((constexprs, k.metadata.shared, size))
    return launch


driver.set_active(HopperWithoutGPU())
JITFunction.__getitem__ = compile_only  # Gluon kernels are JITFunctions too
torch.cuda.get_device_capability = lambda device=None: (9, 0)
torch.Tensor.is_cuda = property(lambda self: True)  # the launchers take their Hopper paths on CPU tensors
import nsa_attention as na  # noqa: E402
import nsa_kernels as nk  # noqa: E402
import sel_kernel  # noqa: E402
from model import GPTConfig  # noqa: E402
nk._sm_count = lambda device: 132  # an H100's multiprocessors: the persistent kernels' grid

L, DS, LS, N, W = 32, 16, 64, 16, 512  # the paper's NSA defaults


def layer(B, T, HQ, H, D, dtype, varlen=False, forced=(1, 2)):
    """The layer core's launches (as bench.py's layer mode makes them), forward and backward, then a decode step."""
    cu = torch.tensor([0, T // 3, T], dtype=torch.int32) if varlen else None
    cu_c = na.cmp_cu_seqlens(cu, L, DS) if varlen else None
    Tc = int(cu_c[-1]) if varlen else na.num_cmp_blocks(T, L, DS)
    x = lambda *shape: torch.randn(*shape, dtype=dtype, requires_grad=True)
    q, kc, vc, ks, vs, kw, vw = x(B, T, HQ, D), x(B, Tc, H, D), x(B, Tc, H, D), *(x(B, T, H, D) for _ in range(4))
    g = torch.rand(B, T, HQ, 3, requires_grad=True)
    o_cmp, lse = na.compressed_attention(q, kc, vc, L, DS, cu_seqlens=cu, cu_seqlens_cmp=cu_c, backend="triton",
                                         gate=g[..., 0])
    idx = na.select_blocks(q.detach(), kc.detach(), L, DS, LS, N, cu_seqlens=cu, cu_seqlens_cmp=cu_c,
                           backend="triton", lse=lse)
    idx = torch.randint(-1, T // LS, idx.shape, dtype=torch.int32)  # the kernel's ids were not computed
    o_slc = na.selection_attention(q, ks, vs, idx, LS, cu_seqlens=cu, backend="triton", gate=g[..., 1], forced=forced)
    o_win = na.window_attention(q, kw, vw, W, cu_seqlens=cu, backend="triton", gate=g[..., 2])
    (o_cmp + o_slc + o_win).sum().backward()
    cfg = GPTConfig(cmp_block=L, cmp_stride=DS, sel_block=LS, n_select=N, window=W)
    cache = na.nsa_cache(B, T, HQ, H, D, cfg, "cpu", dtype)
    nk.decode_attention_triton(q[:, -1].detach(), cache, torch.full((B,), T - 1), g[:, -1].detach(), L, DS, LS, N,
                               1, 2, D ** -0.5)


SHAPES = [  # B, T, HQ, H, D, dtype, var-length
    (1, 2048, 64, 4, 128, torch.bfloat16, False),  # bench.py's layer: G = 16 (Gluon kernels, union tiles)
    (1, 2048, 128, 4, 256, torch.bfloat16, False),  # G = 32, heads of 256: halved tiles
    (1, 1500, 6, 2, 64, torch.float16, True),  # G = 3 as Track B: heads of 64 ("*_small_d"), var-length
    (1, 600, 4, 4, 96, torch.float32, False),  # G = 1, fp32: no Gluon, rows of 384 bytes
]
for shape in SHAPES:
    layer(*shape)
    print(f"compiled {shape[:5]} {str(shape[5])[6:]}{' var-length' if shape[6] else ''}: {len(compiled)} variants",
          flush=True)
sel_kernel.DS_MAX_BYTES = 0  # the query path's dq kernel, where its score gradients do not fit
nk.SELECT_WS_MIN_G = 64  # and Triton's block selection at G = 16 (as where the Hopper one does not apply)
layer(*SHAPES[0])
layer(*SHAPES[1], forced=None)  # and one token a tile with the forced blocks in its slots
for (name, dtypes, constexprs), shared in sorted(compiled.items()):
    print(f"{name:<28} {shared:>7} B  {','.join(dtypes)} {' '.join(f'{n}={v}' for n, v in constexprs)}")
kernels = {n for m in (nk, sel_kernel) for n, f in vars(m).items() if isinstance(f, JITFunction)}
missed = {n for n in kernels if n.endswith("_kernel")} - {name for name, _, _ in compiled}
too_big = sorted({name for (name, _, _), shared in compiled.items() if shared > HOPPER_SMEM})
if missed or too_big or select_off:
    sys.exit(f"error: kernels not launched here: {sorted(missed)}; needing more than {HOPPER_SMEM} B of shared "
             f"memory: {too_big}; _select_kernel's shared memory against _select_smem: {sorted(select_off)}")
