"""The Triton backends' autotuning hooks: ``configs(problem)`` and ``run_config``.

Every tile config a GPU would be offered is run in Triton's interpreter on a small problem
(G=3: a skewed split with an empty group, N=64, K=96 so both contraction steps end partly
masked) against a float64 reference, into a NaN-poisoned fp32 ``out``. The interpreter
ignores warps and stages, so of the configs differing only in those one runs (``_sample``):
every distinct bm / bn / bk / blocks / bt / per_sm value is still covered. The spaces are
taken at two mean group sizes (the small problem's own, and 512 rows: the large-tile
defaults), so the large tiles run too. ``configs`` itself is checked on described sm_90 /
sm_100 problems (as on a GPU host) and on CPU ones (no configs: tuning would only spend
interpreter time).
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import autotune, tuning_store
from grouped_gemm.autotune import MAX_CONFIGS
from grouped_gemm.backends.triton_mx import (
    TritonGroupedBackend,
    TritonMxfp4Backend,
    TritonMxfp8Backend,
    launch,
    layouts,
)
from grouped_gemm.device import emulated
from grouped_gemm.errors import InvalidArgumentError
from grouped_gemm.inputs import GroupedInputs
from grouped_gemm.mx import quantize_mx, quantize_mx_rows, quantize_mx_weight
from grouped_gemm.recipes import get_recipe
from grouped_gemm.registry import registry
from grouped_gemm.testing import poison, ref_dgrad, ref_fwd, ref_wgrad, rel_error, sqnr_db

SPLITS = [9, 0, 55]
N, K = 64, 96
#: Mean rows per group of a large problem: the spaces around the largest default tiles.
LARGE_MEAN_ROWS = 512
#: As tests/test_triton_grouped.py: fp32 results of bf16 products, summation order aside.
FP32_OUT_TOL = 1e-5
#: As tests/test_triton_mxfp4.py / test_triton_mxfp8.py, against the exact product of the
#: quantized operands.
MIN_SQNR = 60.0
#: Path name -> the arch emulated: the sm_90 upcast kernel (the CPU's path) or dot_scaled.
PATHS = {"upcast": "cpu", "dot_scaled": "gfx950"}
MX = {"triton_mxfp4": (TritonMxfp4Backend, "mxfp4"), "triton_mxfp8": (TritonMxfp8Backend, "mxfp8")}

needs_interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not launch.interpreted(), reason="CPU tests run the kernels in Triton's interpreter"
)


def _sample(*spaces):
    """One config per behaviour the interpreter can tell apart: warps and stages aside."""
    seen = {}
    for config in (c for space in spaces for c in space):
        key = (type(config), *(v for f, v in dataclasses.asdict(config).items() if f not in ("warps", "stages")))
        seen.setdefault(key, config)
    return list(seen.values())


def _space(op, kind, *fmt):
    """The GPU candidates of a kernel (``kind``: grouped, upcast, scaled; ``fmt``: the
    upcast weight format) at the test problem's mean group size and at a large one."""
    if op == "wgrad":
        return _sample(launch.wgrad_configs())
    spaces = {"grouped": launch.grouped_configs, "upcast": launch.upcast_configs, "scaled": launch.scaled_configs}
    groups = len(SPLITS)
    return _sample(spaces[kind](sum(SPLITS), groups, *fmt), spaces[kind](LARGE_MEAN_ROWS * groups, groups, *fmt))


def _problem(a, b, op, recipe, out, accumulate=False):
    """The Problem dispatch builds for the call (on the emulated chip, if any)."""
    return gg.explain(
        a, b, SPLITS, op=op, recipe=recipe, out=out, out_dtype=torch.float32, accumulate=accumulate
    ).problem


#: Config field -> the launch keyword it becomes.
LAUNCH_KEYWORDS = {
    "bm": "BM",
    "bn": "BN",
    "bk": "BK",
    "bt": "BT",
    "blocks": "BLOCKS",
    "warps": "num_warps",
    "stages": "num_stages",
    "small": "SMALL",
    "tma": "TMA",
}


