"""The conformance suite: what every backend of a feature must do, as pytest classes a plugin author subclasses.

Example (a plugin's tests/test_conformance.py)::

    from hf_accel.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend = "my_attention"

or, with nothing written: ``pytest --hf-accel-backend my_attention``. Each class parametrizes itself
(``pytest_generate_tests``) over the tiny architectures the backend declares it serves (its
:class:`~hf_accel.plugin.Capabilities`), the prompt shapes of :data:`~hf_accel.testing.models.PROMPTS`
and, for attention, the dtypes it declares; an architecture it does not declare must be refused.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Iterator

import pytest
import torch

import hf_accel
from hf_accel.patching.backends import Backend, model_needs
from hf_accel.patching.errors import BackendUnavailableError, VerificationError
from hf_accel.patching.features import FEATURE_NAMES
from hf_accel.patching.plugin_manager import get_plugin_manager
from hf_accel.patching.registry import BackendRegistry
from hf_accel.patching.verify import LOSSLESS_TOLERANCE, LayerCheck, LayerMismatch
from hf_accel.testing.checks import (
    assert_same_tokens,
    chi_square_p_value,
    exact_continuations,
    logits_of,
    relative_error,
    replaced_modules,
    sampling_model,
)
from hf_accel.testing.models import PROMPTS, TINY_ARCHITECTURES, left_padded_batch, make_tiny_model, tiny_config

#: The option of ``patch`` the suite passes a draft model through, to a backend that declares it.
DRAFT_MODEL_OPTION = "draft_model"
#: The option that asks a backend to keep what it replaces, so that ``unpatch`` can put it back.
KEEP_ORIGINAL_OPTION = "keep_original"


class BackendConformance:
    """Tests every backend passes, whatever its feature. Subclass a feature's class and set ``backend``."""

    #: The name of the backend under test (None: the names given with ``--hf-accel-backend``).
    backend: ClassVar[str | None] = None
    feature: ClassVar[str] = ""
    #: The tiny architectures to try (see :data:`~hf_accel.testing.models.TINY_ARCHITECTURES`).
    architectures: ClassVar[tuple[str, ...]] = tuple(TINY_ARCHITECTURES)
    prompts: ClassVar[dict[str, tuple[int, ...]]] = PROMPTS
    #: Other ``patch`` arguments for every patch the suite makes (backend options, other features).
    patch_options: ClassVar[dict[str, Any]] = {}
    new_tokens: ClassVar[int] = 8

    # -- parametrization ----------------------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        names = [self.backend] if self.backend else _names_from_option(metafunc.config, self.feature)
        wanted = [arg for arg in ("backend_name", "arch", "prompt", "dtype") if arg in metafunc.fixturenames]
        cases, ids = [], []
        for name in names:
            for case in self._cases(name, metafunc.function.__name__, wanted):
                cases.append(tuple(case[arg] for arg in wanted))
                ids.append("-".join(str(case[arg]).removeprefix("torch.") for arg in wanted))
        metafunc.parametrize(wanted, cases, ids=ids)

    def _cases(self, name: str, test: str, wanted: list[str]) -> Iterator[dict[str, Any]]:
        backend = registered_backend(name, required=False)
        declared = [a for a in self.architectures if backend is None or not unserved_needs(backend, a)]
        if test == "test_refuses_models_it_does_not_declare":
            archs = [a for a in self.architectures if backend is not None and unserved_needs(backend, a)]
            archs = archs or [None]  # one case, which skips saying so
        else:
            archs = declared if "arch" in wanted else [None]
        prompts = list(self.prompts) if "prompt" in wanted else [None]
        dtypes = self.dtypes(backend) if "dtype" in wanted else [None]
        for arch in archs:
            for prompt in prompts:
                for dtype in dtypes:
                    yield {"backend_name": name, "arch": arch, "prompt": prompt, "dtype": dtype}

    def dtypes(self, backend: Backend | None) -> list[torch.dtype]:
        """The dtypes to try: those the backend declares (fp32 and bf16 when it declares none)."""
        declared = backend.capabilities.dtypes if backend is not None else ()
        return [d for d in (torch.float32, torch.bfloat16, torch.float16) if d in declared] if declared else \
            [torch.float32, torch.bfloat16]

    # -- fixtures -----------------------------------------------------------------------------------------
    @pytest.fixture
    def backend_under_test(self, backend_name: str) -> Backend:
        """The registered backend, skipping the test (with its reason) where it cannot run on this machine."""
        backend = registered_backend(backend_name)
        problem = backend.machine_problem()
        if problem:
            pytest.skip(f"backend {backend_name!r} cannot run here: {problem}")
        return backend

    # -- patching the way the suite does ------------------------------------------------------------------
    def patch(self, model: torch.nn.Module, backend: Backend, verify: bool = False,
              **arguments: Any) -> torch.nn.Module:
        """``hf_accel.patch`` with ``backend`` forced for its feature and every other feature off, unless
        :meth:`companions` turns one on. Unverified unless asked: the suite measures the backend itself, and
        ``test_passes_patch_time_validation`` checks the core's validation lets it in."""
        requests = {feature: None for feature in FEATURE_NAMES}
        requests.update(self.companions(backend))
        requests[backend.feature] = backend.name
        options = dict(self.patch_options)
        if DRAFT_MODEL_OPTION in backend.options:
            options[DRAFT_MODEL_OPTION] = draft_model_for(model)
        hf_accel.patch(model, verify=verify, **{**requests, **options, **arguments})
        chosen = hf_accel.report(model)[backend.feature]
        assert chosen.backend == backend.name, f"patch chose {chosen.backend!r} for {backend.feature}: {chosen.reason}"
        return model

    def companions(self, backend: Backend) -> dict[str, Any]:
        """Other features the backend's feature needs on (none, but for a compiled step: a cache)."""
        return {}

    # -- every backend ------------------------------------------------------------------------------------
    def test_is_registered_for_this_feature(self, backend_name: str) -> None:
        backend = registered_backend(backend_name)
        assert backend.feature == self.feature, (
            f"backend {backend_name!r} serves {backend.feature!r}; run it with the {backend.feature} conformance class")
        assert backend.lossless or backend.probe is None or backend.tolerance is not None, (
            f"backend {backend_name!r} is lossy (lossless=False) and verified by a probe but declares no tolerance: "
            "say how far its logits may move (Backend(tolerance=...)) so verification can hold it to that")

    def test_availability_check_gives_a_reason(self, backend_name: str) -> None:
        backend = registered_backend(backend_name)
        problem = backend.machine_problem()
        if problem is None:
            return
        assert isinstance(problem, str) and problem.strip() and "Traceback" not in problem, (
            f"why_unavailable of {backend_name!r} should say in words why it cannot run, got {problem!r}")
        model = make_tiny_model("llama")
        with pytest.raises(BackendUnavailableError, match="cannot run here"):
            hf_accel.patch(model, **{backend.feature: backend.name})
        pytest.skip(f"backend {backend_name!r} cannot run here: {problem}")

    def test_passes_patch_time_validation(self, backend_under_test: Backend, arch: str) -> None:
        model = make_tiny_model(arch)
        try:
            self.patch(model, backend_under_test, verify=True)
        except VerificationError as refusal:
            pytest.fail(f"patch-time validation refused {backend_under_test.name!r} on {arch}: {refusal}", False)
        verification = hf_accel.report(model)[backend_under_test.feature].verification
        assert verification is None or verification.passed, verification

    def test_refuses_models_it_does_not_declare(self, backend_under_test: Backend, arch: str | None) -> None:
        if arch is None:
            pytest.skip(f"{backend_under_test.name!r} declares everything the tiny models need")
        model = make_tiny_model(arch)
        with pytest.raises(BackendUnavailableError, match="does not support"):
            self.patch(model, backend_under_test)
        assert hf_accel.report(model)[backend_under_test.feature].backend is None

    def test_unpatch_restores_the_model(self, backend_under_test: Backend, arch: str) -> None:
        model = make_tiny_model(arch)
        ids, mask = left_padded_batch(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
        before = logits_of(model, ids, mask)
        # A backend that frees what it replaced (quantized weights) keeps it when asked to, so it can unpatch.
        keep = {KEEP_ORIGINAL_OPTION: True} if KEEP_ORIGINAL_OPTION in backend_under_test.options else {}
        self.patch(model, backend_under_test, **keep)
        hf_accel.unpatch(model)
        after = model.state_dict()
        assert after.keys() == state.keys()
        changed = [k for k in state if not torch.equal(state[k], after[k])]
        assert not changed, f"unpatch left these tensors changed: {changed}"
        assert torch.equal(logits_of(model, ids, mask), before), "unpatch left the model's outputs changed"


class _GreedyIdentity:
    """Greedy output identical to the unpatched model's, over every prompt shape, then another batch size."""

    def test_greedy_matches_stock(self, backend_under_test: Backend, arch: str, prompt: str) -> None:
        skip_if_lossy(backend_under_test)
        model = make_tiny_model(arch)
        ids, mask = left_padded_batch(model, self.prompts[prompt])
        expected = greedy(model, ids, mask, self.new_tokens)
        self.patch(model, backend_under_test)
        assert_same_tokens(greedy(model, ids, mask, self.new_tokens), expected, ids.shape[1],
                           f"{backend_under_test.name} on {arch}, {prompt}")

    def test_calls_of_other_batch_sizes_in_turn(self, backend_under_test: Backend, arch: str) -> None:
        skip_if_lossy(backend_under_test)
        model = make_tiny_model(arch)
        batches = [left_padded_batch(model, lengths, seed=i) for i, lengths in enumerate([(5, 9), (4,), (6, 2, 8)])]
        expected = [greedy(model, ids, mask, self.new_tokens) for ids, mask in batches]
        self.patch(model, backend_under_test)
        for (ids, mask), stock in zip(batches + batches[:1], expected + expected[:1]):
            assert_same_tokens(greedy(model, ids, mask, self.new_tokens), stock, ids.shape[1],
                               f"{backend_under_test.name} on {arch}, batch of {ids.shape[0]} after other calls")


class AttentionConformance(BackendConformance):
    """An attention backend: logits within rounding of eager attention for every declared dtype, shape and
    architecture (GQA, sliding windows, soft-capping as declared), and eager's greedy tokens."""

    feature = "attention"

    def test_logits_match_eager(self, backend_under_test: Backend, arch: str, prompt: str, dtype: torch.dtype) -> None:
        model, reference = make_tiny_model(arch, dtype=dtype), make_tiny_model(arch, dtype=dtype)
        reference.set_attn_implementation("eager")
        ids, mask = left_padded_batch(model, self.prompts[prompt])
        expected = logits_of(reference, ids, mask)
        self.patch(model, backend_under_test)
        actual = logits_of(model, ids, mask)
        error, where = relative_error(expected, actual, mask)
        bound = LOSSLESS_TOLERANCE.get(dtype, 3e-2)
        assert error <= bound, (f"{backend_under_test.name} on {arch} ({prompt}, {dtype}): logits differ from eager "
                                f"attention by {error:.2e} relative (bound {bound:.0e}), most at {where}")

    def test_greedy_matches_eager(self, backend_under_test: Backend, arch: str, prompt: str) -> None:
        model, reference = make_tiny_model(arch), make_tiny_model(arch)
        reference.set_attn_implementation("eager")
        ids, mask = left_padded_batch(model, self.prompts[prompt])
        expected = greedy(reference, ids, mask, self.new_tokens)
        self.patch(model, backend_under_test)
        assert_same_tokens(greedy(model, ids, mask, self.new_tokens), expected, ids.shape[1],
                           f"{backend_under_test.name} on {arch}, {prompt}")


class KVCacheConformance(_GreedyIdentity, BackendConformance):
    """A KV-cache backend: stock's greedy tokens for every shape, and across calls of other batch sizes."""

    feature = "kv_cache"


class CompileConformance(_GreedyIdentity, BackendConformance):
    """A compile backend (with the default cache on): stock's greedy tokens for every shape and batch size.
    Set ``patch_options`` to make it compile where its default waits (``{"compile_when": "first_use"}``)."""

    feature = "compile"

    def companions(self, backend: Backend) -> dict[str, Any]:
        return {"kv_cache": "auto"}


class SpeculativeConformance(_GreedyIdentity, BackendConformance):
    """A speculative backend (its drafter in the core's loop): stock's greedy tokens, drafts accepted, and
    samples that follow the target's own distribution at every position."""

    feature = "speculative"
    #: Sampled rows per prompt in the distribution test, and the significance level it fails at.
    sampled_rows: ClassVar[int] = 2000
    significance: ClassVar[float] = 1e-3

    def test_greedy_matches_stock(self, backend_under_test: Backend, arch: str, prompt: str) -> None:
        super().test_greedy_matches_stock(backend_under_test, arch, prompt)

    def test_sampling_follows_the_target_distribution(self, backend_under_test: Backend) -> None:
        """Two prompts (one left-padded), a 4-token vocabulary, 3 new tokens: each prompt's 64 outcomes over
        ``sampled_rows`` rows against the target's exact distribution, by a chi-square test."""
        vocab, new = 4, 3
        model = sampling_model(vocab)
        prompts = [torch.tensor([[1, 3, 2, 3]]), torch.tensor([[0, 0, 2, 1]])]
        masks = [torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]])]
        exact = [exact_continuations(model, p, m, vocab, new) for p, m in zip(prompts, masks)]
        self.patch(model, backend_under_test)
        rows = self.sampled_rows
        ids = torch.cat([p.expand(rows, -1) for p in prompts])
        mask = torch.cat([m.expand(rows, -1) for m in masks])
        torch.manual_seed(1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=new,
                                 pad_token_id=0)[:, ids.shape[1]:]
        details = hf_accel.report(model)["speculative"].details
        assert details.get("fallbacks_to_stock", 0) == 0 and details.get("drafted", 0) > 0, (
            f"{backend_under_test.name} did not speculate on the sampled call: {details}")
        index = sum(out[:, j] * vocab ** (new - 1 - j) for j in range(new))
        for i, expected in enumerate(exact):
            observed = torch.bincount(index[i * rows:(i + 1) * rows], minlength=vocab ** new).double()
            p_value = chi_square_p_value(observed, expected * rows)
            worst = int(((observed - expected * rows).abs()).argmax())
            assert p_value > self.significance, (
                f"{backend_under_test.name}: sampled continuations of prompt {i} do not follow the target's "
                f"distribution (chi-square p = {p_value:.1e}); continuation {worst} came {int(observed[worst])} "
                f"times where {float(expected[worst] * rows):.0f} were expected. A drafter must return the "
                "probabilities it sampled its tokens from (Draft.probs), or None for a token it chose outright")


