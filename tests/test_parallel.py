"""ExpertParallelMoE on groups of 2 and 4 CPU processes (gloo, localhost) against the single-process layer.

One job starts 4 worker processes (forked from this file, run as a script); 4-rank cases
use the default group, 2-rank cases two groups of 2 at once; ``torchrun`` runs the example on 2
processes. Every worker
builds the single-process layer and runs it on the whole batch *before* joining the
process group (so it is a plain local layer), then runs the expert-parallel layer with
the same weights on its own slice of the tokens and writes the relative errors of the
output, the input gradient and every weight gradient to a JSON file. Routing is steered
by the router weights: "banned" experts get a logit far below the others for every
token, so some ranks receive no rows for some or all of their experts. Every collective
has the process group's timeout and every job a wall-clock limit, so a failure cannot hang.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from gloo_ranks import gloo_env
from moe_reference import dense_float64

import grouped_gemm as gg
from grouped_gemm.parallel import ExpertParallelMoE

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE_TIMEOUT_S = 30
JOB_TIMEOUT_S = 50
FAILURE_TIMEOUT_S = 2
WORLD = 4
TOLERANCE = 1e-5

# Per case: tokens on each rank, experts no token picks, ranks whose x needs no gradient.
# ``empty``: (rank, local expert) pairs that must receive no rows, checked from the routing.
CASES: dict[str, dict] = {
    # rank 1 has no tokens and its experts (2, 3) receive nothing: it only waits and relays.
    "w2_rank1_idle": dict(
        world=2, experts=4, top_k=2, tokens=[13, 0], banned=[2, 3], activation="relu", empty=[(1, 0), (1, 1)]
    ),
    # uneven tokens; expert 1 (rank 0) receives nothing; x on rank 1 needs no gradient.
    "w2_uneven": dict(
        world=2, experts=4, top_k=2, tokens=[5, 11], banned=[1], activation="swiglu", no_input_grad=[1], empty=[(0, 1)]
    ),
    "w2_no_tokens": dict(
        world=2, experts=2, top_k=1, tokens=[0, 0], banned=[], activation="relu", empty=[(0, 0), (1, 0)]
    ),
    # rank 1 has no tokens and receives nothing; rank 3 receives nothing for expert 6; biases.
    "w4_skewed": dict(
        world=4,
        experts=8,
        top_k=3,
        tokens=[9, 0, 17, 4],
        banned=[2, 3, 6],
        activation="gelu",
        bias=True,
        empty=[(1, 0), (1, 1), (3, 0)],
    ),
    # one expert per rank; rank 2 has no tokens and its expert receives nothing. top-1 with
    # unnormalised weights (normalised, each weight is 1 and the router gets no gradient).
    "w4_one_expert_each": dict(
        world=4,
        experts=4,
        top_k=1,
        tokens=[3, 8, 0, 1],
        banned=[2],
        activation="geglu",
        normalize=False,
        empty=[(2, 0)],
    ),
}
HIDDEN, FFN = 16, 12


def _layer(case: dict, **kwargs) -> ExpertParallelMoE:
    return ExpertParallelMoE(
        case["experts"],
        HIDDEN,
        FFN,
        case["top_k"],
        recipe="fp32",
        activation=case["activation"],
        bias=case.get("bias", False),
        normalize_weights=case.get("normalize", True),
        **kwargs,
    )


def _inputs(case: dict, seed: int) -> tuple[ExpertParallelMoE, torch.Tensor, torch.Tensor]:
    """The single-process layer, all tokens and the output gradient, from ``seed``."""
    torch.manual_seed(seed)
    ref = _layer(case, process_group=None)
    total = sum(case["tokens"])
    x = torch.randn(total, HIDDEN)
    x[:, 0] = 1 + x[:, 0].abs()  # a positive feature the router uses to ban experts
    with torch.no_grad():  # feature 0 moves only the banned experts' logits
        ref.router.weight[:, 0] = 0.0
        ref.router.weight[case["banned"], 0] = -100.0
    dy = torch.randn(total, HIDDEN)
    return ref, x, dy


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item() if want.numel() else 0.0


def _worker(rank: int, store: str, out_dir: str) -> None:
    """One of 4 ranks. 4-rank cases run on the default group (``process_group=None``);
    2-rank cases run on ranks {0, 1} and, at the same time, on {2, 3} (an explicit group
    whose ranks differ from the global ones)."""
    import torch.distributed as dist

    references = {}
    for i, (name, case) in enumerate(CASES.items()):  # single process: no group exists yet
        ref, x, dy = _inputs(case, seed=100 + i)
        x.requires_grad_(True)
        y = ref(x)
        (y * dy).sum().backward()
        references[name] = (ref, x, y.detach(), dy)

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, WORLD),
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    results: dict[str, dict] = {}
    try:
        for group, experts in ((None, 6), (pairs[rank // 2], 3)):
            with pytest.raises(
                gg.InvalidArgumentError, match=rf"num_experts={experts} .*multiple of the process group"
            ):
                ExpertParallelMoE(experts, HIDDEN, FFN, 1, recipe="fp32", process_group=group)
        results["uneven_experts_error"] = {"raised": 1.0}
        for name, case in CASES.items():
            ref, x_all, y_all, dy_all = references[name]
            group = None if case["world"] == WORLD else pairs[rank // 2]
            torch.manual_seed(1000 + rank)  # a different init: the load below must overwrite it
            layer = _layer(case, process_group=group)
            r, world = layer.rank, layer.world_size
            assert (r, world) == ((rank, WORLD) if group is None else (rank % 2, 2)), (r, world)
            assert layer.expert_range == range(r * case["experts"] // world, (r + 1) * case["experts"] // world)
            layer.load_full_state_dict(ref.state_dict())
            gathered = layer.full_state_dict()
            err = {f"state:{k}": _rel(v, ref.state_dict()[k]) for k, v in gathered.items()}

            start = sum(case["tokens"][:r])
            rows = slice(start, start + case["tokens"][r])
            x = x_all.detach()[rows].clone().requires_grad_(r not in case.get("no_input_grad", []))
            received = layer.route(x.detach()).expert_splits
            y = layer(x)
            (y * dy_all[rows]).sum().backward()
            err["out"] = _rel(y.detach(), y_all[rows])
            if x.requires_grad:
                err["x.grad"] = _rel(x.grad, x_all.grad[rows])
            router_grad = layer.router.weight.grad.clone()
            dist.all_reduce(router_grad, group=layer.group)  # each rank's share covers its tokens
            err["router.weight.grad"] = _rel(router_grad, ref.router.weight.grad)
            for key, param in layer.named_parameters():
                if key.startswith("router."):
                    continue
                parts = [torch.empty_like(param.grad) for _ in range(world)]
                dist.all_gather(parts, param.grad.contiguous(), group=layer.group)
                err[f"{key}.grad"] = _rel(torch.cat(parts), ref.get_parameter(key).grad)
            results[name] = {"group_rank": r, "errors": err, "received": list(received)}
        # A group of one: no exchange, the same numbers as the local layer.
        solo, _ = dist.new_subgroups(group_size=1)
        case = CASES["w2_uneven"]
        ref, x_all, y_all, _ = references["w2_uneven"]
        layer = _layer(case, process_group=solo)
        layer.load_full_state_dict(ref.state_dict())
        results["group_of_one"] = {"world_size": layer.world_size, "out": _rel(layer(x_all.detach()), y_all)}
        # Last (the group is unusable after a timeout): the last rank's bad input raises
        # before any collective; the others give up after the group's timeout, not hang.
        short = dist.new_group(list(range(WORLD)), timeout=timedelta(seconds=FAILURE_TIMEOUT_S))
        layer = ExpertParallelMoE(4, HIDDEN, FFN, 1, recipe="fp32", process_group=short)
        start = time.monotonic()
        try:
            layer(torch.randn(2, HIDDEN + (rank == WORLD - 1)))
            outcome = "returned"
        except gg.ShapeError:
            outcome = "ShapeError"
        except RuntimeError:  # torch.distributed's timeout (DistBackendError)
            outcome = "RuntimeError"
        results["one_rank_fails"] = {"outcome": outcome, "seconds": time.monotonic() - start}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _run_bounded(commands: list[list[str]], timeout: float, env: dict[str, str]) -> list[tuple[int, str]]:
    """Start every command in its own session; past ``timeout`` (for all together) kill what is left."""
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in commands
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            outputs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        logs = "\n".join(f"--- process {i}\n{p.communicate()[0]}" for i, p in enumerate(procs))
        pytest.fail(f"processes still running after {timeout} s, killed:\n{logs}")
    return outputs


def _fork_workers(world: int, store: str, out_dir: str) -> None:
    """Every rank's ``_worker`` in a process of its own, forked from this one, which has
    imported torch, pytest and grouped_gemm once for all of them (each worker started its
    own Python before: ~4 s of imports a rank, the four on two cores). Nothing distributed
    exists before the fork. A rank's output goes to ``rank<r>.log``, its exit status (1 and
    the traceback if ``_worker`` raises, as a Python running it would exit) to
    ``statuses.json``."""
    ranks = {}
    for rank in range(world):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            log = os.open(Path(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            status = 0
            try:
                _worker(rank, store, out_dir)
            except BaseException:  # noqa: BLE001 - exits 1 with the traceback, as Python would
                traceback.print_exc()
                status = 1
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        ranks[pid] = rank
    statuses = {}
    while ranks:
        pid, status = os.wait()
        statuses[ranks.pop(pid)] = os.waitstatus_to_exitcode(status)
    Path(out_dir, "statuses.json").write_text(json.dumps(statuses))


@pytest.fixture(scope="module")
def job_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Every rank's results of one 4-process job."""
    out = tmp_path_factory.mktemp("expert_parallel")
    cmd = [sys.executable, __file__, "--workers", str(WORLD), str(out / "store"), str(out)]
    [(code, log)] = _run_bounded([cmd], JOB_TIMEOUT_S, gloo_env())
    assert code == 0, log
    statuses = json.loads((out / "statuses.json").read_text())
    for rank in range(WORLD):
        code = statuses[str(rank)]
        assert code == 0, f"rank {rank} exited with {code}:\n{(out / f'rank{rank}.log').read_text()}"
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_a_group_of_one_is_the_local_layer(job_results: list[dict]):
    assert all(results["group_of_one"] == {"world_size": 1, "out": 0.0} for results in job_results), job_results