class _Spy:
    """A cached launcher that records the keywords of each launch (``seen``), either way
    it is called, then launches through ``real``."""

    def __init__(self, real, seen: list) -> None:
        self.real, self.seen = real, seen

    def __call__(self, grid, *args, **kwargs):
        self.seen.append(kwargs)
        return self.real(grid, *args, **kwargs)

    def launch(self, grid, constexprs, *args):
        self.seen.append(dict(constexprs.kwargs))
        return self.real.launch(grid, constexprs, *args)


@pytest.fixture
def launches(monkeypatch):
    """The keywords of every kernel launch (the cached launchers, spied on)."""
    seen = []
    for attr in ("_GROUPED", "_UPCAST", "_SCALED", "_WGRAD"):
        monkeypatch.setattr(launch, attr, _Spy(getattr(launch, attr), seen))
    return seen


def _check_launched(launches, config):
    """The last launch took ``config``'s tiles, and no more programs than ``per_sm`` allows
    (the interpreter counts 2 SMs)."""
    kwargs = launches[-1]
    fields = dataclasses.asdict(config)
    if "tma" in fields:  # the test operands are all TMA-aligned: the flag reaches the kernel
        fields["tma"] = bool(fields["tma"])
    assert {LAUNCH_KEYWORDS[f]: v for f, v in fields.items() if f != "per_sm"} == {
        LAUNCH_KEYWORDS[f]: kwargs[LAUNCH_KEYWORDS[f]] for f in fields if f != "per_sm"
    }
    assert kwargs["NUM_PROGS"] <= 2 * fields.get("per_sm", 1)


def _out(op):
    shape = {"fwd": (sum(SPLITS), N), "dgrad": (sum(SPLITS), K), "wgrad": (len(SPLITS), N, K)}[op]
    return poison(torch.empty(shape))


# ---- run_config: every candidate against float64 ----------------------------------------


@needs_interpreter
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad", "wgrad_accumulate"])
def test_grouped_every_config_matches_float64(op, gen, launches):
    """triton_grouped: bf16 operands, fp32 results; wgrad also accumulating into fp32."""
    accumulate = op == "wgrad_accumulate"
    op = "wgrad" if accumulate else op
    m, g = sum(SPLITS), len(SPLITS)
    shapes = {"fwd": ((m, K), (g, N, K)), "dgrad": ((m, N), (g, N, K)), "wgrad": ((m, N), (m, K))}[op]
    a, b = (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in shapes)
    want = {"fwd": ref_fwd, "dgrad": ref_dgrad, "wgrad": ref_wgrad}[op](a, b, SPLITS)
    backend = TritonGroupedBackend()
    start = torch.randn(g, N, K, generator=gen) if accumulate else None
    if accumulate:
        want = want + start.double()
    problem = _problem(a, b, op, "bf16", _out(op), accumulate)
    for config in _space(op, "grouped"):
        out = start.clone() if accumulate else _out(op)
        got = backend.run_config(problem, GroupedInputs(a, b, tuple(SPLITS), out), dataclasses.asdict(config))
        _check_launched(launches, config)
        assert got is out
        assert rel_error(got, want) < FP32_OUT_TOL, config


def _mx_operands(op, recipe, scale_rule, grad_format, gen):
    """(a, b) of an MX call and the float64 result of its quantized operands: fwd / dgrad
    with pre-quantized MXTensors, wgrad with bf16 dy and x (the backend quantizes them along
    the tokens per group, as ``gg.quantize_mx_rows`` does here)."""
    r = get_recipe(recipe)
    m, g = sum(SPLITS), len(SPLITS)
    if op == "wgrad":
        dy, x = torch.randn(m, N, generator=gen), torch.randn(m, K, generator=gen)
        dy_q = quantize_mx_rows(dy, SPLITS, grad_format, scale_rule=scale_rule).dequantize(torch.float64)
        x_q = quantize_mx_rows(x, SPLITS, r.act_format, scale_rule=scale_rule).dequantize(torch.float64)
        return dy, x, ref_wgrad(dy_q, x_q, SPLITS)
    w = torch.randn(g, N, K, generator=gen)
    w_q = quantize_mx_weight(w, r.weight_format, op=op, scale_rule=scale_rule)
    a = torch.randn(m, K if op == "fwd" else N, generator=gen)
    a_q = quantize_mx(a, r.act_format if op == "fwd" else grad_format, axis=-1, scale_rule=scale_rule)
    ref = ref_fwd if op == "fwd" else ref_dgrad
    return a_q, w_q, ref(a_q.dequantize(torch.float64), w_q.dequantize(torch.float64), SPLITS)


