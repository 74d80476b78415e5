"""grouped-gemm check: floors, problem coverage, and that wrong backends fail it."""

from __future__ import annotations

import math

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import check, testing
from grouped_gemm.cli import main


def test_same_function_only_when_the_backend_quantizes_nothing_more():
    plain, mxfp8, a16w4 = "bf16", "mxfp8", "a16w4"
    assert testing.same_function(plain, "wgrad", prequantized_weight=False)
    assert not testing.same_function(a16w4, "fwd", prequantized_weight=False)
    assert testing.same_function(a16w4, "fwd", prequantized_weight=True)
    assert testing.same_function(a16w4, "wgrad", prequantized_weight=False)
    assert not testing.same_function(mxfp8, "dgrad", prequantized_weight=True)


def test_floors_follow_output_rounding():
    assert testing.output_floor_db("float32") == 60.0
    assert testing.output_floor_db("float16") == 60.0
    assert testing.output_floor_db("bfloat16") == pytest.approx(20 * 8 * math.log10(2) - 3)  # 45.2 dB
    assert testing.sqnr_floor("bfloat16", "mxfp8", same_function=True) == pytest.approx(45.16, abs=0.01)
    assert testing.sqnr_floor("float32", "mxfp8", same_function=False) == 25.0
    assert testing.sqnr_floor("bfloat16", "a16w4", same_function=False) == 12.0


@pytest.mark.parametrize(("dtype", "bits"), [(torch.bfloat16, 8), (torch.float16, 11)])
def test_rounding_alone_stays_above_the_bound_the_floor_is_built_on(dtype, bits, gen):
    exact = torch.randn(4096, dtype=torch.float64, generator=gen) * torch.logspace(-3, 3, 4096, dtype=torch.float64)
    rounded = exact.to(dtype)
    sqnr = gg.testing.sqnr_db(rounded, exact)
    assert sqnr >= 20 * bits * math.log10(2) >= testing.output_floor_db(str(dtype).removeprefix("torch."))


def test_scenarios_cover_the_edge_cases():
    by_name = {s.name: s for s in check.SCENARIOS}
    assert by_name["all_empty"].m == 0 and by_name["single_group"].groups == 1
    assert by_name["empty_groups"].splits[0] == 0 and by_name["empty_groups"].splits[-1] == 0
    skewed = by_name["skewed"].splits
    assert max(skewed) > 2 * sum(skewed) / len(skewed) and len(set(skewed)) > 2
    unaligned = by_name["unaligned"]
    assert unaligned.n % 32 and unaligned.k % 32 and any(s % 8 for s in unaligned.splits)
    assert set(check.VARIANTS) == {"fwd", "dgrad", "wgrad", "wgrad+acc", "fwd+mxw", "dgrad+mxw"}


def test_reference_passes_every_plain_recipe_and_op(capsys):
    assert main(["check", "--backends", "reference", "--recipes", "bf16,fp16,fp32"]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines() if line.startswith("reference ")]
    assert len(lines) == 3 * 4 + 2 * 3  # bf16/fp16: 3 ops x 2 out dtypes + acc; fp32: 4 variants
    assert all(line[-1] == "pass" and int(line[4]) == len(check.SCENARIOS) for line in lines)
    assert {line[1] for line in lines} == {"fwd", "dgrad", "wgrad", "wgrad+acc"}
    assert "grouped-gemm check: all 108 runs passed" in out


