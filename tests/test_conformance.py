"""The conformance suite (hf_accel.testing) on every built-in backend, on the plugin template's ``example``
installed as a user would install it, and on three deliberately wrong backends it must fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from flash_reference import ReferenceFlashAttn

import hf_accel
from hf_accel.testing import (
    AttentionConformance,
    CompileConformance,
    KVCacheConformance,
    QuantizeConformance,
    SpeculativeConformance,
)
from hf_accel_plugins import attention_flash

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "plugin_template"
#: Grouped-query attention with a sliding window and soft-capping (gemma2), without (llama), and multi-head
#: attention through Conv1D layers (gpt2): the features that are not attention's need no more architectures.
FEW = ("llama", "gemma2", "gpt2")


class TestSdpa(AttentionConformance):
    backend = "sdpa"


class TestSdpaFlash(AttentionConformance):
    backend = "sdpa_flash"


class TestEager(AttentionConformance):
    backend, architectures = "eager", FEW  # the suite's reference itself: the wiring, not the arithmetic


class TestTritonFlash(AttentionConformance):
    # CUDA only (it declares no device: Triton's interpreter runs it on the CPU too); without CUDA, its
    # availability check's reason, the rest skipped with it.
    backend = "triton_flash"
    device = "cuda" if torch.cuda.is_available() else None


class TestFlashAttnAdapter(AttentionConformance):
    """flash_attn's adapter over a reference implementation of the package's two functions (no CUDA here)."""

    backend, architectures = "flash_attn", FEW

    @pytest.fixture(autouse=True)
    def reference_kernels(self):
        with attention_flash.injected_kernels(ReferenceFlashAttn()):
            yield


class TestStaticCache(KVCacheConformance):
    backend, architectures = "static", FEW


class TestStaticInt8Cache(KVCacheConformance):
    backend, architectures = "static-int8", FEW


class TestOnednnPrepack(CompileConformance):
    backend, architectures = "onednn_prepack", FEW


class TestInductor(CompileConformance):
    # Compiling on first use (the default waits until compiling pays, which these short calls never reach); one
    # architecture, as each compiles for tens of seconds here: tests/test_compiled_step.py compiles the others.
    backend, architectures = "inductor", ("llama",)
    patch_options = {"compile_when": "first_use"}


class TestNgram(SpeculativeConformance):
    backend, architectures = "ngram", FEW


class TestDraftModel(SpeculativeConformance):
    backend, architectures = "draft_model", FEW


class TestSelfInt8(SpeculativeConformance):
    backend, architectures = "self_int8", FEW


class TestSelfInt4(SpeculativeConformance):
    backend, architectures = "self_int4", FEW


class TestNgramSelfInt4(SpeculativeConformance):
    backend, architectures = "ngram_self_int4", FEW


class TestInt8WeightOnly(QuantizeConformance):
    backend, architectures = "int8_weight_only", FEW


class TestInt4WeightOnly(QuantizeConformance):
    backend, architectures = "int4_weight_only", FEW


class TestBitsandbytes(QuantizeConformance):
    backend, architectures = "bnb", FEW


def run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, **env, "HF_ACCEL_LOAD_PLUGINS": env.get("HF_ACCEL_LOAD_PLUGINS", "")}
    environment.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(command, cwd=cwd, env=environment, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def installed_template(tmp_path_factory) -> Path:
    """The template installed as a user installs a plugin (pip, into a target directory put on sys.path)."""
    target, source = tmp_path_factory.mktemp("template_target"), tmp_path_factory.mktemp("build") / "template"
    shutil.copytree(TEMPLATE, source, ignore=shutil.ignore_patterns("__pycache__"))  # the build writes beside it
    done = run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                "--target", str(target), str(source)], cwd=source.parent)
    assert done.returncode == 0, done.stderr
    return target


def test_the_installed_template_passes_the_conformance_suite(installed_template, tmp_path):
    done = run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--hf-accel-backend", "example",
                str(TEMPLATE / "tests" / "test_attention_math.py")], cwd=tmp_path,
               PYTHONPATH=str(installed_template), HF_ACCEL_LOAD_PLUGINS="example")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    passed = [line for line in done.stdout.splitlines() if line.endswith("PASSED") or " PASSED " in line]
    suite = [line for line in passed if "::TestAttention::test_" in line]
    assert len(suite) > 60 and len(passed) - len(suite) >= 10, done.stdout[-3000:]  # the suite and the template's own
    for case in ("test_logits_match_eager[example-gemma2-long-left-padded-float32]",
                 "test_greedy_matches_eager[example-qwen3-batch3-left-padded]",
                 "test_logits_match_eager[example-llama-length1-bfloat16]"):
        assert any(case in line for line in suite), case


def test_the_installed_template_is_listed_and_serves_patch(installed_template, tmp_path):
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        import hf_accel
        from hf_accel.tools.cli import main
        from conftest import make_tiny_model
        main(["doctor"])
        model = make_tiny_model("llama")
        hf_accel.patch(model, attention="example")
        print("chosen:", hf_accel.report(model)["attention"].backend, model.config._attn_implementation)
    """)
    done = run([sys.executable, "-c", script, str(REPO / "tests")], cwd=tmp_path, PYTHONPATH=str(installed_template),
               HF_ACCEL_LOAD_PLUGINS="example")
    assert done.returncode == 0, done.stderr[-3000:]
    listed = [line.split()[:3] for line in done.stdout.splitlines()]
    assert ["attention", "example", "example"] in listed, done.stdout
    assert "chosen: example hf_accel_example" in done.stdout