class QuantizeConformance(BackendConformance):
    """A quantization backend: logits within its declared tolerance, every layer it replaced within it too,
    checkpoints that keep the original keys, and patch-time validation passed."""

    feature = "quantize"

    def test_logits_within_the_declared_tolerance(self, backend_under_test: Backend, arch: str) -> None:
        model, reference = make_tiny_model(arch), make_tiny_model(arch)
        ids, mask = left_padded_batch(model)
        self.patch(model, backend_under_test)
        error, where = relative_error(logits_of(reference, ids, mask), logits_of(model, ids, mask), mask)
        bound = tolerance_of(backend_under_test, model)
        assert error <= bound, (f"{backend_under_test.name} on {arch}: logits moved by {error:.2e} relative, more "
                                f"than the backend's declared tolerance {bound:.0e}, most at {where}")

    def test_each_replaced_layer_stays_within_the_tolerance(self, backend_under_test: Backend, arch: str) -> None:
        model, reference = make_tiny_model(arch), make_tiny_model(arch)
        before = dict(model.named_modules())
        self.patch(model, backend_under_test)
        replaced = replaced_modules(before, model, reference)
        assert replaced, f"{backend_under_test.name} replaced no module of {arch}"
        check = LayerCheck(reference, tolerance_of(backend_under_test, model))
        mismatches = []
        for name, original, replacement in replaced:
            parent, _, leaf = name.rpartition(".")
            try:
                check(reference.get_submodule(parent), leaf, original, replacement)
            except LayerMismatch as mismatch:
                mismatches.append(str(mismatch))
        assert not mismatches, f"{backend_under_test.name} on {arch}: {'; '.join(mismatches)}"

    def test_state_dict_keeps_the_original_keys(self, backend_under_test: Backend, arch: str) -> None:
        model = make_tiny_model(arch)
        keys = set(model.state_dict())
        self.patch(model, backend_under_test)
        saved = model.state_dict()
        assert set(saved) == keys, (f"{backend_under_test.name}: a checkpoint saved after patching has other keys "
                                    f"(missing {sorted(keys - set(saved))[:4]}, new {sorted(set(saved) - keys)[:4]}): "
                                    "stock from_pretrained would load it as random weights")

    def test_generates_after_patching(self, backend_under_test: Backend, arch: str) -> None:
        model = make_tiny_model(arch)
        ids, mask = left_padded_batch(model)
        self.patch(model, backend_under_test)
        out = greedy(model, ids, mask, self.new_tokens)
        assert out.shape == (ids.shape[0], ids.shape[1] + self.new_tokens) and torch.equal(out[:, :ids.shape[1]], ids)


