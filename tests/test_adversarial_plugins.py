"""Adversarial pass over the plugin surface: backend specs and registration, the route
cache, the padded_bmm plugin's numerics, the compiled backend's cache directory and the
CLI's bad arguments. Every test here failed before the fix it comes with."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from plugin_site import install_plugin, with_import_path

import grouped_gemm as gg
from grouped_gemm.testing import ref_fwd

SPEC = dict(ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"})


@pytest.mark.parametrize("name", ["reference\n", "fine\n", "a\n"])
def test_a_backend_name_with_a_trailing_newline_is_refused(name):
    # `$` matches before a final newline: "reference\n" registered beside "reference",
    # printed the same in every table and unreachable from any order (names are stripped).
    with pytest.raises(ValueError, match="lower-case letters"):
        gg.BackendSpec(name=name, **SPEC)


@pytest.mark.parametrize("field", ["ops", "recipes", "vendors"])
def test_a_spec_that_declares_nothing_is_refused(field):
    # A backend with no ops / recipes / vendors can never run; list_backends (and
    # `grouped-gemm backends`) raised IndexError for every user once one was registered.
    with pytest.raises(ValueError, match=field):
        gg.BackendSpec(name="nothing", **{**SPEC, field: set()})


class _Zeros(gg.Backend):
    def __init__(self, name: str, priority: int) -> None:
        self.spec = gg.BackendSpec(name=name, priority=priority, **SPEC)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        return torch.zeros(problem.m, problem.n)


def test_a_spec_replaced_after_registration_does_not_break_routing(gen):
    # The registry keys a backend by the name it registered with; a plugin that later
    # assigned another spec (another name) made every call that ranked it first raise
    # UnknownBackendError (backend='renamed'), and list_backends too.
    backend = _Zeros("renamer", 10**6)
    gg.register_backend(backend)
    try:
        x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
        assert torch.equal(gg.grouped_gemm(x, w, [2, 4]), torch.zeros(6, 3))
        backend.spec = gg.BackendSpec(name="renamed", priority=10**6, **{**SPEC, "ops": {"dgrad"}})
        gg.reset_config()  # drops the cached routes: the next call decides again
        assert torch.equal(gg.grouped_gemm(x, w, [2, 4]), torch.zeros(6, 3))
        assert gg.explain(x, w, [2, 4]).selected == "renamer"
        names = [info.name for info in gg.list_backends()]
        assert "renamer" in names and "renamed" not in names
    finally:
        gg.unregister_backend("renamer")
    assert "renamer" not in [info.name for info in gg.list_backends()]


@pytest.mark.parametrize("op", ["fwd", "dgrad", "wgrad"])
@pytest.mark.parametrize(("dtype", "out_dtype"), [(torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_padded_bmm_computes_a_mixed_output_dtype_in_fp32(op, dtype, out_dtype, gen):
    # padded_bmm computed in the input dtype unless the output was fp32: fp16 products
    # beyond 65504 came back inf in a bf16 output that holds them, and a bf16 -> fp16
    # result carried bf16's 8-bit rounding (SQNR ~56 dB, under fp16's 60 dB floor).
    pytest.importorskip("grouped_gemm_padded_bmm", reason="example plugin not installed (plugins/padded_bmm)")
    from grouped_gemm.testing import output_floor_db, ref_dgrad, ref_fwd, ref_wgrad, sqnr_db

    splits, n, k = [5, 0, 11], 24, 40
    scale = 200.0 if dtype == torch.float16 else 1.0  # fp16: sums of products past 65504
    a = (torch.randn(16, n if op != "fwd" else k, generator=gen) * scale).to(dtype)
    if op == "wgrad":
        b = (torch.randn(16, k, generator=gen) * scale).to(dtype)
        expected = ref_wgrad(a, b, splits)
        call, out = gg.grouped_gemm_wgrad, torch.full((3, n, k), float("nan"), dtype=out_dtype)
    else:
        b = (torch.randn(3, n, k, generator=gen) * scale).to(dtype)
        expected = (ref_fwd if op == "fwd" else ref_dgrad)(a, b, splits)
        call = gg.grouped_gemm if op == "fwd" else gg.grouped_gemm_dgrad
        out = torch.full(tuple(expected.shape), float("nan"), dtype=out_dtype)
    with gg.use_backends("padded_bmm", strict=True):
        got = call(a, b, splits, out=out)
    assert got is out
    assert sqnr_db(got, expected) >= output_floor_db(str(out_dtype).removeprefix("torch."))


@pytest.mark.parametrize("flag", ["--warmup-ms", "--rep-ms"])
def test_bench_refuses_an_infinite_time_budget(flag, capsys):
    # `>= 0` let inf through, and the first block raised OverflowError (int(inf)) from
    # deep in the timing loop after the ceilings had been measured.
    from grouped_gemm.cli import main

    assert main(["bench", flag, "inf", "--scale", "0.01", "--no-peer", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{flag.removeprefix('--')}=inf is invalid" in err and "finite" in err


def _no_home(cls: type) -> None:
    raise RuntimeError("Could not determine home directory.")  # pathlib's words, HOME unset and no passwd entry


@pytest.mark.parametrize("home", ["~no_such_user_h16b/cache", ""])
def test_a_cache_directory_whose_home_cannot_be_found_is_a_build_reason(home, monkeypatch, capsys):
    # pathlib raised RuntimeError for "~user" of no such user (and for no home at all),
    # outside the build's OSError handler: explain called it a [plugin] bug of hip_mxfp8
    # and `grouped-gemm backends` died with a traceback in the backend's status().
    from grouped_gemm import cli
    from grouped_gemm.backends.hip_mxfp8 import build

    monkeypatch.setenv(build.CACHE_ENV, home)
    if not home:
        monkeypatch.delenv("HOME", raising=False)
        monkeypatch.setattr(build.Path, "home", classmethod(_no_home))
    build.forget()
    try:
        if build.blocker("cuda") is None:
            # A toolkit and a GPU here: decisions leave the build to the call that runs it,
            # so build as that call would; its failure is then every decision's reason.
            assert not build.ensure("sm_90", "cuda").ok
        reasons = gg.explain(op="fwd", recipe="mxfp8", groups=8, m=4096, n=1024, k=1024, device="sm_90")
        found = reasons.candidate("hip_mxfp8").reasons
        assert [r.code for r in found] == ["build"], found
        assert "cache directory unusable" in found[0].message and build.CACHE_ENV in found[0].message
        assert cli.main(["backends", "--arch", "sm_90"]) == 0
        section = capsys.readouterr().out.split("\nhip_mxfp8 ", 1)[1].split("\n\n", 1)[0]
        assert "here: unavailable: [build] cache directory unusable" in section
    finally:
        build.forget()


class _BrokenTools(_Zeros):
    """A backend whose optional CLI hooks (``status``, ``build``) are broken."""

    def status(self) -> str:
        raise RuntimeError("status exploded")

    def build(self) -> gg.Reason | None:
        raise RuntimeError("build exploded")


def test_a_plugin_with_a_broken_status_or_build_spares_the_cli(register, capsys):
    # `grouped-gemm backends` and `grouped-gemm build` call a backend's status() / build()
    # when it has them; one that raised ended either command in a traceback for every
    # backend, the built-ins included.
    from grouped_gemm import cli

    register(_BrokenTools("broken_tools", 0))
    assert cli.main(["backends"]) == 0
    listing = capsys.readouterr().out
    section = listing.split("\nbroken_tools ", 1)[1].split("\n\n", 1)[0]
    assert "status: status() raised RuntimeError: status exploded" in section
    assert "\nreference " in listing and "\ntorch_grouped_mm " in listing
    assert cli.main(["build", "broken_tools"]) == 1
    assert "broken_tools: not built: build() raised RuntimeError: build exploded" in capsys.readouterr().out


EAGER = """
import torch, grouped_gemm as gg