def test_a_failing_rank_makes_the_others_raise_not_hang(job_results: list[dict]):
    outcomes = [results["one_rank_fails"] for results in job_results]
    assert [o["outcome"] for o in outcomes] == ["RuntimeError"] * (WORLD - 1) + ["ShapeError"]
    assert all(o["seconds"] < FAILURE_TIMEOUT_S + 10 for o in outcomes), outcomes


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world: int, job_results: list[dict]):
    cases = [name for name, c in CASES.items() if c["world"] == world]
    assert all(results["uneven_experts_error"] == {"raised": 1.0} for results in job_results)
    for rank, results in enumerate(job_results):
        for name in cases:
            case, result = CASES[name], results[name]
            r, errors, received = result["group_rank"], result["errors"], result["received"]
            assert r == (rank if world == WORLD else rank % 2)
            assert len(received) == case["experts"] // world
            for e, rows in enumerate(received):
                assert (rows == 0) == ((r, e) in case["empty"]), (name, rank, received)
            weights = ["gate_up.weight", "down.weight"] + (["gate_up.bias", "down.bias"] if case.get("bias") else [])
            wanted = {"out", "router.weight.grad", *(f"{w}.grad" for w in weights), *(f"state:{w}" for w in weights)}
            if r not in case.get("no_input_grad", []):
                wanted.add("x.grad")
            assert wanted <= set(errors), (name, rank, sorted(errors))
            bad = {k: v for k, v in errors.items() if not v < TOLERANCE}
            assert not bad, f"{name}, rank {rank}: relative errors above {TOLERANCE}: {bad}"