@needs_interpreter
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("name", list(MX))
def test_mx_every_config_matches_float64(name, op, path, gen, launches):
    """triton_mxfp4 (the mxfp4 recipe) and triton_mxfp8 on both kernel paths."""
    cls, recipe = MX[name]
    r = get_recipe(recipe)
    a, b, want = _mx_operands(op, recipe, r.scale_rule, r.grad_format, gen)
    backend = cls()
    with emulated(PATHS[path]):
        problem = _problem(a, b, op, recipe, _out(op))
        assert problem.device.has("scaled_mma") == (path == "dot_scaled")
        upcast = ("upcast", "e4m3" if recipe == "mxfp8" else "e2m1")
        for config in _space(op, *(("scaled",) if path == "dot_scaled" else upcast)):
            out = _out(op)
            got = backend.run_config(problem, GroupedInputs(a, b, tuple(SPLITS), out), dataclasses.asdict(config))
            _check_launched(launches, config)
            assert got is out
            assert torch.isfinite(got).all(), f"unwritten (NaN-poisoned) outputs with {config}"
            assert sqnr_db(got, want) >= MIN_SQNR, config


@needs_interpreter
@pytest.mark.parametrize("tma", [1, 0], ids=["tma", "pointer_loads"])
def test_upcast_activation_loads_on_an_unaligned_activation(tma, gen, launches):
    """a16w4 on an activation whose base is not 16-byte aligned (a view one element into its
    storage): a ``tma`` config falls back to pointer loads (TMA cannot describe it), and
    both give the float64 result of the quantized weight."""
    m, g = sum(SPLITS), len(SPLITS)
    x = torch.randn(m * K + 1, generator=gen).to(torch.bfloat16)[1:].view(m, K)
    assert x.data_ptr() % 16 and not launch.describable(x)
    w = quantize_mx_weight(torch.randn(g, N, K, generator=gen), "e2m1", op="fwd")
    want = ref_fwd(x, w.dequantize(torch.float64), SPLITS)
    config = dataclasses.replace(launch.upcast_config(m, g, "e2m1"), tma=tma)
    problem = _problem(x, w, "fwd", "a16w4", _out("fwd"))
    out = _out("fwd")
    got = TritonMxfp4Backend().run_config(problem, GroupedInputs(x, w, tuple(SPLITS), out), dataclasses.asdict(config))
    assert launches[-1]["TMA"] is False
    assert rel_error(got, want) < FP32_OUT_TOL


@needs_interpreter
def test_switching_the_ptx_decode_reaches_a_cached_launch_plan(gen, monkeypatch):
    """The GPU tests and decode probes compare the PTX decode with the portable one by
    switching ``launch.ptx_decode`` between two launches of one shape: the launch plans are
    cached per shape, so they must key on it (the second launch otherwise reused the
    first's ``PTX`` and the comparison compared a decode with itself)."""
    seen = []

    def recording(name):
        """A launcher that records its launches' ``name`` constexpr and runs nothing."""
        return types.SimpleNamespace(launch=lambda grid, constexprs, *args: seen.append(constexprs.kwargs[name]))

    monkeypatch.setattr(launch, "_UPCAST", recording("PTX"))
    monkeypatch.setattr(launch, "_QUANTIZE_DECODE", recording("HW_E4M3"))
    m, g = sum(SPLITS), len(SPLITS)
    x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
    w = layouts.build_upcast_weight(quantize_mx_weight(torch.randn(g, N, K, generator=gen), "e2m1", op="fwd"))
    sizes = torch.tensor(SPLITS, dtype=torch.int32)
    for ptx in (False, True, False):
        monkeypatch.setattr(launch, "ptx_decode", lambda _device, ptx=ptx: ptx)
        launch.launch_upcast(x, w, sizes, _out("fwd"), g)
        launch.quantize_decode(x, "e4m3", "rceil")
    assert seen == [False, False, True, True, False, False]