class Eager(gg.Backend):
    spec = gg.BackendSpec(name="eager", ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"})

    def run(self, problem, inputs):
        return torch.zeros(problem.m, problem.n)

gg.register_backend(Eager())  # at import, while grouped_gemm is loading its plugins
"""

EAGER_PROBE = """
import json, torch, grouped_gemm as gg
from grouped_gemm.testing import ref_fwd, rel_error
x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
print(json.dumps({
    "failures": [str(f) for f in gg.plugin_failures()],
    "names": sorted(b.name for b in gg.list_backends()),
    # Named: where torch has no CPU _grouped_mm (2.11), the plugin's zeros outrank reference.
    "error": rel_error(gg.grouped_gemm(x, w, [2, 4], backend="reference"), ref_fwd(x, w, [2, 4])),
}))
"""


def _entry_point_plugin(site: Path, module: str, source: str) -> dict[str, str]:
    """Install ``module`` as a ``grouped_gemm`` entry-point plugin into ``site``; the
    environment of a Python process that sees it."""
    install_plugin(site, module, {module: source})
    return with_import_path(site)


def test_a_plugin_registering_at_import_does_not_fail_the_builtins(tmp_path):
    # register_backend at import ran while the registry was loading its plugins: the same
    # thread re-entered the load and registered every plugin again, so every built-in
    # backend was reported (and logged with a traceback) as a failed plugin, "already
    # registered by" itself.
    env = _entry_point_plugin(tmp_path, "eager_plugin", EAGER)
    done = subprocess.run([sys.executable, "-c", EAGER_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["failures"] == []
    assert {"eager", "reference", "torch_grouped_mm"} <= set(report["names"])
    assert report["error"] < 1e-6


class _Slow(_Zeros):
    """Signals when its check() starts, then waits until released (a race, made certain)."""

    def __init__(self, name: str, priority: int) -> None:
        super().__init__(name, priority)
        self.checking, self.release = threading.Event(), threading.Event()

    def check(self, problem: gg.Problem) -> list[gg.Reason]:
        self.checking.set()
        self.release.wait(30)
        return []


def test_a_backend_unregistered_while_a_call_decides_does_not_fail_the_call(gen):
    # decide() ranked a snapshot of the registry, then the route looked the winner up by
    # name: unregistered in between (another thread), the call raised UnknownBackendError
    # for backend='doomed', an argument its caller never passed.
    doomed = _Slow("doomed", 10**6)
    gg.register_backend(doomed)
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    outcome: list[object] = []
    caller = threading.Thread(target=lambda: outcome.append(_attempt(gg.grouped_gemm, x, w, [2, 4])))
    caller.start()
    try:
        assert doomed.checking.wait(30)
        gg.unregister_backend("doomed")
    finally:
        doomed.release.set()
        caller.join(30)
        if "doomed" in [info.name for info in gg.list_backends()]:
            gg.unregister_backend("doomed")
    (result,) = outcome
    assert isinstance(result, torch.Tensor), result
    assert torch.allclose(result, ref_fwd(x, w, [2, 4]).float(), atol=1e-5)  # decided again without it


def _attempt(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test reports what was raised
        return exc


def test_registering_the_backend_class_instead_of_an_instance_is_refused():
    # A class has `spec`, `check` and `run` too, so it passed the protocol check: it was
    # registered, and every decision then logged check() "missing 1 required positional
    # argument" against it instead of the registration saying what was wrong.
    with pytest.raises(gg.InvalidTypeError, match=r"backend=.*_Class.*an instance") as caught:
        gg.register_backend(_Class)
    assert caught.value.argument == "backend"
    assert "class_registered" not in [info.name for info in gg.list_backends()]


class _Class(_Zeros):
    spec = gg.BackendSpec(name="class_registered", **SPEC)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"arch": None}, "arch"),
        ({"arch": 90}, "arch"),
        ({"arch": "sm_90", "multiprocessors": -5}, "multiprocessors"),
        ({"arch": "sm_90", "multiprocessors": "132"}, "multiprocessors"),
        ({"arch": "sm_90", "multiprocessors": True}, "multiprocessors"),
        ({"arch": "sm_90", "name": 7}, "name"),
    ],
)
def test_describing_a_device_with_bad_values_names_the_argument(kwargs, argument):
    # for_arch called arch.lower() on whatever it got (AttributeError for None or 90) and
    # kept any multiprocessors value, a described chip with -5 SMs that explain then used.
    with pytest.raises(gg.InvalidArgumentError) as caught:
        gg.DeviceInfo.for_arch(**kwargs)
    assert caught.value.argument == argument


def test_describing_a_device_keeps_good_values():
    info = gg.DeviceInfo.for_arch("SM_90", multiprocessors=66, name="half an H100")
    assert (info.arch, info.multiprocessors, info.name, info.detected) == ("sm_90", 66, "half an H100", False)
    assert gg.DeviceInfo.for_arch("gfx950").multiprocessors == 256


class _ReturnsOutTransposed(gg.Backend):
    """Writes nothing and returns a transposed view of the caller's ``out``."""

    spec = gg.BackendSpec(name="returns_out_t", **SPEC)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        return inputs.out.t()


def test_a_result_overlapping_out_is_a_backend_run_error(register, gen):
    # The core copies a result that is not `out` into `out`; a view of `out` itself made
    # copy_ raise torch's "refer to a single memory location" RuntimeError, unwrapped: the
    # caller learnt neither which backend nor that a backend was at fault.
    register(_ReturnsOutTransposed())
    x, w = torch.randn(4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    with pytest.raises(gg.BackendRunError, match=r"'returns_out_t'.*inputs\.out"):
        gg.grouped_gemm(x, w, [1, 3], out=torch.empty(4, 4), backend="returns_out_t")


def test_a_plugin_that_exits_at_import_does_not_end_the_process(tmp_path):
    # A plugin module that parses the command line at import (argparse exits on flags it
    # does not know) or calls sys.exit raised SystemExit out of the first grouped_gemm call,
    # which `except Exception` let through: the application exited with the plugin's code.
    env = _entry_point_plugin(tmp_path, "exiting_plugin", "import argparse\nargparse.ArgumentParser().parse_args()\n")
    done = subprocess.run(
        [sys.executable, "-c", EAGER_PROBE, "--a-flag-of-the-application"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    (failure,) = report["failures"]
    assert failure.startswith("exiting_plugin (exiting_plugin) (import): SystemExit: 2")
    assert report["error"] < 1e-6


@pytest.mark.parametrize("level", ["configure", "scope"])
def test_an_order_naming_an_unregistered_backend_names_where_the_order_was_set(level, gen):
    # The order was checked when it was set, then its backend was unregistered: the next
    # call's error said backend='gone' although that call passed no backend= at all.
    gg.register_backend(_Zeros("gone", 0))
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    if level == "configure":
        gg.configure(backends="gone")
        scope = gg.use_backends()
    else:
        scope = gg.use_backends("gone")
    with scope:
        gg.unregister_backend("gone")
        with pytest.raises(gg.UnknownBackendError) as caught:
            gg.grouped_gemm(x, w, [2, 4])
    assert caught.value.argument == ("configure(backends=)" if level == "configure" else "use_backends(order)")
    assert caught.value.value == "gone"


class _Chatty(_Zeros):
    """A check() that answers a string (not a list of Reasons) naming the problem's shape."""

    def check(self, problem: gg.Problem) -> list[gg.Reason]:
        return f"not ok at M={problem.m} N={problem.n}"  # type: ignore[return-value]


def test_a_malformed_check_answer_is_logged_once_however_it_varies(register, gen, caplog, monkeypatch):
    # The log-once key held the answer's repr: a check() answering a string with the
    # problem's shape in it logged a new warning (and grew the key set) for every decision.
    from grouped_gemm import backend_hooks

    monkeypatch.setattr(backend_hooks, "_logged_plugin_bugs", set())
    register(_Chatty("chatty", 0))
    with caplog.at_level("WARNING", logger="grouped_gemm"):
        for n in range(1, 12):
            decision = gg.explain(torch.randn(5, 4, generator=gen), torch.randn(1, n, 4, generator=gen), [5])
            assert [r.code for r in decision.candidate("chatty").reasons] == ["plugin"]
    assert sum("grouped_gemm backend chatty" in r.getMessage() for r in caplog.records) == 1


class _PriorityAttribute(_Zeros):
    priority = 50  # meant as the rank; the hook is a method (or BackendSpec(priority=...))


class _RunAttribute(_Zeros):
    run = "compute the result"


@pytest.mark.parametrize(("cls", "hook"), [(_PriorityAttribute, "priority"), (_RunAttribute, "run")])
def test_a_backend_whose_hook_is_not_callable_is_refused_at_registration(cls, hook):
    # The protocol check only asks that `check` and `run` exist, and an optional hook that
    # is not callable was skipped: `priority = 50` was silently ignored (spec.priority
    # ranked it), and a `run` string registered a backend that failed every call it won.
    with pytest.raises(gg.InvalidTypeError, match=rf"backend\.{hook}=.*a method") as caught:
        gg.register_backend(cls("not_callable", 0))
    assert caught.value.argument == f"backend.{hook}"
    assert "not_callable" not in [info.name for info in gg.list_backends()]


@pytest.mark.parametrize("flag", ["--markdown", "--plot"])
@pytest.mark.parametrize("where", ["under_a_file", "a_directory"])
def test_bench_checks_every_output_path_before_it_runs(flag, where, tmp_path, capsys):
    # Only --out was checked at the start: an unwritable --markdown or --plot raised
    # FileNotFoundError / IsADirectoryError as a traceback after the whole sweep had run.
    from grouped_gemm.cli import main

    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "table.md" if where == "under_a_file" else tmp_path
    small = ["--cases", "dsv3_down_ep8", "--scale", "0.01", "--backends", "reference", "--ops", "fwd"]
    small += ["--splits", "balanced", "--warmup-ms", "0", "--rep-ms", "1", "--min-reps", "1", "--max-reps", "1"]
    assert main(["bench", flag, str(path), *small, "--no-peer", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{flag.removeprefix('--')}={str(path)!r} is invalid" in err


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"n_multiple": 0}, "n_multiple"),  # was: ZeroDivisionError in every call's decision
        ({"recipes": "fp32"}, "recipes"),  # was: read as the set of letters f, p, 3, 2
        ({"m_multiple": 3}, "m_multiple"),
        ({"name": "Not A Name"}, "name"),
    ],
)
def test_a_spec_copied_with_unvalidated_updates_is_refused(update, field, gen):
    # model_copy(update=...) skips pydantic's validation; the registry took such a spec as is.
    backend = _Zeros("copied", 0)
    backend.spec = backend.spec.model_copy(update=update)
    with pytest.raises(gg.InvalidArgumentError, match=rf"backend\.spec\.{field}=") as caught:
        gg.register_backend(backend)
    assert caught.value.argument == f"backend.spec.{field}"
    assert backend.spec.name not in [info.name for info in gg.list_backends()]
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    torch.testing.assert_close(gg.grouped_gemm(x, w, [2, 4]).double(), ref_fwd(x, w, [2, 4]))


@pytest.mark.parametrize(
    ("field", "value"), [("priority", True), ("priority", "90"), ("m_multiple", True), ("min_k", 32.0)]
)
def test_a_spec_number_of_another_type_is_refused(field, value):
    # Pydantic's lax mode took priority=True as 1 and "90" as 90: a bool priority ranked silently.
    with pytest.raises(ValueError, match=rf"{field}\n.*valid integer"):
        gg.BackendSpec(name="typed", **SPEC, **{field: value})


class _Exits(_Zeros):
    def __init__(self, hook: str) -> None:
        super().__init__("exits", 10**6)
        setattr(self, hook, lambda problem: sys.exit(f"{hook} gave up"))


@pytest.mark.parametrize("hook", ["check", "priority", "prepare"])
def test_a_hook_that_calls_sys_exit_is_a_reason_not_the_end_of_the_process(hook, register, gen):
    # Hooks were guarded by `except Exception`: SystemExit escaped from gg.grouped_gemm and
    # exited the application, although plugin imports already counted it as the plugin's failure.
    register(_Exits(hook))
    x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
    torch.testing.assert_close(gg.grouped_gemm(x, w, [2, 4]).double(), ref_fwd(x, w, [2, 4]))
    candidate = gg.explain(x, w, [2, 4]).candidate("exits")
    assert [str(r) for r in candidate.reasons] == [f"[plugin] {hook}() raised SystemExit: {hook} gave up"]


class _ExitsInRun(gg.Backend):
    spec = gg.BackendSpec(name="exits_in_run", priority=10**6, **SPEC)

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        sys.exit("exits_in_run gave up")


def test_sys_exit_in_run_is_that_backends_error(gen):
    # The dispatcher wrapped only Exception from run(): a backend calling sys.exit ended the
    # caller's process, where check() / priority() / prepare() already report it as theirs.
    gg.register_backend(_ExitsInRun())
    try:
        x, w = torch.randn(6, 4, generator=gen), torch.randn(2, 3, 4, generator=gen)
        with pytest.raises(gg.BackendRunError, match=r"exits_in_run.*SystemExit.*gave up") as raised:
            gg.grouped_gemm(x, w, [2, 4])
        assert isinstance(raised.value.__cause__, SystemExit)
        torch.testing.assert_close(gg.grouped_gemm(x, w, [2, 4], backend="reference").double(), ref_fwd(x, w, [2, 4]))
    finally:
        gg.unregister_backend("exits_in_run")


def _dense_result(inputs: gg.GroupedInputs) -> torch.Tensor:
    return ref_fwd(inputs.a, inputs.b, inputs.splits_list()).float()


#: Results of the right shape, dtype and device in a layout the caller cannot use as a
#: plain tensor (each built from the right numbers).
_NOT_STRIDED = {
    "nested": lambda t: torch.nested.nested_tensor(list(t)),
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.to_sparse_csr(),
    "mkldnn": lambda t: t.to_mkldnn(),
}


class _ReturnsLayout(gg.Backend):
    """Returns the right numbers in another layout (``_NOT_STRIDED[layout]``)."""

    def __init__(self, layout: str) -> None:
        self.spec = gg.BackendSpec(name=f"returns_{layout}", **SPEC)
        self.layout = layout

    def run(self, problem: gg.Problem, inputs: gg.GroupedInputs) -> torch.Tensor:
        return _NOT_STRIDED[self.layout](_dense_result(inputs))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors", "ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("layout", list(_NOT_STRIDED))
def test_a_result_in_another_layout_is_that_backends_error_with_out(layout, register, gen):
    """With ``out=``: a nested result raised torch's "NestedTensorImpl doesn't support
    sizes" out of the result check, naming no backend."""
    register(_ReturnsLayout(layout))
    x, w = torch.randn(4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    with pytest.raises(gg.BackendRunError, match=rf"'returns_{layout}'.*strided"):
        gg.grouped_gemm(x, w, [1, 3], out=torch.empty(4, 4), backend=f"returns_{layout}")


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors", "ignore:Sparse CSR tensor support")
@pytest.mark.parametrize("layout", list(_NOT_STRIDED))
def test_a_result_in_another_layout_is_that_backends_error(layout, register, gen):
    """Without ``out=``: the dispatcher's fast path read a nested result's shape (torch's
    error, no backend named) and handed a sparse or mkldnn result to the caller."""
    register(_ReturnsLayout(layout))
    x, w = torch.randn(4, 4, generator=gen), torch.randn(2, 4, 4, generator=gen)
    with pytest.raises(gg.BackendRunError, match=rf"'returns_{layout}'.*strided"):
        gg.grouped_gemm(x, w, [1, 3], backend=f"returns_{layout}")
