"""The conformance suite: what every backend of a feature must do, as pytest classes a plugin author subclasses.

Example (a plugin's tests/test_conformance.py)::

    from hf_accel.testing import AttentionConformance

    class TestMyBackend(AttentionConformance):
        backend = "my_attention"

or, with nothing written: ``pytest --hf-accel-backend my_attention``. Each class parametrizes itself
(``pytest_generate_tests``) over the tiny architectures the backend declares it serves (its
:class:`~hf_accel.plugin.Capabilities`), the prompt shapes of :data:`~hf_accel.testing.models.PROMPTS`
and, for attention, the dtypes it declares; an architecture it does not declare must be refused. Models run on
the backend's first declared device and in fp32 (or its first declared dtype); set ``device``/``dtype`` to
choose.
"""

from __future__ import annotations

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
    draft_model_for,
    exact_joint,
    greedy,
    logits_of,
    relative_error,
    replaced_modules,
    sampling_failures,
    sampling_model,
    tolerance_of,
)
from hf_accel.testing.models import PROMPTS, TINY_ARCHITECTURES, left_padded_batch, make_tiny_model, tiny_config

#: The option of ``patch`` the suite passes a draft model through, to a backend that declares it.
DRAFT_MODEL_OPTION = "draft_model"
#: The option that asks a backend to keep what it replaces, so that ``unpatch`` can put it back.
KEEP_ORIGINAL_OPTION = "keep_original"
#: The reference attention the attention class compares with: transformers' own.
REFERENCE_ATTENTION = "eager"


