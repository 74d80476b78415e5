"""ExpertParallelMoE across 2 and 4 CPU processes (gloo, localhost) against the single-process layer.

Each job starts ``world`` worker processes (this file, run as a script). Every worker
builds the single-process layer and runs it on the whole batch *before* joining the
process group (so it is a plain local layer), then runs the expert-parallel layer with
the same weights on its own slice of the tokens and writes the relative errors of the
output, the input gradient and every weight gradient to a JSON file. Routing is steered
by the router weights: "banned" experts get a logit far below the others for every
token, so some ranks receive no rows for some or all of their experts. Every collective
has the process group's timeout and every job a wall-clock limit, so a failure cannot hang.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm.parallel import ACTIVATIONS, ExpertParallelMoE

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE_TIMEOUT_S = 30
JOB_TIMEOUT_S = 50
TOLERANCE = 1e-5

# Per case: tokens on each rank, experts no token picks, ranks whose x needs no gradient.
# ``empty``: (rank, local expert) pairs that must receive no rows, checked from the routing.
CASES: dict[str, dict] = {
    # rank 1 has no tokens and its experts (2, 3) receive nothing: it only waits and relays.
    "w2_rank1_idle": dict(
        world=2, experts=4, top_k=2, tokens=[13, 0], banned=[2, 3], activation="swiglu", empty=[(1, 0), (1, 1)]
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
    with torch.no_grad():
        for e in case["banned"]:
            ref.router.weight[e, 0] = -100.0
    dy = torch.randn(total, HIDDEN)
    return ref, x, dy


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item() if want.numel() else 0.0


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    cases = {name: c for name, c in CASES.items() if c["world"] == world}
    references = {}
    for i, (name, case) in enumerate(cases.items()):  # single process: no group exists yet
        ref, x, dy = _inputs(case, seed=100 + i)
        x.requires_grad_(True)
        y = ref(x)
        (y * dy).sum().backward()
        references[name] = (ref, x, y.detach(), dy)

    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    results: dict[str, dict] = {}
    try:
        with pytest.raises(gg.InvalidArgumentError, match=r"num_experts=3 .*multiple of the process group's size"):
            ExpertParallelMoE(3, HIDDEN, FFN, 1, recipe="fp32")
        results["uneven_experts_error"] = {"raised": 1.0}
        for name, case in cases.items():
            ref, x_all, y_all, dy_all = references[name]
            start = sum(case["tokens"][:rank])
            rows = slice(start, start + case["tokens"][rank])
            torch.manual_seed(1000 + rank)  # a different init: the load below must overwrite it
            layer = _layer(case)
            assert layer.expert_range == range(
                rank * case["experts"] // world, (rank + 1) * case["experts"] // world
            ), layer.expert_range
            layer.load_full_state_dict(ref.state_dict())
            gathered = layer.full_state_dict()
            err = {f"state:{k}": _rel(v, ref.state_dict()[k]) for k, v in gathered.items()}

            x = x_all.detach()[rows].clone().requires_grad_(rank not in case.get("no_input_grad", []))
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
                dist.all_gather(parts, param.grad.contiguous())
                err[f"{key}.grad"] = _rel(torch.cat(parts), ref.get_parameter(key).grad)
            results[name] = {"errors": err, "received": list(received)}
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def _run_bounded(commands: list[list[str]], timeout: float, env: dict[str, str]) -> list[tuple[int, str]]:
    """Start every command in its own session; past ``timeout`` kill what is left."""
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        for cmd in commands
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        logs = "\n".join(f"--- process {i}\n{p.communicate()[0]}" for i, p in enumerate(procs))
        pytest.fail(f"processes still running after {timeout} s, killed:\n{logs}")
    return outputs


def _env() -> dict[str, str]:
    # Loopback only; one thread per process (two cores shared by every rank).
    return {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_matches_single_process(world: int, tmp_path: Path):
    cmds = [
        [sys.executable, __file__, "--worker", str(rank), str(world), str(tmp_path / "store"), str(tmp_path)]
        for rank in range(world)
    ]
    outputs = _run_bounded(cmds, JOB_TIMEOUT_S, _env())
    for rank, (code, log) in enumerate(outputs):
        assert code == 0, f"rank {rank} exited with {code}:\n{log}"
    cases = [name for name, c in CASES.items() if c["world"] == world]
    for rank in range(world):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results.pop("uneven_experts_error") == {"raised": 1.0}
        assert sorted(results) == sorted(cases)
        for name, result in results.items():
            case, errors, received = CASES[name], result["errors"], result["received"]
            assert len(received) == case["experts"] // world
            for e, rows in enumerate(received):
                assert (rows == 0) == ((rank, e) in case["empty"]), (name, rank, received)
            weights = ["gate_up.weight", "down.weight"] + (["gate_up.bias", "down.bias"] if case.get("bias") else [])
            wanted = {"out", "router.weight.grad", *(f"{w}.grad" for w in weights), *(f"state:{w}" for w in weights)}
            if rank not in case.get("no_input_grad", []):
                wanted.add("x.grad")
            assert wanted <= set(errors), (name, rank, sorted(errors))
            bad = {k: v for k, v in errors.items() if not v < TOLERANCE}
            assert not bad, f"{name}, rank {rank}: relative errors above {TOLERANCE}: {bad}"


def test_example_runs_under_torchrun(tmp_path: Path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "examples" / "expert_parallel.py"),
        "--tokens",
        "24",
        "--bench-iters",
        "2",
        "--out",
        str(tmp_path),
    ]
    [(code, log)] = _run_bounded([cmd], JOB_TIMEOUT_S, _env())
    assert code == 0, log
    assert "matches the single-process layer" in log, log
    report = json.loads((tmp_path / "expert_parallel.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["all_to_all_ms"] > 0 and r["grouped_gemm_ms"] > 0 for r in report["ranks"])


def _dense_float64(state: dict[str, torch.Tensor], x: torch.Tensor, case: dict) -> torch.Tensor:
    """Every token through each of its top-k experts one at a time, from the layer's state."""
    gated, act = ACTIVATIONS[case["activation"]]
    probs = (x @ state["router.weight"].T).softmax(dim=-1)
    top, chosen = probs.topk(case["top_k"], dim=-1)
    if case.get("normalize", True):
        top = top / top.sum(dim=-1, keepdim=True)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(HIDDEN, dtype=x.dtype)
        for j, e in enumerate(chosen[t].tolist()):
            h = state["gate_up.weight"][e] @ x[t] + (state["gate_up.bias"][e] if case.get("bias") else 0)
            h = act(h[:FFN]) * h[FFN:] if gated else act(h)
            acc = acc + top[t, j] * (state["down.weight"][e] @ h + (state["down.bias"][e] if case.get("bias") else 0))
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["w2_uneven", "w4_skewed", "w4_one_expert_each"])
def test_single_process_layer_matches_float64(name: str):
    """The local layer (the expert-parallel tests' reference) against a token-by-token float64 MoE."""
    case = CASES[name]
    layer, x, dy = _inputs(case, seed=7)
    x.requires_grad_(True)
    y = layer(x)
    (y * dy).sum().backward()
    state = {k: v.detach().double().requires_grad_(True) for k, v in layer.state_dict().items()}
    x64 = x.detach().double().requires_grad_(True)
    y64 = _dense_float64(state, x64, case)
    (y64 * dy.double()).sum().backward()
    assert _rel(y, y64) < TOLERANCE
    assert _rel(x.grad, x64.grad) < TOLERANCE
    for key, param in layer.named_parameters():
        assert _rel(param.grad, state[key].grad) < TOLERANCE, key


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


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
