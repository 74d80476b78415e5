"""Plugins: built-ins without metadata, entry points, failing and duplicate plugins.

Plugin loading happens once per process, so scenarios with their own installed
distributions run in a subprocess with a temporary site directory on PYTHONPATH.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plugin_site import install_plugin, run_python

import grouped_gemm as gg
from grouped_gemm.testing import ref_fwd, rel_error

GOOD = """
    import torch
    import grouped_gemm as gg

    class Doubler(gg.Backend):
        spec = gg.BackendSpec(name="via_callback", ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"}, priority=999)

        def run(self, problem, inputs):
            ref = gg.grouped_gemm(inputs.a, inputs.b, inputs.m_splits, backend="reference")
            return ref

    @gg.hookimpl
    def grouped_gemm_backends(register):
        register(Doubler())
"""

BROKEN = "raise ImportError('simulated missing dependency libfoo')\n"

DUPLICATE = """
    import grouped_gemm as gg

    class Impostor(gg.Backend):
        spec = gg.BackendSpec(name="reference", ops={"fwd"}, recipes={"fp32"}, vendors={"cpu"}, priority=10**6)

        def run(self, problem, inputs):
            raise AssertionError("an impostor must never run")

    @gg.hookimpl
    def grouped_gemm_backends():
        return [Impostor()]
"""

REPORT = """
    import json, torch
    import grouped_gemm as gg
    x, w = torch.randn(6, 4), torch.randn(2, 3, 4)
    print(json.dumps({
        "backends": {b.name: b.plugin for b in gg.list_backends()},
        "failures": [[f.plugin, f.stage, f.error] for f in gg.plugin_failures()],
        "selected": gg.explain(x, w, [2, 4]).selected,
        "ran": gg.grouped_gemm(x, w, [2, 4]).shape[0],
    }))
"""


@pytest.fixture
def site(tmp_path: Path) -> Path:
    install_plugin(tmp_path, "gg_plugin_good", {"gg_plugin_good": GOOD}, {"good": "gg_plugin_good"})
    install_plugin(tmp_path, "gg_plugin_broken", {"gg_plugin_broken": BROKEN}, {"broken": "gg_plugin_broken"})
    install_plugin(
        tmp_path, "gg_plugin_duplicate", {"gg_plugin_duplicate": DUPLICATE}, {"duplicate": "gg_plugin_duplicate"}
    )
    return tmp_path


def test_entry_points_failures_and_duplicates(site):
    proc = run_python(site, REPORT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backends"]["via_callback"] == "good (gg_plugin_good)"
    assert report["backends"]["reference"] == "grouped_gemm.backends.reference"
    failures = {plugin: (stage, error) for plugin, stage, error in report["failures"]}
    assert failures["broken (gg_plugin_broken)"] == ("import", "ImportError: simulated missing dependency libfoo")
    stage, error = failures["duplicate (gg_plugin_duplicate)"]
    assert stage == "register backend" and "'reference'" in error and "already registered" in error
    assert report["selected"] == "via_callback"
    assert report["ran"] == 6


def test_autoload_can_be_disabled(site):
    proc = run_python(site, REPORT, GROUPED_GEMM_DISABLE_PLUGIN_AUTOLOAD="1")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "via_callback" not in report["backends"]
    assert "reference" in report["backends"]
    assert report["failures"] == [] or all("gg_plugin" not in f[0] for f in report["failures"])


def test_cli_shows_failed_plugins(site):
    proc = run_python(site, "from grouped_gemm.cli import main; raise SystemExit(main(['backends']))")
    assert proc.returncode == 0, proc.stderr
    assert "plugins that failed to load" in proc.stdout
    assert "simulated missing dependency libfoo" in proc.stdout


def test_register_in_code_rejects_duplicates_and_non_backends(make_backend):
    make_backend("unique_name")
    with pytest.raises(gg.DuplicateBackendError, match=r"'unique_name' .* already registered by plugin 'code'"):
        make_backend("unique_name")
    with pytest.raises(gg.InvalidTypeError, match="BackendSpec"):
        gg.register_backend(object())
    with pytest.raises(ValueError, match="lower-case"):
        gg.BackendSpec(name="Bad-Name", ops={"fwd"}, recipes={"bf16"}, vendors={"cpu"})
    with pytest.raises(ValueError, match="unknown recipes"):
        gg.BackendSpec(name="x", ops={"fwd"}, recipes={"int4"}, vendors={"cpu"})


def test_padded_bmm_plugin_is_discovered_ranked_selected_and_explained(gen):
    infos = {b.name: b for b in gg.list_backends()}
    assert "padded_bmm" in infos, "install the example plugin: pip install ./plugins/padded_bmm"
    info = infos["padded_bmm"]
    assert info.plugin.startswith("padded_bmm") and info.available
    splits = [5, 0, 9, 2]
    # N=6 is not 16-byte aligned for torch_grouped_mm, which outranks padded_bmm on CPU.
    x, w = torch.randn(16, 24, generator=gen), torch.randn(4, 6, 24, generator=gen)
    decision = gg.explain(x, w, splits)
    names = [c.name for c in decision.candidates]
    assert names.index("torch_grouped_mm") < names.index("padded_bmm") < names.index("reference")
    assert decision.selected == "padded_bmm"
    assert "padded_bmm" in decision.table()
    assert rel_error(gg.grouped_gemm(x, w, splits), ref_fwd(x, w, splits)) < 1e-5
    assert gg.dispatch_stats()["selected"] == {"padded_bmm": 1}
    many = gg.explain(op="fwd", groups=32, m=256, n=8, k=8, recipe="fp32")
    assert "G=32 exceeds the maximum 16" in str(many.candidate("padded_bmm").reasons[0])
    on_device = gg.explain(op="fwd", groups=4, m=256, n=8, k=8, recipe="fp32", device_splits=True)
    assert "GROUPED_GEMM_PADDED_BMM_CAPACITY" in str(on_device.candidate("padded_bmm").reasons[0])


def test_every_built_in_backend_loads():
    from grouped_gemm.plugins import DEFAULT_PLUGINS

    assert [str(f) for f in gg.plugin_failures()] == []
    names = {b.plugin for b in gg.list_backends()}
    assert set(DEFAULT_PLUGINS) <= names


HOOKLESS = {
    # pluggy ignores both without a word: the plugin's backends were missing, no failure said why
    "gg_misspelled": """
        import grouped_gemm as gg

        @gg.hookimpl
        def grouped_gemm_backend():
            return []
    """,
    "gg_undecorated": """
        def grouped_gemm_backends():
            return []
    """,
}


def test_a_plugin_whose_hook_pluggy_ignores_is_a_failure(tmp_path):
    for module, source in HOOKLESS.items():
        install_plugin(tmp_path, module, {module: source})
    proc = run_python(tmp_path, REPORT)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failures = {plugin: (stage, error) for plugin, stage, error in report["failures"]}
    stage, error = failures["gg_misspelled (gg_misspelled)"]
    assert stage == "hooks" and "@grouped_gemm.hookimpl on grouped_gemm_backend, which is no grouped_gemm hook" in error
    stage, error = failures["gg_undecorated (gg_undecorated)"]
    assert stage == "hooks" and "not decorated with @grouped_gemm.hookimpl" in error
    assert not any(plugin.startswith("grouped_gemm.backends") for plugin in failures)
    assert report["ran"] == 6