class BackendConformance:
    """Tests every backend passes, whatever its feature. Subclass a feature's class and set ``backend``."""

    #: The name of the backend under test (``pytest --hf-accel-backend NAME`` sets ``backends_from_option``).
    backend: ClassVar[str | None] = None
    backends_from_option: ClassVar[tuple[str, ...]] = ()
    feature: ClassVar[str] = ""
    #: The tiny architectures to try (see :data:`~hf_accel.testing.models.TINY_ARCHITECTURES`).
    architectures: ClassVar[tuple[str, ...]] = tuple(TINY_ARCHITECTURES)
    prompts: ClassVar[dict[str, tuple[int, ...]]] = PROMPTS
    #: Where and in what dtype the models run (None: the backend's first declared device, else the CPU; fp32
    #: unless the backend declares dtypes without it, then the first it declares).
    device: ClassVar[str | None] = None
    dtype: ClassVar[torch.dtype | None] = None
    #: Other ``patch`` arguments for every patch the suite makes (backend options, other features).
    patch_options: ClassVar[dict[str, Any]] = {}
    new_tokens: ClassVar[int] = 8

    # -- parametrization ----------------------------------------------------------------------------------
    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        names = [self.backend] if self.backend else list(self.backends_from_option) or [None]
        wanted = [arg for arg in ("backend_name", "arch", "prompt", "dtype") if arg in metafunc.fixturenames]
        cases, ids = [], []
        for name in names:
            for case in self._cases(name, metafunc.function.__name__, wanted):
                cases.append(tuple(case[arg] for arg in wanted))
                ids.append("-".join(str(case[arg]).removeprefix("torch.") for arg in wanted))
        metafunc.parametrize(wanted, cases, ids=ids)

    def _cases(self, name: str | None, test: str, wanted: list[str]) -> Iterator[dict[str, Any]]:
        backend = registered_backend(name, required=False) if name else None
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
        """The dtypes the attention class tries: those the backend declares (fp32 and bf16 when it declares
        none)."""
        declared = backend.capabilities.dtypes if backend is not None else ()
        return [d for d in (torch.float32, torch.bfloat16, torch.float16) if d in declared] if declared else \
            [torch.float32, torch.bfloat16]

    # -- fixtures -----------------------------------------------------------------------------------------
    @pytest.fixture
    def backend_under_test(self, backend_name: str | None) -> Backend:
        """The registered backend, skipping the test (with its reason) where it cannot run on this machine."""
        backend = registered_backend(backend_name, owner=type(self).__name__)
        problem = backend.machine_problem()
        if problem:
            pytest.skip(f"backend {backend_name!r} cannot run here: {problem}")
        return backend

    # -- models and patches the way the suite makes them ----------------------------------------------------
    def model(self, backend: Backend, arch: str, dtype: torch.dtype | None = None, seed: int = 0) -> Any:
        """The tiny ``arch`` on the device and in the dtype the suite runs ``backend`` with."""
        return make_tiny_model(arch, seed=seed, dtype=dtype or self.dtype_for(backend)).to(self.device_for(backend))

    def batch(self, model: Any, lengths: tuple[int, ...], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = left_padded_batch(model, lengths, seed=seed)
        return ids.to(model.device), mask.to(model.device)

    def device_for(self, backend: Backend) -> str:
        return self.device or next(iter(backend.capabilities.devices), "cpu")

    def dtype_for(self, backend: Backend) -> torch.dtype:
        declared = backend.capabilities.dtypes
        return self.dtype or (declared[0] if declared and torch.float32 not in declared else torch.float32)

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
    def test_is_registered_for_this_feature(self, backend_name: str | None) -> None:
        backend = registered_backend(backend_name, owner=type(self).__name__)
        assert backend.feature == self.feature, (
            f"backend {backend_name!r} serves {backend.feature!r}; run it with the {backend.feature} conformance class")
        assert backend.lossless or backend.probe is None or backend.tolerance is not None, (
            f"backend {backend_name!r} is lossy (lossless=False) and verified by a probe but declares no tolerance: "
            "say how far its logits may move (Backend(tolerance=...)) so verification can hold it to that")

    def test_availability_check_gives_a_reason(self, backend_name: str | None) -> None:
        backend = registered_backend(backend_name, owner=type(self).__name__)
        problem = backend.machine_problem()
        if problem is None:
            return
        assert isinstance(problem, str) and problem.strip() and "Traceback" not in problem, (
            f"why_unavailable of {backend_name!r} should say in words why it cannot run, got {problem!r}")
        with pytest.raises(BackendUnavailableError) as refused:
            hf_accel.patch(make_tiny_model("llama"), **{backend.feature: backend.name})
        assert problem in str(refused.value), f"forcing {backend_name!r} did not give its reason: {refused.value}"
        pytest.skip(f"backend {backend_name!r} cannot run here: {problem}")

    def test_passes_patch_time_validation(self, backend_under_test: Backend, arch: str) -> None:
        model = self.model(backend_under_test, arch)
        try:
            self.patch(model, backend_under_test, verify=True)
        except VerificationError as refusal:
            pytest.fail(f"patch-time validation refused {backend_under_test.name!r} on {arch}: {refusal}", False)
        verification = hf_accel.report(model)[backend_under_test.feature].verification
        assert verification is None or verification.passed, verification

    def test_refuses_models_it_does_not_declare(self, backend_under_test: Backend, arch: str | None) -> None:
        if arch is None:
            pytest.skip(f"{backend_under_test.name!r} declares everything the tiny models need")
        model = self.model(backend_under_test, arch)
        with pytest.raises(BackendUnavailableError, match="does not support"):
            self.patch(model, backend_under_test)
        assert hf_accel.report(model)[backend_under_test.feature].backend is None

    def test_unpatch_restores_the_model(self, backend_under_test: Backend, arch: str) -> None:
        model = self.model(backend_under_test, arch)
        ids, mask = self.batch(model, (7, 3, 5))
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
    """Greedy output identical to the unpatched model's, over every prompt shape, then other batch sizes."""

    def test_greedy_matches_stock(self, backend_under_test: Backend, arch: str, prompt: str) -> None:
        skip_if_lossy(backend_under_test)
        model = self.model(backend_under_test, arch)
        ids, mask = self.batch(model, self.prompts[prompt])
        expected = greedy(model, ids, mask, self.new_tokens)
        self.patch(model, backend_under_test)
        assert_same_tokens(greedy(model, ids, mask, self.new_tokens), expected, ids.shape[1],
                           f"{backend_under_test.name} on {arch}, {prompt}")

    def test_calls_of_other_batch_sizes_in_turn(self, backend_under_test: Backend, arch: str) -> None:
        skip_if_lossy(backend_under_test)
        model = self.model(backend_under_test, arch)
        batches = [self.batch(model, lengths, seed=i) for i, lengths in enumerate([(5, 9), (4,), (6, 2, 8)])]
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
        model, reference = self.model(backend_under_test, arch, dtype), self.model(backend_under_test, arch, dtype)
        reference.set_attn_implementation(REFERENCE_ATTENTION)
        ids, mask = self.batch(model, self.prompts[prompt])
        expected = logits_of(reference, ids, mask)
        self.patch(model, backend_under_test)
        actual = logits_of(model, ids, mask)
        error, where = relative_error(expected, actual, mask)
        bound = LOSSLESS_TOLERANCE.get(dtype, 3e-2)
        assert error <= bound, (f"{backend_under_test.name} on {arch} ({prompt}, {dtype}): logits differ from eager "
                                f"attention by {error:.2e} relative (bound {bound:.0e}), most at {where}")

    def test_greedy_matches_eager(self, backend_under_test: Backend, arch: str, prompt: str) -> None:
        model, reference = self.model(backend_under_test, arch), self.model(backend_under_test, arch)
        reference.set_attn_implementation(REFERENCE_ATTENTION)
        ids, mask = self.batch(model, self.prompts[prompt])
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
    """A speculative backend (its drafter in the core's loop): stock's greedy tokens, and samples that follow
    the target's own distribution at every position."""

    feature = "speculative"
    #: Sampled rows per prompt in the distribution test, how many tokens each, and the significance level the
    #: test fails at (shared by its tests: the joint of the first tokens and each position's own distribution).
    sampled_rows: ClassVar[int] = 2000
    sampled_tokens: ClassVar[int] = 6
    significance: ClassVar[float] = 1e-3

    def test_sampling_follows_the_target_distribution(self, backend_under_test: Backend) -> None:
        """Two prompts (one left-padded), a 4-token vocabulary: ``sampled_rows`` rows of ``sampled_tokens``
        tokens each, against the target's exact distribution by chi-square tests: the joint distribution of
        the first three tokens, and the distribution at each position (so every draft position a drafter of
        up to ``sampled_tokens - 1`` tokens proposes is covered)."""
        device = self.device_for(backend_under_test)
        model = sampling_model(4).to(device, self.dtype_for(backend_under_test))
        prompts = [torch.tensor([[1, 3, 2, 3]]), torch.tensor([[0, 0, 2, 1]])]
        masks = [torch.tensor([[1, 1, 1, 1]]), torch.tensor([[0, 0, 1, 1]])]
        exact = [exact_joint(model, p.to(device), m.to(device), self.sampled_tokens) for p, m in zip(prompts, masks)]
        self.patch(model, backend_under_test)
        rows = self.sampled_rows
        ids = torch.cat([p.expand(rows, -1) for p in prompts]).to(device)
        mask = torch.cat([m.expand(rows, -1) for m in masks]).to(device)
        torch.manual_seed(1)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=True, top_k=0, max_new_tokens=self.sampled_tokens,
                                 pad_token_id=0)[:, ids.shape[1]:].cpu()
        details = hf_accel.report(model)["speculative"].details
        assert details.get("fallbacks_to_stock", 0) == 0 and details.get("drafted", 0) > 0, (
            f"{backend_under_test.name} did not speculate on the sampled call: {details}")
        failures = [f"prompt {i}: {failure}" for i, joint in enumerate(exact)
                    for failure in sampling_failures(out[i * rows:(i + 1) * rows], joint, self.significance)]
        assert not failures, (
            f"{backend_under_test.name}: sampled tokens do not follow the target's distribution ("
            + "; ".join(failures) + "). A drafter must return the probabilities it sampled its tokens from "
            "(Draft.probs), or None for tokens it chose outright")