#: The conformance class of each feature.
CONFORMANCE: dict[str, type[BackendConformance]] = {
    cls.feature: cls for cls in (AttentionConformance, KVCacheConformance, CompileConformance,
                                 SpeculativeConformance, QuantizeConformance)
}


def registered_backend(name: str, required: bool = True) -> Backend | None:
    """The backend registered under ``name`` (by the installed plugins); a readable failure if none is."""
    registry = BackendRegistry.collect(get_plugin_manager())
    backend = registry.get(name)
    if backend is None and required:
        known = ", ".join(sorted(b.name for b in registry))
        pytest.fail(f"no backend named {name!r} is registered (installed: {known}); is its plugin installed and "
                    "declared in the hf_accel entry-point group? `hf-accel plugins` lists what is loaded", False)
    return backend


def unserved_needs(backend: Backend, arch: str) -> list[str]:
    """What the tiny ``arch`` needs that ``backend`` does not declare."""
    caps = backend.capabilities
    return [need for need, used in model_needs(tiny_config(arch)).items() if used and not getattr(caps, need, True)]


def skip_if_lossy(backend: Backend) -> None:
    if not backend.lossless:
        pytest.skip(f"{backend.name!r} declares itself lossy (lossless=False): its tokens may differ from stock's")


def tolerance_of(backend: Backend, model: torch.nn.Module) -> float:
    return backend.tolerance if backend.tolerance is not None else LOSSLESS_TOLERANCE.get(model.dtype, 3e-2)


def draft_model_for(model: torch.nn.Module) -> torch.nn.Module:
    """A model of the same configuration with other weights: a draft that agrees with the target sometimes."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return type(model)(copy.deepcopy(model.config)).to(model.dtype).eval()


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def _names_from_option(config: pytest.Config, feature: str) -> list[str]:
    """The ``--hf-accel-backend`` names registered for ``feature`` (the pytest plugin refuses unknown names)."""
    names = config.getoption("hf_accel_backend", default=None) or []
    return [name for name in names if getattr(registered_backend(name, required=False), "feature", None) == feature]