class _Broken(gg.Backend):
    """A backend with one deliberate bug per op, to prove check catches each kind."""

    spec = gg.BackendSpec(
        name="check_test_broken",
        ops=frozenset({"fwd", "dgrad", "wgrad"}),
        recipes=frozenset({"bf16", "fp32"}),
        vendors=frozenset({"cpu"}),
    )

    def run(self, problem, inputs):
        splits = inputs.splits_list()
        a, b, out = inputs.a, inputs.b, inputs.out
        starts = [sum(splits[:g]) for g in range(len(splits))]
        if problem.op == "wgrad":  # bug: empty groups keep whatever the buffer held
            for g, rows in enumerate(splits):
                if rows:
                    grad = a[starts[g] : starts[g] + rows].float().T @ b[starts[g] : starts[g] + rows].float()
                    out[g] = grad + out[g].float() if problem.accumulate else grad
            return out
        for g, rows in enumerate(splits):
            if g == len(splits) - 1 and problem.op == "fwd":
                break  # bug: the last group's rows are never written
            w = b[g].float()
            out[starts[g] : starts[g] + rows] = a[starts[g] : starts[g] + rows].float() @ (
                w.T if problem.op == "fwd" else w
            )
        if problem.op == "dgrad":  # bug: computed at bf16 precision twice over
            return out.to(torch.float8_e4m3fn).to(out.dtype)
        return out


class _Raising(_Broken):
    spec = _Broken.spec.model_copy(update={"name": "check_test_raising", "ops": frozenset({"fwd"})})

    def run(self, problem, inputs):
        raise RuntimeError("kernel exploded")


@pytest.fixture
def broken():
    for b in (_Broken(), _Raising()):
        gg.register_backend(b)
    yield
    for name in ("check_test_broken", "check_test_raising"):
        gg.unregister_backend(name)


def test_wrong_backends_fail_with_their_sqnr_and_exit_code(capsys, broken):
    code = main(["check", "--backends", "check_test_broken,check_test_raising", "--recipes", "bf16"])
    out = capsys.readouterr().out
    assert code == 1
    assert "grouped-gemm check: FAILED" in out.splitlines()[-1]
    fails = [line for line in out.splitlines() if line.lstrip().startswith(("FAIL ", "ERROR"))]
    fwd = [f for f in fails if "check_test_broken fwd" in f]
    # Every scenario whose last group has rows leaves NaN rows: -inf SQNR, not a pass.
    assert fwd and all("SQNR -inf dB" in f for f in fwd)
    assert not any("check_test_broken fwd bf16 empty_groups" in f for f in fails)  # its last group is empty
    assert any("check_test_broken dgrad" in f for f in fails)  # e4m3 rounding: about 30 dB < 45.2
    assert any("check_test_broken wgrad bf16 empty_groups" in f for f in fails)  # NaN poison left in empty groups
    assert any("check_test_broken wgrad bf16 all_empty" in f for f in fails)
    assert not any("check_test_broken wgrad bf16 aligned" in f for f in fails)  # no empty group: correct
    raising = [f for f in fails if "check_test_raising" in f]
    assert raising and all("ERROR" in f and "kernel exploded" in f for f in raising)


def test_verbose_shows_why_a_backend_was_skipped(capsys, broken):
    assert main(["check", "--backends", "check_test_raising", "--recipes", "fp32", "--ops", "dgrad", "-v"]) == 1
    out = capsys.readouterr().out
    assert "check_test_raising: not runnable on any check problem here: [op] op dgrad not supported" in out
    assert "skip  check_test_raising dgrad fp32 aligned out=float32" in out
    assert "FAILED, no backend ran any problem" in out


def test_bad_arguments(capsys):
    assert main(["check", "--backends", "ghost"]) == 2
    assert "backends='ghost' is invalid" in capsys.readouterr().err
    assert main(["check", "--ops", "fwd,bwd"]) == 2
    assert "ops='bwd' is invalid: one of fwd, dgrad, wgrad, wgrad+acc" in capsys.readouterr().err
    assert main(["check", "--recipes", "int8"]) == 2
    assert "recipes='int8'" in capsys.readouterr().err


@pytest.mark.gpu
def test_check_on_the_gpu_passes(capsys):
    assert main(["check", "--device", "cuda", "--recipes", "bf16,fp32"]) == 0
    assert "grouped-gemm check: all" in capsys.readouterr().out
