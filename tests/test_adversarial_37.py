"""Adversarial cases from the thirty-seventh hunt: stored autotune choices whose config
the backend does not offer as stored, recipe strings naming a field twice. Each test
failed before its fix; CPU only, small shapes, fresh random data, float64 references.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import grouped_gemm as gg
from grouped_gemm import autotune, ops, testing, tuning_store, validation
from grouped_gemm.registry import registry

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
    reg = registry()
    saved = [(e.backend, e.plugin) for e in reg.entries()]
    for backend, _ in saved:
        reg.unregister(backend.spec.name)
    backend = StrictTiles("tiled", delay=0.003, configs=[{"delay": 0.003, "tile": 2}, {"delay": 0.0002, "tile": 1}])
    reg.register(backend, plugin="test")
    yield backend
    for name in reg.names():
        reg.unregister(name)
    for backend, plugin in saved:
        reg.register(backend, plugin)
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
