"""What the conformance suite measures: logits, their relative error and where it is largest, token identity
with the first differing position, replaced modules, and exact sampling distributions with a chi-square test."""

from __future__ import annotations

import copy

import torch
import transformers

from hf_accel.patching.backends import Backend
from hf_accel.patching.verify import LOSSLESS_TOLERANCE


def logits_of(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 logits at every position, ``[batch, length, vocab]`` (padded positions included), with each row's
    positions counted from its first real token, as ``generate`` counts them."""
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits.float()


def relative_error(expected: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor) -> tuple[float, str]:
    """The largest difference over the real (unpadded) positions, relative to ``expected``'s largest value,
    and where it is (NaN and infinity count as infinitely wrong)."""
    real = mask.bool()
    difference = (actual - expected).abs().nan_to_num(float("inf")).amax(-1).masked_fill(~real, 0)
    scale = expected[real].abs().max().clamp_min(1e-6)
    row, column = divmod(int(difference.argmax()), difference.shape[1])
    padding = int((~real[row, :column]).sum())
    return float(difference.max() / scale), f"row {row}, token {column - padding}"


def assert_same_tokens(actual: torch.Tensor, expected: torch.Tensor, prompt_length: int, what: str,
                       reference: str = "stock's greedy output") -> None:
    """Fail, naming the first differing row and new-token position, unless the outputs are equal."""
    if actual.shape == expected.shape and torch.equal(actual, expected):
        return
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: output shape {tuple(actual.shape)}, {reference}'s {tuple(expected.shape)}")
    row, column = (actual != expected).nonzero()[0].tolist()
    raise AssertionError(f"{what}: row {row} differs from {reference} at new token {column - prompt_length}"
                         f" ({int(actual[row, column])} instead of {int(expected[row, column])})")


def replaced_modules(before: dict[str, torch.nn.Module], patched: torch.nn.Module,
                     reference: torch.nn.Module) -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, the module of that name in ``reference``, its replacement) for each module of ``patched`` that is
    not the object ``before`` (its ``named_modules()`` before patching) had there. ``reference`` is an unpatched
    twin: a backend may free what it replaced."""
    return [(name, reference.get_submodule(name), module) for name, module in patched.named_modules()
            if name in before and module is not before[name]]


def sampling_model(vocab: int = 4) -> transformers.PreTrainedModel:
    """A tiny llama over a ``vocab``-token vocabulary whose next-token distributions are peaked, so that a
    drafter's tokens are often, but not always, accepted."""
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=None,
                                      eos_token_id=None, pad_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(6)
    return model


def exact_continuations(model: torch.nn.Module, prompt: torch.Tensor, mask: torch.Tensor, vocab: int,
                        new: int) -> torch.Tensor:
    """The probability of each of the ``vocab ** new`` continuations of the (left-padded) ``prompt`` under plain
    sampling, from the model's own forwards over every prefix (index: first token most significant)."""
    joint = torch.ones(1, dtype=torch.float64, device=prompt.device)
    for depth in range(new):
        prefixes = (torch.cartesian_prod(*[torch.arange(vocab)] * depth).reshape(-1, depth) if depth
                    else torch.zeros(1, 0, dtype=torch.long)).to(prompt.device)
        ids = torch.cat([prompt.expand(len(prefixes), -1), prefixes], dim=1)
        full_mask = torch.cat([mask.expand(len(prefixes), -1), torch.ones_like(prefixes)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(ids, attention_mask=full_mask, position_ids=positions).logits[:, -1]
        joint = (joint[:, None] * logits.double().softmax(-1)).reshape(-1)
    return joint


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test, pooling the categories expected fewer than 5 times into one."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):  # an outcome the target never produces
        return 0.0
    statistic = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic.double() / 2))


def sampling_failures(samples: torch.Tensor, joint: torch.Tensor, significance: float) -> list[str]:
    """Where ``samples`` (``[rows, new]`` token ids) depart from the exact ``joint`` distribution (``[vocab] * new``):
    chi-square tests of the joint distribution of the first (up to) three tokens and of each position's own
    distribution, each at ``significance`` divided by the number of tests. Empty when none fails."""
    rows, new = samples.shape
    vocab = joint.shape[0]
    head = min(3, new)
    tests = [("the first %d tokens jointly" % head, tuple(range(head)))]
    tests += [(f"position {j}", (j,)) for j in range(new)]
    failures = []
    for what, positions in tests:
        others = tuple(j for j in range(new) if j not in positions)
        expected = (joint.sum(dim=others) if others else joint).reshape(-1) * rows
        index = sum(samples[:, j] * vocab ** (len(positions) - 1 - i) for i, j in enumerate(positions))
        observed = torch.bincount(index, minlength=vocab ** len(positions)).double()
        p_value = chi_square_p_value(observed, expected)
        if p_value <= significance / len(tests):
            worst = int((observed - expected).abs().argmax())
            failures.append(f"{what}: chi-square p = {p_value:.1e}, outcome {worst} came {int(observed[worst])} "
                            f"times where {float(expected[worst]):.0f} were expected")
    return failures


def tolerance_of(backend: Backend, model: torch.nn.Module) -> float:
    return backend.tolerance if backend.tolerance is not None else LOSSLESS_TOLERANCE.get(model.dtype, 3e-2)


def draft_model_for(model: torch.nn.Module) -> torch.nn.Module:
    """A model of the same configuration with other weights: a draft that agrees with the target sometimes."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return type(model)(copy.deepcopy(model.config)).to(model.device, model.dtype).eval()


def greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)


def exact_joint(model: torch.nn.Module, prompt: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """:func:`exact_continuations` of ``new`` tokens as a ``[vocab] * new`` tensor on the CPU."""
    vocab = model.config.vocab_size
    return exact_continuations(model, prompt, mask, vocab, new).reshape([vocab] * new).cpu()