def test_the_compiled_portable_decode_takes_pointer_loads():
    """TMA with the compiled portable decode gave wrong sums on the H200 (four-block steps,
    Triton 3.6): its plans drop TMA, while the PTX decode and the interpreter keep it."""
    config = launch.UpcastConfig(bm=256, bn=128, blocks=4, warps=8, stages=3, per_sm=1, tma=1)
    cpu = torch.device("cpu")

    def tma(interp: bool, ptx: bool) -> bool:
        return launch._upcast_plan(interp, ptx, 4096, 8, "e2m1", 512, 1024, True, cpu, config)[1].kwargs["TMA"]

    assert tma(interp=False, ptx=True) and tma(interp=True, ptx=False)
    assert not tma(interp=False, ptx=False)


# ---- run_config: refused configs -----------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"bm": 48}, "bm=48: a power of two"),
        ({"bn": 512}, "bn=512: a power of two from 16 to 256"),
        ({"warps": 4.0}, "warps=4.0"),
        ({"per_sm": 0}, "per_sm=0: an integer from 1 to 8"),
        ({"tile": 1}, "with the keys"),
    ],
)
@pytest.mark.parametrize("name", ["triton_grouped", *MX])
def test_a_bad_config_names_config_and_what_is_allowed(name, change, match, gen):
    """Wrong values or unknown keys; also, below, a dict of another kernel's fields."""
    x, w = torch.randn(sum(SPLITS), K, generator=gen), torch.randn(len(SPLITS), N, K, generator=gen)
    recipe = "bf16" if name == "triton_grouped" else MX[name][1]
    if name == "triton_grouped":
        x, w = x.to(torch.bfloat16), w.to(torch.bfloat16)
        backend, config = TritonGroupedBackend(), launch.grouped_configs(64, 3)[0]
    else:
        backend, config = MX[name][0](), launch.upcast_configs(64, 3)[0]
    problem = _problem(x, w, "fwd", recipe, None)
    inputs = GroupedInputs(x, w, tuple(SPLITS))
    with pytest.raises(InvalidArgumentError, match=r"^config=.*" + match):
        backend.run_config(problem, inputs, {**dataclasses.asdict(config), **change})
    other = launch.wgrad_configs()[0]  # the wgrad kernel's fields on a fwd call
    with pytest.raises(InvalidArgumentError, match=r"config=.*with the keys"):
        backend.run_config(problem, inputs, dataclasses.asdict(other))


# ---- configs(problem) --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("small", "match"),
    [(8, "small=8: 0 or a power of two from 16 to 128"), (24, "small=24: 0 or a power of two"), (32, "below bm=32")],
)
def test_a_bad_small_height_is_refused(small, match):
    """``small`` is 0 (one row height) or a power of two of at least 16 below ``bm``."""
    config = dataclasses.asdict(launch.UpcastConfig(bm=32, bn=128, blocks=4, warps=4, stages=3, per_sm=2))
    with pytest.raises(InvalidArgumentError, match=r"^config=.*" + match):
        launch.parse_config(launch.UpcastConfig, {**config, "small": small})


def test_a_stored_tuning_without_small_still_parses():
    """Tunings stored before ``small`` existed name the other fields only: one row height."""
    config = dataclasses.asdict(launch.UpcastConfig(bm=32, bn=128, blocks=4, warps=4, stages=3, per_sm=2))
    del config["small"]
    assert launch.parse_config(launch.UpcastConfig, config).small == 0


BACKENDS = {
    "triton_grouped": TritonGroupedBackend,
    "triton_mxfp4": TritonMxfp4Backend,
    "triton_mxfp8": TritonMxfp8Backend,
}
RECIPE = {"triton_grouped": "bf16", "triton_mxfp4": "mxfp4", "triton_mxfp8": "mxfp8"}


def _described(name, op, arch, m=8192, groups=32, out_dtype="float32"):
    return gg.describe_problem(
        op=op, groups=groups, m=m, n=1024, k=2048, recipe=RECIPE[name], device=arch, out_dtype=out_dtype
    )


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize("name", list(BACKENDS))
def test_no_configs_for_cpu_tensors(name, op):
    assert BACKENDS[name]().configs(_described(name, op, "cpu")) == []


