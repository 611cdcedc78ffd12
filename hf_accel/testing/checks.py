"""What the conformance suite measures: logits, their relative error and where it is largest, token identity
with the first differing position, replaced modules, and exact sampling distributions with a chi-square test."""

from __future__ import annotations

import torch
import transformers


def logits_of(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 logits at every position, ``[batch, length, vocab]`` (padded positions included)."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()


def relative_error(expected: torch.Tensor, actual: torch.Tensor, mask: torch.Tensor) -> tuple[float, str]:
    """The largest difference over the real (unpadded) positions, relative to ``expected``'s largest value,
    and where it is (NaN and infinity count as infinitely wrong)."""
    real = mask.bool()
    difference = (actual - expected).abs().nan_to_num(float("inf")).amax(-1).masked_fill(~real, 0)
    scale = expected[real].abs().max().clamp_min(1e-6)
    row, column = divmod(int(difference.argmax()), difference.shape[1])
    padding = int((~real[row, :column]).sum())
    return float(difference.max() / scale), f"row {row}, token {column - padding}"


def assert_same_tokens(actual: torch.Tensor, expected: torch.Tensor, prompt_length: int, what: str) -> None:
    """Fail, naming the first differing row and new-token position, unless the outputs are equal."""
    if actual.shape == expected.shape and torch.equal(actual, expected):
        return
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: output shape {tuple(actual.shape)}, stock's {tuple(expected.shape)}")
    row, column = (actual != expected).nonzero()[0].tolist()
    raise AssertionError(f"{what}: row {row} differs from stock's greedy output at new token {column - prompt_length}"
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
    joint = torch.ones(1, dtype=torch.float64)
    for depth in range(new):
        prefixes = (torch.cartesian_prod(*[torch.arange(vocab)] * depth).reshape(-1, depth) if depth
                    else torch.zeros(1, 0, dtype=torch.long))
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