def _run_example(out: Path, env: dict[str, str], *args: str, timeout: float = JOB_TIMEOUT_S) -> dict:
    """``torchrun --standalone --nproc-per-node 2 examples/expert_parallel.py``; its JSON report."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(ROOT / "examples" / "expert_parallel.py"), "--out", str(out), *args]
    [(code, log)] = _run_bounded([cmd], timeout, env)
    assert code == 0, log
    assert "matches the single-process layer" in log, log
    report = json.loads((out / "expert_parallel.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["all_to_all_ms"] > 0 and r["grouped_gemm_ms"] > 0 for r in report["ranks"])
    return report


@pytest.mark.slow
def test_example_runs_under_torchrun(tmp_path: Path):
    report = _run_example(tmp_path, gloo_env(), "--tokens", "24", "--bench-iters", "1")
    assert report["backend"] == "gloo"
    assert [r["tokens"] for r in report["ranks"]] == [16, 32]  # uneven on purpose


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one GPU per rank)")
@pytest.mark.parametrize(
    "args", [("--recipe", "fp32"), ("--recipe", "bf16", "--model", "qwen3_30b_a3b", "--tokens", "2048")]
)
def test_gpu_example_runs_under_torchrun_with_nccl(tmp_path: Path, args: tuple[str, ...]):
    report = _run_example(tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"}, *args, "--bench-iters", "3", timeout=300)
    assert report["backend"] == "nccl"


def _check_against_float64(case: dict, device: str) -> None:
    layer, x, dy = _inputs(case, seed=7)
    layer, x, dy = layer.to(device), x.to(device).requires_grad_(True), dy.to(device)
    y = layer(x)
    (y * dy).sum().backward()
    state = {k: v.detach().cpu().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    x64 = x.detach().cpu().double().requires_grad_(True)
    y64 = dense_float64(state, x64, case)
    (y64 * dy.cpu().double()).sum().backward()
    assert _rel(y.cpu(), y64) < TOLERANCE
    assert _rel(x.grad.cpu(), x64.grad) < TOLERANCE
    for key, param in layer.named_parameters():
        assert _rel(param.grad.cpu(), state[key].grad) < TOLERANCE, key


@pytest.mark.parametrize("name", ["w2_uneven", "w4_skewed", "w4_one_expert_each"])
def test_single_process_layer_matches_float64(name: str):
    """The local layer (the expert-parallel tests' reference) against a token-by-token float64 MoE."""
    _check_against_float64(CASES[name], "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["w2_uneven", "w4_skewed"])
def test_gpu_single_process_layer_matches_float64(name: str):
    _check_against_float64(CASES[name], "cuda")


def test_single_process_without_a_group_checks_its_arguments():
    with pytest.raises(gg.InvalidArgumentError, match="top_k=5"):
        ExpertParallelMoE(4, HIDDEN, FFN, 5)
    with pytest.raises(gg.InvalidArgumentError, match="activation='tanh'"):
        ExpertParallelMoE(4, HIDDEN, FFN, 1, activation="tanh")
    with pytest.raises(gg.InvalidTypeError, match="process_group='world'"):
        ExpertParallelMoE(4, HIDDEN, FFN, 1, process_group="world")
    layer = ExpertParallelMoE(4, HIDDEN, FFN, 2, recipe="fp32")
    assert layer.world_size == 1 and layer.expert_range == range(4)
    with pytest.raises(gg.ShapeError, match="x="):
        layer(torch.randn(3, HIDDEN + 1))
    with pytest.raises(gg.DTypeError, match="x="):
        layer(torch.randn(3, HIDDEN, dtype=torch.float64))
    state = layer.state_dict()
    with pytest.raises(gg.InvalidArgumentError, match=r"missing keys \['down.weight'\]"):
        layer.load_full_state_dict({k: v for k, v in state.items() if k != "down.weight"})
    with pytest.raises(gg.ShapeError, match="num_experts=4"):
        layer.load_full_state_dict({**state, "down.weight": state["down.weight"][:3]})


def test_an_input_the_experts_cannot_take_is_named_before_routing():
    """A meta x, or a layer cast to float64 (``.double()``), passed the input check and failed
    in the experts, after the exchange, as an error about x=Tensor(shape=(T * top_k, hidden))
    (the dispatched rows); now named as the caller's x / the layer's parameters."""
    with pytest.raises(gg.DeviceMismatchError, match=rf"^x=Tensor\(shape=\(3, {HIDDEN}\).*meta"):
        ExpertParallelMoE(4, HIDDEN, FFN, 2, recipe="fp32", device="meta")(torch.randn(3, HIDDEN, device="meta"))
    layer = ExpertParallelMoE(4, HIDDEN, FFN, 2).double()
    with pytest.raises(gg.DTypeError, match=r"^router.weight=.*float32 .*cast to torch.float64"):
        layer(torch.randn(3, HIDDEN, dtype=torch.float64))
    layer.float()  # cast back: it runs again
    assert layer(torch.randn(3, HIDDEN)).shape == (3, HIDDEN)


def test_load_full_state_dict_names_a_tensor_of_the_wrong_shape_dtype_or_device():
    """Each used to reach ``load_state_dict``: a wrong shape raised torch's RuntimeError,
    a meta tensor "Cannot copy out of meta tensor", an integer tensor was cast silently."""
    layer = ExpertParallelMoE(4, HIDDEN, FFN, 2, recipe="fp32", bias=True)
    state = layer.state_dict()
    bad = {
        "gate_up.weight": (torch.randn(4, 2 * FFN), gg.ShapeError, rf"shape \(4, {2 * FFN}, {HIDDEN}\)"),
        "down.bias": (torch.randn(4, HIDDEN + 1), gg.ShapeError, rf"shape \(4, {HIDDEN}\) \(num_experts=4"),
        "router.weight": (torch.randn(3, HIDDEN), gg.ShapeError, rf"shape \(4, {HIDDEN}\)"),
        "down.weight": (torch.ones(4, HIDDEN, FFN, dtype=torch.int32), gg.DTypeError, "a floating-point"),
        "gate_up.bias": (torch.randn(4, 2 * FFN, device="meta"), gg.InvalidArgumentError, "not on the meta device"),
    }
    for key, (value, error, message) in bad.items():
        with pytest.raises(error, match=rf"state\['{key}'\]=Tensor.* is invalid: .*{message}"):
            layer.load_full_state_dict({**state, key: value})
    with pytest.raises(gg.InvalidTypeError, match=r"state\['router.weight'\]=\[1.0\] is invalid: a tensor"):
        layer.load_full_state_dict({**state, "router.weight": [1.0]})
    good = {k: torch.randn(v.shape, dtype=torch.float64) for k, v in state.items()}
    layer.load_full_state_dict(good)
    assert all(torch.equal(v.double(), good[k].float().double()) for k, v in layer.state_dict().items())


def test_all_to_all_without_a_process_group_is_named():
    """``group=None`` before ``init_process_group`` escaped as torch's ValueError
    ("Default process group has not been initialized")."""
    from grouped_gemm.parallel import all_to_all

    assert not torch.distributed.is_initialized()
    with pytest.raises(gg.InvalidArgumentError, match=r"^group=None is invalid: .*init_process_group"):
        all_to_all(torch.randn(3, 2), [3], [3], None)


if __name__ == "__main__" and sys.argv[1:2] == ["--workers"]:
    _fork_workers(int(sys.argv[2]), sys.argv[3], sys.argv[4])