def _default(name, op, arch, m, groups):
    """The tiles a plain ``run`` launches on a GPU for the problem."""
    if op == "wgrad":
        return launch.wgrad_config()
    if name == "triton_grouped":
        return launch.grouped_config(m, groups)
    if arch == "sm_90":
        return launch.upcast_config(m, groups, "e4m3" if name == "triton_mxfp8" else "e2m1")
    return launch.scaled_config(m, groups)


@pytest.mark.parametrize("mean_rows", [2, 16, 48, 128, 512])
def test_e4m3_weights_take_e2m1_tiles_four_blocks_a_step(mean_rows, monkeypatch):
    """E4M3's layout is read four blocks a step (``layouts_e4m3``): its default is E2M1's
    tile (with the stages measured for E4M3 on the decode tiles) and every tuning candidate
    has four blocks."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    m, groups = mean_rows * 32, 32
    e4m3 = BACKENDS["triton_mxfp8"]().configs(_described("triton_mxfp8", "fwd", "sm_90", m=m, groups=groups))
    assert e4m3 and all(c["blocks"] == 4 for c in e4m3)
    e2m1 = launch.upcast_config(m, groups, "e2m1")
    measured = {"stages": 4, "per_sm": 2} if e2m1.per_sm == 3 else {}  # E2M1's 3-a-SM tile lost on E4M3
    measured = {"stages": 3} if e2m1.small else measured  # the two-height tile's own measured stages
    measured = {"per_sm": 2} if e2m1.bm == 128 else measured  # two a SM won on E4M3 at 65-160 rows
    assert launch.upcast_config(m, groups, "e4m3") == dataclasses.replace(e2m1, **measured)


@pytest.mark.parametrize("mean_rows", [2, 16, 48, 128, 512])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(
    ("name", "arch"), [("triton_grouped", "sm_90"), *((n, a) for n in MX for a in ("sm_90", "sm_100"))]
)
def test_gpu_problems_get_a_small_space_with_the_default_first(name, arch, op, mean_rows, monkeypatch):
    """JSON-scalar dicts, at most MAX_CONFIGS, the default first, each within the limits and
    accepted back by ``parse_config``."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)  # as on a GPU host
    groups = 32
    offered = BACKENDS[name]().configs(_described(name, op, arch, m=mean_rows * groups, groups=groups))
    assert 4 <= len(offered) <= min(12, MAX_CONFIGS)
    assert json.loads(json.dumps(offered)) == offered
    default = _default(name, op, arch, mean_rows * groups, groups)
    assert offered[0] == dataclasses.asdict(default)
    assert len({json.dumps(c, sort_keys=True) for c in offered}) == len(offered)
    for config in offered:
        tiles = launch.parse_config(type(default), config)
        fmt = ("e4m3" if name == "triton_mxfp8" else "e2m1",) if isinstance(tiles, launch.UpcastConfig) else ()
        assert tiles.smem_bytes(*fmt) <= launch.SMEM_BYTES
        # TWO_PROGRAM_TILE is over the estimate but compile-checked to spill nothing.
        assert tiles.registers() <= max(launch.REGISTERS, default.registers()) or tiles == launch.TWO_PROGRAM_TILE


