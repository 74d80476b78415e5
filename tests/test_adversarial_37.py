"""Adversarial cases from the thirty-seventh hunt: stored autotune choices whose config
the backend does not offer as stored, recipe strings naming a field twice, library
errors that did not survive pickling or fullgraph tracing, an expert-parallel router
that differs between ranks. Each test failed before its fix; CPU only (two gloo
processes), small shapes, fresh random data, float64 references.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import multiprocessing
import os
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gloo_ranks import run_ranks
from moe_reference import dense_float64

import grouped_gemm as gg
from grouped_gemm import autotune, ops, testing, tuning_store, validation
from grouped_gemm.parallel import ExpertParallelMoE

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("autotune_fakes", HERE / "autotune_fakes.py")
_fakes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fakes)

# ---- stored autotune configs -------------------------------------------------------------

SPLITS = [9, 0, 23]


class StrictTiles(_fakes.TimedBackend):
    """A backend that checks its config as a Triton backend does (``launch.parse_config``:
    every tile an int), so a config it does not offer fails inside its run."""

    def run_config(self, problem: gg.Problem, inputs: gg.GroupedInputs, config: dict) -> torch.Tensor:
        if type(config.get("tile")) is not int:
            raise gg.InvalidArgumentError("config", config, "tile an int")
        return super().run_config(problem, inputs, config)


@pytest.fixture
def tiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[StrictTiles]:
    """``StrictTiles`` as the only registered backend, with a private store and short plans."""
    monkeypatch.setenv(tuning_store.ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.setattr(autotune, "PLAN", autotune.Plan(warmup_ms=1, rep_ms=3, min_reps=3, max_reps=9))
    # A virtual clock: slept delays on a loaded host (CI beside other jobs) made the 0.2 ms
    # config as slow as the 3 ms default, and the close call kept the default.
    clock = _fakes.FakeClock()
    monkeypatch.setattr(autotune, "Clock", clock)
    configs = [{"delay": 0.003, "tile": 2}, {"delay": 0.0002, "tile": 1}]
    backend = StrictTiles("tiled", delay=0.003, configs=configs, clock=clock)
    with _fakes.only_registered() as add:
        add(backend)
        yield backend
    gg.configure(autotune=False)


def _tuned(gen: torch.Generator) -> tuple[Path, dict, torch.Tensor, torch.Tensor]:
    """Tune one fwd signature; the store file, its document and the operands."""
    x, w = torch.randn(sum(SPLITS), 16, generator=gen), torch.randn(len(SPLITS), 8, 16, generator=gen)
    gg.configure(autotune=True)
    assert testing.rel_error(gg.grouped_gemm(x, w, SPLITS), testing.ref_fwd(x, w, SPLITS)) < 1e-6
    problem = validation.fwd_or_dgrad("fwd", x, w, SPLITS, None, None, None).problem()
    path = autotune.TUNER.file_for(problem.device)
    return path, json.loads(path.read_text()), x, w


def _edit_choice(path: Path, document: dict, change: Callable[[dict], None]) -> None:
    """Apply ``change`` to the stored choice's config (entry and timing), write the file,
    and forget what this process read (a fresh process's view)."""
    entry = next(iter(document["entries"].values()))
    assert entry["config"] == {"delay": 0.0002, "tile": 1}, entry
    for timing in entry["timings"]:
        if timing["config"] == entry["config"]:
            change(timing["config"])
    change(entry["config"])
    path.write_text(json.dumps(document))
    autotune.TUNER._tables.clear()
    gg.configure(autotune=True)


@pytest.mark.parametrize("value", [1.0, True], ids=["float", "bool"])
def test_a_stored_config_equal_only_by_value_is_not_offered(value, tiled, gen):
    """``{"tile": 1.0}`` (a hand edit, a JSON tool rewriting numbers) or ``{"tile": True}``
    equals the offered ``{"tile": 1}`` by ``==``, so the check that the backend offers the
    stored config passed it, and every call failed in the backend: ``BackendRunError: ...
    config={'delay': 0.0002, 'tile': 1.0} is invalid``. Now it is not offered: a warning,
    and the call runs."""
    path, document, x, w = _tuned(gen)
    _edit_choice(path, document, lambda config: config.update(tile=value))
    with pytest.warns(tuning_store.AutotuneCacheWarning, match="does not offer that config"):
        y = gg.grouped_gemm(x, w, SPLITS)
    assert testing.rel_error(y, testing.ref_fwd(x, w, SPLITS)) < 1e-6


def test_a_stored_config_not_offered_is_measured_again_and_replaced(tiled, gen):
    """The warning said "measuring again", but ``Tuner.measure`` took the stored entry for one
    another thread had just measured (it named every eligible backend) and returned it
    unmeasured: the entry stayed, every call ran untuned on the slow path and warned twice
    (6 warnings in 3 calls), in every process. Now it is measured once and replaced."""
    path, document, x, w = _tuned(gen)
    _edit_choice(path, document, lambda config: config.update(tile=7))
    tuned = gg.dispatch_stats()["autotune"]["tuned"]
    with pytest.warns(tuning_store.AutotuneCacheWarning, match="does not offer that config"):
        y = gg.grouped_gemm(x, w, SPLITS)
    assert testing.rel_error(y, testing.ref_fwd(x, w, SPLITS)) < 1e-6
    assert gg.dispatch_stats()["autotune"]["tuned"] == tuned + 1
    entry = next(iter(json.loads(path.read_text())["entries"].values()))
    assert entry["config"] == {"delay": 0.0002, "tile": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            y = gg.grouped_gemm(x, w, SPLITS)
            assert testing.rel_error(y, testing.ref_fwd(x, w, SPLITS)) < 1e-6
    decision = gg.explain(x, w, SPLITS)
    assert (decision.selected, decision.config) == ("tiled", {"delay": 0.0002, "tile": 1})


# ---- recipe keys ---------------------------------------------------------------------------

REPEATED_KEYS = [
    "mxfp8;scale_rule=floor;grad_format=e5m2;scale_rule=rceil",
    "mxfp8;scale_rule=floor;grad_format=e5m2;grad_format=e4m3",
]


@pytest.mark.parametrize("key", REPEATED_KEYS)
def test_a_recipe_key_naming_a_field_twice_is_refused(key, gen):
    """A recipe string may change ``scale_rule`` and ``grad_format``; one naming a field twice
    ran silently with the last value (``...;scale_rule=floor;...;scale_rule=rceil`` as rceil),
    whichever the caller meant. Now it is refused, naming the string."""
    a = torch.randn(8, 32, generator=gen, dtype=torch.bfloat16)
    b = torch.randn(2, 32, 16, generator=gen, dtype=torch.bfloat16)
    with pytest.raises(gg.UnknownRecipeError, match=r"^recipe='mxfp8;scale_rule=floor;.* is invalid: a recipe name"):
        ops.gmm(a, b, [3, 5], recipe=key)
    y = ops.gmm(a, b, [3, 5], recipe="mxfp8;scale_rule=floor;grad_format=e5m2")
    floor = gg.get_recipe("mxfp8").model_copy(update={"scale_rule": "floor", "grad_format": "e5m2"})
    assert torch.equal(y, ops.gmm(a, b, [3, 5], recipe=floor))
    assert testing.sqnr_db(y, testing.ref_dgrad(a, b, [3, 5])) > 18  # two e4m3 operands, floor scales


BAD_MXFP8 = {
    "block_size": gg.Recipe(name="mxfp8", act_format="e4m3", weight_format="e4m3", grad_format="e4m3", block_size=16),
    "weight_format": gg.Recipe(name="mxfp8", act_format="e4m3", weight_format="e2m1", grad_format="e4m3"),
}


@pytest.mark.parametrize("field", list(BAD_MXFP8))
def test_a_recipe_object_the_key_cannot_carry_is_refused_under_compile(field, gen):
    """Eager, ``get_recipe`` refuses a Recipe named after a built-in with another block size
    or operand format. Under torch.compile it was skipped (Dynamo cannot trace pydantic),
    ``recipe_key`` made the built-in's key from the name, and the op ran plain mxfp8,
    silently: the compiled result equalled ``recipe="mxfp8"``'s bit for bit."""
    recipe = BAD_MXFP8[field]
    a = torch.randn(8, 64, generator=gen, dtype=torch.bfloat16)
    b = torch.randn(2, 64, 16, generator=gen, dtype=torch.bfloat16)
    torch._dynamo.reset()
    try:
        for fullgraph in (True, False):
            compiled = torch.compile(
                lambda a, b: ops.gmm(a, b, [3, 5], recipe=recipe), backend="eager", fullgraph=fullgraph
            )
            error = rf"UnknownRecipeError\('recipe.{field}'" if fullgraph else r"^recipe=Recipe\(name='mxfp8'"
            with pytest.raises(Exception, match=error):
                compiled(a, b)
        floor = gg.get_recipe("mxfp8").model_copy(update={"scale_rule": "floor"})  # a change the key carries
        compiled = torch.compile(lambda a, b: ops.gmm(a, b, [3, 5], recipe=floor), backend="eager", fullgraph=True)
        y = compiled(a, b)
        assert torch.equal(y, ops.gmm(a, b, [3, 5], recipe=floor))
        assert testing.sqnr_db(y, testing.ref_dgrad(a, b, [3, 5])) > 18
    finally:
        torch._dynamo.reset()


# ---- the library's errors across processes and under torch.compile ----------------------

ERRORS = [
    gg.InvalidArgumentError("m_splits", [-1, 3], "non-negative group sizes"),
    gg.SplitsError("m_splits", torch.tensor([4, 1]), "group sizes summing to x.shape[0]=3"),
    gg.DTypeError("x", torch.zeros(2, 2, dtype=torch.float64), "dtype bfloat16, float16 or float32"),
    gg.BackendRunError("reference", "fwd fp32 G=2", RuntimeError("boom")),
]


@pytest.mark.parametrize("error", ERRORS, ids=[type(e).__name__ for e in ERRORS])
def test_an_error_pickles_with_its_message_and_attributes(error):
    """Unpickling called ``cls(*args)`` with the one message where ``__init__`` takes
    (argument, value, allowed) or (backend, problem, cause): TypeError. Pickling is how a
    worker's error reaches its parent (multiprocessing, concurrent.futures)."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    for key, value in vars(error).items():
        assert key in vars(back)
        if not isinstance(value, torch.Tensor):
            assert vars(back)[key] == value, key


def _bad_splits_call(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return gg.grouped_gemm(torch.randn(3, 4, generator=gen), torch.randn(2, 5, 4, generator=gen), [1, 5])


def test_an_error_in_a_process_pool_worker_reaches_the_caller():
    """A SplitsError raised in a ProcessPoolExecutor worker came back as ``BrokenProcessPool:
    A process in the process pool was terminated abruptly`` (the parent could not unpickle
    it; ``multiprocessing.Pool.map`` hung instead). Now the caller gets the error itself."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        future = pool.submit(_bad_splits_call, 5)
        with pytest.raises(gg.SplitsError, match=r"^m_splits=\[1, 5\] is invalid: .*x.shape\[0\]=3") as caught:
            future.result(timeout=60)
    assert caught.value.argument == "m_splits" and caught.value.value == [1, 5]


def test_a_bad_argument_is_named_under_fullgraph_compile(gen):
    """Under ``torch.compile(fullgraph=True)`` Dynamo traces the check that raises, and it
    could not trace the error's ``super().__init__``: a bad argument of ``ops.gmm`` (or of
    any layer) failed as "Attempted to call a super() attribute that is not a function or
    method", naming neither argument nor value. Dynamo now reports the error it raised."""
    torch._dynamo.reset()
    a, b = torch.randn(8, 4, generator=gen), torch.randn(2, 4, 3, generator=gen)
    try:
        compiled = torch.compile(lambda a, b, s: ops.gmm(a, b, s, 1), backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=r"InvalidTypeError\('trans_b', 1, 'True or False'\)"):
            compiled(a, b, torch.tensor([3, 5]))
        good = torch.compile(lambda a, b, s: ops.gmm(a, b, s), backend="eager", fullgraph=True)
        assert testing.rel_error(good(a, b, torch.tensor([3, 5])), testing.ref_dgrad(a, b, [3, 5])) < 1e-6
    finally:
        torch._dynamo.reset()


# ---- expert parallelism: the replicated router ------------------------------------------

EP_ARGS = (4, 8, 6, 2)  # num_experts, hidden, ffn, top_k
EP_TOKENS = [5, 7]


BAD_RANK_SPLITS = {
    "bool_tensor": torch.tensor([True]),  # counted as 1 (a Python bool was refused)
    "meta_item": [torch.tensor(3, device="meta")],  # torch's bare "Tensor.item() ... meta"
}


@pytest.mark.parametrize("label", list(BAD_RANK_SPLITS))
def test_all_to_all_names_splits_that_are_not_counts_in_rank_order(label, gen):
    """On a one-rank gloo group (made here, destroyed after): a bool tensor's items were
    taken as sizes and exchanged, a meta item raised torch's bare RuntimeError. Each is
    named now; a list, 1-D tensor or numpy array of ints still moves the rows."""
    import numpy as np
    import torch.distributed as dist

    from grouped_gemm.parallel import all_to_all

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        rows = torch.randn(3, 4, generator=gen)
        bad = BAD_RANK_SPLITS[label]
        n = 1 if label == "bool_tensor" else 3
        with pytest.raises(gg.InvalidArgumentError, match=r"^send_splits="):
            all_to_all(rows[:n], bad, [n], None)
        for good in ([3], torch.tensor([3]), np.array([3])):
            assert torch.equal(all_to_all(rows, good, good, None), rows)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("splits", "shown"), [({5, 3}, r"\{3, 5\}"), ({0: 5, 1: 3}, r"\{0: 5, 1: 3\}")])
def test_rank_splits_in_a_set_or_mapping_are_refused(splits, shown):
    """A set iterates in hash order (``{5, 3}`` was read as [3, 5]: rank 0's rows sent to
    rank 1 and the other way round) and a mapping by its keys (``{0: 5, 1: 3}`` as
    [0, 1]); silently, where the sizes happened to sum to the rows."""
    from grouped_gemm.parallel import _rank_splits

    with pytest.raises(gg.InvalidArgumentError, match=rf"^send_splits={shown} is invalid: .*in rank order"):
        _rank_splits("send_splits", splits, 2)
    assert _rank_splits("send_splits", (5, 3), 2) == [5, 3]


def _ep_worker(rank: int, store: str, out_dir: str) -> None:
    """One of 2 gloo ranks. Layers built after seeding each rank differently (``seed + rank``,
    a common idiom) have different routers: forward and full_state_dict must say so on
    both ranks. Then one state loaded on both: the layer matches the float64 MoE."""
    from datetime import timedelta

    import torch.distributed as dist

    torch.manual_seed(7)  # the same on both ranks: the whole layer and batch
    ref = ExpertParallelMoE(*EP_ARGS, dtype=torch.float32)
    x_all = torch.randn(sum(EP_TOKENS), EP_ARGS[1])
    dist.init_process_group(
        "gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2, timeout=timedelta(seconds=30)
    )
    results: dict[str, object] = {}
    try:
        rows = slice(sum(EP_TOKENS[:rank]), sum(EP_TOKENS[: rank + 1]))
        for name, use in {
            "forward": lambda layer: layer(x_all[rows]),
            "full_state_dict": ExpertParallelMoE.full_state_dict,
        }.items():
            torch.manual_seed(100 + rank)
            try:
                use(ExpertParallelMoE(*EP_ARGS, dtype=torch.float32))
                results[name] = "returned"
            except gg.InvalidArgumentError as e:
                results[name] = str(e)
        torch.manual_seed(100 + rank)
        layer = ExpertParallelMoE(*EP_ARGS, dtype=torch.float32)
        layer.load_full_state_dict(ref.state_dict())
        y = layer(x_all[rows])
        state = {k: v.double() for k, v in layer.full_state_dict().items()}
        want = dense_float64(state, x_all[rows].double(), {"activation": layer.activation, "top_k": EP_ARGS[3]})
        results["rel_error"] = testing.rel_error(y, want)
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


def test_a_router_that_differs_between_ranks_is_named(tmp_path):
    """The router is replicated, but nothing made it so: after ``torch.manual_seed(seed +
    rank)`` each rank built its own random router, the layer routed each rank's tokens
    with another router (no single layer computes that), and ``full_state_dict``, which
    promises every rank the same dict, gave each rank its own router; silently. Now the
    first forward or full_state_dict names router.weight on every rank."""
    results = run_ranks(__file__, "--ep-worker", tmp_path, timeout_s=120)
    for rank, res in enumerate(results):
        for name in ("forward", "full_state_dict"):
            assert res[name].startswith("router.weight=Tensor(shape=(4, 8)"), (rank, name, res[name])
            assert f"rank {1 - rank}'s differs" in res[name], res[name]
        assert res["rel_error"] < 1e-6, res


if __name__ == "__main__" and sys.argv[1:2] == ["--ep-worker"]:
    _ep_worker(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    os._exit(0)  # skip interpreter teardown, where gloo's threads can abort the process
