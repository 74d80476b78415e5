"""Regressions of issue 12, one section per class: silent wrong answers and crash-class
failures found by an adversarial run. Each test failed before its fix."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from plugin_site import install_plugin, run_python

import grouped_gemm as gg
from grouped_gemm import dispatch
from grouped_gemm.testing import poison, ref_dgrad, ref_fwd, ref_wgrad, rel_error
from grouped_gemm.validation import assert_device_splits

# 1. A third-party duplicate of a built-in name always loses, even with trylast=True.


@pytest.mark.slow
def test_trylast_plugin_cannot_replace_a_builtin(tmp_path):
    install_plugin(
        tmp_path,
        "shadow",
        {
            "shadow": """
        import torch
        import grouped_gemm as gg

        class Shadow(gg.Backend):
            spec = gg.BackendSpec(name="reference", ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"})

            def run(self, problem, inputs):
                return torch.zeros(problem.m, problem.n)

        @gg.hookimpl(trylast=True)
        def grouped_gemm_backends():
            return [Shadow()]
        """
        },
    )
    done = run_python(
        tmp_path,
        """
        import torch, grouped_gemm as gg
        from grouped_gemm.testing import ref_fwd, rel_error
        x, w = torch.randn(6, 4, dtype=torch.float64).float(), torch.randn(2, 3, 4)
        owner = {b.name: b.plugin for b in gg.list_backends()}["reference"]
        err = rel_error(gg.grouped_gemm(x, w, [2, 4], backend="reference"), ref_fwd(x, w, [2, 4]))
        print(owner, err < 1e-6, [f.plugin + "|" + f.error for f in gg.plugin_failures()])
        """,
    )
    assert done.returncode == 0, done.stderr
    owner, correct, failures = done.stdout.split(" ", 2)
    assert owner == "grouped_gemm.backends.reference"
    assert correct == "True"
    assert "shadow" in failures and "already registered" in failures


# 2. Flags set in code are bools; the rest is rejected, naming the rule.


@pytest.mark.parametrize("field", ["strict", "warn_fallback", "check_device_splits", "debug"])
@pytest.mark.parametrize("value", ["no", "false", "off", 0, 1, "yes", None])
def test_configure_flags_take_bools_only(field, value):
    with pytest.raises(gg.ConfigError, match=rf"{field}=.*True or False \(a bool"):
        gg.configure(**{field: value})
    assert getattr(gg.settings(), field) is False


def test_configure_stores_real_bools():
    assert gg.configure(strict=True).strict is True
    assert type(gg.settings().strict) is bool


def test_equals_in_an_order_names_the_colon_mistake():
    with pytest.raises(gg.ConfigError, match=r"uses '=': .*separated by ':', e.g. 'bf16:torch_grouped_mm'"):
        gg.configure(backends="bf16=torch_grouped_mm")


@pytest.mark.slow
def test_log_level_env_shows_records_on_stderr():
    code = "import torch, grouped_gemm as gg; gg.grouped_gemm(torch.randn(4, 2), torch.randn(2, 3, 2), [1, 3])"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "GROUPED_GEMM_LOG_LEVEL": "DEBUG"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "DEBUG grouped_gemm: grouped_gemm decision" in done.stderr


# 3. grouped_linear snapshots m_splits at forward.


@pytest.mark.parametrize("kind", ["list_reverse", "list_item", "cpu_tensor", "layer"])
def test_backward_uses_the_splits_of_forward(kind, gen):
    x = torch.randn(10, 8, generator=gen, requires_grad=True)
    w = torch.randn(3, 6, 8, generator=gen, requires_grad=True)
    splits = torch.tensor([3, 0, 7]) if kind == "cpu_tensor" else [3, 0, 7]
    if kind == "layer":
        layer = gg.GroupedLinear(3, 8, 6, bias=False, recipe="fp32")
        with torch.no_grad():
            layer.weight.copy_(w)
        y = layer(x, splits)
        w = layer.weight
    else:
        y = gg.grouped_linear(x, w, splits)
    dy = torch.randn(10, 6, generator=gen)
    if kind == "cpu_tensor":
        splits.copy_(torch.tensor([7, 0, 3]))
    elif kind == "list_item":
        splits[0], splits[2] = 7, 3
    else:
        splits.reverse()
    y.backward(dy)
    assert rel_error(x.grad, ref_dgrad(dy, w.detach(), [3, 0, 7])) < 1e-6
    assert rel_error(w.grad, ref_wgrad(dy, x.detach(), [3, 0, 7])) < 1e-6


# 4. The core checks what run() returns.


def _bad_return(kind: str):
    def run(problem, inputs):
        m, n = problem.m, problem.n
        return {
            "none": None,
            "shape": torch.zeros(m, n + 1),
            "dtype": torch.zeros(m, n, dtype=torch.float64),
            "type": [[0.0] * n] * m,
            "broadcast": torch.zeros(1, n),
            "requires_grad": torch.zeros(m, n, requires_grad=True),
        }[kind]

    return run


@pytest.mark.parametrize("kind", ["none", "shape", "dtype", "type", "broadcast", "requires_grad"])
@pytest.mark.parametrize("with_out", [False, True])
def test_bad_results_raise_naming_the_backend(kind, with_out, make_backend):
    backend = make_backend("liar", priority=10**6)
    backend.run = _bad_return(kind)
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    out = poison(torch.empty(6, 3)) if with_out else None
    with pytest.raises(gg.BackendRunError, match=r"backend 'liar' failed.*run\(\) returned"):
        gg.grouped_gemm(x, w, [2, 4], out=out)


def test_accumulate_must_write_into_out(make_backend):
    backend = make_backend("copier", ops=frozenset({"wgrad"}), priority=10**6)
    backend.run = lambda problem, inputs: torch.zeros(problem.groups, problem.n, problem.k)
    dy, x = torch.randn(6, 3), torch.randn(6, 4)
    with pytest.raises(gg.BackendRunError, match=r"must add into inputs\.out"):
        gg.grouped_gemm_wgrad(dy, x, [2, 4], out=torch.zeros(2, 3, 4), accumulate=True)


# 5. Immutable splits; input mutation detected in debug mode.


def test_backends_get_immutable_splits(make_backend):
    backend = make_backend("reverser", priority=10**6)
    seen = []

    def run(problem, inputs):
        seen.append(type(inputs.m_splits))
        inputs.m_splits.reverse()

    backend.run = run
    splits = [2, 4]
    with pytest.raises(gg.BackendRunError, match="reverser"):
        gg.grouped_gemm(torch.randn(6, 4), torch.randn(2, 3, 4), splits)
    assert seen == [tuple] and splits == [2, 4]


@pytest.mark.parametrize("how", ["configure", "scope", "env"])
def test_debug_mode_detects_inputs_modified_in_place(how, make_backend, monkeypatch):
    backend = make_backend("scribbler", priority=10**6)
    inner = backend.run

    def run(problem, inputs):
        inputs.a.mul_(2)
        return inner(problem, inputs)

    backend.run = run
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    gg.grouped_gemm(x, w, [2, 4])  # not in debug mode: unnoticed (the check costs time)
    if how == "env":
        monkeypatch.setenv("GROUPED_GEMM_DEBUG", "1")
        gg.reset_config()
    elif how == "configure":
        gg.configure(debug=True)
    with pytest.raises(gg.BackendRunError, match=r"scribbler.*modified its input a in place"):
        if how == "scope":
            with gg.use_backends(debug=True):
                gg.grouped_gemm(x, w, [2, 4])
        else:
            gg.grouped_gemm(x, w, [2, 4])


# 6. out= overlapping an input, or repeated wgrad buffers.


def test_out_overlapping_an_input_is_rejected():
    w = torch.randn(2, 3, 4)
    x = torch.randn(6, 4)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*shares no memory with the input w"):
        gg.grouped_gemm(torch.randn(4, 4), w, [2, 2], out=w.view(-1)[:12].view(4, 3), backend="reference")
    buf = torch.randn(6, 4)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*input dy"):
        gg.grouped_gemm_dgrad(buf[:, :3], w, [2, 4], out=buf)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*input x"):
        gg.grouped_gemm(x, torch.randn(2, 4, 4), [2, 4], out=x)


@pytest.mark.parametrize("backend", ["reference", "torch_grouped_mm"])
def test_repeated_wgrad_out_buffers_are_rejected(backend):
    buf = torch.zeros(3, 4)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*out\[0\] and out\[1\] share memory"):
        gg.grouped_gemm_wgrad(torch.randn(6, 3), torch.randn(6, 4), [2, 4], out=[buf] * 2, backend=backend)
    whole = torch.zeros(2, 3, 4)
    with pytest.raises(gg.InvalidArgumentError, match=r"^out=.*share memory"):
        gg.grouped_gemm_wgrad(
            torch.randn(6, 3), torch.randn(6, 4), [2, 4], out=[whole[0], whole.view(-1)[6:18].view(3, 4)]
        )
    got = gg.grouped_gemm_wgrad(torch.ones(6, 3), torch.ones(6, 4), [2, 4], out=list(whole), backend=backend)
    assert [float(t[0, 0]) for t in got] == [2.0, 4.0]


# 7. Malformed plugin answers: a reason for that backend only, logged once with traceback.


@pytest.mark.parametrize(
    ("answer", "expect"),
    [
        (lambda p: ["nope"], "returned 'nope' (str) among its reasons"),
        (lambda p: "nope", "returned 'nope' (str), not a list"),
        (lambda p: None, "returned None (NoneType), not a list"),
        (lambda p: 1 / 0, "raised ZeroDivisionError"),
    ],
)
def test_malformed_check_answers_are_reasons(answer, expect, make_backend, caplog):
    backend = make_backend("weird", priority=10**6)
    backend.check = answer
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    with caplog.at_level(logging.WARNING, logger="grouped_gemm"):
        for _ in range(3):
            gg.reset_config()  # a fresh decision each time
            out = gg.grouped_gemm(x, w, [2, 4])
    assert rel_error(out, ref_fwd(x, w, [2, 4])) < 1e-6
    reasons = gg.explain(x, w, [2, 4]).candidate("weird").reasons
    assert [r.code for r in reasons] == ["plugin"] and expect in reasons[0].message
    logged = [r for r in caplog.records if "weird" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.WARNING
    assert ("ZeroDivisionError" in expect) == (logged[0].exc_info is not None)


@pytest.mark.parametrize("answer", [lambda p: "high", lambda p: 1.5, lambda p: True, lambda p: [][1]])
def test_malformed_priority_is_a_reason(answer, make_backend):
    backend = make_backend("fickle", priority=10**6)
    backend.priority = answer
    assert [r.code for r in gg.explain(groups=2, m=6, n=3, k=4, recipe="fp32").candidate("fickle").reasons] == [
        "plugin"
    ]


# 8. The functional ops are not differentiable: one error on every backend.


@pytest.mark.parametrize("backend", ["reference", "torch_grouped_mm", "padded_bmm", "triton_mxfp4"])
@pytest.mark.parametrize("which", ["x", "w"])
@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
def test_functional_ops_refuse_tensors_that_require_grad(backend, which, op):
    """One behaviour on every backend that runs on CPU: a clear error (checked before
    dispatch), and under torch.no_grad() the same numbers as the reference backend."""
    if backend not in {b.name for b in gg.list_backends()}:
        pytest.skip(f"{backend} is not installed")
    recipe, dtype = ("mxfp4", torch.bfloat16) if backend == "triton_mxfp4" else ("fp32", torch.float32)
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(64, 64 if op == "fwd" else 32, generator=gen).to(dtype)
    b = (
        torch.randn(64, 64, generator=gen).to(dtype)
        if op == "wgrad"
        else torch.randn(2, 32, 64, generator=gen).to(dtype)
    )
    fn = {"fwd": gg.grouped_gemm, "dgrad": gg.grouped_gemm_dgrad, "wgrad": gg.grouped_gemm_wgrad}[op]
    (a if which == "x" else b).requires_grad_()
    name = {"x": "x" if op == "fwd" else "dy", "w": "w" if op != "wgrad" else "x"}[which]
    with pytest.raises(gg.InvalidArgumentError, match=rf"^{name}=.*not differentiable.*gg.grouped_linear"):
        fn(a, b, [32, 32], recipe=recipe, backend=backend)
    with torch.no_grad(), gg.use_backends(strict=True):
        got = fn(a, b, [32, 32], recipe=recipe, backend=backend)
        want = fn(a, b, [32, 32], recipe=recipe, backend="reference")
    assert not got.requires_grad
    assert rel_error(got, want) < (2e-2 if backend == "triton_mxfp4" else 1e-6)


# 10. fork() while a lock is held: the child still dispatches.

FORK_LOCKS = ["dispatch", "device", "registry", "config"]

#: One process takes each lock named in argv in turn: holds it in a thread, forks, and
#: prints "<lock> child <exit status>" (or "<lock> child hung"). The process is left as it
#: was after each lock (the thread joined, the child reaped), so each lock is forked under
#: as a process of its own would have been (one startup instead of four: ~4 s each).
FORK = """
import os, sys, threading, time, torch
torch.set_num_threads(1)  # torch's own OpenMP pool is not fork-safe; grouped_gemm's locks must be
import grouped_gemm as gg
from grouped_gemm import config, device, dispatch, registry
from grouped_gemm.testing import ref_fwd, rel_error
w = torch.randn(4, 16, 32)
gg.grouped_gemm(torch.randn(64, 32), w, [16] * 4)
locks = {"dispatch": dispatch.DISPATCHER._lock, "device": device._detect_lock,
         "registry": registry._registry._lock, "config": config._state.lock}
for name in sys.argv[1:]:
    lock = locks[name]
    held, release = threading.Event(), threading.Event()
    def hold(lock=lock, held=held, release=release):
        with lock:
            held.set()
            release.wait()
    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        gg.reset_config()
        device._detected.clear()
        x = torch.randn(30, 32)
        ok = rel_error(gg.grouped_gemm(x, w, [10, 5, 5, 10]), ref_fwd(x, w, [10, 5, 5, 10])) < 1e-6
        os._exit(0 if ok else 3)
    release.set()
    t.join()
    deadline = time.time() + 30
    while time.time() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print(name, "child", os.waitstatus_to_exitcode(status), flush=True)
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print(name, "child hung", flush=True)
"""


@pytest.fixture(scope="module")
def forked_under_locks() -> tuple[dict[str, str], str]:
    """({lock: what its child did}, the process's output) of one run of ``FORK``."""
    done = subprocess.run([sys.executable, "-c", FORK, *FORK_LOCKS], capture_output=True, text=True, timeout=300)
    found = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.split(" ", 1)[0] in FORK_LOCKS)
    return found, done.stdout + done.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
@pytest.mark.parametrize("lock", FORK_LOCKS)
def test_fork_while_a_lock_is_held(lock, forked_under_locks):
    found, output = forked_under_locks
    assert found.get(lock) == "child 0", output


# 11. Clear errors.


@pytest.mark.parametrize("block_size", [32.0, "32", True, 33, None])
def test_bad_block_sizes(block_size):
    with pytest.raises(gg.GroupedGemmError, match=r"^block_size="):
        gg.mx.quantize_mx(torch.randn(4, 64), "e4m3", block_size=block_size)


def test_numpy_integer_block_size_and_splits_are_accepted(gen):
    t = torch.randn(64, 32, generator=gen)
    q = gg.mx.quantize_mx(t, "e4m3", block_size=np.int64(32))
    assert q.block_size == 32 and type(q.block_size) is int
    rows = gg.mx.quantize_mx_rows(t, [np.int64(30), np.int32(34)], "e4m3")
    assert rows.padded_splits == [32, 64]
    assert gg.grouped_gemm(t, torch.randn(2, 4, 32), [np.int64(30), np.int32(34)]).shape == (64, 4)


@pytest.mark.parametrize("layout", ["coo", "csr"])
@pytest.mark.parametrize("which", ["x", "w"])
def test_sparse_operands(layout, which):
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    if which == "x":
        x = x.to_sparse() if layout == "coo" else x.to_sparse_csr()
    else:
        w = w.to_sparse() if layout == "coo" else w.to_sparse(layout=torch.sparse_csr, dense_dim=1)
    with pytest.raises(gg.InvalidArgumentError, match=rf"^{which}=.*dense \(strided\) tensor"):
        gg.grouped_gemm(x, w, [2, 4])


def test_meta_splits_and_operands():
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    with pytest.raises(gg.GroupedGemmError, match=r"^m_splits="):
        gg.grouped_gemm(x, w, torch.tensor([2, 4], device="meta"))
    with pytest.raises(gg.GroupedGemmError, match=r"^x=.*meta"):
        gg.grouped_gemm(x.to("meta"), w.to("meta"), torch.tensor([2, 4], device="meta"))
    with pytest.raises(gg.GroupedGemmError, match=r"^m_splits=.*meta"):
        gg.mx.quantize_mx_rows(torch.randn(64, 32), torch.tensor([32, 32], device="meta"), "e4m3")


def test_bias_of_the_wrong_shape_fails_before_the_gemm(make_backend):
    spy = make_backend("spy", priority=10**6)
    with pytest.raises(gg.ShapeError, match=r"^bias=.*shape \(G, N\)=\(2, 3\)"):
        gg.grouped_linear(torch.randn(6, 4), torch.randn(2, 3, 4), [2, 4], bias=torch.randn(2, 4))
    layer = gg.GroupedLinear(2, 4, 3, recipe="fp32")
    layer.bias = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(gg.ShapeError, match=r"^bias="):
        layer(torch.randn(6, 4), [2, 4])
    assert spy.runs == 0


@pytest.mark.parametrize("item", [torch.tensor(True), torch.tensor(2.0), torch.tensor([1, 1]), np.bool_(True)])
def test_bad_items_inside_a_splits_list(item):
    with pytest.raises(gg.SplitsError, match=r"^m_splits=.*integers; m_splits\[0\]"):
        gg.grouped_gemm(torch.randn(6, 4), torch.randn(2, 3, 4), [item, 4])


def test_described_problem_with_huge_g():
    with pytest.raises(gg.InvalidArgumentError, match=r"^groups=1099511627776 .*at most"):
        gg.explain(groups=2**40, m=100, n=8, k=8)


def test_bench_out_unwritable_fails_at_start(tmp_path):
    from grouped_gemm.cli import main

    started = time.perf_counter()
    assert main(["bench", "--out", str(tmp_path / "missing" / "x.json")]) != 0
    assert time.perf_counter() - started < 10


# 12. Bounded caches; configure() drops stale routes.


def test_call_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "ROUTE_CACHE_SIZE", 8)
    w = torch.randn(1, 2, 3)
    for n in range(1, 30):
        gg.grouped_gemm(torch.randn(1, n), torch.randn(1, 2, n), [1])
        with pytest.raises(gg.UnknownBackendError):
            gg.grouped_gemm(torch.randn(1, 3), w, [1], backend=f"nosuch{n}")
        gg.grouped_gemm(torch.randn(1, 3), w, [1], backend={"fp32": ["reference"]})  # a mapping: unhashable
    assert len(dispatch.DISPATCHER._cache) <= 8
    assert gg.dispatch_stats()["calls"] == 58  # evicted routes keep their counts


def test_configure_drops_cached_routes():
    gg.grouped_gemm(torch.randn(6, 4), torch.randn(2, 3, 4), [2, 4])
    assert dispatch.DISPATCHER._cache
    gg.configure(strict=False)
    assert not dispatch.DISPATCHER._cache


# 13. The device-splits check cannot be fooled by int64 overflow.


def test_device_splits_check_is_overflow_proof():
    splits = torch.tensor([2**63 - 1, 2**63 - 1, 12])
    assert int(splits.sum()) == 10  # the wrap-around the old check trusted
    with pytest.raises(RuntimeError, match="outside"):
        assert_device_splits(splits, 10, "x")
    assert_device_splits(torch.tensor([3, 0, 7]), 10, "x")


# Minor: Recipe copies are validated.


def test_bogus_recipe_copy_is_rejected():
    bogus = gg.get_recipe("mxfp8").model_copy(update={"scale_rule": "bogus"})
    with pytest.raises(gg.UnknownRecipeError, match=r"^recipe.scale_rule='bogus'"):
        gg.grouped_gemm(torch.randn(6, 32), torch.randn(2, 3, 32), [2, 4], recipe=bogus)