def test_sm90_wgrad_to_the_vendor_route_offers_none(monkeypatch):
    """A new bf16 wgrad result on sm_90 goes to torch._grouped_mm: no Triton tiles to tune.
    fp32 results (and accumulation) stay on the Triton kernel, and are offered configs."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    for name in MX:
        backend = BACKENDS[name]()
        assert backend.configs(_described(name, "wgrad", "sm_90", out_dtype="bfloat16")) == []
        assert backend.configs(_described(name, "wgrad", "sm_90")) == [
            dataclasses.asdict(c) for c in launch.wgrad_configs()
        ]


# ---- through the tuner -------------------------------------------------------------------


@pytest.fixture
def only_triton_grouped():
    """``triton_grouped`` as the only registered backend (so the tuner's choice is among
    its own tiles), the others restored afterwards."""
    reg = registry()
    saved = [(e.backend, e.plugin) for e in reg.entries() if e.backend.spec.name != "triton_grouped"]
    for backend, _ in saved:
        reg.unregister(backend.spec.name)
    yield
    for backend, plugin in saved:
        reg.register(backend, plugin)


@needs_interpreter
def test_the_tuner_times_the_offered_tiles_and_later_calls_use_the_choice(
    gen, monkeypatch, tmp_path, only_triton_grouped
):
    """End to end on the CPU (the hook made to offer two GPU configs for CPU tensors): the
    tuner measures the default ``run`` and both configs, and dispatch runs the stored choice."""
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(autotune, "PLAN", autotune.Plan(warmup_ms=1, rep_ms=2, min_reps=2, max_reps=4))
    monkeypatch.setattr(autotune, "CLOSE_PLAN", autotune.ClosePlan(rep_ms=2, min_blocks=2, max_blocks=2))
    offered = [dataclasses.asdict(c) for c in launch.grouped_configs(64, 3)[:2]]
    monkeypatch.setattr(launch, "offered", lambda problem, space: offered)
    x, w = torch.randn(sum(SPLITS), K, generator=gen).bfloat16(), torch.randn(3, N, K, generator=gen).bfloat16()
    gg.configure(autotune=True)
    got = gg.grouped_gemm(x, w, SPLITS, out_dtype=torch.float32)
    assert rel_error(got, ref_fwd(x, w, SPLITS)) < FP32_OUT_TOL
    decision = gg.explain(x, w, SPLITS, out_dtype=torch.float32)
    timed = [t.config for t in decision.tuning.timings]
    assert sorted(map(json.dumps, timed)) == sorted(map(json.dumps, [None, *offered]))
    assert decision.selected == "triton_grouped" and decision.config in (None, *offered)
    runs = []
    real = TritonGroupedBackend.run_config
    monkeypatch.setattr(TritonGroupedBackend, "run_config", lambda self, *a: runs.append(a[2]) or real(self, *a))
    gg.grouped_gemm(x, w, SPLITS, out_dtype=torch.float32)
    assert runs[-1] == decision.config


def test_three_programs_a_sm_cap_registers_so_they_fit(monkeypatch):
    """The E2M1 decode tile runs three programs a SM: its launch caps registers so that all
    three fit the SM's register file under any Triton (``UpcastConfig.max_registers``);
    two-program tiles are not capped, and no tuning candidate gets a cap below REGISTERS."""
    monkeypatch.setattr(launch, "interpreted", lambda: False)
    decode = launch.upcast_config(4 * 32, 32, "e2m1")
    assert (decode.bm, decode.per_sm, decode.warps) == (16, 3, 4)
    cap = decode.max_registers()
    assert cap is not None and cap % 8 == 0 and 3 * 4 * 32 * cap <= launch.REGISTER_FILE < 3 * 4 * 32 * (cap + 8)
    assert launch.upcast_config(4 * 32, 32, "e4m3").max_registers() is None  # E4M3 keeps two a SM
    assert launch.TWO_PROGRAM_TILE.max_registers() is None
    for config in launch.upcast_configs(4 * 32, 32, "e2m1"):
        assert config.max_registers() is None or config.max_registers() >= launch.REGISTERS, config
    assert any(c.per_sm == 3 for c in launch.upcast_configs(4 * 32, 32, "e2m1"))


def test_upcast_shared_memory_estimate_follows_the_weight_format():
    """E2M1 words take half the bytes of E4M3's (16 against 32 a row and 32-block), in the
    ``stages - 1`` buffers the words get; the format-less estimate is E4M3's, the upper
    bound tuning checks candidates against (benchmarks/triton_mx_compile.py holds the
    estimate to what Triton allocates)."""
    tile = launch.UpcastConfig(bm=16, bn=128, blocks=4, warps=4, stages=4, per_sm=3)
    assert tile.smem_bytes() == tile.smem_bytes("e4m3")
    assert tile.smem_bytes("e4m3") - tile.smem_bytes("e2m1") == (tile.stages - 1) * tile.bn * tile.blocks * 16
    big = launch.UpcastConfig(bm=256, bn=128, blocks=4, warps=8, stages=4, per_sm=1)
    assert big.smem_bytes("e2m1") > launch.SMEM_BYTES  # four stages of 256 rows: not offered