@pytest.fixture(scope="module")
def wrong_backends_installed(tmp_path_factory) -> Path:
    """tests/wrong_backends.py as an installed distribution's entry point."""
    site = tmp_path_factory.mktemp("wrong_site")
    info = site / "wrong_backends-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrong-backends\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hf_accel]\nwrong = wrong_backends\n")
    return site


def test_the_suite_fails_each_wrong_backend_with_a_readable_message(wrong_backends_installed, tmp_path):
    done = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "llama or sampling",
                "--hf-accel-backend", "no_causal_mask", "--hf-accel-backend", "zeroing_int8",
                "--hf-accel-backend", "biased_drafter"], cwd=tmp_path,
               PYTHONPATH=os.pathsep.join([str(wrong_backends_installed), str(REPO / "tests")]),
               HF_ACCEL_LOAD_PLUGINS="wrong")
    out = done.stdout
    assert done.returncode == 1, out[-3000:] + done.stderr[-2000:]
    failed = {line.split()[1].split("[")[0].rsplit("::", 1)[-1] + "[" + line.split("[")[1].split("]")[0] + "]"
              for line in out.splitlines() if line.startswith("FAILED ")}
    assert "test_logits_match_eager[no_causal_mask-llama-batch3-left-padded-float32]" in failed, failed
    assert "test_greedy_matches_eager[no_causal_mask-llama-long-left-padded]" in failed
    assert "no_causal_mask on llama (long-left-padded, torch.float32): logits differ from eager attention by" in out
    assert "patch-time validation refused 'no_causal_mask' on llama" in out
    assert "test_each_replaced_layer_stays_within_the_tolerance[zeroing_int8-llama]" in failed
    assert "zeroing_int8 on llama: layer model.layers.0.mlp.down_proj: output error 1.0e+00 (bound 1e-01)" in out
    assert "patch-time validation refused 'zeroing_int8' on llama" in out
    assert "test_sampling_follows_the_target_distribution[biased_drafter]" in failed
    assert "biased_drafter: sampled tokens do not follow the target's distribution (prompt 0: the first 3 tokens " \
           "jointly: chi-square p = " in out
    assert not any("biased_drafter" in test and "greedy" in test for test in failed)  # greedy stays exact
    assert "test_passes_patch_time_validation[biased_drafter-llama]" not in failed


@pytest.fixture
def wrong_plugin():
    import wrong_backends

    return wrong_backends


def test_patch_time_validation_refuses_attention_that_drops_the_causal_mask(wrong_plugin):
    model = make_tiny_model("llama")
    with pytest.raises(hf_accel.VerificationError) as refused:
        hf_accel.patch(model, attention="no_causal_mask", plugins=[wrong_plugin])
    message = str(refused.value)
    assert message.startswith("attention='no_causal_mask' (plugin ")
    assert "logit error" in message and "at row 0, token 0 (its first token) of the forward probe" in message
    assert model.config._attn_implementation == "sdpa" and not hasattr(model, "_hf_accel_state")