class QuantizeConformance(BackendConformance):
    """A quantization backend: logits within its declared tolerance, every layer it replaced within it too,
    checkpoints that keep the original keys, and a generate that follows its own logits."""

    feature = "quantize"

    def test_logits_within_the_declared_tolerance(self, backend_under_test: Backend, arch: str) -> None:
        model, reference = self.model(backend_under_test, arch), self.model(backend_under_test, arch)
        ids, mask = self.batch(model, (7, 3, 5))
        self.patch(model, backend_under_test)
        error, where = relative_error(logits_of(reference, ids, mask), logits_of(model, ids, mask), mask)
        bound = tolerance_of(backend_under_test, model)
        assert error <= bound, (f"{backend_under_test.name} on {arch}: logits moved by {error:.2e} relative, more "
                                f"than the backend's declared tolerance {bound:.0e}, most at {where}")

    def test_each_replaced_layer_stays_within_the_tolerance(self, backend_under_test: Backend, arch: str) -> None:
        model, reference = self.model(backend_under_test, arch), self.model(backend_under_test, arch)
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
        model = self.model(backend_under_test, arch)
        keys = set(model.state_dict())
        self.patch(model, backend_under_test)
        saved = model.state_dict()
        assert set(saved) == keys, (f"{backend_under_test.name}: a checkpoint saved after patching has other keys "
                                    f"(missing {sorted(keys - set(saved))[:4]}, new {sorted(set(saved) - keys)[:4]}): "
                                    "stock from_pretrained would load it as random weights")

    def test_greedy_follows_its_own_logits(self, backend_under_test: Backend, arch: str) -> None:
        model = self.model(backend_under_test, arch)
        ids, mask = self.batch(model, (7, 3, 5))
        self.patch(model, backend_under_test)
        out = greedy(model, ids, mask, self.new_tokens)
        assert out.shape == (ids.shape[0], ids.shape[1] + self.new_tokens) and torch.equal(out[:, :ids.shape[1]], ids)
        full_mask = torch.cat([mask, torch.ones_like(out[:, ids.shape[1]:])], dim=1)
        following = logits_of(model, out, full_mask)[:, ids.shape[1] - 1:-1].argmax(-1)
        made = out[:, ids.shape[1]:]
        eos = model.generation_config.eos_token_id
        is_eos = torch.isin(made, torch.tensor([] if eos is None else eos, device=made.device).long().reshape(-1))
        ended = is_eos.long().cumsum(-1) - is_eos.long() > 0  # after a row's first EOS: padding
        assert_same_tokens(made.masked_fill(ended, -1), following.masked_fill(ended, -1), 0,
                           f"{backend_under_test.name} on {arch}", "the argmax of its own forward")


#: The conformance class of each feature.
CONFORMANCE: dict[str, type[BackendConformance]] = {
    cls.feature: cls for cls in (AttentionConformance, KVCacheConformance, CompileConformance,
                                 SpeculativeConformance, QuantizeConformance)
}


def registered_backend(name: str | None, required: bool = True, owner: str = "") -> Backend | None:
    """The backend registered under ``name`` (by the installed plugins); a readable failure if none is."""
    if name is None:
        pytest.fail(f"{owner or 'this conformance class'} names no backend: set backend = '<its name>' on the class, "
                    "or run pytest --hf-accel-backend <its name>", False)
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