def test_patch_time_validation_refuses_a_quantizer_that_zeroes_a_layer_naming_the_layer(wrong_plugin):
    model = make_tiny_model("llama")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hf_accel.VerificationError,
                       match=r"quantize='zeroing_int8' .* output error 1\.0e\+00 at layer model\.layers\.0\.mlp\."
                             r"down_proj \(bound 1e-01\)"):
        hf_accel.patch(model, quantize="zeroing_int8", plugins=[wrong_plugin])
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_auto_skips_a_refused_backend_with_the_reason_unless_strict(wrong_plugin):
    from hf_accel.plugin import Backend, hookimpl

    class Preferred:
        """The wrong attention, at the top of auto's order."""

        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="eager_first", feature="attention", priority=1000,
                             apply=wrong_plugin.use_attention_without_causal_mask))

    model = make_tiny_model("llama")
    hf_accel.patch(model, kv_cache=None, compile=None, speculative=None, plugins=[Preferred()])
    attention = hf_accel.report(model)["attention"]
    assert attention.backend == "sdpa_flash"  # the next in auto's order
    refused = {skip["backend"]: skip["reason"] for skip in attention.skipped}["eager_first"]
    assert refused.startswith("failed verification (FAILED: logit error") and "of the forward probe" in refused
    hf_accel.unpatch(model)
    with pytest.raises(hf_accel.VerificationError, match="eager_first.*strict=True turns this fallback into an error"):
        hf_accel.patch(model, kv_cache=None, compile=None, speculative=None, strict=True, plugins=[Preferred()])


def test_strict_refuses_a_generate_call_the_loop_would_hand_to_stock():
    model = make_tiny_model("llama")
    ids = torch.tensor([[5, 6, 7]])
    hf_accel.patch(model, compile=None, speculative="ngram", strict=True)
    model.generate(ids, max_new_tokens=4, do_sample=False)  # covered: runs
    with pytest.raises(hf_accel.PatchError, match="num_beams.*strict=True"):
        model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)


def test_strict_refuses_a_requested_variant_that_finds_no_backend():
    from hf_accel.plugin import Backend, hookimpl

    class Picky:
        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="picky_int3", feature="quantize", variants=("int3",), lossless=False, tolerance=0.5,
                             apply=lambda context: None, why_unsuitable=lambda context: "serves no tiny model"))

    model = make_tiny_model("llama")
    hf_accel.patch(model, quantize="int3", plugins=[Picky()])
    assert hf_accel.report(model)["quantize"].backend is None  # without strict: patched, quantize left out
    hf_accel.unpatch(model)
    with pytest.raises(hf_accel.BackendUnavailableError, match="quantize='int3' found no backend "
                                                               r"\(picky_int3: serves no tiny model\); strict=True"):
        hf_accel.patch(model, quantize="int3", strict=True, plugins=[Picky()])


def test_a_backend_that_does_not_declare_grouped_query_attention_is_refused_for_such_models():
    from hf_accel.plugin import Backend, Capabilities, hookimpl, set_attention

    class MultiHeadOnly:
        @hookimpl
        def hf_accel_register_backends(self, register):
            register(Backend(name="mha_only", feature="attention", capabilities=Capabilities(grouped_query=False),
                             apply=lambda context: set_attention(context, "eager")))

    with pytest.raises(hf_accel.BackendUnavailableError,
                       match="attention='mha_only' cannot run here: does not support grouped-query attention"):
        hf_accel.patch(make_tiny_model("llama"), attention="mha_only", plugins=[MultiHeadOnly()])
    gpt2 = hf_accel.patch(make_tiny_model("gpt2"), attention="mha_only", plugins=[MultiHeadOnly()])
    assert hf_accel.report(gpt2)["attention"].backend == "mha_only"


def test_every_built_in_backend_has_a_conformance_class_here():
    from hf_accel.patching.plugin_manager import plugin_origin

    classes = {cls.backend for cls in globals().values() if isinstance(cls, type) and getattr(cls, "backend", None)}
    built_in = {b.name for b in hf_accel.available_backends() if plugin_origin(b.plugin).builtin}
    assert built_in and built_in <= classes, f"built-in backends without a conformance class: {built_in - classes}"
